"""The Helm chart as a new user meets it: `helm lint` and `helm template` with the chart's own
defaults (no --kube-version), and what the rendered workloads promise: the restricted security
context, requests and limits, probes, the control port and its token, the NetworkPolicies.

The same chart installed on a real node is tests/e2e (``make test-e2e``).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from graphkeeper.proto import ports

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "graphkeeper"
TOKEN_DIR = "/var/run/graphkeeper/control"


def render(helm: Path, *args: str) -> list[dict]:
    out = subprocess.run([str(helm), "template", "gk", str(CHART), "-n", "llm", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {[d['metadata']['name'] for d in docs if d['kind'] == kind]}"
    return found[0]


def test_helm_lint_passes_with_the_charts_defaults(helm):
    out = subprocess.run([str(helm), "lint", "--strict", str(CHART)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_helm_template_renders_without_a_kube_version(helm):
    """deploy/README.md's command, as written there."""
    docs = render(helm)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "Secret", "NetworkPolicy"} <= kinds


def test_the_charts_kube_version_floor_still_holds(helm):
    out = subprocess.run([str(helm), "template", "gk", str(CHART), "--kube-version", "1.28.0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "kubeVersion" in out.stderr


@pytest.mark.parametrize("component", ["operator", "worker"])
def test_pods_run_restricted(helm, component):
    docs = render(helm, "--set", "workers.enabled=true")
    pod = one(docs, "Deployment", f"gk-graphkeeper-{component}")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    assert "readinessProbe" in container and "livenessProbe" in container
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "/tmp" in mounts, "a writable /tmp on the read-only root filesystem"
    assert mounts[TOKEN_DIR]["readOnly"] is True
    assert f"--control-token-file={TOKEN_DIR}/token" in container["args"]


def test_workers_serve_control_on_its_own_port_and_probe_inference(helm):
    docs = render(helm, "--set", "workers.enabled=true", "--set", "workers.modelRoots={/models}")
    container = one(docs, "Deployment", "gk-graphkeeper-worker")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "control": 50052, "metrics": 9400, "http": 8000}
    assert {"--http-port=8000", "--vllm-metric-names"} <= set(container["args"])
    assert "--control-port=50052" in container["args"]
    assert "--model-root=/models" in container["args"]
    # Probes ask the metrics port, which no inference client can fill (issue 37).
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def test_the_charts_default_ports_are_the_codes_defaults():
    """YAML cannot import proto/ports.py: the chart keeps its own copy, held here to the code's."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    workers, service = values["workers"], values["workers"]["service"]["ports"]
    assert (workers["grpcPort"], workers["controlPort"], workers["metricsPort"], workers["httpPort"]) == (
        ports.GRPC_PORT, ports.CONTROL_PORT, ports.METRICS_PORT, ports.HTTP_PORT)
    assert (service["grpc"], service["http"]) == (ports.GRPC_PORT, ports.HTTP_PORT)
    assert values["operator"]["metricsPort"] == ports.OPERATOR_METRICS_PORT


def test_workers_serve_openai_http_and_vllm_metric_names_by_choice(helm):
    docs = render(helm, "--set", "workers.enabled=true", "--set", "workers.httpPort=8080",
                  "--set", "workers.vllmMetricNames=false", "--set", "workers.servedModelName=smollm2",
                  "--set", "workers.service.ports.http=0")
    container = one(docs, "Deployment", "gk-graphkeeper-worker")["spec"]["template"]["spec"]["containers"][0]
    assert {"--http-port=8080", "--served-model-name=smollm2"} <= set(container["args"])
    assert "--no-vllm-metric-names" in container["args"] and "--vllm-metric-names" not in container["args"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["http"] == 8080
    svc = one(docs, "Service", "gk-graphkeeper-worker")["spec"]
    assert [p["name"] for p in svc["ports"]] == ["grpc"]  # 0: the HTTP API is not behind the Service


def worker_pod(helm: Path, *sets: str) -> dict:
    args = [a for s in ("workers.enabled=true", *sets) for a in ("--set", s)]
    return one(render(helm, *args), "Deployment", "gk-graphkeeper-worker")["spec"]["template"]["spec"]


def cache_volume(pod: dict) -> dict | None:
    """The compile cache's volume, checked to be mounted where --compile-cache-dir points."""
    volume = {v["name"]: v for v in pod["volumes"]}.get("compile-cache")
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert (volume is None) == ("compile-cache" not in mounts)
    if volume is not None:
        assert f"--compile-cache-dir={mounts['compile-cache']}" in pod["containers"][0]["args"]
    return volume


def test_workers_get_the_preset_quantization_and_a_compile_cache_dir(helm):
    pod = worker_pod(helm)
    args = pod["containers"][0]["args"]
    assert {"--optimization-level=2", "--quantization=none",
            "--compile-cache-dir=/var/cache/graphkeeper/compile"} <= set(args)
    assert "--optimization-level=1" in worker_pod(helm, "workers.optimizationLevel=1")["containers"][0]["args"]
    bad = subprocess.run([str(helm), "template", "gk", str(CHART), "--set", "workers.optimizationLevel=3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "optimizationLevel" in bad.stderr


def test_sleep_mode_is_off_unless_asked_and_then_passes_the_flag(helm):
    assert "--enable-sleep-mode" not in worker_pod(helm)["containers"][0]["args"]
    assert "--enable-sleep-mode" in worker_pod(helm, "workers.sleepMode=true")["containers"][0]["args"]
    bad = subprocess.run([str(helm), "template", "gk", str(CHART), "--set", "workers.enabled=true",
                          "--set-string", "workers.sleepMode=yes"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "sleepMode" in bad.stderr


def test_tensor_parallel_workers_pass_the_size_and_request_a_gpu_per_rank(helm):
    one_rank = worker_pod(helm)
    container = one_rank["containers"][0]
    assert not any(a.startswith("--tensor-parallel-size") for a in container["args"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "shm" not in {v["name"] for v in one_rank["volumes"]}
    pod = worker_pod(helm, "workers.tensorParallelSize=4")
    container = pod["containers"][0]
    assert "--tensor-parallel-size=4" in container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {v["name"]: v for v in pod["volumes"]}["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    cpu = worker_pod(helm, "workers.tensorParallelSize=2", "workers.device=cpu")["containers"][0]
    assert "--tensor-parallel-size=2" in cpu["args"]
    assert "nvidia.com/gpu" not in {**cpu["resources"]["limits"], **cpu["resources"]["requests"]}
    for bad_set, why in (("workers.tensorParallelSize=9", "tensorParallelSize"),
                         ("workers.tensorParallelSize=0", "tensorParallelSize")):
        bad = subprocess.run([str(helm), "template", "gk", str(CHART), "--set", "workers.enabled=true",
                              "--set", bad_set], capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and why in bad.stderr
    bad = subprocess.run([str(helm), "template", "gk", str(CHART), "--set", "workers.enabled=true", "--set",
                          "workers.tensorParallelSize=2", "--set", "workers.sleepMode=true"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "sleepMode is not supported with workers.tensorParallelSize" in bad.stderr


def test_gpu_workers_share_a_node_local_compile_cache_owned_by_the_worker(helm):
    pod = worker_pod(helm)  # device: cuda by default
    assert cache_volume(pod)["hostPath"] == {"path": "/var/cache/graphkeeper/compile", "type": "DirectoryOrCreate"}
    (init,) = pod["initContainers"]
    assert init["command"] == ["chown", "10001:10001", "/var/cache/graphkeeper/compile"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert init["volumeMounts"] == [{"name": "compile-cache", "mountPath": "/var/cache/graphkeeper/compile"}]
    pod = worker_pod(helm, "workers.compileCache.hostPath.path=/data/gk",
                     "workers.compileCache.hostPath.fixPermissions=false")
    assert cache_volume(pod)["hostPath"]["path"] == "/data/gk" and "initContainers" not in pod


def test_cpu_workers_keep_the_compile_cache_in_scratch(helm):
    pod = worker_pod(helm, "workers.device=cpu")
    assert cache_volume(pod) is None and "initContainers" not in pod  # inside the scratch emptyDir
    assert cache_volume(worker_pod(helm, "workers.compileCache.type=scratch")) is None


def test_the_compile_cache_can_live_on_a_claim_or_any_volume(helm):
    pod = worker_pod(helm, "workers.compileCache.type=persistentVolumeClaim",
                     "workers.compileCache.persistentVolumeClaim.claimName=gk-cache")
    assert cache_volume(pod)["persistentVolumeClaim"] == {"claimName": "gk-cache"}
    assert "initContainers" not in pod
    pod = worker_pod(helm, "workers.compileCache.volume.nfs.server=nfs.example",
                     "workers.compileCache.volume.nfs.path=/gk")
    assert cache_volume(pod)["nfs"] == {"server": "nfs.example", "path": "/gk"}  # volume wins over type auto
    unnamed = subprocess.run([str(helm), "template", "gk", str(CHART), "--set", "workers.enabled=true",
                              "--set", "workers.compileCache.type=persistentVolumeClaim"],
                             capture_output=True, text=True, timeout=120)
    assert unnamed.returncode != 0 and "claimName is required" in unnamed.stderr
    wrong = subprocess.run([str(helm), "template", "gk", str(CHART), "--set", "workers.compileCache.type=nfs"],
                           capture_output=True, text=True, timeout=120)
    assert wrong.returncode != 0 and "type" in wrong.stderr


def test_the_control_token_secret_is_mounted_by_both(helm):
    docs = render(helm, "--set", "workers.enabled=true")
    secret = one(docs, "Secret", "gk-graphkeeper-control-token")
    assert set(secret["data"]) == {"token"}
    for component in ("operator", "worker"):
        pod = one(docs, "Deployment", f"gk-graphkeeper-{component}")["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["control-token"]["secret"]["secretName"] == "gk-graphkeeper-control-token"


def test_network_policy_opens_control_only_to_the_operator(helm):
    docs = render(helm, "--set", "workers.enabled=true")
    worker = one(docs, "NetworkPolicy", "gk-graphkeeper-worker")["spec"]
    operator_pods = one(docs, "Deployment", "gk-graphkeeper-operator")["spec"]["selector"]["matchLabels"]
    worker_pods = one(docs, "Deployment", "gk-graphkeeper-worker")["spec"]["selector"]["matchLabels"]
    assert worker["podSelector"]["matchLabels"] == worker_pods
    control = [r for r in worker["ingress"] if {"port": "control", "protocol": "TCP"} in r["ports"]]
    assert control == [{"ports": [{"port": "control", "protocol": "TCP"}],
                        "from": [{"podSelector": {"matchLabels": operator_pods}}]}]
    served = {p["port"] for r in worker["ingress"] for p in r["ports"]}
    assert served == {"control", "grpc", "http", "metrics"}, "nothing else is reachable"
    operator = one(docs, "NetworkPolicy", "gk-graphkeeper-operator")["spec"]
    assert operator["podSelector"]["matchLabels"] == operator_pods


def test_workers_can_follow_a_policy_applied_outside_the_chart(helm):
    docs = render(helm, "-f", str(ROOT / "deploy" / "local" / "values-local-node.yaml"))
    assert not [d for d in docs if d["kind"] == "GraphPolicy"]
    pod = one(docs, "Deployment", "gk-graphkeeper-worker")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["policy"]["configMap"]["name"] == "decode-graphpolicy"
    assert pod["containers"][0]["imagePullPolicy"] == "Never"


def test_the_charts_policy_leaves_sleep_off_and_refuses_a_negative_idle_time(helm):
    docs = render(helm, "--set", "workers.enabled=true")
    spec = [d for d in docs if d["kind"] == "GraphPolicy"][0]["spec"]
    assert spec["sleepAfterIdleSeconds"] == 0
    on = render(helm, "--set", "workers.enabled=true", "--set", "workers.policy.sleepAfterIdleSeconds=900")
    assert [d for d in on if d["kind"] == "GraphPolicy"][0]["spec"]["sleepAfterIdleSeconds"] == 900
    bad = subprocess.run([str(helm), "template", "gk", str(CHART), "--set", "workers.enabled=true",
                          "--set", "workers.policy.sleepAfterIdleSeconds=-1"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "sleepAfterIdleSeconds" in bad.stderr


# ------------------------------------------------------------------ the workers' Service and GPU ----

GPU = "nvidia.com/gpu"


def worker_resources(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "gk-graphkeeper-worker")["spec"]["template"]["spec"]["containers"][0][
        "resources"]


def test_device_cpu_requests_no_gpu_and_cuda_does(helm):
    cuda = worker_resources(render(helm, "--set", "workers.enabled=true"))
    assert cuda["limits"][GPU] == 1, "the default (device: cuda) asks for a GPU"
    cpu = worker_resources(render(helm, "--set", "workers.enabled=true", "--set", "workers.device=cpu"))
    assert GPU not in cpu.get("limits", {}) and GPU not in cpu.get("requests", {}), cpu
    assert cpu["limits"]["memory"] == cuda["limits"]["memory"], "only the GPU goes"
    # Even when the values ask for one in both places (a CPU pod would never be scheduled).
    cpu = worker_resources(render(helm, "--set", "workers.enabled=true", "--set", "workers.device=cpu",
                                  "--set", "workers.resources.requests.nvidia\\.com/gpu=1"))
    assert GPU not in cpu["limits"] and GPU not in cpu["requests"], cpu
    bad = subprocess.run([str(helm), "template", "gk", str(CHART), "--set", "workers.device=gpu"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "device" in bad.stderr


def test_the_workers_service_selects_the_workers_grpc_port(helm):
    docs = render(helm, "--set", "workers.enabled=true")
    svc = one(docs, "Service", "gk-graphkeeper-worker")
    pod = one(docs, "Deployment", "gk-graphkeeper-worker")["spec"]["template"]
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"] == one(docs, "Deployment", "gk-graphkeeper-worker")["spec"]["selector"][
        "matchLabels"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP",
                                     "appProtocol": "kubernetes.io/h2c"},
                                    {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
                                     "appProtocol": "http"}]
    container_ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    # The control port is never behind the Service; metrics only when asked for.
    docs = render(helm, "--set", "workers.enabled=true", "--set", "workers.service.ports.metrics=9400",
                  "--set", "workers.service.clusterIP=None")
    svc = one(docs, "Service", "gk-graphkeeper-worker")["spec"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["ports"]] == [
        ("grpc", 50051, "grpc"), ("http", 8000, "http"), ("metrics", 9400, "metrics")]
    assert svc["clusterIP"] == "None"
    docs = render(helm, "--set", "workers.enabled=true", "--set", "workers.service.enabled=false")
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Service"] == ["gk-graphkeeper-operator-metrics"]
    assert "gk-graphkeeper-worker" not in {d["metadata"]["name"] for d in render(helm) if d["kind"] == "Service"}


def test_notes_say_how_to_reach_the_workers(helm, tmp_path):
    """NOTES.txt through helm's engine: `helm install --dry-run` wants a cluster, `helm template` leaves
    NOTES out, so a copy of the chart renders the same file into a ConfigMap with `tpl`."""
    chart = tmp_path / "graphkeeper"
    shutil.copytree(CHART, chart)
    shutil.copy(CHART / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "notes-for-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        "data: {notes: {{ tpl (.Files.Get \"notes.txt\") . | quote }}}\n")

    def notes(*args: str) -> str:
        out = subprocess.run([str(helm), "template", "gk", str(chart), "-n", "llm", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return one([d for d in yaml.safe_load_all(out.stdout) if d], "ConfigMap", "notes")["data"]["notes"]

    text = notes("--set", "workers.enabled=true")
    assert "gk-graphkeeper-worker.llm.svc:50051" in text
    assert "kubectl port-forward -n llm svc/gk-graphkeeper-worker 50051:50051" in text
    assert "graphkeeper generate --target 127.0.0.1:50051" in text
    assert "svc/gk-graphkeeper-worker" not in notes(), "no workers, no word of them"
    assert "by its pod IP on port 50051" in notes("--set", "workers.enabled=true",
                                                  "--set", "workers.service.enabled=false")


def _token(docs: list[dict]) -> str:
    return one(docs, "Secret", "gk-graphkeeper-control-token")["data"]["token"]


def test_a_supplied_control_token_renders_the_same_every_time(helm):
    """GitOps tools render with `helm template` (no live Secret to read): a supplied token is stable."""
    token = "t" * 40
    first, second = (render(helm, "--set", f"controlToken.token={token}") for _ in range(2))
    assert _token(first) == _token(second)
    assert base64.b64decode(_token(first)).decode() == token
    # Without one, each render makes a new random token (what values.yaml warns about).
    assert _token(render(helm)) != _token(render(helm))
    short = subprocess.run([str(helm), "template", "gk", str(CHART), "--set", "controlToken.token=short"],
                           capture_output=True, text=True, timeout=120)
    assert short.returncode != 0 and "token" in short.stderr


def test_an_existing_control_token_secret_is_mounted_and_none_rendered(helm):
    docs = render(helm, "--set", "workers.enabled=true", "--set", "controlToken.existingSecret=my-token")
    assert [d for d in docs if d["kind"] == "Secret"] == []
    for component in ("operator", "worker"):
        pod = one(docs, "Deployment", f"gk-graphkeeper-{component}")["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["control-token"]["secret"]["secretName"] == "my-token"
    both = subprocess.run([str(helm), "template", "gk", str(CHART), "--set", "controlToken.existingSecret=x",
                           "--set", f"controlToken.token={'t' * 40}"], capture_output=True, text=True, timeout=120)
    assert both.returncode != 0


def test_values_comments_name_only_keys_the_schema_has():
    """A comment in values.yaml that names a dotted key (e.g. networkPolicy.allowFrom) names a real one."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def exists(path: list[str]) -> bool:
        node = schema
        for part in path:
            props = node.get("properties", {})
            if part not in props:
                return False
            node = props[part]
        return True

    text = (CHART / "values.yaml").read_text()
    comments = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    # Dotted names not followed by more of a name or a path (monitoring.coreos.com/v1 is an API group).
    named = set(re.findall(r"\b((?:[a-z][A-Za-z]*\.)+[a-z][A-Za-z]*)\b(?![\w./-])", comments))
    keys = {n for n in named if n.split(".")[0] in schema["properties"]}
    assert "networkPolicy.allowFrom" in keys, "the comment that narrows the worker ports names it"
    assert [k for k in sorted(keys) if not exists(k.split("."))] == []


def test_two_operator_replicas_by_default_one_acting_through_a_lease(helm):
    docs = render(helm)
    deployment = one(docs, "Deployment", "gk-graphkeeper-operator")["spec"]
    assert deployment["replicas"] == 2
    container = deployment["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["GRAPHKEEPER_LEADER_ELECTION_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    spread = deployment["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == \
        "kubernetes.io/hostname"
    role = one(docs, "Role", "gk-graphkeeper-operator-lease")
    assert role["metadata"]["namespace"] == "llm"
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "create", "update"]}]
    binding = one(docs, "RoleBinding", "gk-graphkeeper-operator-lease")
    assert binding["subjects"][0]["name"] == deployment["template"]["spec"]["serviceAccountName"]
    assert one(render(helm, "--set", "operator.replicas=1"), "Deployment", "gk-graphkeeper-operator")[
        "spec"]["replicas"] == 1
