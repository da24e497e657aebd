#!/usr/bin/env bash
# The whole system on this machine, in one command (`make demo`; `make demo-down` removes it):
#   1. a control plane and a real node (cluster.sh up --node: kubelet, containerd, a CNI bridge);
#   2. the graphkeeper image built without Docker and loaded into the node (build-images.sh);
#   3. `helm install` of the chart with two CPU workers (values-local-node.yaml) serving
#      SmolLM2-135M-Instruct, which the image carries;
#   4. `kubectl apply` of deploy/examples/graphpolicy.yaml (tenant "batch" runs without graphs);
#   5. Prometheus (built from the Go module proxy) scraping the pods through Kubernetes service
#      discovery, with graphkeeper's recording and alerting rules loaded;
#   6. traffic from two tenants, then what each part reports: pods and policies, the policy's
#      conditions, each worker's `graphkeeper status`, and steps per tenant and eager steps by
#      fallback reason from Prometheus; and one question answered in words.
#
#   deploy/local/demo.sh up | down | status
#
# Needs root, Go 1.26, and Debian's containerd, runc, containernetworking-plugins, buildah,
# debootstrap and iptables (`make demo` installs them with apt-get when missing).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${GRAPHKEEPER_CACHE:-$HOME/.cache/graphkeeper}
export GRAPHKEEPER_CLUSTER_DIR=${GRAPHKEEPER_DEMO_DIR:-$cache/demo}
export GRAPHKEEPER_APISERVER_PORT=${GRAPHKEEPER_APISERVER_PORT:-26443}
export GRAPHKEEPER_ETCD_PORT=${GRAPHKEEPER_ETCD_PORT:-33790}
export GRAPHKEEPER_KCM_PORT=${GRAPHKEEPER_KCM_PORT:-30257}
export GRAPHKEEPER_SCHEDULER_PORT=${GRAPHKEEPER_SCHEDULER_PORT:-30259}
export GRAPHKEEPER_NODE_BRIDGE=${GRAPHKEEPER_NODE_BRIDGE:-gkbr0}
export GRAPHKEEPER_NODE_NET=${GRAPHKEEPER_NODE_NET:-198.18.1}
export GRAPHKEEPER_PROMETHEUS_PORT=${GRAPHKEEPER_PROMETHEUS_PORT:-29090}
export GRAPHKEEPER_CONTAINERD_SOCK=$GRAPHKEEPER_CLUSTER_DIR/node/containerd/containerd.sock
prom_port=$GRAPHKEEPER_PROMETHEUS_PORT
ns=graphkeeper-demo
chart=${GRAPHKEEPER_CHART:-$root/charts/graphkeeper}
state=$GRAPHKEEPER_CLUSTER_DIR
py=${PYTHON:-$root/.venv/bin/python}
gk=$root/.venv/bin/graphkeeper

log() { printf '\n== %s\n' "$*" >&2; }

promql() { # promql QUERY: one line per series, "labels value"
  "$py" - "$prom_port" "$1" <<'PY'
import json, sys, urllib.parse, urllib.request
port, query = sys.argv[1], sys.argv[2]
url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
data = json.load(urllib.request.urlopen(url, timeout=10))["data"]["result"]
for r in sorted(data, key=lambda r: sorted(r["metric"].items())):
    labels = ", ".join(f"{k}={v}" for k, v in sorted(r["metric"].items()))
    print(f"  {{{labels}}} {float(r['value'][1]):g}")
if not data:
    print("  (no data)")
PY
}

up() {
  local start=$SECONDS
  log "control plane and a real node (deploy/local/cluster.sh up --node)"
  "$here/cluster.sh" up --node
  eval "$("$here/cluster.sh" env)"
  log "images (deploy/docker/build-images.sh)"
  PYTHON="$py" "$root/deploy/docker/build-images.sh"

  log "helm install graphkeeper charts/graphkeeper (two CPU workers serving SmolLM2-135M-Instruct)"
  helm upgrade --install graphkeeper "$chart" -n "$ns" --create-namespace \
    -f "$here/values-local-node.yaml" --set workers.model=builtin:smollm2-135m-instruct \
    --wait=false >/dev/null
  kubectl -n "$ns" apply -f "$root/deploy/examples/graphpolicy.yaml"
  "$here/prometheus.sh" up "$ns" >/dev/null
  kubectl -n "$ns" rollout status deploy/graphkeeper-operator --timeout=300s
  kubectl -n "$ns" rollout status deploy/graphkeeper-worker --timeout=600s
  kubectl -n "$ns" wait graphpolicy/decode --for=condition=Ready --timeout=300s

  log "traffic: tenant chat (graphs allowed) and tenant batch (graphs disabled by the policy)"
  local ip tenant i
  for ip in $(kubectl -n "$ns" get pods -l app.kubernetes.io/component=inference-worker \
                -o jsonpath='{.items[*].status.podIP}'); do
    for tenant in chat batch; do
      for i in 1 2 3; do
        "$gk" generate --target "$ip:50051" --tenant "$tenant" --prompt-ids "$i,2,3,4" \
          --max-new-tokens 12 --json >/dev/null
      done
    done
  done
  log "a question, through the model's chat template"
  ip=$(kubectl -n "$ns" get pods -l app.kubernetes.io/component=inference-worker \
         -o jsonpath='{.items[0].status.podIP}')
  "$gk" generate --target "$ip:50051" --tenant chat --chat "What is the capital of France?" --max-new-tokens 24
  # Two scrapes and a rule evaluation after the last request.
  sleep 12

  log "kubectl get graphpolicies,pods -n $ns -o wide"
  kubectl -n "$ns" get graphpolicies,pods -o wide
  log "the policy's conditions"
  kubectl -n "$ns" get graphpolicy decode \
    -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}'
  # GraphControl (the worker's status) wants the chart's bearer token.
  kubectl -n "$ns" get secret graphkeeper-control-token -o jsonpath='{.data.token}' | base64 -d \
    >"$state/control-token"
  chmod 600 "$state/control-token"
  for ip in $(kubectl -n "$ns" get pods -l app.kubernetes.io/component=inference-worker \
                -o jsonpath='{.items[*].status.podIP}'); do
    log "graphkeeper status --target $ip:50051"
    "$gk" status --target "$ip:50051" --token-file "$state/control-token"
  done
  log "Prometheus: steps per tenant and execution (graphkeeper_tenant_steps_total)"
  promql 'sum by (tenant, execution) (graphkeeper_tenant_steps_total)'
  log "Prometheus: eager steps by fallback reason per pod (graphkeeper_eager_steps_total)"
  promql 'sum by (pod, fallback_reason) (graphkeeper_eager_steps_total) > 0'
  log "Prometheus: targets up"
  promql 'up{job="graphkeeper-pods"}'
  log "done in $((SECONDS - start)) s. Prometheus: http://127.0.0.1:$prom_port; kubectl: eval \"\$(deploy/local/demo.sh env)\"; remove all: make demo-down"
}

case "${1:-}" in
  up) up ;;
  # wipe: the node's image store is ~10 GB; the built image stays cached for the next `up`.
  down) "$here/prometheus.sh" down; "$here/cluster.sh" wipe ;;
  env) "$here/cluster.sh" env ;;
  status) "$here/cluster.sh" status ;;
  *) echo "usage: $0 up|down|env|status" >&2; exit 2 ;;
esac
