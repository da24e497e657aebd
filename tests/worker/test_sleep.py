"""GraphControl Sleep and Wake on a real CPU worker over real gRPC: a CPU cannot sleep, so Sleep is
refused with the reason (FAILED_PRECONDITION), a bad level is INVALID_ARGUMENT naming ``level``,
Wake on an awake worker does nothing and says so, and the worker serves on through all of it."""

from __future__ import annotations

import json

import grpc
import pytest
from worker_harness import generate, make_request

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc

CPU_REASON = "sleep needs a CUDA device: this worker runs on cpu"
PROMPT = [3, 14, 15, 92, 65]


def _http_json(worker, path: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(worker.http_url + path, timeout=10) as resp:
        return json.loads(resp.read())


def test_sleep_on_a_cpu_worker_is_refused_with_the_reason_and_the_worker_serves_on(worker):
    before, _ = generate(worker, make_request(PROMPT, 8))
    with pytest.raises(grpc.RpcError) as refused:
        worker.control.Sleep(pb.SleepRequest(level=1), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == CPU_REASON
    status = worker.status()
    assert status.state == pb.LIFECYCLE_STATE_READY
    assert (status.sleep.level, status.sleep.pending_level, status.sleep.sleeps) == (0, 0, 0)
    assert status.sleep.unavailable_reason == CPU_REASON
    after, completion = generate(worker, make_request(PROMPT, 8))
    assert after == before and completion.finish_reason == pb.FINISH_REASON_LENGTH
    assert worker.metric("graphkeeper_sleeping") == 0
    assert worker.metric("graphkeeper_sleeps_total", level="1") == 0


@pytest.mark.parametrize("level", [0, 3, -1])
def test_a_level_other_than_1_or_2_is_invalid_argument_naming_level(worker, level):
    with pytest.raises(grpc.RpcError) as refused:
        worker.control.Sleep(pb.SleepRequest(level=level), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == f"level: must be 1 or 2, not {level}"
    assert generate(worker, make_request(PROMPT, 2))[1].finish_reason == pb.FINISH_REASON_LENGTH


def test_wake_on_an_awake_worker_does_nothing_and_says_so(worker):
    first = worker.control.Wake(pb.WakeRequest(), timeout=10)
    second = worker.control.Wake(pb.WakeRequest(), timeout=10)
    for answer in (first, second):
        assert not answer.was_asleep and not answer.withdrew_sleep
        assert (answer.level, answer.restored_bytes) == (0, 0)
    assert worker.status().state == pb.LIFECYCLE_STATE_READY
    assert all(worker.metric("graphkeeper_wakes_total", cause=c) == 0 for c in ("wake", "request", "control"))


def test_an_awake_worker_says_it_is_not_sleeping_and_ready(worker):
    assert _http_json(worker, "/is_sleeping") == {"is_sleeping": False}
    assert worker.http_get("/readyz") == (200, "READY\n")


def test_sleep_and_wake_need_the_bearer_token(worker):
    with grpc.insecure_channel(worker.control_target) as channel:
        stub = pb_grpc.GraphControlStub(channel)
        for call, request in ((stub.Sleep, pb.SleepRequest(level=1)), (stub.Wake, pb.WakeRequest())):
            with pytest.raises(grpc.RpcError) as denied:
                call(request, timeout=10)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_cpu_worker_started_with_sleep_mode_still_refuses_sleep_for_its_device(module_workers):
    worker = module_workers("--enable-sleep-mode")
    for level in (1, 2):
        with pytest.raises(grpc.RpcError) as refused:
            worker.control.Sleep(pb.SleepRequest(level=level), timeout=10)
        assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.FAILED_PRECONDITION, CPU_REASON)
    assert generate(worker, make_request(PROMPT, 4))[1].finish_reason == pb.FINISH_REASON_LENGTH
