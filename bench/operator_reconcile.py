"""Reconcile latency of the GraphPolicy operator: apply -> every selected worker acknowledged.

Runs a real control plane (``deploy/local/cluster.sh``, audit log on) and ``graphkeeper
operator`` as a process, then for each fleet:

- N real workers (``graphkeeper worker``, CPU, tiny random model) whose pods the tests' kubelet
  stand-in keeps Ready; "acknowledged" is read from each worker's own GetGraphStatus
  (policy uid and generation held, state READY);
- a SIMULATION of M workers: light in-process GraphControl servers (``bench/operator_fakefleet.py``)
  that record when they accepted each generation.

Each round applies a generation (create, then spec updates) and measures the time until every
worker holds it ("ack") and until the policy's status says Ready at that generation ("status").
API requests the operator made are counted from the kube-apiserver audit log by user agent
(kopf's own ``kopf/*`` and the operator's ``graphkeeper-operator/*``).

    python bench/operator_reconcile.py --real 1,10 --simulated 200 --rounds 3

``--rollout 10,200`` adds rollout durations: a SIMULATED fleet whose every capture takes
``--capture-seconds``, a capture-size change at ``maxUnavailable: 25%`` beside the same change
all at once (``100%``); duration from the API call until every worker reports the generation
adopted and READY, and the most workers recapturing at once, from the workers' own reports.
``--real '' --simulated 0 --rollout 10,200`` runs only that and replaces only the rollout
section of the results file.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The cluster suite's harness, and tests/ports.py that it imports as ``ports`` (as pytest does).
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tests.cluster.conftest import (  # noqa: E402
    Cluster,
    Kubelet,
    Operator,
    Policies,
    now,
    start_cluster,
    stop_cluster,
    wait_until,
)

OPERATOR_AGENTS = ("kopf/", "graphkeeper-operator/")
SIZES = [[1, 2, 4, 8], [1, 2, 4, 8, 16], [2, 4, 8, 16, 32], [1, 4, 16], [8, 16, 32, 64]]


def make_namespace(cluster: Cluster) -> str:
    name = f"bench-{uuid.uuid4().hex[:6]}"
    cluster.core.create_namespace({"metadata": {"name": name}})
    wait_until("default ServiceAccount",
               lambda: any(sa.metadata.name == "default" for sa in
                           cluster.core.list_namespaced_service_account(name).items), timeout=30)
    return name


def simulated_pods(cluster, ports: list[int]) -> str:
    """A namespace with one Running, Ready pod per simulated worker port (all on 127.0.0.1);
    returns the namespace once the operator has had time to index them."""
    ns = make_namespace(cluster)

    def make_pod(i_port: tuple[int, int]) -> None:
        i, port = i_port
        name = f"sim-{i:03d}"
        cluster.core.create_namespaced_pod(ns, {
            "metadata": {"name": name, "labels": {"bench": "fleet"}},
            "spec": {"containers": [{"name": "worker", "image": "simulated",
                                     "ports": [{"name": "grpc", "containerPort": port}]}]}})
        cluster.core.patch_namespaced_pod_status(name, ns, {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now()}]}},
            _content_type="application/merge-patch+json")

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(make_pod, enumerate(ports)))
    time.sleep(3.0)
    return ns


def drop_namespace(cluster: Cluster, name: str) -> None:
    """Deletes a fleet's namespace and waits for its pods to go: ports are reused by the next
    fleet, and a stale pod at a reused address is (rightly) a conflict for the operator."""
    cluster.core.delete_namespace(name)
    wait_until(f"the pods of {name} to go",
               lambda: not cluster.core.list_namespaced_pod(name).items, timeout=300,
               interval=0.5)


def spec(round_: int) -> dict:
    return {"selector": {"matchLabels": {"bench": "fleet"}}, "mode": "FullAndPiecewise",
            "captureSizes": {"sizes": SIZES[round_ % len(SIZES)]}}


def apply_round(policies: Policies, round_: int) -> tuple[float, dict]:
    t0 = time.time()
    if round_ == 0:
        obj = policies.create("bench", spec(0))
    else:
        obj = policies.patch_spec("bench", {"captureSizes": spec(round_)["captureSizes"]})
    return t0, obj


def wait_status(policies: Policies, generation: int, count: int, timeout: float) -> float:
    def ready() -> bool:
        status = policies.get("bench").get("status") or {}
        cond = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
        return (status.get("observedGeneration") == generation and cond.get("status") == "True"
                and status.get("capturedWorkers") == count)

    wait_until(f"status Ready at generation {generation}", ready, timeout=timeout, interval=0.02)
    return time.time()


def audit_count(cluster: Cluster, since: float, until: float) -> Counter:
    """Operator requests in [since, until] by verb and resource, from the audit log."""
    counts: Counter = Counter()
    path = cluster.state / "logs" / "audit.log"
    seen = set()
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not str(event.get("userAgent", "")).startswith(OPERATOR_AGENTS):
            continue
        if event.get("auditID") in seen:
            continue
        stamp = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if not since <= stamp.timestamp() <= until:
            continue
        seen.add(event.get("auditID"))
        ref = event.get("objectRef") or {}
        resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource")
                                               else "")
        counts[f"{event['verb']} {resource}"] += 1
    return counts


def run_real(cluster: Cluster, kubelet: Kubelet, count: int, rounds: int) -> dict:
    ns = make_namespace(cluster)
    with ThreadPoolExecutor(max_workers=min(count, 4)) as pool:
        workers = list(pool.map(lambda i: kubelet.create_worker(ns, f"w{i:03d}",
                                                                {"bench": "fleet"}),
                                range(count)))
    policies = Policies(cluster, ns)
    time.sleep(2.0)  # let the operator's pod index settle
    acks, statuses = [], []
    for r in range(rounds):
        t0, obj = apply_round(policies, r)
        uid, gen = obj["metadata"]["uid"], obj["metadata"]["generation"]

        def all_hold(uid: str = uid, gen: int = gen) -> bool:
            for w in workers:
                s = w.graph_status()
                if not (s.policy_uid == uid and s.policy_generation == gen and s.state == 5):
                    return False
            return True

        wait_until("every real worker to hold the generation", all_hold, timeout=120,
                   interval=0.01)
        acks.append(time.time() - t0)
        statuses.append(wait_status(policies, gen, count, 120) - t0)
        time.sleep(1.0)
    for w in workers:
        kubelet.kill(w)
    drop_namespace(cluster, ns)
    return {"fleet": f"{count} real worker(s)", "count": count, "ack": acks, "status": statuses}


def run_simulated(cluster: Cluster, count: int, rounds: int, settle: float) -> dict:
    fleet = subprocess.Popen([sys.executable, str(ROOT / "bench" / "operator_fakefleet.py"),
                              "--count", str(count)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=cluster.env)
    ports = json.loads(fleet.stdout.readline())["ports"]
    applied: dict[tuple[str, int], list[float]] = {}
    lock = threading.Lock()

    def read() -> None:
        for line in fleet.stdout:
            parts = line.split()
            if parts and parts[0] == "applied":
                with lock:
                    applied.setdefault((parts[2], int(parts[3])), []).append(float(parts[4]))

    threading.Thread(target=read, daemon=True).start()
    ns = simulated_pods(cluster, ports)
    policies = Policies(cluster, ns)
    acks, statuses, requests = [], [], []
    for r in range(rounds):
        t0, obj = apply_round(policies, r)
        key = (obj["metadata"]["uid"], obj["metadata"]["generation"])
        wait_until("every simulated worker to accept the generation",
                   lambda k=key: len(applied.get(k, [])) >= count, timeout=300, interval=0.01)
        with lock:
            acks.append(max(applied[key]) - t0)
        t_status = wait_status(policies, key[1], count, 300)
        statuses.append(t_status - t0)
        time.sleep(2.0)  # let follow-up writes land inside the counting window
        requests.append(audit_count(cluster, t0 - 0.001, time.time()))
    idle_start = time.time()
    time.sleep(settle)
    idle = audit_count(cluster, idle_start, time.time())
    drop_namespace(cluster, ns)
    fleet.stdin.close()
    fleet.wait(timeout=60)
    return {"fleet": f"{count} simulated workers (SIMULATION: in-process GraphControl servers)",
            "count": count, "ack": acks, "status": statuses, "requests": requests,
            "idle": idle, "idle_seconds": settle}


def run_rollout(cluster: Cluster, count: int, capture_seconds: float, rounds: int,
                max_unavailable: str) -> dict:
    """Rollout duration of a capture-size change on a simulated fleet at ``max_unavailable``."""
    fleet = subprocess.Popen([sys.executable, str(ROOT / "bench" / "operator_fakefleet.py"),
                              "--count", str(count), "--capture-seconds", str(capture_seconds)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=cluster.env)
    ports = json.loads(fleet.stdout.readline())["ports"]
    ready: dict[tuple[str, int], dict[str, float]] = {}
    states: list[tuple[float, str, str]] = []
    lock = threading.Lock()

    def read() -> None:
        for line in fleet.stdout:
            parts = line.split()
            with lock:
                if parts and parts[0] == "ready":
                    ready.setdefault((parts[2], int(parts[3])), {})[parts[1]] = float(parts[4])
                elif parts and parts[0] == "state":
                    states.append((float(parts[3]), parts[1], parts[2]))

    threading.Thread(target=read, daemon=True).start()
    ns = simulated_pods(cluster, ports)
    policies = Policies(cluster, ns)
    body = {**spec(0), "rollout": {"maxUnavailable": max_unavailable}}
    obj = policies.create("bench", body)
    uid = obj["metadata"]["uid"]
    wait_until("generation 1 everywhere", lambda: len(ready.get((uid, 1), {})) >= count,
               timeout=600, interval=0.05)
    durations, most = [], []
    for r in range(1, rounds + 1):
        t0 = time.time()
        obj = policies.patch_spec("bench", {"captureSizes": spec(r)["captureSizes"]})
        key = (uid, obj["metadata"]["generation"])
        wait_until("every simulated worker READY at the generation",
                   lambda k=key: len(ready.get(k, {})) >= count, timeout=900, interval=0.02)
        with lock:
            durations.append(max(ready[key].values()) - t0)
            changes = sorted(s for s in states if s[0] >= t0)
        busy: set[str] = set()
        peak = 0
        for _, port, state in changes:
            (busy.discard if state == "READY" else busy.add)(port)
            peak = max(peak, len(busy))
        most.append(peak)
        time.sleep(1.0)
    drop_namespace(cluster, ns)
    fleet.stdin.close()
    fleet.wait(timeout=60)
    return {"count": count, "max_unavailable": max_unavailable, "capture": capture_seconds,
            "duration": durations, "most": most}


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()


ROLLOUT_BEGIN = "<!-- rollout: begin -->"
ROLLOUT_END = "<!-- rollout: end -->"


def rollout_report(results: list[dict], args: argparse.Namespace, commit: str) -> str:
    lines = [
        ROLLOUT_BEGIN,
        "## Rollout duration (SIMULATION)",
        "",
        f"- Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; commit {commit}",
        "- Machine: 2-core CPU VM, no GPU; control plane, operator and the simulated fleet on "
        "this machine over loopback",
        f"- Command: `python bench/operator_reconcile.py --real '{args.real}' --simulated "
        f"{args.simulated} --rollout {args.rollout} --capture-seconds {args.capture_seconds:g} "
        f"--rounds {args.rounds}`",
        f"- Fleet: light in-process GraphControl servers (`bench/operator_fakefleet.py`), each "
        f"capture simulated as {args.capture_seconds:g} s RECAPTURING; not the real worker.",
        "- One capture-size change per round (a new generation). *duration*: from the API call "
        "until every worker reports the generation adopted and READY (the workers' own "
        "reports). *most at once*: the most workers not READY at one moment, from the same "
        "reports.",
        "",
        "- 25% of 10 rounds down to 2 (5 batches); 25% of 200 is 50 (4 batches). A batch "
        "costs the capture plus the time to see its workers READY (status reads every 0.5 s "
        "while a rollout is under way). With `--real '' --simulated 0` only this section is "
        "run and rewritten.",
        "",
        "| Workers | maxUnavailable | duration | most at once |",
        "|---|---|---|---|",
    ]
    for r in results:
        label = "100% (all at once)" if r["max_unavailable"] == "100%" else r["max_unavailable"]
        lines.append(f"| {r['count']} | {label} | {fmt(r['duration'])} | "
                     f"{max(r['most'])} |")
    lines.append(ROLLOUT_END)
    return "\n".join(lines) + "\n"


def merge_rollout(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else ""
    if ROLLOUT_BEGIN in text:
        head, _, rest = text.partition(ROLLOUT_BEGIN)
        _, _, tail = rest.partition(ROLLOUT_END)
        text = head + section.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def fmt(values: list[float]) -> str:
    return (f"median {statistics.median(values):.2f} s (min {min(values):.2f}, "
            f"max {max(values):.2f}, n={len(values)})")


def report(results: list[dict], args: argparse.Namespace, interval: float) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [
        "# Operator reconcile latency",
        "",
        f"- Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; commit {head_commit()}",
        f"- Machine: 2-core CPU VM ({cpu}, Python {platform.python_version()}), no GPU; "
        "control plane, operator and workers all on this machine over loopback",
        "- Control plane: `deploy/local/cluster.sh` (etcd 3.5.1, kube-apiserver and "
        "kube-controller-manager v1.36.3), audit log on",
        f"- Operator: `graphkeeper operator --status-interval {interval}` (kopf 1.45.2)",
        f"- Command: `python bench/operator_reconcile.py --real {args.real} "
        f"--simulated {args.simulated} --rounds {args.rounds}"
        + (f" --rollout {args.rollout} --capture-seconds {args.capture_seconds:g}"
           if args.rollout else "") + "`",
        "- Round 1 creates the GraphPolicy, later rounds change `captureSizes` (a new generation).",
        "- *ack*: from the API call until every selected worker reports the generation "
        "(real workers: their GetGraphStatus polled every 10 ms; simulated: the time each "
        "fake accepted it). *status*: until `.status` says Ready at that generation with every "
        "worker captured (polled every 20 ms).",
        "",
        "| Fleet | ack (apply -> all workers hold the generation) | status Ready |",
        "|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['fleet']} | {fmt(r['ack'])} | {fmt(r['status'])} |")
    sim = next((r for r in results if "requests" in r), None)
    if sim:
        lines += ["", f"## API requests the operator made for {sim['count']} simulated workers",
                  "", "Counted from the kube-apiserver audit log by user agent (kopf and the "
                  "operator's own client), from the apply until 2 s after status Ready. The watch "
                  "streams the operator opened at start (pods, GraphPolicies, CRDs) are "
                  "long-running requests outside this window. The change reaches the fleet in "
                  "batches (the default maxUnavailable 25%), and status and a PolicyPushed "
                  "Event are written as each batch goes out.", "",
                  "| Round | requests | by verb and resource |", "|---|---|---|"]
        for i, counts in enumerate(sim["requests"], 1):
            detail = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
            lines.append(f"| {i} | {sum(counts.values())} | {detail} |")
        idle = sim["idle"]
        lines += ["", f"Idle (no change, {sim['idle_seconds']:.0f} s, status reads every "
                  f"{interval:g} s): {sum(idle.values())} requests "
                  f"({', '.join(f'{k}: {v}' for k, v in sorted(idle.items())) or 'none'}). "
                  "Workers are read over gRPC, not through the API server, and an unchanged "
                  "status is not written."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", default="1,10", help="comma-separated real fleet sizes")
    parser.add_argument("--simulated", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--status-interval", type=float, default=5.0)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "operator-reconcile.md"))
    parser.add_argument("--rollout", default="", help="comma-separated simulated fleet sizes")
    parser.add_argument("--capture-seconds", type=float, default=2.0)
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="gk-bench-"))
    cluster = start_cluster(state / "cluster", {"GRAPHKEEPER_AUDIT": "1"})
    operator = Operator(cluster, state / "operator.log", status_interval=args.status_interval)
    kubelet = Kubelet(cluster, state)
    results = []
    rollouts = []
    try:
        operator.start()
        for count in [int(c) for c in args.rollout.split(",") if c.strip()]:
            for max_unavailable in ("25%", "100%"):
                rollouts.append(run_rollout(cluster, count, args.capture_seconds, args.rounds,
                                            max_unavailable))
                print(rollouts[-1], flush=True)
        for count in [int(c) for c in args.real.split(",") if c.strip()]:
            results.append(run_real(cluster, kubelet, count, args.rounds))
            print(results[-1], flush=True)
        if args.simulated:
            results.append(run_simulated(cluster, args.simulated, args.rounds, args.idle_seconds))
            print(results[-1], flush=True)
    finally:
        kubelet.close()
        operator.stop()
        stop_cluster(cluster)
    if results:
        text = report(results, args, args.status_interval)
        Path(args.out).write_text(text)
        print(text)
    if rollouts:
        section = rollout_report(rollouts, args, head_commit())
        merge_rollout(Path(args.out), section)
        print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
