"""A light in-process ``GraphControl`` server that stands in for a worker: the operator's test double.

Used by the operator's unit tests (``tests/operator``), as a process by the cluster suite
(``python tests/fakes/fake_worker.py --port ...``, see ``main``) and by the 200-worker simulation
in ``bench/operator_fakefleet.py``. It lives under ``tests/`` so that it never ships in the
wheel. It keeps the worker's contract (idempotent by policy uid and generation,
FAILED_PRECONDITION for an older generation, INVALID_ARGUMENT for an invalid policy, any other
uid accepted) and counts every call, but captures nothing: it is a simulation, never a
substitute for the real worker in a claim about the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from graphkeeper.proto import SERVER_OPTIONS
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.proto.enums import lifecycle_name
from graphkeeper.proto.policy import PolicyError, recapture_key, validate_policy
from graphkeeper.proto.serving_counters import ITL_BOUNDS_SECONDS, itl_bucket
from graphkeeper.proto.watch import heartbeat_seconds, watch_status

#: The simulated step time: a fixed part and a part per real token (seconds), at speed 1.
STEP_SECONDS, TOKEN_SECONDS = 0.002, 0.00002


@dataclass
class FakeWorkerState:
    policy: pb.GraphPolicy | None = None  # adopted
    pending_policy: pb.GraphPolicy | None = None
    model_source: str = "random:tiny"
    model_revision: str = "rev-0"
    pending_revision: str = ""
    state: int = pb.LIFECYCLE_STATE_READY
    max_num_batched_tokens: int | None = 64
    capture_seconds: float = 0.0
    load_seconds: float = 0.0
    #: A policy listing any of these sizes "fails" to capture them (SIZE_CAPTURE_FAILED).
    fail_sizes: frozenset[int] = frozenset()
    last_error: str = ""
    skipped: list = field(default_factory=list)
    #: When set, every GraphControl call must carry ``authorization: Bearer <token>``.
    token: str = ""
    calls: Counter = field(default_factory=Counter)
    #: (unix time, lifecycle state name) at each change: the stand-in's own lifecycle report.
    transitions: list = field(default_factory=list)
    on_transition: Callable[[float, str], None] | None = None
    #: Simulated traffic: (real tokens, uniform decode, steps per second). The reported histogram
    #: holds rate x seconds since the last adoption (a worker resets its histogram on adoption).
    traffic: list[tuple[int, bool, float]] = field(default_factory=list)
    #: A file in ``parse_traffic``'s format, read again when it changes (tests change traffic).
    traffic_file: str = ""
    traffic_since: float = field(default_factory=time.time)
    #: Device bytes each captured graph reports (CapturedSize.device_bytes).
    graph_bytes: int = 4 * 2**20
    #: How fast its steps run (1: the simulated step time; 0.9: 10% slower per sequence), and the
    #: speed while it holds exactly some explicit sizes (a test makes the canary's set slower).
    speed: float = 1.0
    speed_with_sizes: dict[tuple[int, ...], float] = field(default_factory=dict)
    #: Whether it serves WatchGraphStatus (False: an older worker, UNIMPLEMENTED, polled instead).
    watch: bool = True
    #: One event per open WatchGraphStatus stream, set on every change.
    watchers: set = field(default_factory=set)
    _traffic_mtime: float = 0.0

    def notify(self) -> None:
        """Wakes every WatchGraphStatus stream: something it reports may have changed."""
        for event in self.watchers:
            event.set()

    def current_speed(self) -> float:
        held = tuple(sorted(set(self.policy.capture_sizes.explicit.sizes))) if self.policy else ()
        return self.speed_with_sizes.get(held, self.speed)

    def serving(self, now: float | None = None) -> pb.ServingCounters:
        """Serving counters for the simulated traffic since the last adoption: each step's
        sequences sample one token each (decode) or one (mixed), at the current speed; a step
        replays the smallest held explicit size that fits it, else runs eager."""
        self.histogram(now)  # reads the traffic file again when it changed
        elapsed = max(0.0, (now or time.time()) - self.traffic_since)
        speed = self.current_speed()
        sizes = sorted(set(self.policy.capture_sizes.explicit.sizes)) if self.policy else []
        out = pb.ServingCounters(since_unix_seconds=self.traffic_since, itl_bounds_seconds=ITL_BOUNDS_SECONDS)
        itl = [0] * (len(ITL_BOUNDS_SECONDS) + 1)
        for tokens, decode, rate in self.traffic:
            steps = int(rate * elapsed)
            seqs = tokens if decode else 1
            seconds = (STEP_SECONDS + TOKEN_SECONDS * tokens) / speed
            out.generated_tokens += steps * seqs
            out.sequence_seconds += steps * seqs * seconds
            itl[itl_bucket(seconds)] += steps * seqs
            size = next((s for s in sizes if s >= tokens), 0)
            if size:
                out.graph_steps += steps
                out.replayed_tokens += steps * size
                out.padded_tokens += steps * (size - tokens)
            else:
                out.eager_steps += steps
        out.itl_counts.extend(itl)
        return out

    def histogram(self, now: float | None = None) -> pb.StepHistogram:
        """The traffic since the last adoption, as a worker reports it."""
        if self.traffic_file:
            from pathlib import Path

            path = Path(self.traffic_file)
            if path.exists() and path.stat().st_mtime != self._traffic_mtime:
                self._traffic_mtime = path.stat().st_mtime
                self.traffic = parse_traffic(path.read_text())
        elapsed = max(0.0, (now or time.time()) - self.traffic_since)
        out = pb.StepHistogram(since_unix_seconds=self.traffic_since,
                               policy_uid=self.policy.policy_uid if self.policy else "",
                               policy_generation=self.policy.generation if self.policy else 0)
        for tokens, decode, rate in self.traffic:
            steps = int(rate * elapsed)
            if steps:
                out.shapes.add(num_tokens=tokens, num_seqs=tokens if decode else 1, uniform_decode=decode,
                               steps=steps)
                out.steps += steps
        return out

    def captured(self) -> list[pb.CapturedSize]:
        """One graph per explicit size of the adopted policy (the light stand-in captures nothing)."""
        if self.policy is None:
            return []
        mode = pb.GRAPH_MODE_FULL if self.policy.mode in (pb.GRAPH_MODE_FULL, pb.GRAPH_MODE_FULL_DECODE_ONLY) \
            else pb.GRAPH_MODE_PIECEWISE
        return [pb.CapturedSize(size=s, mode=mode, device_bytes=self.graph_bytes, capture_seconds=0.01)
                for s in sorted(set(self.policy.capture_sizes.explicit.sizes) - self.fail_sizes)]

    def set_state(self, state: int) -> None:
        if state == self.state:
            return
        self.state = state
        self.notify()
        stamp, name = time.time(), lifecycle_name(state)
        self.transitions.append((stamp, name))
        if self.on_transition is not None:
            self.on_transition(stamp, name)


class FakeGraphControl(pb_grpc.GraphControlServicer, pb_grpc.InferenceWorkerServicer):
    """GraphControl (and GetModelInfo) with the worker's semantics and no model.

    Like the worker, a pushed policy is pending until its capture ends (``capture_seconds``,
    RECAPTURING meanwhile), and only then adopted; a policy that differs from the adopted one
    only in tenant toggles or in spelling (equal ``recapture_key``) is adopted at once. A reload
    is LOADING for ``load_seconds``, then recaptures, and LoadModelRevision answers only when the
    revision serves.
    """

    def __init__(self, state: FakeWorkerState | None = None) -> None:
        self.state = state or FakeWorkerState()
        self._capture: asyncio.Task | None = None

    async def _authorize(self, context) -> None:
        if not self.state.token:
            return
        metadata = dict(context.invocation_metadata() or ())
        if metadata.get("authorization") != f"Bearer {self.state.token}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    def _adopt(self, policy: pb.GraphPolicy) -> None:
        self.state.policy = policy
        self.state.pending_policy = None
        self.state.traffic_since = time.time()
        sizes = set(policy.capture_sizes.explicit.sizes)
        failed = sorted(sizes & self.state.fail_sizes)
        self.state.skipped = [pb.SkippedSize(size=s, reason=pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED,
                                             message="simulated capture failure")
                              for s in failed]
        self.state.last_error = f"capture failed for sizes {failed}" if failed else ""
        self.state.notify()

    async def _recapture(self) -> None:
        if self.state.capture_seconds > 0:
            self.state.set_state(pb.LIFECYCLE_STATE_RECAPTURING)
            await asyncio.sleep(self.state.capture_seconds)
        if self.state.pending_policy is not None:
            self._adopt(self.state.pending_policy)
        self.state.set_state(pb.LIFECYCLE_STATE_READY)

    async def ApplyGraphPolicy(self, request, context):  # noqa: N802 (gRPC method name)
        await self._authorize(context)
        self.state.calls["ApplyGraphPolicy"] += 1
        policy = request.policy
        held = self.state.pending_policy or self.state.policy
        try:
            validate_policy(policy, self.state.max_num_batched_tokens)
        except PolicyError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if held is not None and held.policy_uid == policy.policy_uid:
            if policy.generation < held.generation:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"holds generation {held.generation}, got {policy.generation}")
            if policy.generation == held.generation:
                return pb.ApplyGraphPolicyResponse(applied_generation=held.generation,
                                                   unchanged=True)
        copy = pb.GraphPolicy()
        copy.CopyFrom(policy)
        if (self.state.pending_policy is None and self.state.policy is not None
                and recapture_key(self.state.policy) == recapture_key(copy)):
            self._adopt(copy)  # tenant toggles or an equivalent rewrite: nothing to recapture
            return pb.ApplyGraphPolicyResponse(applied_generation=policy.generation)
        self.state.pending_policy = copy
        self.state.notify()
        if self._capture is None or self._capture.done():
            self._capture = asyncio.create_task(self._recapture())
        return pb.ApplyGraphPolicyResponse(applied_generation=policy.generation,
                                           recapture_started=True)

    async def GetGraphStatus(self, request, context):  # noqa: N802
        await self._authorize(context)
        self.state.calls["GetGraphStatus"] += 1
        return self._status()

    async def WatchGraphStatus(self, request, context):  # noqa: N802
        """The worker's stream (``proto/watch.py``), woken by the stand-in's own changes."""
        await self._authorize(context)
        if not self.state.watch:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        self.state.calls["WatchGraphStatus"] += 1
        event = asyncio.Event()

        async def changed(timeout: float) -> None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await event.wait()
            event.clear()

        self.state.watchers.add(event)
        try:
            async for status in watch_status(self._status, heartbeat_seconds(request), changed):
                self.state.calls["WatchGraphStatus messages"] += 1
                yield status
        finally:
            self.state.watchers.discard(event)

    def _status(self) -> pb.GraphStatus:
        held, pending = self.state.policy, self.state.pending_policy
        return pb.GraphStatus(
            state=self.state.state,
            requested_mode=held.mode if held else pb.GRAPH_MODE_UNSPECIFIED,
            effective_mode=pb.GRAPH_MODE_NONE,
            policy_uid=held.policy_uid if held else "",
            policy_generation=held.generation if held else 0,
            pending_policy_uid=pending.policy_uid if pending else "",
            pending_policy_generation=pending.generation if pending else 0,
            model_revision=self.state.model_revision,
            pending_model_revision=self.state.pending_revision,
            skipped=self.state.skipped,
            last_error=self.state.last_error,
            traffic=self.state.histogram(),
            captured=self.state.captured(),
            serving=self.state.serving(),
            graph_memory_bytes=self.state.graph_bytes * len(self.state.captured()),
        )

    async def LoadModelRevision(self, request, context):  # noqa: N802
        await self._authorize(context)
        self.state.calls["LoadModelRevision"] += 1
        revision = request.revision or "derived"
        self.state.pending_revision = revision
        self.state.notify()
        self.state.set_state(pb.LIFECYCLE_STATE_LOADING)
        if self.state.load_seconds > 0:
            await asyncio.sleep(self.state.load_seconds)
        self.state.model_source = request.source or self.state.model_source
        self.state.model_revision = revision
        self.state.pending_revision = ""
        self.state.notify()
        await self._recapture()
        return pb.LoadModelRevisionResponse(revision=self.state.model_revision,
                                            recapture_started=True)

    async def GetModelInfo(self, request, context):  # noqa: N802
        self.state.calls["GetModelInfo"] += 1
        return pb.GetModelInfoResponse(source=self.state.model_source,
                                       revision=self.state.model_revision)


class FakeWorkerServer:
    """One fake worker on ``127.0.0.1``: inference (GetModelInfo) on ``port`` and GraphControl
    on ``control_port`` when ``separate_control`` (the worker's shape), else both on ``port``
    (port 0 picks a free one)."""

    def __init__(self, state: FakeWorkerState | None = None, port: int = 0,
                 servicer: type[FakeGraphControl] = FakeGraphControl,
                 separate_control: bool = False, control_port: int = 0) -> None:
        self.servicer = servicer(state)
        # The worker's options: a port another process holds fails the bind instead of splitting
        # that port's connections between two servers.
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_InferenceWorkerServicer_to_server(self.servicer, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self._control = grpc.aio.server(options=SERVER_OPTIONS) if separate_control else self._server
        pb_grpc.add_GraphControlServicer_to_server(self.servicer, self._control)
        self.control_port = (self._control.add_insecure_port(f"127.0.0.1:{control_port}")
                             if separate_control else self.port)

    @property
    def state(self) -> FakeWorkerState:
        return self.servicer.state

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def control_target(self) -> str:
        return f"127.0.0.1:{self.control_port}"

    async def start(self) -> FakeWorkerServer:
        await self._server.start()
        if self._control is not self._server:
            await self._control.start()
        return self

    async def stop(self) -> None:
        await self._server.stop(grace=None)
        if self._control is not self._server:
            await self._control.stop(grace=None)


def parse_traffic(text: str) -> list[tuple[int, bool, float]]:
    """``8:decode:100,40:mixed:5``: steps per second of each (real tokens, kind)."""
    out = []
    for item in text.replace("\n", ",").split(","):
        if not item.strip():
            continue
        tokens, kind, rate = item.strip().split(":")
        if kind not in ("decode", "mixed"):
            raise ValueError(f"traffic kind must be decode or mixed, got {kind!r}")
        out.append((int(tokens), kind == "decode", float(rate)))
    return out


def parse_speeds(text: str) -> dict[tuple[int, ...], float]:
    """``1,8,40=0.9;2,16=1.1``: the speed while holding exactly those explicit sizes."""
    out = {}
    for item in text.split(";"):
        if item.strip():
            sizes, speed = item.split("=")
            out[tuple(sorted({int(s) for s in sizes.split(",")}))] = float(speed)
    return out


async def serve_forever(args) -> None:
    """A fake worker process: GraphControl (on --control-port when given), GetModelInfo and
    gRPC health (SERVING at once) on --port. Lifecycle changes are appended to
    --lifecycle-log as ``<unix time> <STATE>`` lines: the stand-in's own report."""
    from pathlib import Path

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from graphkeeper.proto.policy import policy_from_json

    policy = policy_from_json(Path(args.policy_file).read_text()) if args.policy_file else None
    token = Path(args.control_token_file).read_text().strip() if args.control_token_file else ""
    log = open(args.lifecycle_log, "a", buffering=1) if args.lifecycle_log else None  # noqa: SIM115
    state = FakeWorkerState(
        max_num_batched_tokens=args.max_num_batched_tokens, model_revision=args.model_revision,
        policy=policy, capture_seconds=args.capture_seconds, load_seconds=args.load_seconds,
        fail_sizes=frozenset(int(s) for s in args.fail_sizes.split(",") if s.strip()),
        token=token, traffic=parse_traffic(args.traffic), traffic_file=args.traffic_file,
        on_transition=(lambda t, name: log.write(f"{t:.6f} {name}\n")) if log else None,
        speed=args.speed, speed_with_sizes=parse_speeds(args.speed_with_sizes), watch=not args.no_watch)
    server = FakeWorkerServer(state, port=args.port, separate_control=bool(args.control_port),
                              control_port=args.control_port)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server._server)
    for name in ("", "graphkeeper.worker.v1.InferenceWorker"):
        await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    await server._server.wait_for_termination()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="a fake graphkeeper worker (GraphControl only)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--control-port", type=int, default=0)
    parser.add_argument("--control-token-file", default="")
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--model-revision", default="rev-0")
    parser.add_argument("--policy-file", default="")
    parser.add_argument("--capture-seconds", type=float, default=0.0)
    parser.add_argument("--load-seconds", type=float, default=0.0)
    parser.add_argument("--fail-sizes", default="")
    parser.add_argument("--lifecycle-log", default="")
    parser.add_argument("--traffic", default="", help="steps per second, e.g. 8:decode:100,40:mixed:5")
    parser.add_argument("--traffic-file", default="", help="the same, read again when it changes")
    parser.add_argument("--speed", type=float, default=1.0, help="step speed (1: the simulated step time)")
    parser.add_argument("--speed-with-sizes", default="", help="e.g. 1,8,40=0.9: the speed holding those sizes")
    parser.add_argument("--no-watch", action="store_true", help="no WatchGraphStatus (an older worker)")
    asyncio.run(serve_forever(parser.parse_args()))


if __name__ == "__main__":
    main()
