"""The chart on a real node: a kubelet runs the probes, containerd runs the image, the operator runs
in a pod as the chart's ServiceAccount, Prometheus scrapes the pods. In the order a person trying it
would go: install, policy Ready, change it, lose a pod, look at the metrics, lint, upgrade, uninstall.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from .conftest import (
    EXAMPLE,
    NAMESPACE,
    OPERATOR_LABEL,
    POLICY,
    RELEASE,
    WORKER_LABEL,
    Node,
    Prometheus,
    manifest,
    ready,
    wait_until,
)

#: The first test also brings up the node and builds the image (minutes on a cold cache).
pytestmark = pytest.mark.timeout(2400)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "graphkeeper-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "graphkeeper-alerts.yaml"

#: Dashboard queries whose series exist only once a CUDA graph was captured or replayed (a GPU
#: worker): on this CPU node every step runs eagerly with reason backend_unsupported, and nothing is
#: captured, skipped or replayed. (panel title, a piece of the query)
GPU_ONLY = {
    ("Workers", "graphkeeper_graph_captured"),
    ("Graph replays by mode and size", "graphkeeper_graph_replays_total"),
    ("Replays by capture size (range)", "graphkeeper_graph_replays_total"),
    ("Captured graphs per pod", "graphkeeper_graph_captured"),
    ("Captured graphs per pod", "graphkeeper_graph_skipped"),
    ("Capture time per graph", "graphkeeper_graph_capture_duration_seconds"),
    ("What each graph buys: GPU time saved", "graphkeeper_graph_replays_total"),
    ("Padding computed per graph", "graphkeeper_graph_padding_tokens_total"),
}


def ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def policy_ready(node: Node, generation: int | None = None) -> dict | None:
    obj = node.policy()
    status = obj.get("status") or {}
    want = generation or obj["metadata"]["generation"]
    cond = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
    if status.get("observedGeneration") == want and cond.get("status") == "True":
        return obj
    return None


def workers(node: Node) -> list[dict]:
    return node.pods(WORKER_LABEL)


def generate(ip: str, tenant: str, n: int = 2) -> None:
    for i in range(n):
        subprocess.run([sys.executable, "-m", "graphkeeper.cli", "generate", "--target",
                        f"{ip}:50051", "--tenant", tenant, "--prompt-ids", f"{i + 1},2,3",
                        "--max-new-tokens", "8", "--json"], check=True, capture_output=True,
                       timeout=120)


# ------------------------------------------------------------------------- install and policy ----


def test_the_operator_runs_in_a_pod_as_the_charts_service_account(release: Node):
    pod = wait_until("the operator pod to be Ready", lambda: next(
        (p for p in release.pods(OPERATOR_LABEL) if ready(p)), None), timeout=300)
    spec = pod["spec"]
    assert spec["serviceAccountName"] == f"{RELEASE}-operator"
    container = spec["containers"][0]
    assert not [e for e in container.get("env", []) if e["name"] == "KUBECONFIG"], "in-cluster config"
    # Ready can come before the operator's first line reaches the container log (once in CI the
    # first read was empty), so the read is repeated; a kubelet that never serves logs still fails.
    log = wait_until("kubectl logs to read the container's output through the kubelet",
                     lambda: release.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"]), timeout=60)
    assert log, "kubectl logs reads the container's output through the kubelet"
    assert "Forbidden" not in log and " 403" not in log, log[-4000:]
    # The same ServiceAccount can do no more than the chart grants: e.g. no Secrets, no Deployments.
    sa = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-operator"
    for verb, resource in (("list", "secrets"), ("create", "deployments.apps"), ("delete", "pods")):
        out = release.kubectl("auth", "can-i", verb, resource, "-n", NAMESPACE, "--as", sa, check=False)
        assert out.strip() == "no", (verb, resource)


def test_a_second_cluster_on_the_same_ports_is_refused_at_once(node: Node, tmp_path: Path):
    """cluster.sh up checks its ports before it starts anything and names the one that is taken."""
    env = {**node.env, "GRAPHKEEPER_CLUSTER_DIR": str(tmp_path / "second")}
    t0 = time.monotonic()
    out = subprocess.run([str(ROOT / "deploy" / "local" / "cluster.sh"), "up", "--node"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert time.monotonic() - t0 < 10, "refused before starting anything"
    api_port = node.env["GRAPHKEEPER_APISERVER_PORT"]
    assert f"port {api_port} (kube-apiserver) is already in use" in out.stderr, out.stderr
    assert not (tmp_path / "second" / "pki").exists(), "nothing was made"
    assert "kube-apiserver: running" in subprocess.run(
        [str(ROOT / "deploy" / "local" / "cluster.sh"), "status"], env=node.env, capture_output=True,
        text=True, timeout=60).stdout, "the first cluster is untouched"


def test_workers_turn_ready_only_after_their_capture_phase(release: Node):
    pods = wait_until("two Ready workers", lambda: (
        p := workers(release)) and len(p) == 2 and all(ready(x) for x in p) and p, timeout=600)
    for pod in pods:
        name = pod["metadata"]["name"]
        assert pod["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"
        log = release.kubectl("logs", "-n", NAMESPACE, name, "--timestamps")
        lines = [ln for ln in log.splitlines() if re.search(r"\bREADY\b", ln)]
        assert lines, f"{name} never logged READY:\n{log[-3000:]}"
        assert "no compiled bytecode" not in log, "the image ships torch without bytecode"
        became_ready = ts(lines[0].split()[0])
        cond = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
        # Ready is reported by the kubelet's gRPC probe, after the worker said READY (second
        # granularity on the condition).
        assert ts(cond["lastTransitionTime"]) >= became_ready.replace(microsecond=0), (cond, lines[0])
        started = ts(pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"])
        assert ts(cond["lastTransitionTime"]) >= started


def test_the_example_policy_is_ready_with_every_worker_holding_its_generation(release: Node):
    obj = wait_until("the policy to be Ready", lambda: policy_ready(release), timeout=300)
    status = obj["status"]
    assert (status["selectedWorkers"], status["capturedWorkers"], status["failedWorkers"]) == (2, 2, 0)
    gen = obj["metadata"]["generation"]
    assert sorted(w["policyGeneration"] for w in status["workers"]) == [gen, gen]
    assert {w["name"] for w in status["workers"]} == {
        f"{NAMESPACE}/{p['metadata']['name']}" for p in workers(release)}


def test_a_capture_size_change_rolls_through(release: Node):
    before = release.policy()["metadata"]["generation"]
    release.kubectl("patch", "graphpolicy", POLICY, "-n", NAMESPACE, "--type", "merge", "-p",
                    json.dumps({"spec": {"captureSizes": {
                        "sizes": [1, 2], "ladder": None, "maxCaptureSize": None}}}))
    obj = wait_until("generation+1 Ready", lambda: policy_ready(release, before + 1), timeout=300)
    assert [w["policyGeneration"] for w in obj["status"]["workers"]] == [before + 1] * 2
    cm = release.get("configmap", f"{POLICY}-graphpolicy", "-n", NAMESPACE)
    rendered = json.loads(cm["data"]["policy.json"])
    assert rendered["capture_sizes"]["explicit"]["sizes"] == [1, 2]


def test_a_model_revision_change_rolls_through(release: Node):
    for pod in workers(release):
        release.kubectl("annotate", "pod", "-n", NAMESPACE, pod["metadata"]["name"], "--overwrite",
                        "graphkeeper.io/model-source=random:tiny@7",
                        "graphkeeper.io/model-revision=rev-7")
    obj = wait_until("every worker to serve rev-7", lambda: (
        o := release.policy())["status"].get("modelRevisions") == ["rev-7"]
        and policy_ready(release) and o, timeout=300)
    assert obj["status"]["capturedWorkers"] == 2


# ------------------------------------------------------------------------- the workers' Service ----


def _requests_served(pod: dict) -> float:
    """graphkeeper_requests_total of one worker, all outcomes, from its metrics port."""
    url = f"http://{pod['status']['podIP']}:9400/metrics"
    with urllib.request.urlopen(url, timeout=20) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^graphkeeper_requests_total\{[^}]*\} (\S+)$", text, re.M))


def test_a_request_through_the_workers_service_reaches_a_worker(release: Node):
    service = f"{RELEASE}-worker"
    pods = wait_until("two Ready workers", lambda: (
        p := workers(release)) and len(p) == 2 and all(ready(x) for x in p) and p, timeout=600)
    for pod in pods:  # device: cpu, and the chart asked for no GPU (the node has none to give)
        assert "nvidia.com/gpu" not in json.dumps(pod["spec"]["containers"][0]["resources"])
    spec = release.get("service", service, "-n", NAMESPACE)["spec"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in spec["ports"]] == [
        ("grpc", 50051, "grpc"), ("http", 8000, "http")]

    # What kube-proxy or a gateway routes to: the EndpointSlice controller's view of the Service is
    # exactly the Ready workers' gRPC ports.
    want = {(p["status"]["podIP"], 50051) for p in pods}

    def endpoints() -> set | None:
        slices = release.get("endpointslices", "-n", NAMESPACE, "-l",
                             f"kubernetes.io/service-name={service}")["items"]
        got = {(address, port["port"]) for s in slices for e in s.get("endpoints") or []
               if (e.get("conditions") or {}).get("ready") for address in e["addresses"]
               for port in s.get("ports") or [] if port.get("name") == "grpc"}
        return got if got == want else None

    wait_until("the Service's endpoints to be the Ready workers", endpoints, timeout=120)

    # A request through the Service, as NOTES.txt tells a user to send one: kubectl port-forward to
    # svc/<release>-worker (the API server resolves the Service to one of its pods and its port).
    notes = release.helm("get", "notes", RELEASE, "-n", NAMESPACE)
    assert f"svc/{service}" in notes and f"{service}.{NAMESPACE}.svc:50051" in notes, notes
    before = {p["metadata"]["name"]: _requests_served(p) for p in pods}
    forward = subprocess.Popen([str(release.bin / "kubectl"), "port-forward", "-n", NAMESPACE,
                                f"svc/{service}", ":50051"], env=release.env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = forward.stdout.readline()
        m = re.search(r"127\.0\.0\.1:(\d+) -> 50051", line)
        assert m, f"kubectl port-forward said {line!r}: {forward.stderr.read() if forward.poll() is not None else ''}"
        out = subprocess.run([sys.executable, "-m", "graphkeeper.cli", "generate", "--target",
                              f"127.0.0.1:{m.group(1)}", "--tenant", "chat", "--prompt-ids", "5,6,7",
                              "--max-new-tokens", "4", "--json"], capture_output=True, text=True, timeout=120)
    finally:
        forward.terminate()
        forward.wait(timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == result["generated_tokens"] == 4, result
    # Exactly one worker counted the request.
    after = {p["metadata"]["name"]: _requests_served(p) for p in pods}
    served = sorted(name for name in after if after[name] > before[name])
    assert len(served) == 1 and after[served[0]] - before[served[0]] == 1, (before, after)


# ------------------------------------------------------------------------------- monitoring ----


def _panel_queries() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    found = []

    def walk(panels):
        for p in panels:
            if p.get("type") == "row":
                walk(p.get("panels", []))
            for t in p.get("targets", []):
                found.append((p["title"], t["expr"]))

    walk(d["panels"])
    for v in d["templating"]["list"]:
        if v.get("definition"):
            found.append((f"variable {v['name']}", v["definition"]))
    return found


def _instantiate(expr: str) -> str:
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr.strip())
    if m:  # Grafana's label_values(selector, label): the selector must return series
        expr = m.group(1)
    return (expr.replace("$namespace", ".*").replace("$pod", ".*")
            .replace("$__range", "10m").replace("$__rate_interval", "1m"))


def test_prometheus_scrapes_every_pod_and_loads_the_rules(prometheus: Prometheus, release: Node):
    pods = {p["metadata"]["name"] for p in workers(release) + release.pods(OPERATOR_LABEL)}
    wait_until("every pod scraped and up", lambda: {
        r["metric"].get("pod") for r in prometheus.query('up{job="graphkeeper-pods"} == 1')} >= pods,
        timeout=120)
    # Traffic after the first scrape, so rates and increases see it.
    for pod in workers(release):
        generate(pod["status"]["podIP"], "chat")
        generate(pod["status"]["podIP"], "batch")
    groups = prometheus.api("/api/v1/rules")["groups"]
    assert {g["name"] for g in groups} == {
        "graphkeeper-worker.rules", "graphkeeper-worker", "graphkeeper-operator"} or len(groups) >= 3
    assert all(r["health"] == "ok" for g in groups for r in g["rules"]), groups


@pytest.mark.parametrize(("panel", "expr"), _panel_queries(), ids=[p for p, _ in _panel_queries()])
def test_every_dashboard_query_returns_data(prometheus: Prometheus, panel: str, expr: str):
    if any(panel == title and piece in expr for title, piece in GPU_ONLY):
        result = prometheus.query(_instantiate(expr))
        assert result == [], f"{panel} is listed GPU-only but has data on a CPU node"
        return
    result = wait_until(f"{panel}: {expr}", lambda: prometheus.query(_instantiate(expr)),
                        timeout=90, interval=5)
    assert result


def test_the_operator_exports_no_created_series(prometheus: Prometheus):
    assert prometheus.query('{__name__=~"graphkeeper_.*_created"}') == []


def test_a_deleted_worker_pod_is_replaced_and_boots_from_the_configmap(release: Node, tmp_path: Path):
    """With the operator away, the replacement can only get its policy from the ConfigMap."""
    gen = release.policy()["metadata"]["generation"]
    release.kubectl("scale", "deploy", f"{RELEASE}-operator", "-n", NAMESPACE, "--replicas=0")
    wait_until("the operator pod to go", lambda: not release.pods(OPERATOR_LABEL), timeout=120)
    before = {p["metadata"]["name"] for p in workers(release)}
    victim = sorted(before)[0]
    release.kubectl("delete", "pod", "-n", NAMESPACE, victim, "--wait=false")

    def replaced() -> dict | None:
        pods = workers(release)
        fresh = [p for p in pods if p["metadata"]["name"] not in before]
        if len(pods) == 2 and all(ready(p) for p in pods) and len(fresh) == 1:
            return fresh[0]
        return None

    new = wait_until("a Ready replacement", replaced, timeout=600)
    token = tmp_path / "token"
    token.write_bytes(base64.b64decode(
        release.get("secret", f"{RELEASE}-control-token", "-n", NAMESPACE)["data"]["token"]))
    status = json.loads(subprocess.run(
        [sys.executable, "-m", "graphkeeper.cli", "status", "--target",
         f"{new['status']['podIP']}:50051", "--token-file", str(token), "--json"],
        check=True, capture_output=True, text=True, timeout=60).stdout)
    assert str(status["graphs"].get("policy_generation")) == str(gen), status
    release.kubectl("scale", "deploy", f"{RELEASE}-operator", "-n", NAMESPACE, "--replicas=1")
    obj = wait_until("the policy Ready again, replacement included", lambda: (
        o := policy_ready(release)) and {w["name"] for w in o["status"]["workers"]} == {
            f"{NAMESPACE}/{p['metadata']['name']}" for p in workers(release)} and o, timeout=300)
    assert obj["metadata"]["generation"] == gen, "nothing was pushed to make it Ready"
    assert [w["policyGeneration"] for w in obj["status"]["workers"]] == [gen, gen]


# ------------------------------------------------------------------------- lint and lifecycle ----


#: kube-score's critical checks the installed chart leaves out on purpose (charts/graphkeeper/README.md).
KUBE_SCORE_IGNORED = [
    # The local node's image is loaded into containerd and cannot be pulled: pullPolicy Never.
    "container-image-pull-policy",
]


def test_kube_score_passes_on_the_installed_chart(release: Node, tmp_path: Path):
    docs = manifest(release)
    path = tmp_path / "manifest.yaml"
    path.write_text(release.helm("get", "manifest", RELEASE, "-n", NAMESPACE))
    out = subprocess.run([str(release.bin / "kube-score"), "score", "--output-format", "ci",
                          *[a for check in KUBE_SCORE_IGNORED for a in ("--ignore-test", check)],
                          str(path)], capture_output=True, text=True, timeout=120)
    critical = [ln for ln in out.stdout.splitlines() if ln.startswith("[CRITICAL]")]
    assert critical == [], out.stdout
    assert {d["kind"] for d in docs} >= {"Deployment", "NetworkPolicy", "Secret"}


def _operator_requests(node: Node) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) of every request the operator's pod made."""
    user = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-operator"
    seen = set()
    for line in (node.state / "logs" / "audit.log").read_text().splitlines():
        event = json.loads(line)
        ref = event.get("objectRef") or {}
        if event["user"]["username"] != user or not ref.get("resource"):
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        seen.add((ref.get("apiGroup", ""), resource, event["verb"]))
    return seen


def test_the_operator_uses_the_rbac_rules_it_holds(release: Node):
    """Prints the closing note's table: each rule of the chart's ClusterRole and whether the
    operator's pod made such a request during this suite."""
    role = release.get("clusterrole", f"{RELEASE}-operator-cluster")
    used = _operator_requests(release)
    rows, unused = [], []
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    hit = (group, resource, verb) in used
                    rows.append(f"{group or 'core'} {resource} {verb}: {'used' if hit else 'NOT SEEN'}")
                    if not hit:
                        unused.append((group, resource, verb))
    print("\n".join(rows))
    (release.state / "logs" / "operator-rbac-usage.txt").write_text("\n".join(rows) + "\n")
    assert used, "the audit log shows the operator's requests"
    # Nothing outside the roles: the pod's requests all fall under the ClusterRole's rules and the
    # Lease Role's (which replica acts).
    lease = release.get("role", f"{RELEASE}-operator-lease", "-n", NAMESPACE)
    granted = {(g, r, v) for rule in role["rules"] + lease["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    assert used <= granted, used - granted


def test_helm_upgrade_keeps_the_control_token_and_rolls_the_operator(release: Node):
    secret = f"{RELEASE}-control-token"
    token = release.get("secret", secret, "-n", NAMESPACE)["data"]["token"]
    release.helm("upgrade", RELEASE, str(ROOT / "charts" / "graphkeeper"), "-n", NAMESPACE,
                 "-f", str(ROOT / "deploy" / "local" / "values-local-node.yaml"),
                 "--set", "operator.statusInterval=3", "--wait", "--timeout", "10m")
    assert release.get("secret", secret, "-n", NAMESPACE)["data"]["token"] == token
    args = release.get("deploy", f"{RELEASE}-operator", "-n", NAMESPACE)["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert "--status-interval=3" in args
    wait_until("the policy Ready after the upgrade", lambda: policy_ready(release), timeout=300)


def test_helm_uninstall_leaves_nothing_behind(release: Node):
    release.kubectl("delete", "-n", NAMESPACE, "-f", str(EXAMPLE), "--wait=true")
    release.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "5m")
    kinds = "all,configmaps,secrets,serviceaccounts,roles,rolebindings,networkpolicies,graphpolicies"

    def leftovers() -> list[str]:
        items = release.get(kinds, "-n", NAMESPACE)["items"]
        return [f"{i['kind']}/{i['metadata']['name']}" for i in items
                if i["metadata"]["name"] not in ("default", "kube-root-ca.crt")]

    wait_until("the namespace to be empty", lambda: not leftovers(), timeout=180)
    cluster_scoped = release.get("clusterroles,clusterrolebindings")["items"]
    assert [i["metadata"]["name"] for i in cluster_scoped if RELEASE in i["metadata"]["name"]] == []
    # Helm never deletes a CRD it installed (crds/): the GraphPolicy CRD stays, by design.
    assert release.get("crd", "graphpolicies.graphkeeper.io")["metadata"]["name"]
