"""Faults a client or a bad step can cause: sampling stays finite for every accepted
parameter, a failing step fails only its own requests, a dead engine takes readiness down and
exits, status never reports a policy the engine has not adopted, generations never go back, and
the drain deadline holds whatever clients do."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_control import apply, policy
from worker_harness import INFERENCE_SERVICE, collect, generate, generate_concurrently, make_request, wait_until

from graphkeeper.proto import worker_pb2 as pb

SHAPE = ("--max-num-seqs", "8", "--max-seq-len", "512", "--max-num-batched-tokens", "64")


@pytest.fixture(scope="module")
def worker(module_workers):
    return module_workers(*SHAPE, env={"GRAPHKEEPER_INJECT_STEP_FAILURE": "499"})


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1e-45, 0, 0.0), (1e-30, 0, 0.5), (1e-7, 1, 0.0), (100.0, 0, 1e-9), (100.0, 0, 0.0), (0.7, 3, 0.9),
])
def test_every_accepted_sampling_parameter_samples_finite_tokens(worker, temperature, top_k, top_p):
    request = make_request([3, 4, 5], 16, temperature=temperature, top_k=top_k, top_p=top_p, seed=7)
    tokens, completion = generate(worker, request)
    assert completion.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) == 16
    assert all(0 <= t < 512 for t in tokens)
    assert generate(worker, request)[0] == tokens  # seeded: the same draw again
    assert worker.status().state == pb.LIFECYCLE_STATE_READY


def test_a_tiny_temperature_samples_the_greedy_token(worker):
    greedy, _ = generate(worker, make_request([9, 8, 7], 12))
    tiny, _ = generate(worker, make_request([9, 8, 7], 12, temperature=1e-45, seed=1))
    assert tiny == greedy


def test_a_failing_step_fails_its_requests_and_the_worker_keeps_serving(worker):
    before = worker.metric("graphkeeper_requests_total", outcome="error")
    long_call = worker.inference.Generate(make_request([11, 12], 200), timeout=120)
    first = next(long_call)
    assert first.HasField("tokens")
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, make_request([5, 499, 6], 4))  # the injected token fails its prefill step
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "step running this request failed" in err.value.details()
    # The running stream shared the failed step: it was re-run without the culprit and goes on.
    tokens, completion = collect(long_call)
    assert completion.generated_tokens == 200 and len(tokens) + len(first.tokens.token_ids) == 200
    assert worker.metric("graphkeeper_requests_total", outcome="error") == before + 1
    assert worker.status().state == pb.LIFECYCLE_STATE_READY
    assert worker.http_get("/readyz")[0] == 200
    tokens, _ = generate(worker, make_request([5, 6], 4))
    assert len(tokens) == 4


def test_a_poison_request_fails_alone_and_its_eight_batch_mates_finish_unchanged(fresh_workers):
    """A request that makes its step raise, sent while 8 others decode: the step is re-run in
    halves without it, so it alone fails (INTERNAL) and each batch-mate's tokens are exactly what
    it generates without the poison."""
    worker = fresh_workers("--max-num-seqs", "16", "--max-seq-len", "512", "--max-num-batched-tokens", "64",
                           env={"GRAPHKEEPER_INJECT_STEP_FAILURE": "499"})
    requests = [make_request([70 + i, 71, 72 + i], 300, request_id=f"mate-{i}") for i in range(8)]
    expected = [tokens for tokens, _ in generate_concurrently(worker, requests)]
    calls = [worker.inference.Generate(r, timeout=120) for r in requests]
    firsts = [list(next(call).tokens.token_ids) for call in calls]
    wait_until(lambda: worker.status().running_sequences == 8, what="eight decoding streams")
    for poison in ([5, 499, 6], [499]):
        with pytest.raises(grpc.RpcError) as err:
            generate(worker, make_request(poison, 4))
        assert err.value.code() == grpc.StatusCode.INTERNAL
    for call, first, want in zip(calls, firsts, expected, strict=True):
        tokens, completion = collect(call)
        assert completion.finish_reason == pb.FINISH_REASON_LENGTH
        assert first + tokens == want
    assert worker.metric("graphkeeper_requests_total", outcome="error") == 2
    assert "isolating it" in worker.log()
    assert worker.status().state == pb.LIFECYCLE_STATE_READY


def test_a_dead_engine_fails_readiness_and_exits(fresh_workers):
    worker = fresh_workers(*SHAPE, env={"GRAPHKEEPER_INJECT_STEP_FAILURE": "499:fatal"})
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, make_request([5, 499, 6], 4))
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert worker.proc.wait(timeout=30) == 1
    assert "engine stopped" in worker.log()


def test_status_never_reports_a_policy_before_the_engine_adopts_it(worker):
    apply(worker, policy("uid-adopt", 1, mode=pb.GRAPH_MODE_FULL))
    wait_until(lambda: worker.status().policy_generation == 1, what="generation 1 adopted")
    calls = [worker.inference.Generate(make_request([20 + i, 21], 400), timeout=120) for i in range(6)]
    wait_until(lambda: worker.status().running_sequences == 6, what="six running streams")
    apply(worker, policy("uid-adopt", 2, mode=pb.GRAPH_MODE_PIECEWISE))
    seen = set()
    for _ in range(100):
        s = worker.status()
        seen.add((s.policy_generation, s.pending_policy_generation, s.requested_mode))
    assert seen <= {(1, 2, pb.GRAPH_MODE_FULL), (2, 0, pb.GRAPH_MODE_PIECEWISE)}, seen
    wait_until(lambda: worker.status().policy_generation == 2, what="generation 2 adopted")
    for c in calls:
        c.cancel()


def test_generations_never_go_back_for_any_uid_the_worker_has_held(worker):
    apply(worker, policy("uid-u", 5))
    apply(worker, policy("uid-v", 1))
    with pytest.raises(grpc.RpcError) as err:
        apply(worker, policy("uid-u", 4))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "older than generation 5" in err.value.details()
    again = apply(worker, policy("uid-v", 1))
    assert again.unchanged
    wait_until(lambda: worker.status().policy_uid == "uid-v", what="uid-v adopted")


def test_the_drain_deadline_holds_when_clients_stop_reading(fresh_workers):
    worker = fresh_workers("--max-num-seqs", "4", "--max-seq-len", "4096", "--max-num-batched-tokens", "64",
                           "--drain-seconds", "1")
    calls = [worker.inference.Generate(make_request([30 + i, 31], 4000), timeout=300) for i in range(4)]
    for call in calls:
        next(call)  # the streams are open; nobody reads them any further
    wait_until(lambda: worker.status().running_sequences == 4, what="four running streams")
    started = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    code = worker.proc.wait(timeout=30)
    assert time.monotonic() - started < 1 + 10
    assert code == 0
    for call in calls:
        call.cancel()


def test_a_burst_past_the_queue_is_refused_counted_and_health_keeps_answering(fresh_workers):
    worker = fresh_workers("--max-num-seqs", "2", "--max-queue", "4", "--max-seq-len", "512",
                           "--max-num-batched-tokens", "64")
    codes: list[grpc.StatusCode] = []
    details: list[str] = []
    health_ok: list[bool] = []

    def one(i: int) -> None:
        try:
            generate(worker, make_request([40 + i, 41], 64))
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.append(err.code())
            details.append(err.details())

    def probe() -> None:
        stub = health_pb2_grpc.HealthStub(worker.channel)
        for _ in range(20):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE), timeout=10)
            health_ok.append(reply.status == health_pb2.HealthCheckResponse.SERVING)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)] + [threading.Thread(target=probe)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED} and refused > 0
    assert all("queue is full" in d for d in details)  # our admission answered, not a transport cap
    assert worker.metric("graphkeeper_requests_total", outcome="queue_full") == refused
    assert len(health_ok) == 20 and all(health_ok)
