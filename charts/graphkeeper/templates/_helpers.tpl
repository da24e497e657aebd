{{- define "graphkeeper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "graphkeeper.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "graphkeeper.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "graphkeeper.labels" -}}
helm.sh/chart: {{ include "graphkeeper.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: graphkeeper
{{- end }}

{{- define "graphkeeper.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "graphkeeper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "graphkeeper.worker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "graphkeeper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: inference-worker
{{- end }}

{{- define "graphkeeper.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "graphkeeper.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "graphkeeper.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "graphkeeper.worker.policyName" -}}
{{- printf "%s-workers" (include "graphkeeper.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- /* The restricted Pod Security Standard, for the operator's and the workers' pods. The image's
user is 10001; fsGroup makes the mounted control token readable to it. */ -}}
{{- define "graphkeeper.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{- define "graphkeeper.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{- /* The Secret holding the GraphControl token (key `token`): the user's, or the chart's. */ -}}
{{- define "graphkeeper.controlTokenSecret" -}}
{{- .Values.controlToken.existingSecret | default (printf "%s-control-token" (include "graphkeeper.fullname" .)) }}
{{- end }}

{{- /* The worker container's resources: workers.resources, without nvidia.com/gpu unless the
device is a GPU (device: cpu requests no GPU, whatever the values say); a GPU worker requests and
is limited to one GPU per tensor parallel rank (workers.tensorParallelSize). */ -}}
{{- define "graphkeeper.worker.resources" -}}
{{- $res := deepCopy (.Values.workers.resources | default dict) }}
{{- $gpu := hasPrefix "cuda" .Values.workers.device }}
{{- range $kind := list "requests" "limits" }}
{{- if not (hasKey $res $kind) }}{{ $_ := set $res $kind dict }}{{ end }}
{{- $table := index $res $kind | default dict }}
{{- if $gpu }}
{{- $_ := set $table "nvidia.com/gpu" (int ($.Values.workers.tensorParallelSize | default 1)) }}
{{- else }}
{{- $_ := unset $table "nvidia.com/gpu" }}
{{- end }}
{{- $_ := set $res $kind $table }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{- /* Where the workers' compile cache lives: hostPath, persistentVolumeClaim, scratch (the pod's
emptyDir) or volume (workers.compileCache.volume, whatever type says); auto is hostPath for GPU
workers and scratch for CPU ones. */ -}}
{{- define "graphkeeper.compileCacheType" -}}
{{- $c := .Values.workers.compileCache -}}
{{- if $c.volume -}}
volume
{{- else if eq $c.type "auto" -}}
{{- if hasPrefix "cuda" .Values.workers.device }}hostPath{{ else }}scratch{{ end -}}
{{- else -}}
{{- $c.type -}}
{{- end -}}
{{- end }}
