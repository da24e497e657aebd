"""One worker's track classified for status and for the rollout planner: pure, no server."""

from __future__ import annotations

from dataclasses import replace

from graphkeeper.operator.selection import WorkerPod
from graphkeeper.operator.status import WorkerState
from graphkeeper.operator.sync import (
    PUSH,
    RELOAD,
    Track,
    classify,
    finish_action,
    needs_read,
    observe,
    record_action,
    settle,
)
from graphkeeper.operator.workerclient import ErrorKind, WorkerError
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import policy_from_spec

SPEC = {"selector": {"matchLabels": {"app": "w"}}, "mode": "Full",
        "captureSizes": {"sizes": [1, 2, 4]}}
READY, RECAPTURING, LOADING = (pb.LIFECYCLE_STATE_READY, pb.LIFECYCLE_STATE_RECAPTURING,
                               pb.LIFECYCLE_STATE_LOADING)
POD = WorkerPod(namespace="ns", name="w0", uid="pod-uid", address="10.0.0.1", port=50051,
                control_port=50052, phase="Running", ready=True)


def policy(generation=1, spec=SPEC, uid="uid-1"):
    return policy_from_spec(spec, uid=uid, name="ns/p", generation=generation)


def track(**status) -> Track:
    return Track(status=pb.GraphStatus(**status), read_at=1.0)


def check(t: Track, wire=None, pod=POD, want="", recaptures=True, now=10.0, deadline=600.0):
    return classify(pod, t, wire or policy(), want_revision=want, recaptures=recaptures,
                    now=now, deadline=deadline)


def test_a_worker_holding_the_generation_and_ready_is_captured_and_needs_nothing():
    obs, view = check(track(state=READY, policy_uid="uid-1", policy_generation=1))
    assert obs.state == WorkerState.CAPTURED and obs.policy_generation == 1
    assert view.available and not view.needs_push and not view.needs_reload and not view.failed


def test_held_means_adopted_and_ready_a_pending_generation_is_not_held_nor_pushed_again():
    obs, view = check(track(state=RECAPTURING, policy_uid="uid-1", policy_generation=1,
                            pending_policy_uid="uid-1", pending_policy_generation=2),
                      wire=policy(2))
    assert obs.state == WorkerState.PENDING and "capturing generation 2" in obs.message
    assert not view.available and not view.needs_push
    adopted_not_ready = check(track(state=RECAPTURING, policy_uid="uid-1", policy_generation=2),
                              wire=policy(2))[0]
    assert adopted_not_ready.state == WorkerState.PENDING


def test_a_worker_lacking_the_generation_needs_a_push_and_a_toggle_only_one_recaptures_nothing():
    _, view = check(track(state=READY, policy_uid="uid-1", policy_generation=1), wire=policy(2))
    assert view.needs_push and view.push_recaptures and view.available
    _, toggle = check(track(state=READY, policy_uid="uid-1", policy_generation=1),
                      wire=policy(2), recaptures=False)
    assert toggle.needs_push and not toggle.push_recaptures


def test_an_older_generation_is_never_forced_on_a_worker():
    obs, view = check(track(state=READY, policy_uid="uid-1", policy_generation=3), wire=policy(2))
    assert not view.needs_push and obs.message == "operator view is stale"


def test_a_push_in_flight_makes_the_worker_unavailable_until_a_later_read_shows_it_ready():
    t = track(state=READY, policy_uid="uid-1", policy_generation=1)
    record_action(t, PUSH, "uid-1/2", now=5.0)
    obs, view = check(t, wire=policy(2))
    assert not view.available and not view.needs_push, "in flight: not pushed twice"
    finish_action(t, policy(2), None, now=5.1)
    settle(t)
    assert not t.settled, "the last read is older than the push's end"
    t.status, t.read_at = pb.GraphStatus(state=READY, policy_uid="uid-1", policy_generation=2), 5.2
    settle(t)
    assert t.settled
    obs, view = check(t, wire=policy(2))
    assert obs.state == WorkerState.CAPTURED and view.available


def test_a_refused_generation_is_rejected_failed_and_not_pushed_again_until_something_changes():
    t = track(state=READY, policy_uid="uid-1", policy_generation=1)
    record_action(t, PUSH, "uid-1/2", now=5.0)
    finish_action(t, policy(2), WorkerError(ErrorKind.REJECTED, "exceeds token budget"), 5.1)
    t.read_at = 6.0
    settle(t)
    obs, view = check(t, wire=policy(2), now=7.0)
    assert obs.state == WorkerState.REJECTED and "token budget" in obs.message
    assert view.blocked and view.failed, "a refusal counts as failed: it pauses the rollout"
    _, later = check(t, wire=policy(2), now=6000.0)
    assert later.blocked and later.failed, "not asked again while nothing changed"
    t.rejected = None  # what on_pod does when the pod changes
    _, changed = check(t, wire=policy(2), now=6000.0)
    assert changed.needs_push and not changed.failed
    _, newer = check(t, wire=policy(3), now=7.0)
    assert newer.needs_push and not newer.blocked, "a new generation is always offered"


def test_a_failed_capture_or_reload_or_a_timeout_marks_the_worker_failed():
    failed_size = track(state=READY, policy_uid="uid-1", policy_generation=1,
                        skipped=[pb.SkippedSize(size=4, message="cudaErrorMemoryAllocation",
                                                reason=pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED)])
    obs, view = check(failed_size)
    assert obs.state == WorkerState.CAPTURE_FAILED and view.failed
    assert "4 (cudaErrorMemoryAllocation)" in obs.message

    kept_old = track(state=READY, policy_uid="uid-1", policy_generation=1, last_error="OOM")
    record_action(kept_old, PUSH, "uid-1/2", now=5.0)
    finish_action(kept_old, policy(2), None, 5.1)
    kept_old.read_at = 6.0
    settle(kept_old)
    obs, view = check(kept_old, wire=policy(2))
    assert obs.state == WorkerState.CAPTURE_FAILED and "OOM" in obs.message and view.failed
    assert not view.needs_push, "a failed worker is not pushed the same generation again"

    reload = track(state=READY, policy_uid="uid-1", policy_generation=1, model_revision="r1")
    record_action(reload, RELOAD, "r2", now=5.0)
    finish_action(reload, None, WorkerError(ErrorKind.ERROR, "no such revision"), 5.1)
    reload.read_at = 6.0
    settle(reload)
    obs, view = check(reload, want="r2")
    assert obs.state == WorkerState.CAPTURE_FAILED and "no such revision" in obs.message

    slow = track(state=RECAPTURING, policy_uid="uid-1", policy_generation=1,
                 pending_policy_uid="uid-1", pending_policy_generation=2)
    record_action(slow, PUSH, "uid-1/2", now=0.0)
    finish_action(slow, policy(2), None, 0.1)
    obs, view = check(slow, wire=policy(2), now=700.0, deadline=600.0)
    assert obs.state == WorkerState.CAPTURE_FAILED and "within 600s" in obs.message
    assert view.failed


def test_a_changed_model_revision_needs_a_reload_once_unless_ignored():
    t = track(state=READY, policy_uid="uid-1", policy_generation=1, model_revision="r1")
    obs, view = check(t, want="r2")
    assert view.needs_reload and obs.state == WorkerState.PENDING
    record_action(t, RELOAD, "r2", now=9.0)
    _, during = check(t, want="r2")
    assert not during.needs_reload and not during.available
    loading = track(state=LOADING, policy_uid="uid-1", policy_generation=1, model_revision="r1",
                    pending_model_revision="r2")
    assert not check(loading, want="r2")[1].needs_reload


def test_a_ready_pod_that_does_not_answer_is_unreachable_and_a_starting_one_is_not_failed():
    err = WorkerError(ErrorKind.UNREACHABLE, "GetGraphStatus: UNAVAILABLE: refused")
    obs, view = check(Track(error=err))
    assert obs.state == WorkerState.UNREACHABLE and "UNAVAILABLE" in obs.message
    assert "10.0.0.1:50052" in obs.message, "named by its control address"
    assert not view.available and view.blocked
    starting = replace(POD, ready=False)
    assert check(Track(error=err), pod=starting)[0].state == WorkerState.STARTING
    pending = WorkerPod(namespace="ns", name="w2", uid="x", phase="Pending")
    assert check(Track(), pod=pending)[0].state == WorkerState.STARTING


def test_a_size_left_out_by_the_budget_is_not_a_failure():
    wire = policy()
    status = pb.GraphStatus(state=READY, policy_uid=wire.policy_uid, policy_generation=1,
                            effective_mode=pb.GRAPH_MODE_FULL, graph_steps=30, eager_steps=10,
                            captured=[pb.CapturedSize(size=1, mode=pb.GRAPH_MODE_FULL)],
                            skipped=[pb.SkippedSize(size=4,
                                                    reason=pb.FALLBACK_REASON_SIZE_OVER_BUDGET)])
    seen = observe(POD, status, wire)
    assert seen.state == WorkerState.CAPTURED
    assert seen.captured_sizes == (1,) and seen.effective_mode == "Full"
    assert seen.fallback_rate == 0.25


def test_a_settled_worker_whose_pod_did_not_change_is_read_only_on_the_slow_resync():
    t = track(state=READY, policy_uid="uid-1", policy_generation=1)
    t.stale = False
    assert not needs_read(t, now=30.0, resync=60.0), "idle: no read"
    assert needs_read(t, now=61.0, resync=60.0), "the resync"
    assert needs_read(replace(t, stale=True), now=30.0, resync=60.0), "its pod changed"
    assert needs_read(replace(t, settled=False), now=30.0, resync=60.0), "a change settles"
    assert needs_read(replace(t, error=WorkerError(ErrorKind.UNREACHABLE, "down")), now=30.0,
                      resync=60.0), "the last read failed"
    assert needs_read(Track(stale=False), now=0.0, resync=60.0), "nothing known yet"


def test_a_sleeping_worker_holds_its_graphs_it_is_captured_settled_and_not_recapturing():
    """Sleep keeps the graphs (the memory comes back at the same addresses, a request wakes the
    worker), so a SLEEPING worker that holds the generation counts as a READY one does."""
    from graphkeeper.operator.canary_rollout import reading
    from graphkeeper.operator.departures import still_recapturing

    sleeping = dict(state=pb.LIFECYCLE_STATE_SLEEPING, policy_uid="uid-1", policy_generation=1)
    obs, view = check(track(**sleeping))
    assert obs.state == WorkerState.CAPTURED
    assert view.available and not view.needs_push
    t = track(**sleeping)
    t.settled = False
    settle(t)
    assert t.settled
    assert not still_recapturing(pb.GraphStatus(**sleeping))
    assert reading(pb.GraphStatus(**sleeping), policy()).holds_proposal
    loading = check(track(state=LOADING, policy_uid="uid-1", policy_generation=1))[0]
    assert loading.state == WorkerState.PENDING, "the other states still are not"
