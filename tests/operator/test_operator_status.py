"""GraphPolicy.status is a pure function of what the operator saw: checked without a cluster."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from graphkeeper.operator.status import (
    MAX_WORKER_SUMMARIES,
    WorkerObservation,
    WorkerState,
    build_status,
    condition,
)

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(seconds=30)


def obs(name: str, state: WorkerState, **kw) -> WorkerObservation:
    return WorkerObservation(name=f"ns/{name}", state=state, **kw)


def test_all_workers_captured_is_ready_and_not_progressing():
    status = build_status(generation=3, observations=[obs("a", WorkerState.CAPTURED),
                                                      obs("b", WorkerState.CAPTURED)],
                          previous=None, now=T0)
    assert status["observedGeneration"] == 3
    assert (status["selectedWorkers"], status["capturedWorkers"], status["failedWorkers"]) == (2, 2, 0)
    assert condition(status, "Ready")["status"] == "True"
    assert condition(status, "Ready")["reason"] == "AllWorkersCaptured"
    assert condition(status, "Progressing")["status"] == "False"
    assert condition(status, "Degraded")["status"] == "False"
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    assert "lastFailure" not in status


def test_a_capturing_worker_makes_the_policy_progressing_not_ready():
    status = build_status(generation=2, observations=[obs("a", WorkerState.CAPTURED),
                                                      obs("b", WorkerState.PENDING)],
                          previous=None, now=T0)
    assert condition(status, "Ready")["status"] == "False"
    assert condition(status, "Ready")["reason"] == "WorkersNotCaptured"
    assert condition(status, "Progressing")["status"] == "True"
    assert "ns/b" in condition(status, "Progressing")["message"]
    assert condition(status, "Degraded")["status"] == "False"


def test_an_unreachable_worker_degrades_the_policy_and_is_named():
    status = build_status(
        generation=1,
        observations=[obs("a", WorkerState.CAPTURED),
                      obs("b", WorkerState.UNREACHABLE, message="127.0.0.1:1: UNAVAILABLE")],
        previous=None, now=T0)
    degraded = condition(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "WorkerUnreachable"
    assert "ns/b" in degraded["message"]
    assert status["failedWorkers"] == 1
    assert status["lastFailure"] == {"worker": "ns/b", "reason": "Unreachable",
                                     "message": "127.0.0.1:1: UNAVAILABLE",
                                     "time": "2026-11-29T12:00:00Z"}
    assert condition(status, "Progressing")["reason"] == "Blocked"
    assert status["workers"][0]["name"] == "ns/b", "failing workers are listed first"


def test_conflict_is_the_degraded_reason_before_any_other_failure():
    status = build_status(
        generation=1,
        observations=[obs("a", WorkerState.UNREACHABLE), obs("b", WorkerState.CONFLICT),
                      obs("c", WorkerState.REJECTED)],
        previous=None, now=T0)
    assert condition(status, "Degraded")["reason"] == "Conflict"


def test_rejected_policy_reads_policy_rejected():
    status = build_status(generation=1, observations=[obs("a", WorkerState.REJECTED,
                                                          message="sizes[0]: too big")],
                          previous=None, now=T0)
    assert condition(status, "Degraded")["reason"] == "PolicyRejected"
    assert "too big" in condition(status, "Degraded")["message"]


def test_no_selected_worker_is_not_ready_and_not_degraded():
    status = build_status(generation=1, observations=[], previous=None, now=T0)
    assert condition(status, "Ready")["reason"] == "NoWorkersSelected"
    assert condition(status, "Ready")["status"] == "False"
    assert condition(status, "Degraded")["status"] == "False"


def test_an_invalid_spec_is_degraded_invalid_policy():
    status = build_status(generation=4, observations=[obs("a", WorkerState.PENDING)],
                          previous=None, now=T0, invalid="spec.mode: 'Turbo' is not one of")
    assert condition(status, "Degraded")["reason"] == "InvalidPolicy"
    assert condition(status, "Ready")["status"] == "False"
    assert status["lastFailure"]["reason"] == "InvalidPolicy"


def test_transition_time_moves_only_when_the_condition_status_flips():
    first = build_status(generation=1, observations=[obs("a", WorkerState.PENDING)],
                         previous=None, now=T0)
    same = build_status(generation=1, observations=[obs("a", WorkerState.PENDING)],
                        previous=first, now=T1)
    assert condition(same, "Ready")["lastTransitionTime"] == "2026-11-29T12:00:00Z"
    flipped = build_status(generation=1, observations=[obs("a", WorkerState.CAPTURED)],
                           previous=same, now=T1)
    assert condition(flipped, "Ready")["lastTransitionTime"] == "2026-11-29T12:00:30Z"
    assert condition(flipped, "Degraded")["lastTransitionTime"] == "2026-11-29T12:00:00Z"


def test_an_unchanged_situation_builds_an_identical_status():
    observations = [obs("a", WorkerState.UNREACHABLE, message="down")]
    first = build_status(generation=1, observations=observations, previous=None, now=T0)
    again = build_status(generation=1, observations=observations, previous=first, now=T1)
    assert again == first, "an identical status lets the reconciler skip the write"


def test_the_last_failure_survives_recovery():
    failing = build_status(generation=1, observations=[obs("a", WorkerState.UNREACHABLE)],
                           previous=None, now=T0)
    recovered = build_status(generation=1, observations=[obs("a", WorkerState.CAPTURED)],
                             previous=failing, now=T1)
    assert recovered["lastFailure"]["worker"] == "ns/a"
    assert recovered["lastFailure"]["time"] == "2026-11-29T12:00:00Z"
    assert condition(recovered, "Degraded")["status"] == "False"


def test_per_worker_summary_is_bounded_but_counts_cover_everyone():
    many = [obs(f"w{i:03d}", WorkerState.CAPTURED, model_revision=f"r{i % 3}",
                captured_sizes=(1, 2, 4), graph_memory_bytes=10, fallback_rate=0.25)
            for i in range(100)]
    status = build_status(generation=1, observations=many, previous=None, now=T0)
    assert status["selectedWorkers"] == 100 and status["capturedWorkers"] == 100
    assert len(status["workers"]) == MAX_WORKER_SUMMARIES
    assert status["modelRevisions"] == ["r0", "r1", "r2"]
    assert status["workers"][0]["capturedSizes"] == [1, 2, 4]
    assert status["workers"][0]["fallbackRate"] == 0.25


def test_messages_name_at_most_three_workers():
    failing = [obs(f"w{i}", WorkerState.UNREACHABLE, message="x") for i in range(7)]
    status = build_status(generation=1, observations=failing, previous=None, now=T0)
    assert "and 4 more" in condition(status, "Degraded")["message"]


def test_a_paused_rollout_is_not_progressing_and_says_which_worker_failed():
    rollout = {"maxUnavailable": 2, "updatedWorkers": 1, "pendingWorkers": 2,
               "failedWorkers": 1, "unavailableWorkers": 0, "paused": True}
    status = build_status(generation=4, observations=[
        obs("a", WorkerState.CAPTURED), obs("b", WorkerState.CAPTURE_FAILED, message="OOM"),
        obs("c", WorkerState.PENDING), obs("d", WorkerState.PENDING)],
        previous=None, now=T0, rollout=rollout)
    progressing = condition(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "RolloutPaused")
    assert "ns/b" in progressing["message"]
    assert condition(status, "Degraded")["reason"] == "CaptureFailed"
    assert status["rollout"] == rollout


def test_a_rollout_under_way_says_how_many_at_a_time():
    rollout = {"maxUnavailable": 2, "updatedWorkers": 0, "pendingWorkers": 2,
               "failedWorkers": 0, "unavailableWorkers": 2, "paused": False}
    status = build_status(generation=2, observations=[obs("a", WorkerState.PENDING),
                                                      obs("b", WorkerState.PENDING)],
                          previous=None, now=T0, rollout=rollout)
    assert "at most 2 at a time" in condition(status, "Progressing")["message"]


def test_normal_events_are_rate_limited_per_reason_and_warnings_are_not():
    from graphkeeper.operator.events import (
        NEW_GENERATION_SECONDS,
        NORMAL_BURST,
        NORMAL_EVERY_SECONDS,
        Told,
        run_events,
    )
    from graphkeeper.operator.sync import PUSH, RELOAD

    told, posted = Told(), []
    for edit in range(50):  # five edits a second for ten seconds, each pushed
        events, told = run_events(told, generation=edit + 1, observations=[], invalid=None, plan=None,
                                  fired={PUSH: ["ns/w0"], RELOAD: []}, now=edit / 5)
        posted += [e.reason for e in events]
    # The burst, then about one a second (a new generation, a second after the last one).
    assert NORMAL_BURST <= posted.count("PolicyPushed") <= NORMAL_BURST + 10 / NEW_GENERATION_SECONDS + 1, posted
    batches = []
    for batch in range(10):  # one generation's batches, a second apart: the bucket alone
        events, told = run_events(told, generation=51, observations=[], invalid=None, plan=None,
                                  fired={PUSH: ["ns/w0"], RELOAD: []}, now=20.0 + batch)
        batches += [e.reason for e in events]
    assert NORMAL_BURST <= len(batches) <= NORMAL_BURST + 10 / NORMAL_EVERY_SECONDS, batches
    failing = [WorkerObservation("ns/w0", WorkerState.UNREACHABLE, "gone")]
    events, _ = run_events(told, generation=52, observations=failing, invalid=None, plan=None,
                           fired={PUSH: [], RELOAD: []}, now=30.0)
    assert [e.reason for e in events] == ["WorkerUnreachable"], "a failure is always told"
