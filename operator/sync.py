"""Bringing one worker to a policy: read its status, push only what it lacks, then classify it.

Reading before writing is what makes the operator safe to restart: a worker that already holds
the policy's generation is never pushed again, so a resumed operator repeats nothing. The same
rule makes a restarted worker (which lost its in-memory policy, or booted from the ConfigMap)
get exactly one push.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from graphkeeper.operator import metrics
from graphkeeper.operator.selection import WorkerPod
from graphkeeper.operator.status import WorkerObservation, WorkerState
from graphkeeper.operator.workerclient import ErrorKind, GraphControlClient, WorkerError
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import MODE_BY_NAME

#: A LoadModelRevision for the same pod and revision is not retried sooner than this.
MODEL_LOAD_RETRY_SECONDS = 60.0
#: A generation a worker refused is not pushed to it again sooner than this (unless the pod changes).
REJECTED_RETRY_SECONDS = 60.0

_MODE_NAME = {v: k for k, v in MODE_BY_NAME.items()}
_BUSY = (pb.LIFECYCLE_STATE_LOADING, pb.LIFECYCLE_STATE_RECAPTURING)


@dataclass
class SyncResult:
    observation: WorkerObservation
    pushed: str = ""  # ApplyGraphPolicy outcome when a push was made: applied, unchanged, ...
    loaded: str = ""  # the revision a LoadModelRevision was asked for
    notes: list[str] = field(default_factory=list)


def holds(status: pb.GraphStatus, policy: pb.GraphPolicy) -> bool:
    """Whether the worker holds exactly this policy generation."""
    return status.policy_uid == policy.policy_uid and status.policy_generation == policy.generation


def lifecycle_name(state: int) -> str:
    return pb.LifecycleState.Name(state).removeprefix("LIFECYCLE_STATE_")


def observe(pod: WorkerPod, status: pb.GraphStatus, policy: pb.GraphPolicy,
            want_revision: str = "", message: str = "") -> WorkerObservation:
    """Classifies a worker from its GraphStatus (pure)."""
    state = WorkerState.PENDING
    failed_sizes = [s for s in status.skipped
                    if s.reason == pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED]
    if holds(status, policy) and status.state == pb.LIFECYCLE_STATE_READY:
        if failed_sizes:
            state = WorkerState.CAPTURE_FAILED
            message = message or "capture failed for sizes " + ", ".join(
                f"{s.size} ({s.message})" for s in failed_sizes[:8])
        elif want_revision and status.model_revision != want_revision:
            message = message or (f"serves revision {status.model_revision!r}, "
                                  f"pod asks for {want_revision!r}")
        else:
            state = WorkerState.CAPTURED
    elif holds(status, policy) and status.last_error and status.state not in _BUSY:
        state = WorkerState.CAPTURE_FAILED
        message = message or status.last_error
    elif not message:
        message = (f"{lifecycle_name(status.state)}, holds generation {status.policy_generation}"
                   if status.policy_uid == policy.policy_uid
                   else f"{lifecycle_name(status.state)}, holds another policy"
                   if status.policy_uid else f"{lifecycle_name(status.state)}, holds no policy")
    steps = status.graph_steps + status.eager_steps
    return WorkerObservation(
        name=pod.key,
        state=state,
        message=message,
        lifecycle=lifecycle_name(status.state),
        policy_generation=status.policy_generation if status.policy_uid == policy.policy_uid else 0,
        model_revision=status.model_revision,
        effective_mode=_MODE_NAME.get(status.effective_mode, ""),
        captured_sizes=tuple(sorted({c.size for c in status.captured})),
        graph_memory_bytes=status.graph_memory_bytes,
        fallback_rate=(status.eager_steps / steps) if steps else None,
    )


async def sync_worker(
    client: GraphControlClient,
    pod: WorkerPod,
    policy: pb.GraphPolicy,
    *,
    recapture_on_revision: bool,
    load_attempts: MutableMapping[str, tuple[str, float]],
    rejections: MutableMapping[str, tuple[str, int, str, float]] | None = None,
) -> SyncResult:
    """Reads the worker, pushes the policy if it lacks it, reloads the model if asked to.

    ``rejections`` remembers, per pod uid, the (policy uid, generation, message, time) a worker
    refused, so a worker that keeps refusing is not pushed the same generation every interval.
    """
    if not pod.running:
        why = "is being deleted" if pod.deleting else f"is {pod.phase or 'Pending'}"
        return SyncResult(WorkerObservation(pod.key, WorkerState.STARTING, f"pod {why}"))
    try:
        status = await _read(client, pod)
    except WorkerError as err:
        return SyncResult(_unreachable(pod, err))
    result = SyncResult(WorkerObservation(pod.key, WorkerState.PENDING))

    if not holds(status, policy):
        if status.policy_uid == policy.policy_uid and status.policy_generation > policy.generation:
            # Our watch has not caught up with a newer generation the worker already holds.
            result.observation = observe(pod, status, policy, message="operator view is stale")
            return result
        refused = (rejections or {}).get(pod.uid)
        if (refused is not None and refused[:2] == (policy.policy_uid, policy.generation)
                and time.monotonic() - refused[3] < REJECTED_RETRY_SECONDS):
            result.observation = _rejected(observe(pod, status, policy), refused[2])
            return result
        try:
            reply = await client.apply_policy(pod.target, policy)
        except WorkerError as err:
            outcome = {ErrorKind.REJECTED: "rejected", ErrorKind.STALE: "stale",
                       ErrorKind.UNREACHABLE: "unreachable"}.get(err.kind, "error")
            metrics.PUSHES.labels(outcome=outcome).inc()
            result.pushed = outcome
            if err.kind is ErrorKind.UNREACHABLE:
                result.observation = _unreachable(pod, err)
            elif err.kind is ErrorKind.STALE:
                result.observation = observe(pod, status, policy, message=err.message)
            else:
                if rejections is not None and err.kind is ErrorKind.REJECTED:
                    rejections[pod.uid] = (policy.policy_uid, policy.generation, err.message, time.monotonic())
                result.observation = _rejected(observe(pod, status, policy), err.message)
            return result
        if rejections is not None:
            rejections.pop(pod.uid, None)
        result.pushed = "unchanged" if reply.unchanged else "applied"
        metrics.PUSHES.labels(outcome=result.pushed).inc()
        try:
            status = await _read(client, pod)
        except WorkerError as err:
            result.observation = _unreachable(pod, err)
            return result

    want = pod.model_revision if recapture_on_revision else ""
    if want and status.model_revision != want and status.state not in _BUSY:
        last = load_attempts.get(pod.uid)
        if last is None or last[0] != want or time.monotonic() - last[1] > MODEL_LOAD_RETRY_SECONDS:
            load_attempts[pod.uid] = (want, time.monotonic())
            result.loaded = want
            try:
                source = pod.model_source or await _current_source(client, pod)
                await client.load_model_revision(pod.target, source, want)
                metrics.MODEL_LOADS.labels(outcome="ok").inc()
                status = await _read(client, pod)
            except WorkerError as err:
                metrics.MODEL_LOADS.labels(outcome=str(err.kind).lower()).inc()
                failed = observe(pod, status, policy, want)
                result.observation = WorkerObservation(**{
                    **failed.__dict__, "state": WorkerState.CAPTURE_FAILED,
                    "message": f"loading model revision {want!r} failed: {err.message}"})
                return result
    result.observation = observe(pod, status, policy, want)
    return result


async def _read(client: GraphControlClient, pod: WorkerPod) -> pb.GraphStatus:
    try:
        status = await client.get_status(pod.target)
    except WorkerError as err:
        metrics.STATUS_READS.labels(outcome=str(err.kind).lower()).inc()
        raise
    metrics.STATUS_READS.labels(outcome="ok").inc()
    return status


async def _current_source(client: GraphControlClient, pod: WorkerPod) -> str:
    """The model source the worker serves now (for a pod that names only a revision)."""
    info = await client.model_info(pod.target)
    return info.source


def _rejected(observation: WorkerObservation, message: str) -> WorkerObservation:
    return WorkerObservation(**{**observation.__dict__, "state": WorkerState.REJECTED, "message": message})


def _unreachable(pod: WorkerPod, err: WorkerError) -> WorkerObservation:
    # A pod that is not ready yet is expected not to answer; a ready one is failing.
    state = WorkerState.UNREACHABLE if pod.ready else WorkerState.STARTING
    return WorkerObservation(pod.key, state, f"{pod.target}: {err.message}")
