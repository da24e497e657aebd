"""The operator at fleet scale: 1,000 SIMULATED workers under 50 GraphPolicies, on this machine.

A real control plane (``deploy/local/cluster.sh``, audit log on) and ``graphkeeper operator`` as
a process with its defaults (5 s reconcile interval, 60 s resync); the workers are light
in-process GraphControl servers (``bench/operator_fakefleet.py``: the worker's policy contract,
no model), one pod each, 20 pods per policy. Measured:

- *one policy changed*: a capture-size change to one policy, from the API call until each of its
  20 workers accepted the generation (the fakes' own reports) and until its status is Ready;
- *all policies changed*: the same change to all 50 policies at once, until all 1,000 workers
  accepted it and every status is Ready;
- for each: the operator's CPU seconds (``/proc/<pid>/stat``) and resident memory, and the API
  requests it made (the audit log, by user agent);
- *idle*: with nothing changing, GetGraphStatus calls per worker per second (the operator's
  ``graphkeeper_operator_status_reads_total``), its CPU and its API requests.

    python bench/operator_fleet.py --workers 1000 --policies 50 --rounds 3 --idle-seconds 120

SIMULATION: the fleet is not the real worker; the figures are the operator's and the API server's.
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
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from operator_reconcile import audit_count, head_commit, make_namespace  # noqa: E402
from proc_stats import cpu_seconds  # noqa: E402

from tests.cluster.conftest import (  # noqa: E402
    Cluster,
    Operator,
    Policies,
    now,
    start_cluster,
    stop_cluster,
    wait_until,
)

SIZES = [[1, 2, 4, 8], [1, 2, 4, 8, 16], [2, 4, 8, 16, 32], [1, 4, 16], [8, 16, 32, 64]]
READS = "graphkeeper_operator_status_reads_total"
STREAMS = "graphkeeper_operator_status_streams"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def make_pods(cluster: Cluster, ns: str, ports: list[int], per_policy: int) -> None:
    def make_pod(i_port: tuple[int, int]) -> None:
        i, port = i_port
        name = f"sim-{i:04d}"
        cluster.core.create_namespaced_pod(ns, {
            "metadata": {"name": name, "labels": {"group": f"g{i // per_policy:02d}"}},
            "spec": {"containers": [{"name": "worker", "image": "simulated",
                                     "ports": [{"name": "grpc", "containerPort": port}]}]}})
        cluster.core.patch_namespaced_pod_status(name, ns, {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now()}]}},
            _content_type="application/merge-patch+json")

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(make_pod, enumerate(ports)))


def spec(group: int, round_: int) -> dict:
    return {"selector": {"matchLabels": {"group": f"g{group:02d}"}}, "mode": "FullAndPiecewise",
            "captureSizes": {"sizes": SIZES[round_ % len(SIZES)]}}


class Fleet:
    """The simulated workers, and when each accepted which (policy uid, generation)."""

    def __init__(self, cluster: Cluster, count: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "operator_fakefleet.py"), "--count", str(count)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=cluster.env)
        self.ports = json.loads(self.proc.stdout.readline())["ports"]
        self.applied: dict[tuple[str, int], dict[str, float]] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = line.split()
            if parts and parts[0] == "applied":
                with self.lock:
                    self.applied.setdefault((parts[2], int(parts[3])), {})[parts[1]] = float(
                        parts[4])

    def count(self, key: tuple[str, int]) -> int:
        with self.lock:
            return len(self.applied.get(key, {}))

    def last(self, key: tuple[str, int]) -> float:
        with self.lock:
            return max(self.applied[key].values())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def all_ready(policies: Policies, names: list[str], generations: dict[str, int], per: int) -> bool:
    items = policies.cluster.custom.list_namespaced_custom_object(
        "graphkeeper.io", "v1alpha1", policies.namespace, "graphpolicies")["items"]
    by_name = {o["metadata"]["name"]: o for o in items}
    for name in names:
        status = by_name[name].get("status") or {}
        cond = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
        if not (status.get("observedGeneration") == generations[name]
                and cond.get("status") == "True" and status.get("capturedWorkers") == per):
            return False
    return True


def change(cluster: Cluster, operator: Operator, fleet: Fleet, policies: Policies,
           names: list[str], uids: dict[str, str], generations: dict[str, int], round_: int,
           per: int) -> dict:
    """Changes ``names`` at once; returns time to every worker's ack and to status Ready, the
    operator's CPU seconds and API requests over the window."""
    pid = operator.process.pid
    cpu0, fleet0, t0 = cpu_seconds(pid), cpu_seconds(fleet.proc.pid), time.time()

    def patch(name: str) -> None:
        group = int(name[1:])
        obj = policies.patch_spec(name, {"captureSizes": spec(group, round_)["captureSizes"]})
        generations[name] = obj["metadata"]["generation"]

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(patch, names))
    keys = [(uids[n], generations[n]) for n in names]
    wait_until("every worker to accept", lambda: all(fleet.count(k) >= per for k in keys),
               timeout=600, interval=0.05)
    ack = max(fleet.last(k) for k in keys) - t0
    wait_until("every status Ready", lambda: all_ready(policies, names, generations, per),
               timeout=600, interval=0.1)
    ready = time.time() - t0
    cpu = cpu_seconds(pid) - cpu0
    fleet_cpu = cpu_seconds(fleet.proc.pid) - fleet0
    time.sleep(2.0)  # follow-up writes land inside the counting window
    requests = audit_count(cluster, t0 - 0.001, time.time())
    return {"policies": len(names), "ack": ack, "ready": ready, "cpu": cpu, "fleet_cpu": fleet_cpu,
            "rss": rss_mib(pid), "requests": sum(requests.values()), "by_verb": dict(requests)}


def edit_burst(cluster: Cluster, operator: Operator, policies: Policies, name: str, edits: int, rate: float,
               generations: dict[str, int], per: int) -> dict:
    """``edits`` capture-size edits to one policy at ``rate`` a second; the operator's API requests
    from the first edit until 2 s after the status is Ready at the last generation."""
    t0 = time.time()
    for i in range(edits):
        due = t0 + i / rate
        time.sleep(max(0.0, due - time.time()))
        obj = policies.patch_spec(name, {"captureSizes": {"sizes": SIZES[i % len(SIZES)][: 2 + i % 3]}})
        generations[name] = obj["metadata"]["generation"]
    sent = time.time() - t0
    wait_until("the last edit Ready", lambda: all_ready(policies, [name], generations, per), timeout=300,
               interval=0.1)
    ready = time.time() - t0
    time.sleep(2.0)
    requests = audit_count(cluster, t0 - 0.001, time.time())
    return {"edits": edits, "rate": rate, "seconds": sent, "ready": ready, "requests": sum(requests.values()),
            "per_edit": sum(requests.values()) / edits, "by_verb": dict(requests)}


def fmt(values: list[float], unit: str = "s") -> str:
    return (f"median {statistics.median(values):.2f} {unit} (min {min(values):.2f}, "
            f"max {max(values):.2f}, n={len(values)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--policies", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=120.0)
    parser.add_argument("--edits", type=int, default=200, help="spec edits to one policy (0: none)")
    parser.add_argument("--edit-rate", type=float, default=5.0, help="edits a second")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "operator-fleet.md"))
    parser.add_argument("--json", default="", help="also write the figures as JSON here")
    args = parser.parse_args()
    per = args.workers // args.policies

    state = Path(tempfile.mkdtemp(prefix="gk-fleet-"))
    cluster = start_cluster(state / "cluster", {"GRAPHKEEPER_AUDIT": "1"})
    operator = Operator(cluster, state / "operator.log", status_interval=5.0, resync_interval=60.0)
    fleet = None
    try:
        operator.start()
        fleet = Fleet(cluster, args.workers)
        ns = make_namespace(cluster)
        t = time.time()
        make_pods(cluster, ns, fleet.ports, per)
        print(f"{args.workers} pods in {time.time() - t:.1f} s", flush=True)
        policies = Policies(cluster, ns)
        names = [f"g{g:02d}" for g in range(args.policies)]
        uids, generations = {}, {}
        t0 = time.time()
        for name in names:
            obj = policies.create(name, spec(int(name[1:]), 0))
            uids[name], generations[name] = obj["metadata"]["uid"], 1
        wait_until("every worker to hold generation 1",
                   lambda: all(fleet.count((uids[n], 1)) >= per for n in names),
                   timeout=900, interval=0.1)
        wait_until("every status Ready", lambda: all_ready(policies, names, generations, per),
                   timeout=900, interval=0.5)
        created = time.time() - t0
        print(f"created: {created:.1f} s", flush=True)
        time.sleep(10.0)

        pid = operator.process.pid
        reads0, cpu0, i0 = operator.metric(READS), cpu_seconds(pid), time.time()
        time.sleep(args.idle_seconds)
        idle_s = time.time() - i0
        idle = {"seconds": idle_s, "reads_per_worker_s": (operator.metric(READS) - reads0)
                / args.workers / idle_s, "cpu_share": (cpu_seconds(pid) - cpu0) / idle_s,
                "rss": rss_mib(pid), "requests": sum(audit_count(cluster, i0, time.time()).values()),
                "streams": operator.metric(STREAMS)}
        print("idle", idle, flush=True)

        one, every = [], []
        for r in range(1, args.rounds + 1):
            one.append(change(cluster, operator, fleet, policies, [names[r % len(names)]], uids,
                              generations, r, per))
            print("one", one[-1], flush=True)
            time.sleep(5.0)
        for r in range(args.rounds + 1, 2 * args.rounds + 1):
            every.append(change(cluster, operator, fleet, policies, names, uids, generations, r,
                                per))
            print("all", every[-1], flush=True)
            time.sleep(5.0)
        burst = None
        if args.edits:
            burst = edit_burst(cluster, operator, policies, names[0], args.edits, args.edit_rate, generations, per)
            print("edits", burst, flush=True)
    finally:
        operator.stop()
        if fleet is not None:
            fleet.close()
        stop_cluster(cluster)

    text = report(args, per, created, idle, one, every, burst)
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.now(UTC).isoformat(), "commit": head_commit(), "workers": args.workers,
            "policies": args.policies, "created_s": created, "idle": idle, "one": one, "all": every,
            "edits": burst}, indent=1) + "\n")
    print(text)
    return 0


def report(args: argparse.Namespace, per: int, created: float, idle: dict, one: list[dict],
           every: list[dict], burst: dict | None) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [
        f"# The operator with {args.workers} workers under {args.policies} policies (SIMULATION)",
        "",
        f"- Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; commit {head_commit()}",
        f"- Machine: 2-core CPU VM ({cpu}, Python {platform.python_version()}), shared with "
        "other work; control plane, operator and the simulated fleet on this machine over "
        "loopback",
        "- Control plane: `deploy/local/cluster.sh` (etcd, kube-apiserver and "
        "kube-controller-manager v1.36.3), audit log on",
        "- Operator: `graphkeeper operator --status-interval 5 --resync-interval 60` (the "
        "defaults)",
        f"- Fleet: {args.workers} light in-process GraphControl servers "
        f"(`bench/operator_fakefleet.py`), one Ready pod each, {per} per policy; captures are "
        "instant. Not the real worker.",
        f"- Command: `python bench/operator_fleet.py --workers {args.workers} --policies "
        f"{args.policies} --rounds {args.rounds} --idle-seconds {args.idle_seconds:g}`",
        f"- Creating the {args.policies} policies until every worker held its policy and every "
        f"status was Ready: {created:.1f} s.",
        "- A change is a capture-size change (it recaptures, so it goes out at the default "
        f"maxUnavailable 25%: {max(1, per // 4)} of {per} workers at a time per policy). *ack*: "
        "from the API call until every worker concerned accepted the generation (the fakes' "
        "own reports); *Ready*: until every status said Ready at it. CPU: the operator "
        "process's user+system seconds over the same window. API requests: the audit log, by "
        "the operator's user agents, from the call until 2 s after Ready.",
        "",
        "| Change | ack | status Ready | operator CPU | stand-ins' CPU | API requests | operator RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rows in ((f"one policy ({per} workers)", one),
                        (f"all {args.policies} policies ({args.workers} workers)", every)):
        lines.append(
            f"| {label} | {fmt([r['ack'] for r in rows])} | {fmt([r['ready'] for r in rows])} | "
            f"{fmt([r['cpu'] for r in rows], 'CPU s')} | {fmt([r['fleet_cpu'] for r in rows], 'CPU s')} | "
            f"median {statistics.median([r['requests'] for r in rows]):.0f} "
            f"(max {max(r['requests'] for r in rows)}) | "
            f"{max(r['rss'] for r in rows):.0f} MiB |")
    by_verb = every[-1]["by_verb"]
    lines += [
        "",
        "Requests of the last all-policies change, by verb and resource: "
        + ", ".join(f"{k}: {v}" for k, v in sorted(by_verb.items())) + ".",
        "",
        "## Idle",
        "",
        f"Nothing changing, {idle['seconds']:.0f} s: **{idle['reads_per_worker_s']:.4f} "
        f"GetGraphStatus calls per worker per second** ({idle['streams']:.0f} WatchGraphStatus "
        f"streams open: each worker sends a heartbeat a minute instead), the operator at "
        f"**{100 * idle['cpu_share']:.1f}% of one core** for {args.workers} workers, "
        f"{idle['rss']:.0f} MiB resident, {idle['requests']} API requests.",
    ]
    if burst is not None:
        lines += [
            "",
            "## An edit burst",
            "",
            f"{burst['edits']} capture-size edits to one policy ({per} workers) at {burst['rate']:g} a second "
            f"(sent over {burst['seconds']:.1f} s; Ready at the last generation {burst['ready']:.1f} s after the "
            f"first): **{burst['requests']} operator API requests, {burst['per_edit']:.2f} per edit** ("
            + ", ".join(f"{k}: {v}" for k, v in sorted(burst["by_verb"].items())) + ").",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
