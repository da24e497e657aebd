"""One worker as the operator knows it: its last status, the calls under way, and what it means.

Reading before writing is what makes the operator safe to restart: a worker that already holds
the policy's generation (or has it pending) is never pushed again, so a resumed operator
repeats nothing, and a restarted worker gets exactly one push.

Each worker has its own ``Track``: status reads, pushes and model reloads run as tasks of their
own with their own deadlines, so a slow or dead worker delays only itself. ``classify`` (pure)
turns a track into the worker's observation for ``.status`` and its view for the rollout
planner. A worker holds a generation only when it reports it adopted (``policy_uid`` and
``policy_generation``) and is READY; a revision only when ``model_revision`` matches and it is
READY.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from graphkeeper.operator.rollout import RolloutWorker
from graphkeeper.operator.selection import WorkerPod
from graphkeeper.operator.status import WorkerObservation, WorkerState
from graphkeeper.operator.traffic import MODE_NAMES, spec_generation
from graphkeeper.operator.workerclient import ErrorKind, WorkerError
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import lifecycle_name, serves_graphs

#: A LoadModelRevision for the same pod and revision is not retried sooner than this.
MODEL_LOAD_RETRY_SECONDS = 60.0

_BUSY = (pb.LIFECYCLE_STATE_LOADING, pb.LIFECYCLE_STATE_RECAPTURING)

PUSH, RELOAD = "push", "reload"


@dataclass
class Track:
    """What the operator knows of one worker between runs (kept per pod uid)."""

    status: pb.GraphStatus | None = None
    #: The last read's failure, when it is newer than ``status``.
    error: WorkerError | None = None
    #: Monotonic time the last completed read was started.
    read_at: float = 0.0
    read: asyncio.Task | None = None
    #: Set when the run that started ``read`` stopped waiting for it: its end wakes the loops.
    read_orphaned: bool = False
    #: Set when the pod changed (ready, restarted, re-annotated) since the last read started.
    stale: bool = True
    #: The last push or reload: kind, goal ("uid/generation" or a revision), start and end.
    action: asyncio.Task | None = None
    action_kind: str = ""
    action_goal: str = ""
    action_started: float = 0.0
    action_done_at: float = 0.0
    action_error: WorkerError | None = None
    #: False from an action's start until a later read shows the worker READY with nothing
    #: pending: until then the worker counts as unavailable in the rollout.
    settled: bool = True
    #: (policy uid, generation, message, time) of the last push the worker refused.
    rejected: tuple[str, int, str, float] | None = None
    #: (revision, time) of the last reload asked for, and its failure message if it failed.
    load_attempt: tuple[str, float] | None = None
    load_failure: tuple[str, str] | None = None
    notes: list[str] = field(default_factory=list)
    #: A WatchGraphStatus stream to the worker is open and has answered (``status_watch``).
    streaming: bool = False

    def busy(self) -> bool:
        return self.action is not None and not self.action.done()


def needs_read(track: Track, now: float, resync: float) -> bool:
    """Whether a run should read the worker's status now (pure).

    An idle fleet costs almost nothing: a worker is read when the operator knows nothing of it,
    its last read failed, its pod changed (readiness, restarts, annotations: ``stale``), a
    change of ours is still settling on it, or ``resync`` seconds passed since its last read
    (the slow resync that catches what no pod event shows).

    A worker with an open status stream sends every change itself (``status_watch``): it is read
    only when nothing is known, its pod changed, or a change of ours ended after its last message
    (an adoption that needed no recapture changes nothing more for the stream to send).
    """
    if track.streaming:
        return (track.status is None or track.stale
                or (not track.settled and not track.busy() and track.read_at < track.action_done_at
                    and not shows_goal(track)))
    return (track.status is None or track.error is not None or track.stale
            or not track.settled or track.busy() or now - track.read_at >= resync)


def goal_of(policy: pb.GraphPolicy) -> str:
    return f"{policy.policy_uid}/{policy.generation}"


def holds(status: pb.GraphStatus, policy: pb.GraphPolicy) -> bool:
    """Whether the worker has adopted exactly this policy generation (READY or not)."""
    return status.policy_uid == policy.policy_uid and status.policy_generation == policy.generation


def has_pending(status: pb.GraphStatus, policy: pb.GraphPolicy) -> bool:
    return (status.pending_policy_uid == policy.policy_uid
            and status.pending_policy_generation == policy.generation)


def settle(track: Track) -> None:
    """Marks an action settled once a read started after it ended, or a streamed status that
    shows its goal adopted, shows nothing under way."""
    if track.settled or track.busy() or track.status is None:
        return
    s = track.status
    if ((track.read_at >= track.action_done_at or shows_goal(track)) and serves_graphs(s.state)
            and not s.pending_policy_uid and not s.pending_model_revision):
        track.settled = True


def shows_goal(track: Track) -> bool:
    """Whether the worker's streamed status already shows the last action's goal adopted (the
    stream sent it before the call's answer came back): no read is needed to know it settled."""
    s = track.status
    if not track.streaming or s is None:
        return False
    if track.action_kind == PUSH:
        return f"{s.policy_uid}/{s.policy_generation}" == track.action_goal
    return track.action_kind == RELOAD and s.model_revision == track.action_goal


def observe(pod: WorkerPod, status: pb.GraphStatus, policy: pb.GraphPolicy,
            want_revision: str = "", message: str = "") -> WorkerObservation:
    """Classifies a worker from its GraphStatus alone (pure)."""
    state = WorkerState.PENDING
    ready = serves_graphs(status.state)
    failed_sizes = [s for s in status.skipped
                    if s.reason == pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED]
    if holds(status, policy) and ready:
        if failed_sizes:
            state = WorkerState.CAPTURE_FAILED
            message = message or "capture failed for sizes " + ", ".join(
                f"{s.size} ({s.message})" for s in failed_sizes[:8])
        elif want_revision and status.model_revision != want_revision:
            message = message or (f"serves revision {status.model_revision!r}, "
                                  f"pod asks for {want_revision!r}")
        else:
            state = WorkerState.CAPTURED
    elif (holds(status, policy) and status.last_error and status.state not in _BUSY
          and not status.pending_policy_uid):
        state = WorkerState.CAPTURE_FAILED
        message = message or status.last_error
    elif not message:
        if has_pending(status, policy):
            message = f"{lifecycle_name(status.state)}, capturing generation {policy.generation}"
        elif status.policy_uid == policy.policy_uid:
            message = (f"{lifecycle_name(status.state)}, holds generation "
                       f"{status.policy_generation}")
        elif status.policy_uid:
            message = f"{lifecycle_name(status.state)}, holds another policy"
        else:
            message = f"{lifecycle_name(status.state)}, holds no policy"
    steps = status.graph_steps + status.eager_steps
    return WorkerObservation(
        name=pod.key,
        state=state,
        message=message,
        lifecycle=lifecycle_name(status.state),
        policy_generation=(spec_generation(status.policy_generation)
                           if status.policy_uid == policy.policy_uid else 0),
        model_revision=status.model_revision,
        effective_mode=MODE_NAMES.get(status.effective_mode, ""),
        started_warm=started_warm(status.startup),
        tensor_parallel_size=status.tensor_parallel_size,
        captured_sizes=tuple(sorted({c.size for c in status.captured})),
        graph_memory_bytes=status.graph_memory_bytes,
        fallback_rate=(status.eager_steps / steps) if steps else None,
    )


def started_warm(startup: pb.StartupStatus) -> bool | None:
    """Whether a worker's start found every cache it used (pure): None when it used none, or
    has not reported its start (not READY yet, or a worker from before startup was reported)."""
    return {"warm": True, "cold": False}.get(startup.caches)


def classify(
    pod: WorkerPod,
    track: Track,
    policy: pb.GraphPolicy,
    *,
    want_revision: str,
    recaptures: bool,
    now: float,
    deadline: float,
) -> tuple[WorkerObservation, RolloutWorker]:
    """The worker's observation for ``.status`` and its view for ``plan_rollout`` (pure).

    ``recaptures``: whether moving from what the worker holds to ``policy`` recaptures graphs
    (False when only tenant toggles differ). ``deadline``: seconds a push or reload may take to
    settle before the worker counts as failed.
    """
    if not pod.running:
        why = "is being deleted" if pod.deleting else f"is {pod.phase or 'Pending'}"
        return (WorkerObservation(pod.key, WorkerState.STARTING, f"pod {why}"),
                RolloutWorker(pod.key, available=False, blocked=True))
    s = track.status
    if track.error is not None or s is None:
        if track.error is None:
            obs = WorkerObservation(pod.key, WorkerState.PENDING, "status not read yet")
        else:
            obs = _unreachable(pod, track.error)
        return obs, RolloutWorker(pod.key, available=False, blocked=True)

    goal = goal_of(policy)
    in_flight = not track.settled
    adopted = holds(s, policy)
    ready = serves_graphs(s.state)
    stale = s.policy_uid == policy.policy_uid and s.policy_generation > policy.generation
    pushing = (has_pending(s, policy)
               or (in_flight and track.action_kind == PUSH and track.action_goal == goal))
    needs_push = not adopted and not pushing and not stale
    reloading = (s.pending_model_revision == want_revision
                 or (in_flight and track.action_kind == RELOAD
                     and track.action_goal == want_revision))
    needs_reload = bool(want_revision) and s.model_revision != want_revision and not reloading
    observation = observe(pod, s, policy, want_revision,
                          message="operator view is stale" if stale else "")
    failed = observation.state == WorkerState.CAPTURE_FAILED
    blocked = False

    refused = track.rejected
    if needs_push and refused is not None and refused[:2] == (policy.policy_uid, policy.generation):
        # Refused like a failed capture: the worker counts as failed and pauses the rollout (a
        # generation one worker refuses, the next would most likely refuse too). It is offered
        # again when the pod changes (restarted, re-annotated: ``on_pod`` clears ``rejected``)
        # or the spec does (a new generation).
        observation = _with(observation, WorkerState.REJECTED, refused[2])
        blocked = failed = True
    if (not failed and not in_flight and track.action_kind == PUSH and track.action_goal == goal
            and not adopted and ready and s.last_error):
        # Pushed, settled, and the worker kept what it had: the capture of ``goal`` failed.
        failed = True
        observation = _with(observation, WorkerState.CAPTURE_FAILED,
                            f"capturing generation {policy.generation} failed: {s.last_error}")
    if want_revision and s.model_revision != want_revision:
        attempt = track.load_attempt
        recent = (attempt is not None and attempt[0] == want_revision
                  and now - attempt[1] < MODEL_LOAD_RETRY_SECONDS)
        if recent and not reloading:
            needs_reload = False  # asked recently; not again so soon
        if (track.load_failure is not None and track.load_failure[0] == want_revision
                and not reloading):
            failed = True
            observation = _with(observation, WorkerState.CAPTURE_FAILED,
                                f"loading model revision {want_revision!r} failed: "
                                f"{track.load_failure[1]}")
    if in_flight and now - track.action_started > deadline:
        # Whatever it is settling (an earlier generation too: a worker busy with one is not
        # handed the next until it is READY), past the deadline it fails and pauses the rollout.
        failed = True
        what = (f"generation {track.action_goal.rpartition('/')[2]}" if track.action_kind == PUSH
                else f"model revision {track.action_goal!r}")
        observation = _with(observation, WorkerState.CAPTURE_FAILED,
                            f"did not report READY with {what} within {deadline:g}s "
                            f"({lifecycle_name(s.state)})")
    view = RolloutWorker(
        name=pod.key,
        available=ready and not in_flight,
        needs_push=needs_push and not failed,
        push_recaptures=recaptures,
        needs_reload=needs_reload and not failed,
        failed=failed,
        blocked=blocked,
        settling=in_flight,
    )
    return observation, view


def record_action(track: Track, kind: str, goal: str, now: float) -> None:
    """Bookkeeping when a push or reload is started."""
    track.action_kind, track.action_goal = kind, goal
    track.action_started, track.action_done_at = now, 0.0
    track.action_error = None
    track.settled = False
    if kind == RELOAD:
        track.load_attempt = (goal, now)
        track.load_failure = None


def finish_action(track: Track, policy: pb.GraphPolicy | None, error: WorkerError | None,
                  now: float) -> str:
    """Bookkeeping when a push or reload ended; returns its outcome label for metrics."""
    track.action_done_at = now
    track.action_error = error
    if error is None:
        if track.action_kind == PUSH:
            track.rejected = None
        return "ok"
    if track.action_kind == RELOAD:
        track.load_failure = (track.action_goal, error.message)
        return str(error.kind).lower()
    if error.kind is ErrorKind.REJECTED and policy is not None:
        track.rejected = (policy.policy_uid, policy.generation, error.message, now)
    return {ErrorKind.REJECTED: "rejected", ErrorKind.STALE: "stale",
            ErrorKind.UNREACHABLE: "unreachable"}.get(error.kind, "error")


def _with(observation: WorkerObservation, state: WorkerState, message: str) -> WorkerObservation:
    return replace(observation, state=state, message=message)


def _unreachable(pod: WorkerPod, err: WorkerError) -> WorkerObservation:
    # A pod that is not ready yet is expected not to answer; a ready one is failing.
    state = WorkerState.UNREACHABLE if pod.ready else WorkerState.STARTING
    return WorkerObservation(pod.key, state, f"{pod.control_target}: {err.message}")
