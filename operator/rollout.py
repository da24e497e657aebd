"""Which workers may be told to recapture or reload now: pure decisions, like a Deployment's.

A change that makes a worker recapture its graphs (capture sizes, mode, memory budget) or reload
its model (a new ``graphkeeper.io/model-revision``) takes that worker out of service until it
reports READY again. ``plan_rollout`` hands such changes to at most ``maxUnavailable`` workers at
a time, counting every worker that is already unavailable (not READY, unreachable, or still
busy with an earlier change) against that budget, so the next batch starts only when the
previous one reports READY with the new generation or revision. Changes that recapture nothing
(tenant toggles, equivalent rewrites: ``push_recaptures``) go to every worker at once. A worker
whose capture or reload failed or timed out pauses the rollout: nothing more is handed out
until it recovers or the spec changes.

Nothing here does I/O; the reconciler builds ``RolloutWorker`` values from what it observed, and
keeps the recapture keys of the generations it built in ``RecaptureKeys``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import RecaptureKey, recapture_key

DEFAULT_MAX_UNAVAILABLE = "25%"
#: Recapture keys remembered per policy (generations a worker may still hold).
MAX_RECAPTURE_KEYS = 64
#: Seconds a worker may take to report READY with a change before the rollout pauses.
DEFAULT_PROGRESS_DEADLINE_SECONDS = 600

_PERCENT_RE = re.compile(r"^([0-9]{1,3})%$")


def resolve_max_unavailable(value: int | str | None, total: int) -> int:
    """``maxUnavailable`` (a count, or a percentage of ``total`` rounded down) as a count.

    0 and 0% are refused, as a Deployment without surge refuses them (nothing could ever
    recapture); the CRD refuses them too. A percentage that rounds down to 0 (25% of 3 workers)
    still yields 1, so that a rollout always makes progress: at the default 25%, a fleet of 7
    or fewer goes one worker at a time.
    """
    if value is None or value == "":
        value = DEFAULT_MAX_UNAVAILABLE
    if isinstance(value, bool):
        raise ValueError("maxUnavailable must be a count or a percentage")
    match = None
    if isinstance(value, int):
        count = value
    else:
        text = str(value).strip()
        match = _PERCENT_RE.match(text)
        if match:
            percent = int(match.group(1))
            if percent > 100:
                raise ValueError(f"maxUnavailable {text!r}: at most 100%")
            if percent == 0:
                raise ValueError(f"maxUnavailable {text!r}: at least 1%")
            count = math.floor(total * percent / 100)
        elif text.isdigit():
            count = int(text)
        else:
            raise ValueError(f"maxUnavailable {text!r} is not a count or a percentage like 25%")
    if count < 0 or (count == 0 and not match):
        raise ValueError(f"maxUnavailable must be at least 1, got {count}")
    return max(1, count)


def rollout_settings(spec: Mapping[str, Any], total: int) -> tuple[int, float]:
    """(maxUnavailable as a count, progress deadline in seconds) from a policy spec."""
    rollout = spec.get("rollout") or {}
    count = resolve_max_unavailable(rollout.get("maxUnavailable"), total)
    deadline = float(rollout.get("progressDeadlineSeconds") or DEFAULT_PROGRESS_DEADLINE_SECONDS)
    return count, deadline


def push_recaptures(held: RecaptureKey | None, policy: pb.GraphPolicy) -> bool:
    """Whether moving a worker from the generation whose key is ``held`` to ``policy`` recaptures
    graphs. An unknown key (a generation this operator never built) counts as yes: the safe answer.

    The key is ``recapture_key`` without a worker's limits, the rule the worker applies too, so an
    equivalent rewrite (sizes reordered, the default mode or ladder spelled out) is no recapture
    and goes to every worker at once, like a tenant toggle.
    """
    return held is None or held != recapture_key(policy)


class RecaptureKeys:
    """The recapture key of each generation this operator built, so that moving a worker from the
    generation it reports holding to the next can tell whether it recaptures (``push_recaptures``).
    A worker holding a generation built by another operator (before a restart) counts as
    recapturing: the safe answer."""

    def __init__(self) -> None:
        #: (policy uid, generation) -> its recapture key.
        self._keys: dict[tuple[str, int], RecaptureKey | None] = {}

    def remember(self, policy: pb.GraphPolicy, policies: int) -> None:
        """Keeps ``policy``'s key; forgets the older half once ``policies`` loops hold too many."""
        self._keys[(policy.policy_uid, policy.generation)] = recapture_key(policy)
        if len(self._keys) > MAX_RECAPTURE_KEYS * max(1, policies):
            for key in list(self._keys)[: len(self._keys) // 2]:
                del self._keys[key]

    def recaptures(self, status: pb.GraphStatus | None, policy: pb.GraphPolicy) -> bool:
        """Whether moving a worker from what ``status`` says it holds to ``policy`` recaptures graphs."""
        held = None
        if status is not None and status.policy_uid:
            held = self._keys.get((status.policy_uid, status.policy_generation))
        return push_recaptures(held, policy)


@dataclass(frozen=True)
class RolloutWorker:
    """One selected worker as the planner sees it."""

    name: str
    #: Serving: reachable, READY, and no change of ours still under way on it.
    available: bool
    #: Lacks the policy's generation (neither adopted nor pending) and a push would reach it.
    needs_push: bool = False
    #: That push makes it recapture (False: only tenant toggles or spellings differ from what it holds).
    push_recaptures: bool = True
    #: Serves another model revision than its pod asks for, and no reload is under way.
    needs_reload: bool = False
    #: Its capture or reload of the current change failed or timed out.
    failed: bool = False
    #: Pushing is pointless now (it refused this generation recently, or is not running).
    blocked: bool = False
    #: Still busy with an earlier push or reload of ours: it gets the latest generation once it
    #: is READY, not every generation of an edit burst meanwhile.
    settling: bool = False
    #: Its pod was deleted while it recaptured; it holds a slot until it can no longer be
    #: recapturing (``departures``).
    departed: bool = False


@dataclass(frozen=True)
class RolloutPlan:
    push: tuple[str, ...] = ()
    reload: tuple[str, ...] = ()
    paused: bool = False
    #: Workers that failed (why the rollout is paused).
    failed: tuple[str, ...] = ()
    unavailable: int = 0
    max_unavailable: int = 1
    #: Workers that still need a recapture or reload and were not handed one this run.
    waiting: tuple[str, ...] = field(default=())
    #: The unavailable workers (what the waiting ones wait on), and which of them are departed;
    #: ``taken``: the workers this plan takes out of service (a recapture or reload now).
    unavailable_names: tuple[str, ...] = ()
    departed: tuple[str, ...] = ()
    taken: tuple[str, ...] = ()


@dataclass(frozen=True)
class Wait:
    """What a rollout waits on: the Progressing condition's reason and message, and the key its
    one Event is posted under (a new key, a new Event)."""

    reason: str
    message: str
    key: tuple[str, ...]


def rollout_wait(plan: RolloutPlan) -> Wait | None:
    """What the workers the plan left waiting wait on (pure); None when none waits, or the rollout
    is paused (``RolloutPaused`` says why)."""
    if plan.paused or not plan.waiting:
        return None
    waiting = f"{len(plan.waiting)} worker(s) wait for a slot (maxUnavailable {plan.max_unavailable})"
    if plan.departed:
        held = ", ".join(plan.departed[:5])
        return Wait("WaitingForDeletedWorker",
                    f"{waiting}: held by {held}, deleted while recapturing; a slot frees when the "
                    "worker's address stops answering, it reports READY, a replacement is READY or "
                    "the progress deadline passes", ("WaitingForDeletedWorker", *plan.departed))
    busy = plan.unavailable_names + plan.taken
    names = ", ".join(busy[:5])
    more = len(busy) - 5
    return Wait("WaitingForUnavailableWorkers",
                f"{waiting}: {len(busy)} unavailable ({names}{f' and {more} more' if more > 0 else ''})",
                ("WaitingForUnavailableWorkers",))


def plan_rollout(workers: Iterable[RolloutWorker], max_unavailable: int) -> RolloutPlan:
    """Who gets a push or a reload now; workers are taken in name order, so runs agree."""
    ordered = sorted(workers, key=lambda w: w.name)
    failed = tuple(w.name for w in ordered if w.failed)
    unavailable = sum(1 for w in ordered if not w.available)
    push: list[str] = []
    reload: list[str] = []
    waiting: list[str] = []
    taken: list[str] = []
    budget = max(0, max_unavailable - unavailable)
    for w in ordered:
        if w.blocked:
            continue
        if w.needs_push and not w.push_recaptures:
            push.append(w.name)  # nothing recaptures (tenant toggles, rewrites): everyone at once
            continue
        if not (w.needs_push or w.needs_reload):
            continue
        if not w.available:
            # Already out of service (starting, recapturing an older change): telling it now
            # costs no availability and saves a second recapture later.
            if w.needs_push and not failed and not w.settling:
                push.append(w.name)
            elif not failed:
                waiting.append(w.name)
            continue
        if failed or budget == 0:
            waiting.append(w.name)
            continue
        budget -= 1
        taken.append(w.name)
        (push if w.needs_push else reload).append(w.name)
    return RolloutPlan(push=tuple(push), reload=tuple(reload), paused=bool(failed),
                       failed=failed, unavailable=unavailable, max_unavailable=max_unavailable,
                       waiting=tuple(waiting),
                       unavailable_names=tuple(w.name for w in ordered if not w.available),
                       departed=tuple(w.name for w in ordered if w.departed), taken=tuple(taken))


def rollout_status(plan: RolloutPlan, *, updated: int, total: int) -> dict[str, Any]:
    """``.status.rollout``: like a Deployment's replica counts, for this policy's change."""
    return {
        "maxUnavailable": plan.max_unavailable,
        "updatedWorkers": updated,
        "pendingWorkers": max(0, total - updated - len(plan.failed)),
        "failedWorkers": len(plan.failed),
        "unavailableWorkers": plan.unavailable,
        "paused": plan.paused,
    }
