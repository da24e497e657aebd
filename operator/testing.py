"""A light in-process ``GraphControl`` server that stands in for a worker.

Used by the operator's unit tests and by the 200-worker simulation in
``bench/operator_reconcile.py``. It keeps the worker's contract (idempotent by policy uid and
generation, FAILED_PRECONDITION for an older generation, INVALID_ARGUMENT for an invalid
policy, any other uid accepted) and counts every call, but captures nothing: it is a
simulation, never a substitute for the real worker in a claim about the worker.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

import grpc

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.proto.policy import PolicyError, validate_policy


@dataclass
class FakeWorkerState:
    policy: pb.GraphPolicy | None = None
    model_source: str = "random:tiny"
    model_revision: str = "rev-0"
    state: int = pb.LIFECYCLE_STATE_READY
    max_num_batched_tokens: int | None = 64
    capture_seconds: float = 0.0
    calls: Counter = field(default_factory=Counter)


class FakeGraphControl(pb_grpc.GraphControlServicer, pb_grpc.InferenceWorkerServicer):
    """GraphControl (and GetModelInfo) with the worker's semantics and no model."""

    def __init__(self, state: FakeWorkerState | None = None) -> None:
        self.state = state or FakeWorkerState()
        self._capture: asyncio.Task | None = None

    async def _recapture(self) -> None:
        if self.state.capture_seconds <= 0:
            self.state.state = pb.LIFECYCLE_STATE_READY
            return
        self.state.state = pb.LIFECYCLE_STATE_RECAPTURING

        async def finish() -> None:
            await asyncio.sleep(self.state.capture_seconds)
            self.state.state = pb.LIFECYCLE_STATE_READY

        self._capture = asyncio.create_task(finish())

    async def ApplyGraphPolicy(self, request, context):  # noqa: N802 (gRPC method name)
        self.state.calls["ApplyGraphPolicy"] += 1
        policy, held = request.policy, self.state.policy
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
        self.state.policy = pb.GraphPolicy()
        self.state.policy.CopyFrom(policy)
        await self._recapture()
        return pb.ApplyGraphPolicyResponse(applied_generation=policy.generation,
                                           recapture_started=True)

    async def GetGraphStatus(self, request, context):  # noqa: N802
        self.state.calls["GetGraphStatus"] += 1
        held = self.state.policy
        return pb.GraphStatus(
            state=self.state.state,
            requested_mode=held.mode if held else pb.GRAPH_MODE_UNSPECIFIED,
            effective_mode=pb.GRAPH_MODE_NONE,
            policy_uid=held.policy_uid if held else "",
            policy_generation=held.generation if held else 0,
            model_revision=self.state.model_revision,
        )

    async def LoadModelRevision(self, request, context):  # noqa: N802
        self.state.calls["LoadModelRevision"] += 1
        self.state.model_source = request.source or self.state.model_source
        self.state.model_revision = request.revision or "derived"
        await self._recapture()
        return pb.LoadModelRevisionResponse(revision=self.state.model_revision,
                                            recapture_started=True)

    async def GetModelInfo(self, request, context):  # noqa: N802
        self.state.calls["GetModelInfo"] += 1
        return pb.GetModelInfoResponse(source=self.state.model_source,
                                       revision=self.state.model_revision)


class FakeWorkerServer:
    """One fake worker listening on ``127.0.0.1:<port>`` (port 0 picks a free one)."""

    def __init__(self, state: FakeWorkerState | None = None, port: int = 0,
                 servicer: type[FakeGraphControl] = FakeGraphControl) -> None:
        self.servicer = servicer(state)
        self._server = grpc.aio.server()
        pb_grpc.add_GraphControlServicer_to_server(self.servicer, self._server)
        pb_grpc.add_InferenceWorkerServicer_to_server(self.servicer, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")

    @property
    def state(self) -> FakeWorkerState:
        return self.servicer.state

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeWorkerServer:
        await self._server.start()
        return self

    async def stop(self) -> None:
        await self._server.stop(grace=None)


async def serve_forever(port: int, max_num_batched_tokens: int, revision: str,
                        policy_file: str = "") -> None:
    """A fake worker process: GraphControl, GetModelInfo and gRPC health (SERVING at once)."""
    from pathlib import Path

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from graphkeeper.proto.policy import policy_from_json

    policy = policy_from_json(Path(policy_file).read_text()) if policy_file else None
    server = FakeWorkerServer(FakeWorkerState(max_num_batched_tokens=max_num_batched_tokens,
                                              model_revision=revision, policy=policy), port=port)
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
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--model-revision", default="rev-0")
    parser.add_argument("--policy-file", default="")
    args = parser.parse_args()
    asyncio.run(serve_forever(args.port, args.max_num_batched_tokens, args.model_revision,
                              args.policy_file))


if __name__ == "__main__":
    main()
