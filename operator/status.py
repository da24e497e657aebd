"""GraphPolicy.status from what the operator observed of each worker: one pure function.

``build_status`` is the only place that decides counts, conditions and the last failure, so a
test can check every combination without a cluster. Conditions follow the Kubernetes API
conventions: ``Ready`` summarises, ``Progressing`` says a rollout of the generation is under
way, ``Degraded`` says something needs a person; ``lastTransitionTime`` moves only when a
condition's status flips.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

MAX_WORKER_SUMMARIES = 32
MAX_MODEL_REVISIONS = 16
MAX_MESSAGE = 1024
MAX_NAMED_IN_MESSAGE = 3


class WorkerState(enum.StrEnum):
    """What one selected worker means for the policy."""

    CAPTURED = "Captured"  # holds this generation and is READY
    PENDING = "Pending"  # reachable, not yet at this generation (capturing, recapturing)
    STARTING = "Starting"  # no process to talk to yet (pod not running, or not ready)
    UNREACHABLE = "Unreachable"  # a ready pod whose worker does not answer
    REJECTED = "Rejected"  # the worker refused the policy (INVALID_ARGUMENT)
    CAPTURE_FAILED = "CaptureFailed"  # the worker holds the policy but a capture failed
    CONFLICT = "Conflict"  # an older policy selects this pod too; not pushed


FAILED_STATES = frozenset({
    WorkerState.UNREACHABLE, WorkerState.REJECTED, WorkerState.CAPTURE_FAILED, WorkerState.CONFLICT,
})

#: The CamelCase reason for each failing worker state, used by the Degraded condition and by the
#: reconciler's Warning Events. In priority order: when several kinds fail, Degraded names the
#: first one present (the one a person can act on first).
FAILURE_REASONS: dict[WorkerState, str] = {
    WorkerState.CONFLICT: "Conflict",
    WorkerState.REJECTED: "PolicyRejected",
    WorkerState.CAPTURE_FAILED: "CaptureFailed",
    WorkerState.UNREACHABLE: "WorkerUnreachable",
}


@dataclass(frozen=True)
class WorkerObservation:
    """One worker as seen in one reconcile; ``name`` is the pod's ``namespace/name``."""

    name: str
    state: WorkerState
    message: str = ""
    lifecycle: str = ""
    policy_generation: int = 0
    model_revision: str = ""
    effective_mode: str = ""
    #: Whether its start found every cache it used (None: it used none, or has not started).
    started_warm: bool | None = None
    #: Ranks the worker shards its model across (0: not reported); its graph memory is one rank's.
    tensor_parallel_size: int = 0
    captured_sizes: tuple[int, ...] = ()
    graph_memory_bytes: int = 0
    fallback_rate: float | None = None
    #: For a CONFLICT: the policy (``namespace/name``) that owns the worker.
    owner: str = ""

    @property
    def failed(self) -> bool:
        return self.state in FAILED_STATES


def rfc3339(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_status(
    *,
    generation: int,
    observations: Iterable[WorkerObservation],
    previous: Mapping[str, Any] | None,
    now: datetime,
    invalid: str | None = None,
    rollout: Mapping[str, Any] | None = None,
    canary: str | None = None,
    wait: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """The whole ``.status`` for a policy at ``generation``.

    ``previous`` is the status as last written (for transition times and the last failure);
    ``invalid`` is the operator's own validation message when the spec cannot be pushed;
    ``rollout`` is ``rollout.rollout_status`` (counts, and whether a failure paused it);
    ``canary``: how a running canary stands (Progressing says it, reason CanaryRunning);
    ``wait``: (reason, message) of what the rollout waits on (``rollout.rollout_wait``).
    """
    previous = previous or {}
    workers = sorted(observations, key=lambda o: (not o.failed, o.state != WorkerState.PENDING,
                                                  o.name))
    failed = [o for o in workers if o.failed]
    captured = [o for o in workers if o.state == WorkerState.CAPTURED]
    waiting = [o for o in workers if o.state in (WorkerState.PENDING, WorkerState.STARTING)]
    selected = len(workers)

    conditions = _conditions(generation, selected, captured, waiting, failed, invalid, rollout, canary, wait)
    old = {c.get("type"): c for c in previous.get("conditions") or []}
    stamp = rfc3339(now)
    for cond in conditions:
        before = old.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        cond["lastTransitionTime"] = before.get("lastTransitionTime", stamp) if same else stamp

    status: dict[str, Any] = {
        "observedGeneration": generation,
        "selectedWorkers": selected,
        "capturedWorkers": len(captured),
        "failedWorkers": len(failed),
        "modelRevisions": sorted({o.model_revision for o in workers if o.model_revision})[
            :MAX_MODEL_REVISIONS
        ],
        "workers": [_summary(o) for o in workers[:MAX_WORKER_SUMMARIES]],
        "conditions": conditions,
    }
    if rollout is not None and invalid is None:
        status["rollout"] = dict(rollout)
    last = _last_failure(failed, invalid, previous.get("lastFailure"), stamp)
    if last is not None:
        status["lastFailure"] = last
    return status


def _conditions(
    generation: int,
    selected: int,
    captured: list[WorkerObservation],
    waiting: list[WorkerObservation],
    failed: list[WorkerObservation],
    invalid: str | None,
    rollout: Mapping[str, Any] | None = None,
    canary: str | None = None,
    wait: tuple[str, str] | None = None,
) -> list[dict[str, Any]]:
    def cond(kind: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        return {"type": kind, "status": "True" if ok else "False", "reason": reason,
                "message": _clip(message), "observedGeneration": generation}

    if invalid is not None:
        return [
            cond("Ready", False, "InvalidPolicy", invalid),
            cond("Progressing", False, "InvalidPolicy", "not pushed: the policy is invalid"),
            cond("Degraded", True, "InvalidPolicy", invalid),
        ]
    if selected == 0:
        return [
            cond("Ready", False, "NoWorkersSelected", "the selector matches no pod"),
            cond("Progressing", False, "NoWorkersSelected", "nothing to push"),
            cond("Degraded", False, "AsExpected", "no worker is failing"),
        ]
    done = f"{len(captured)}/{selected} workers captured generation {generation}"
    if len(captured) == selected:
        ready = cond("Ready", True, "AllWorkersCaptured", done)
    else:
        ready = cond("Ready", False, "WorkersNotCaptured", done)
    paused = bool(rollout and rollout.get("paused"))
    if paused:
        stuck = [o for o in failed if o.state == WorkerState.CAPTURE_FAILED] or failed
        progressing = cond("Progressing", False, "RolloutPaused",
                           f"rollout paused: {_names(stuck)} failed to capture or load; no "
                           f"further worker is changed until it recovers or the spec changes "
                           f"({done})")
    elif canary is not None:
        progressing = cond("Progressing", True, "CanaryRunning", f"{canary} ({done})")
    elif waiting and wait is not None:
        progressing = cond("Progressing", True, wait[0], f"{wait[1]} ({done})")
    elif waiting:
        unavailable = f", at most {rollout['maxUnavailable']} at a time" if rollout else ""
        progressing = cond("Progressing", True, "WaitingForWorkers",
                           f"waiting for {_names(waiting)} ({done}{unavailable})")
    elif failed:
        progressing = cond("Progressing", False, "Blocked",
                           f"no progress possible until the failing workers recover ({done})")
    else:
        progressing = cond("Progressing", False, "AllWorkersCaptured", done)
    if failed:
        worst = min(failed, key=lambda o: list(FAILURE_REASONS).index(o.state))
        reason = FAILURE_REASONS[worst.state]
        shown = failed[:MAX_NAMED_IN_MESSAGE]
        details = "; ".join(f"{o.name}: {o.state}: {o.message}" for o in shown)
        more = len(failed) - MAX_NAMED_IN_MESSAGE
        if more > 0:
            details += f"; and {more} more"
        summary = f"{conflict_summary(failed)}: " if reason == "Conflict" else ""
        degraded = cond("Degraded", True, reason, f"{summary}{len(failed)} failing: {details}")
    else:
        degraded = cond("Degraded", False, "AsExpected", "no worker is failing")
    return [ready, progressing, degraded]


def _last_failure(
    failed: list[WorkerObservation],
    invalid: str | None,
    previous: Mapping[str, Any] | None,
    stamp: str,
) -> dict[str, Any] | None:
    if invalid is not None:
        current = {"worker": "", "reason": "InvalidPolicy", "message": _clip(invalid)}
    elif failed:
        first = failed[0]
        current = {"worker": first.name, "reason": str(first.state),
                   "message": _clip(first.message)}
    else:
        return dict(previous) if previous else None  # the last failure stays until the next one
    if previous and all(previous.get(k) == v for k, v in current.items()):
        current["time"] = previous.get("time", stamp)  # the same failure, still going on
    else:
        current["time"] = stamp
    return current


def _summary(o: WorkerObservation) -> dict[str, Any]:
    out: dict[str, Any] = {"name": o.name, "state": str(o.state)}
    if o.lifecycle:
        out["lifecycle"] = o.lifecycle
    if o.policy_generation:
        out["policyGeneration"] = o.policy_generation
    if o.model_revision:
        out["modelRevision"] = o.model_revision
    if o.effective_mode:
        out["effectiveMode"] = o.effective_mode
    if o.started_warm is not None:
        out["startedWarm"] = o.started_warm
    if o.tensor_parallel_size:
        out["tensorParallelSize"] = o.tensor_parallel_size
    out["capturedSizes"] = list(o.captured_sizes)[:512]
    out["graphMemoryBytes"] = o.graph_memory_bytes
    if o.fallback_rate is not None:
        out["fallbackRate"] = round(min(max(o.fallback_rate, 0.0), 1.0), 3)
    if o.message:
        out["message"] = _clip(o.message)
    return out


def conflict_summary(observations: Iterable[WorkerObservation]) -> str:
    """Each policy that owns some of this policy's selected workers, and how many."""
    counts = Counter(o.owner for o in observations if o.state == WorkerState.CONFLICT and o.owner)
    return "; ".join(f"{n} selected pod(s) owned by the older policy {who}"
                     for who, n in sorted(counts.items()))


def _names(observations: list[WorkerObservation]) -> str:
    names = ", ".join(o.name for o in observations[:MAX_NAMED_IN_MESSAGE])
    more = len(observations) - MAX_NAMED_IN_MESSAGE
    return names + (f" and {more} more" if more > 0 else "")


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    """The condition of type ``kind`` in a status, if present."""
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)
