"""The operator's own Prometheus metrics and its HTTP endpoint (``/metrics``, ``/healthz``).

The operator is one process, so the default registry is enough. Labels stay bounded: outcomes
and states are closed lists, and per-policy series are removed when the policy goes away.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

# As in the worker: the *_created series double every counter for no dashboard's benefit.
disable_created_metrics()

RECONCILE_SECONDS = Histogram(
    "graphkeeper_operator_reconcile_duration_seconds",
    "Time to reconcile one GraphPolicy: read every worker, push where needed, write status.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
PUSHES = Counter(
    "graphkeeper_operator_policy_pushes_total",
    "ApplyGraphPolicy calls, by outcome (applied, unchanged, rejected, stale, unreachable, error).",
    ["outcome"],
)
MODEL_LOADS = Counter(
    "graphkeeper_operator_model_loads_total",
    "LoadModelRevision calls made because a pod's model-revision annotation changed, by outcome.",
    ["outcome"],
)
#: Outcome label values, created up front so that the panels show 0 after a restart, not no data.
PUSH_OUTCOMES = ("applied", "unchanged", "rejected", "stale", "unreachable", "error")
MODEL_LOAD_OUTCOMES = ("ok", "unreachable", "rejected", "stale", "error")
for _outcome in PUSH_OUTCOMES:
    PUSHES.labels(outcome=_outcome)
for _outcome in MODEL_LOAD_OUTCOMES:
    MODEL_LOADS.labels(outcome=_outcome)
STATUS_READS = Counter(
    "graphkeeper_operator_status_reads_total",
    "GetGraphStatus calls, by outcome (ok, or the kind of failure).",
    ["outcome"],
)
STATUS_STREAMS = Gauge(
    "graphkeeper_operator_status_streams",
    "WatchGraphStatus streams open to workers (workers without the call are read instead).",
)
STATUS_STREAM_BREAKS = Counter(
    "graphkeeper_operator_status_stream_breaks_total",
    "WatchGraphStatus streams that broke, ended or fell silent (each marks its worker unreachable).",
)
WORKERS = Gauge(
    "graphkeeper_operator_workers",
    "Selected workers by state (Captured, Pending, Starting, Unreachable, ...), per policy.",
    ["namespace", "policy", "state"],
)
API_REQUESTS = Counter(
    "graphkeeper_operator_api_requests_total",
    "Kubernetes API requests the operator's own code made (kopf's watches not included).",
    ["verb", "resource"],
)
STATUS_WRITES = Counter(
    "graphkeeper_operator_status_writes_total",
    "GraphPolicy status patches (a reconcile that changes nothing writes nothing).",
)

#: Capture sizes from traffic (spec.captureSizes.fromTraffic), per policy: what the recommended set
#: and the set in effect are expected to buy on the merged histogram, and what the recommended set costs.
EXPECTED_COVERAGE = Gauge(
    "graphkeeper_operator_expected_coverage_ratio",
    "Expected share of all steps a graph replays (served coverage, predicted) on the merged traffic, "
    "for the recommended sizes and the sizes in effect (sizes: recommended, current).",
    ["namespace", "policy", "sizes"],
)
RECOMMENDED_GRAPHS = Gauge(
    "graphkeeper_operator_recommended_graphs",
    "Graphs the sizes recommended from traffic would capture.",
    ["namespace", "policy"],
)
RECOMMENDED_MEMORY = Gauge(
    "graphkeeper_operator_recommended_graph_memory_bytes",
    "Estimated graph memory of the sizes recommended from traffic.",
    ["namespace", "policy"],
)
TRAFFIC_STEPS = Gauge(
    "graphkeeper_operator_traffic_steps",
    "Steps in the merged step-shape histogram the recommendation was computed from.",
    ["namespace", "policy"],
)
SIZE_APPLIES = Counter(
    "graphkeeper_operator_capture_size_applies_total",
    "Capture-size sets applied from traffic (fromTraffic mode Apply).",
)
COVERAGE_SIZES = ("recommended", "current")


def set_recommendation(namespace: str, policy: str, *, recommended: float, current: float, graphs: int,
                       memory_bytes: int, steps: int) -> None:
    EXPECTED_COVERAGE.labels(namespace=namespace, policy=policy, sizes="recommended").set(recommended)
    EXPECTED_COVERAGE.labels(namespace=namespace, policy=policy, sizes="current").set(current)
    RECOMMENDED_GRAPHS.labels(namespace=namespace, policy=policy).set(graphs)
    RECOMMENDED_MEMORY.labels(namespace=namespace, policy=policy).set(memory_bytes)
    TRAFFIC_STEPS.labels(namespace=namespace, policy=policy).set(steps)


CANARY_PHASE = Gauge(
    "graphkeeper_operator_canary_phase",
    "The policy's canary of a set chosen from traffic: 0 Idle, 1 Canary, 2 Promoted, 3 Reverted.",
    ["namespace", "policy"],
)


def set_worker_states(
    namespace: str, policy: str, counts: dict[str, int], states: list[str]
) -> None:
    for state in states:
        WORKERS.labels(namespace=namespace, policy=policy, state=state).set(counts.get(state, 0))


def forget_policy(namespace: str, policy: str, states: list[str]) -> None:
    for state in states:
        with contextlib.suppress(KeyError):
            WORKERS.remove(namespace, policy, state)
    for sizes in COVERAGE_SIZES:
        with contextlib.suppress(KeyError):
            EXPECTED_COVERAGE.remove(namespace, policy, sizes)
    for gauge in (RECOMMENDED_GRAPHS, RECOMMENDED_MEMORY, TRAFFIC_STEPS, CANARY_PHASE):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, policy)


async def serve(port: int, health: Callable[[], dict]) -> web.AppRunner:
    """Starts ``/metrics`` and ``/healthz`` on ``port`` (0.0.0.0); returns the runner to stop."""
    started = time.monotonic()

    async def metrics_view(_: web.Request) -> web.Response:
        body = generate_latest()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health_view(_: web.Request) -> web.Response:
        report = {"ok": True, "uptime_seconds": round(time.monotonic() - started, 1), **health()}
        return web.json_response(report, status=200 if report["ok"] else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", health_view)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner
