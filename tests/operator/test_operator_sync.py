"""Bringing one worker to a policy, against a real gRPC server that keeps the worker's contract.

The server is ``graphkeeper.operator.testing.FakeWorkerServer`` (no model; it only keeps the
policy bookkeeping), so these tests run in a second and need no cluster.
"""

from __future__ import annotations

import asyncio

from graphkeeper.operator.selection import WorkerPod
from graphkeeper.operator.status import WorkerState
from graphkeeper.operator.sync import sync_worker
from graphkeeper.operator.testing import FakeWorkerServer, FakeWorkerState
from graphkeeper.operator.workerclient import GraphControlClient
from graphkeeper.proto.policy import policy_from_spec

SPEC = {"selector": {"matchLabels": {"app": "w"}}, "mode": "Full",
        "captureSizes": {"sizes": [1, 2, 4]}}


def policy(generation=1, spec=SPEC, uid="uid-1"):
    return policy_from_spec(spec, uid=uid, name="ns/p", generation=generation)


def pod_for(server, **kw):
    base = dict(namespace="ns", name="w0", uid="pod-uid", address="127.0.0.1", port=server.port,
                phase="Running", ready=True)
    return WorkerPod(**{**base, **kw})


def run(coro_fn, state=None):
    async def main():
        server = await FakeWorkerServer(state).start()
        client = GraphControlClient(timeout=2.0, load_timeout=5.0)
        try:
            return await coro_fn(server, client)
        finally:
            await client.close()
            await server.stop()
    return asyncio.run(main())


def test_a_worker_lacking_the_policy_gets_exactly_one_push():
    async def scenario(server, client):
        loads = {}
        first = await sync_worker(client, pod_for(server), policy(), recapture_on_revision=True,
                                  load_attempts=loads)
        second = await sync_worker(client, pod_for(server), policy(), recapture_on_revision=True,
                                   load_attempts=loads)
        return first, second, server.state.calls
    first, second, calls = run(scenario)
    assert first.pushed == "applied" and first.observation.state == WorkerState.CAPTURED
    assert second.pushed == "" and second.observation.state == WorkerState.CAPTURED
    assert calls["ApplyGraphPolicy"] == 1, "a worker that holds the generation is not pushed again"
    assert first.observation.policy_generation == 1
    assert first.observation.effective_mode == "None"


def test_a_new_generation_is_pushed_and_a_capturing_worker_is_pending():
    async def scenario(server, client):
        await sync_worker(client, pod_for(server), policy(1), recapture_on_revision=True,
                          load_attempts={})
        server.state.capture_seconds = 5.0
        return await sync_worker(client, pod_for(server), policy(2), recapture_on_revision=True,
                                 load_attempts={})
    result = run(scenario)
    assert result.pushed == "applied"
    assert result.observation.state == WorkerState.PENDING
    assert result.observation.lifecycle == "RECAPTURING"


def test_a_policy_the_worker_refuses_is_rejected_with_its_message():
    too_big = {**SPEC, "captureSizes": {"sizes": [128]}}
    result = run(lambda server, client: sync_worker(
        client, pod_for(server), policy(spec=too_big), recapture_on_revision=True,
        load_attempts={}), FakeWorkerState(max_num_batched_tokens=64))
    assert result.pushed == "rejected"
    assert result.observation.state == WorkerState.REJECTED
    assert "token budget" in result.observation.message


def test_a_refused_generation_is_not_pushed_again_every_interval():
    too_big = {**SPEC, "captureSizes": {"sizes": [128]}}

    async def scenario(server, client):
        refused, results = {}, []
        for generation in (1, 1, 2):
            results.append(await sync_worker(client, pod_for(server), policy(generation, spec=too_big),
                                             recapture_on_revision=True, load_attempts={}, rejections=refused))
        return results, server.state.calls
    (first, again, newer), calls = run(scenario, FakeWorkerState(max_num_batched_tokens=64))
    assert first.pushed == "rejected"
    assert again.pushed == "" and again.observation.state == WorkerState.REJECTED
    assert "token budget" in again.observation.message
    assert newer.pushed == "rejected", "a new generation is always offered"
    assert calls["ApplyGraphPolicy"] == 2


def test_an_older_generation_is_never_forced_on_a_worker():
    async def scenario(server, client):
        await sync_worker(client, pod_for(server), policy(3), recapture_on_revision=True,
                          load_attempts={})
        return await sync_worker(client, pod_for(server), policy(2), recapture_on_revision=True,
                                 load_attempts={}), server.state.calls
    result, calls = run(scenario)
    assert calls["ApplyGraphPolicy"] == 1
    assert result.observation.state == WorkerState.PENDING


def test_a_changed_model_revision_is_loaded_once_with_the_pods_source():
    async def scenario(server, client):
        loads = {}
        pod = pod_for(server, model_source="random:tiny@7", model_revision="rev-7")
        first = await sync_worker(client, pod, policy(), recapture_on_revision=True,
                                  load_attempts=loads)
        second = await sync_worker(client, pod, policy(), recapture_on_revision=True,
                                   load_attempts=loads)
        return first, second, server.state
    first, second, state = run(scenario)
    assert first.loaded == "rev-7" and second.loaded == ""
    assert state.calls["LoadModelRevision"] == 1
    assert (state.model_source, state.model_revision) == ("random:tiny@7", "rev-7")
    assert second.observation.state == WorkerState.CAPTURED


def test_ignore_leaves_a_changed_model_revision_alone():
    async def scenario(server, client):
        pod = pod_for(server, model_revision="rev-9")
        result = await sync_worker(client, pod, policy(), recapture_on_revision=False,
                                   load_attempts={})
        return result, server.state.calls
    result, calls = run(scenario)
    assert calls["LoadModelRevision"] == 0
    assert result.observation.state == WorkerState.CAPTURED


def test_a_ready_pod_that_does_not_answer_is_unreachable_and_a_starting_one_is_not_failed():
    async def scenario(server, client):
        port = server.port
        await server.stop()
        ready = WorkerPod(namespace="ns", name="w0", uid="u", address="127.0.0.1", port=port,
                          phase="Running", ready=True)
        starting = WorkerPod(namespace="ns", name="w1", uid="v", address="127.0.0.1", port=port,
                             phase="Running", ready=False)
        pending = WorkerPod(namespace="ns", name="w2", uid="x", phase="Pending")
        return [await sync_worker(client, p, policy(), recapture_on_revision=True,
                                  load_attempts={}) for p in (ready, starting, pending)]
    ready, starting, pending = run(scenario)
    assert ready.observation.state == WorkerState.UNREACHABLE
    assert "UNAVAILABLE" in ready.observation.message
    assert starting.observation.state == WorkerState.STARTING
    assert pending.observation.state == WorkerState.STARTING


def test_a_size_whose_capture_failed_makes_the_worker_capture_failed():
    from graphkeeper.operator.sync import observe
    from graphkeeper.proto import worker_pb2 as pb

    wire = policy()
    status = pb.GraphStatus(
        state=pb.LIFECYCLE_STATE_READY, policy_uid=wire.policy_uid, policy_generation=1,
        effective_mode=pb.GRAPH_MODE_FULL, graph_steps=30, eager_steps=10,
        captured=[pb.CapturedSize(size=1, mode=pb.GRAPH_MODE_FULL),
                  pb.CapturedSize(size=2, mode=pb.GRAPH_MODE_FULL)],
        skipped=[pb.SkippedSize(size=4, reason=pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED,
                                message="cudaErrorMemoryAllocation")])
    pod = WorkerPod(namespace="ns", name="w0", uid="u")
    seen = observe(pod, status, wire)
    assert seen.state == WorkerState.CAPTURE_FAILED
    assert "4 (cudaErrorMemoryAllocation)" in seen.message
    assert seen.captured_sizes == (1, 2) and seen.effective_mode == "Full"
    assert seen.fallback_rate == 0.25
    over_budget = pb.GraphStatus()
    over_budget.CopyFrom(status)
    del over_budget.skipped[:]
    over_budget.skipped.add(size=4, reason=pb.FALLBACK_REASON_SIZE_OVER_BUDGET)
    assert observe(pod, over_budget, wire).state == WorkerState.CAPTURED, (
        "a size left out by the memory budget is the policy working, not a failure")
