"""Sleep and wake, the control side: which orders are taken (pure rules, and ``SleepControl`` with
no engine thread to carry them out), and when a real engine carries them out.

The engine tests run a real ``Engine`` (random:tiny on the CPU) with the device-memory side
standing in: a CPU has no memory to release, and what is under test here is the control plane:
that a sleep waits for running sequences, that new ones wait for it, that the lifecycle, status and
metrics follow, and that a request sent to a sleeping engine wakes it and is served. The device
side itself is tested on a GPU (tests/gpu/test_sleep_cuda.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.field_checks import FieldError
from graphkeeper.worker.engine import sleep_control
from graphkeeper.worker.engine.control import Control, default_policy
from graphkeeper.worker.engine.errors import SleepRefused, SleepWithdrawn
from graphkeeper.worker.engine.lifecycle import Lifecycle
from graphkeeper.worker.engine.sleep import SleepOutcome, WakeOutcome
from graphkeeper.worker.engine.sleep_control import Ruling, SleepControl, rule_sleep, rule_wake, wake_cause
from graphkeeper.worker.metrics import WorkerMetrics

S = pb.LifecycleState
READY, SLEEPING = S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_SLEEPING
TO_READY = (S.LIFECYCLE_STATE_MODEL_LOADED, S.LIFECYCLE_STATE_WARMED, S.LIFECYCLE_STATE_CAPTURED, READY)


# --- the rules (pure) ---------------------------------------------------------------------------


@pytest.mark.parametrize(("level", "refusal", "state", "asleep", "pending", "ruling"), [
    (3, None, READY, 0, 0, Ruling.INVALID),
    (0, "level must be 1 or 2", READY, 0, 0, Ruling.INVALID),
    (1, "sleep needs a CUDA device: this worker runs on cpu", READY, 0, 0, Ruling.REFUSED),
    (1, None, READY, 0, 0, Ruling.ORDER),
    (2, None, S.LIFECYCLE_STATE_RECAPTURING, 0, 0, Ruling.ORDER),  # carried out once the graphs are in
    (1, None, S.LIFECYCLE_STATE_LOADING, 0, 0, Ruling.REFUSED),
    (1, None, S.LIFECYCLE_STATE_DRAINING, 0, 0, Ruling.REFUSED),
    (1, None, SLEEPING, 1, 0, Ruling.ALREADY),
    (2, None, SLEEPING, 1, 0, Ruling.REFUSED),
    (1, None, READY, 0, 1, Ruling.JOIN),
    (2, None, READY, 0, 1, Ruling.REFUSED),
])
def test_rule_sleep(level, refusal, state, asleep, pending, ruling):
    assert rule_sleep(level, refusal, state, asleep, pending)[0] is ruling


def test_a_refused_sleep_says_why():
    assert rule_sleep(9, None, READY, 0, 0) == (Ruling.INVALID, "must be 1 or 2, not 9")
    assert rule_sleep(2, None, SLEEPING, 1, 0)[1] == "the worker sleeps at level 1: Wake it before a level 2 sleep"
    assert rule_sleep(1, None, S.LIFECYCLE_STATE_LOADING, 0, 0)[1] == (
        "the worker is LOADING: it sleeps only while it serves")
    assert "a level 1 sleep is already waiting" in rule_sleep(2, None, READY, 0, 1)[1]


def test_rule_wake():
    assert rule_wake(asleep=1, pending=0) is Ruling.ORDER
    assert rule_wake(asleep=0, pending=2) is Ruling.WITHDRAW
    assert rule_wake(asleep=0, pending=0) is Ruling.NOTHING


def test_wake_cause_names_what_woke_the_engine_first():
    assert wake_cause(ordered=True, requests=True, other_work=True) == "wake"
    assert wake_cause(ordered=False, requests=True, other_work=True) == "request"
    assert wake_cause(ordered=False, requests=False, other_work=True) == "control"
    assert wake_cause(ordered=False, requests=False, other_work=False) is None


# --- orders, with no engine thread to carry them out --------------------------------------------


def _orders(device_type: str = "cuda", sleep_mode: bool = True, ready: bool = True) -> SleepControl:
    control = Control(default_policy(), Lifecycle(), (8, 64))
    for state in TO_READY if ready else ():
        control.move(state)
    return SleepControl(device_type, sleep_mode, control, WorkerMetrics(), lambda: None)


def test_a_cpu_worker_or_one_without_sleep_mode_refuses_sleep_with_the_reason():
    with pytest.raises(SleepRefused, match="^sleep needs a CUDA device: this worker runs on cpu$"):
        _orders("cpu").sleep(1)
    with pytest.raises(SleepRefused, match="^this worker started without --enable-sleep-mode: its memory"):
        _orders("cuda", sleep_mode=False).sleep(2)
    assert _orders("cpu").status().unavailable_reason == "sleep needs a CUDA device: this worker runs on cpu"
    assert _orders().status().unavailable_reason == ""


def test_a_bad_level_is_a_field_error_naming_level_before_anything_else():
    with pytest.raises(FieldError) as refused:
        _orders("cpu").sleep(7)
    assert refused.value.field == "level"


def test_a_worker_that_does_not_serve_yet_refuses_sleep():
    with pytest.raises(SleepRefused, match="LOADING"):
        _orders(ready=False).sleep(1)


def test_a_sleep_waits_once_callers_of_the_same_level_join_it_and_another_level_is_refused():
    orders = _orders()
    first, second = orders.sleep(1), orders.sleep(1)
    assert not first.done() and not second.done()
    assert orders.status().pending_level == 1
    with pytest.raises(SleepRefused, match="a level 1 sleep is already waiting"):
        orders.sleep(2)


def test_a_wake_withdraws_a_sleep_still_waiting_and_its_callers_are_told():
    orders = _orders()
    sleeps = [orders.sleep(2), orders.sleep(2)]
    answer = orders.wake().result(0)
    assert answer.withdrew_sleep and not answer.was_asleep
    for sleep in sleeps:
        with pytest.raises(SleepWithdrawn):
            sleep.result(0)
    assert orders.status().pending_level == 0
    assert not orders.sleep(1).done()  # a new sleep may be ordered again


def test_a_wake_on_an_awake_worker_is_answered_at_once_with_nothing_done():
    answer = _orders().wake().result(0)
    assert not answer.was_asleep and not answer.withdrew_sleep


# --- a real engine carries them out (the device side standing in) -------------------------------


class DeviceSide:
    """Stands in for engine/sleep.py's device side on the CPU, and records when it was called."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.fail_sleep = False

    def sleep_model(self, slot, level: int) -> SleepOutcome:
        if self.fail_sleep:
            raise RuntimeError("the device side failed")
        self.events.append(("sleep", level))
        return SleepOutcome(level, 1 << 20, 0.01)

    def wake_model(self, slot) -> WakeOutcome:
        self.events.append(("wake",))
        return WakeOutcome(1, 1 << 20, 0.02)


@pytest.fixture
def sleepy(monkeypatch):
    """A started engine whose SleepControl takes orders as on a CUDA worker with sleep mode."""
    from graphkeeper.worker.engine import Engine, EngineSettings

    events: list = []
    side = DeviceSide(events)
    monkeypatch.setattr(sleep_control, "sleep_model", side.sleep_model)
    monkeypatch.setattr(sleep_control, "wake_model", side.wake_model)
    engine = Engine(EngineSettings(model="random:tiny", max_num_seqs=2, max_seq_len=64, max_num_batched_tokens=32,
                                   sleep_mode=True))
    engine.sleep_control.device_type = "cuda"  # a CPU has nothing to release: the orders are what is tested
    engine.start()
    assert engine.ready.wait(120) and engine.failed is None
    yield engine, side
    engine.drain_and_stop(5)


def _request(max_new_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8],
                              stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True))


class Stream:
    """A stream's tokens and end; ``on_token`` runs (on the engine thread) at its first token."""

    def __init__(self, events: list, name: str, on_token=None) -> None:
        self.events, self.name, self.on_token = events, name, on_token
        self.tokens: list[int] = []
        self.end = None
        self.done = threading.Event()

    def __call__(self, tokens: list[int], end) -> None:
        if tokens and not self.tokens:
            self.events.append(("first token", self.name))
            if self.on_token is not None:
                self.on_token()
        self.tokens += tokens
        if end is not None:
            self.end = end
            self.events.append(("end", self.name))
            self.done.set()


def _generate(engine, max_new_tokens: int = 8) -> list[int]:
    stream = Stream([], "probe")
    engine.submit(_request(max_new_tokens), stream)
    assert stream.done.wait(60)
    return stream.tokens


def test_sleep_then_wake_moves_the_lifecycle_status_and_metrics_and_tokens_stay_the_same(sleepy):
    engine, side = sleepy
    before = _generate(engine)
    slept = engine.sleep_control.sleep(1).result(30)
    assert (slept.level, slept.released_bytes, slept.already_asleep) == (1, 1 << 20, False)
    assert engine.lifecycle.state == SLEEPING
    status = engine.status()
    assert status.state == SLEEPING
    assert (status.sleep.level, status.sleep.sleeps, status.sleep.released_bytes) == (1, 1, 1 << 20)
    assert status.sleep.since_unix_seconds > 0
    assert engine.metrics.sleeping._value.get() == 1
    again = engine.sleep_control.sleep(1).result(0)
    assert again.already_asleep and side.events.count(("sleep", 1)) == 1
    woke = engine.sleep_control.wake().result(30)
    assert (woke.was_asleep, woke.level, woke.restored_bytes) == (True, 1, 1 << 20)
    assert engine.lifecycle.state == READY and engine.status().sleep.level == 0
    assert engine.status().sleep.wakes == 1
    assert engine.metrics.sleeping._value.get() == 0
    assert engine.metrics.wakes.labels("wake")._value.get() == 1
    assert _generate(engine) == before


def test_a_sleep_waits_for_the_running_sequence_and_a_request_that_arrives_meanwhile_waits_then_wakes_it(sleepy):
    engine, side = sleepy
    events = side.events
    orders: list[Future] = []
    late = Stream(events, "late")

    def order_sleep_and_send_another() -> None:  # on the engine thread, while "running" runs
        orders.append(engine.sleep_control.sleep(1))
        engine.submit(_request(4), late)

    running = Stream(events, "running", order_sleep_and_send_another)
    engine.submit(_request(40), running)
    assert running.done.wait(60) and late.done.wait(60)
    assert orders[0].result(10).level == 1
    assert len(running.tokens) == 40 and running.end.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(late.tokens) == 4 and late.end.finish_reason == pb.FINISH_REASON_LENGTH
    assert events == [("first token", "running"), ("end", "running"), ("sleep", 1), ("wake",),
                      ("first token", "late"), ("end", "late")]
    assert engine.metrics.wakes.labels("request")._value.get() == 1
    assert engine.lifecycle.state == READY


def test_a_request_sent_to_a_sleeping_engine_is_queued_and_served(sleepy):
    engine, side = sleepy
    before = _generate(engine, 6)
    engine.sleep_control.sleep(2).result(30)
    assert engine.lifecycle.state == SLEEPING
    assert _generate(engine, 6) == before
    assert side.events[-1] == ("wake",) and engine.lifecycle.state == READY


def test_a_sleep_the_device_side_fails_leaves_the_engine_awake_and_serving(sleepy):
    engine, side = sleepy
    side.fail_sleep = True
    with pytest.raises(RuntimeError, match="the device side failed"):
        engine.sleep_control.sleep(1).result(30)
    assert engine.lifecycle.state == READY and engine.status().sleep.pending_level == 0
    assert len(_generate(engine, 3)) == 3


def test_falling_asleep_and_a_pending_sleep_each_start_a_watch_message():
    from graphkeeper.proto.watch import change_key

    awake = pb.GraphStatus(state=READY)
    pending = pb.GraphStatus(state=READY, sleep=pb.SleepStatus(pending_level=1))
    asleep = pb.GraphStatus(state=SLEEPING, sleep=pb.SleepStatus(level=1))
    assert len({change_key(awake), change_key(pending), change_key(asleep)}) == 3
    assert change_key(asleep) == change_key(pb.GraphStatus(state=SLEEPING, sleep=pb.SleepStatus(level=1, wakes=4)))


def test_graphkeeper_status_prints_whether_the_worker_sleeps_or_why_it_cannot():
    from graphkeeper.client import sleep_line

    assert sleep_line(pb.SleepStatus(unavailable_reason="sleep needs a CUDA device: this worker runs on cpu")) == (
        "sleep     unavailable: sleep needs a CUDA device: this worker runs on cpu")
    assert sleep_line(pb.SleepStatus(level=1, since_unix_seconds=0, released_bytes=3 << 30, sleeps=2, wakes=1,
                                     last_wake_seconds=0.5)) == (
        "sleep     level 1 since 1970-01-01 00:00:00 UTC, 3.0 GiB released; 2 sleeps, 1 wakes (last 0.50 s)")
    assert sleep_line(pb.SleepStatus(pending_level=2)) == (
        "sleep     awake (a level 2 sleep waits for running sequences); 0 sleeps, 0 wakes")


def _idle_policy(seconds: int, level: int = 0) -> pb.GraphPolicy:
    return pb.GraphPolicy(policy_uid="idle-uid", policy_name="default/idle", generation=1,
                          sleep_after_idle_seconds=seconds, sleep_level=level)


def test_the_policy_s_idle_sleep_puts_an_idle_engine_to_sleep_and_a_request_wakes_it(sleepy):
    engine, side = sleepy
    before = _generate(engine, 6)
    engine.apply_policy(_idle_policy(1, level=2))
    for _ in range(200):
        if engine.lifecycle.state == SLEEPING:
            break
        threading.Event().wait(0.05)
    assert engine.lifecycle.state == SLEEPING and side.events == [("sleep", 2)]
    assert _generate(engine, 6) == before
    assert side.events == [("sleep", 2), ("wake",)] and engine.lifecycle.state == READY
    assert engine.metrics.wakes.labels("request")._value.get() == 1


def test_a_worker_that_cannot_sleep_stays_ready_under_an_idle_sleep_policy_and_says_why():
    """On a CPU worker the policy's idle sleep is refused (once in the log) and nothing changes."""
    from graphkeeper.worker.engine import Engine, EngineSettings

    engine = Engine(EngineSettings(model="random:tiny", max_num_seqs=2, max_seq_len=64, max_num_batched_tokens=32,
                                   sleep_mode=True))
    engine.start()
    try:
        assert engine.ready.wait(120) and engine.failed is None
        engine.apply_policy(_idle_policy(1))
        threading.Event().wait(2.5)
        status = engine.status()
        assert status.state == READY and status.sleep.sleeps == 0
        assert "sleep needs a CUDA device" in status.sleep.unavailable_reason
        assert "sleep needs a CUDA device" in engine.sleep_control._idle_refusal
        assert len(_generate(engine, 4)) == 4
    finally:
        engine.drain_and_stop(5)
