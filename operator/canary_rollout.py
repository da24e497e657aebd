"""Carries out a policy's canary (``canary.py`` decides): one ``CanaryRollout`` per policy loop.

The traffic look hands a new set to ``offer`` instead of applying it; ``run`` (one line of the
reconcile run) starts the canary on the first ready workers, gives them the proposed set (through
``Desired.canary``: the rest keep the set in effect, and so does the ConfigMap new pods boot from),
feeds the run's readings to ``canary.advance``, and on a verdict changes the set in effect:
promoted, the proposal (the normal rollout takes it to the rest, ``maxUnavailable`` at a time);
reverted, the previous sizes under a newer sequence (the canary recaptures them, the rest only
adopt the new generation). ``canary_status`` is ``status.canary``.

An operator restarted while a canary runs reverts it (``resume``): the window's baseline is gone,
and the canary worker must not keep sizes nobody judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from graphkeeper.operator.canary import (
    CANARY,
    IDLE,
    PROMOTED,
    REVERT,
    REVERTED,
    Canary,
    Reading,
    Verdict,
    advance,
    reverted_set,
    start_canary,
)
from graphkeeper.operator.desired import Desired
from graphkeeper.operator.events import Event
from graphkeeper.operator.traffic import Applied, FromTraffic
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import serves_graphs


@dataclass(frozen=True)
class CanaryStep:
    """What one run's canary step decided: the policy to push, the set in effect, its Events."""

    desired: Desired
    applied: Applied
    events: tuple[Event, ...] = ()


def reading(status: pb.GraphStatus | None, wire: pb.GraphPolicy) -> Reading:
    """A worker's status as the canary reads it (``wire``: the policy the worker is to hold)."""
    if status is None:
        return Reading(False, None)
    adopted = status.policy_uid == wire.policy_uid and status.policy_generation == wire.generation
    holds = adopted and serves_graphs(status.state) and not status.pending_policy_uid
    failed = adopted and any(s.reason == pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED for s in status.skipped)
    return Reading(holds, status.serving if status.HasField("serving") else None, status.graph_memory_bytes,
                   failed)


class CanaryRollout:
    """The canary of one policy, between runs."""

    def __init__(self) -> None:
        self.state = Canary()
        #: A set the traffic look chose and handed over instead of applying it.
        self.offered: Applied | None = None

    @property
    def busy(self) -> bool:
        """A set is offered or on canary: the traffic look waits for the verdict."""
        return self.offered is not None or self.state.running

    def offer(self, settings: FromTraffic | None, proposed: Applied) -> bool:
        """Takes ``proposed`` for a canary when the spec asks for one (False: apply it as usual)."""
        if settings is None or settings.canary is None:
            return False
        self.offered = proposed
        return True

    def resume(self, status: Mapping[str, Any] | None, applied: Applied, now: float) -> Applied:
        """The set in effect for a restarted operator: a canary the last one left running is reverted."""
        raw = (status or {}).get("canary") or {}
        if raw.get("phase") != CANARY:
            return applied
        proposed = Applied(tuple(raw.get("proposedSizes") or ()), int(raw.get("proposedSequence") or 0), 0.0,
                           applied.mode)
        self.state = Canary(REVERTED, tuple(raw.get("workers") or ()), proposed, applied, finished=now,
                            verdict=Verdict(REVERT, "the operator restarted during the window"))
        return reverted_set(self.state, now)

    def run(self, desired: Desired, applied: Applied, statuses: Mapping[str, pb.GraphStatus | None],
            now: float) -> CanaryStep:
        """One run: ``statuses`` by pod key of every owned worker (None: not read); ``applied``: the
        set in effect."""
        settings = desired.traffic.canary if desired.traffic is not None else None
        if settings is None:
            self.offered = None
            if self.state.running:  # the spec dropped its canary: nothing is judged, the set stays as it was
                self.state = replace(self.state, phase=REVERTED, finished=now,
                                     verdict=Verdict(REVERT, "the spec no longer asks for a canary"))
                return self._revert(desired, now)
            return CanaryStep(desired, applied)
        events: list[Event] = []
        if self.offered is not None and not self.state.running:
            ready = [k for k, s in statuses.items() if s is not None and serves_graphs(s.state)]
            started = start_canary(applied, self.offered, ready, settings, now)
            proposed, self.offered = self.offered, None
            if started is None:  # no worker left to compare with: applied as without a canary
                return CanaryStep(desired.applying(proposed), proposed, (Event(
                    "Normal", "CaptureSizesApplied",
                    f"sizes {list(proposed.sizes)} applied without a canary: {len(ready)} ready worker(s), "
                    f"none left to compare a canary of {settings.workers} with"),))
            self.state = started
            events.append(Event("Normal", "CanaryStarted",
                                f"sizes {list(proposed.sizes)} first on {', '.join(started.workers)}; "
                                f"judged after {settings.window_seconds}s against the rest"))
        if not self.state.running:
            return CanaryStep(desired, applied, tuple(events))
        canary_desired = desired.canary_on(self.state.workers, self.state.proposed)
        readings = {k: reading(s, canary_desired.wire_for(k)) for k, s in statuses.items()}
        self.state = advance(self.state, readings, settings, now)
        if self.state.phase == PROMOTED:
            message = f"sizes {list(self.state.proposed.sizes)} promoted to every worker: {self.state.verdict.reason}"
            events.append(Event("Normal", "CanaryPromoted", message))
            return CanaryStep(desired.applying(self.state.proposed), self.state.proposed, tuple(events))
        if self.state.phase == REVERTED:
            step = self._revert(desired, now)
            return replace(step, events=(*events, *step.events))
        return CanaryStep(canary_desired, applied, tuple(events))

    def _revert(self, desired: Desired, now: float) -> CanaryStep:
        back = reverted_set(self.state, now)
        verdict = self.state.verdict
        message = (f"sizes {list(self.state.proposed.sizes)} reverted on {', '.join(self.state.workers)} "
                   f"to {list(back.sizes) or 'the spec sizes'}: {verdict.reason if verdict else ''}")
        return CanaryStep(desired.applying(back), back, (Event("Warning", "CanaryReverted", message),))

    def progressing(self) -> str | None:
        """The Progressing condition's message while a canary runs (None otherwise)."""
        if not self.state.running:
            return None
        why = self.state.verdict.reason if self.state.verdict else "starting"
        return (f"canary of sizes {list(self.state.proposed.sizes)} on {', '.join(self.state.workers)}: {why}")


def _stamp(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def canary_status(state: Canary) -> dict[str, Any] | None:
    """``status.canary``; None before the first canary."""
    if state.phase == IDLE:
        return None
    out: dict[str, Any] = {"phase": state.phase, "workers": list(state.workers)[:256],
                           "proposedSizes": list(state.proposed.sizes), "previousSizes": list(state.previous.sizes),
                           "proposedSequence": state.proposed.sequence}
    if state.started:
        out["startTime"] = _stamp(state.started)
    if state.window_start:
        out["windowStart"] = _stamp(state.window_start)
        out["windowEnd"] = _stamp(state.finished or state.window_start + state.window_seconds)
    if state.verdict is not None:
        out["verdict"] = state.verdict.decision
        out["reason"] = state.verdict.reason[:1024]
        if state.verdict.canary is not None and state.verdict.rest is not None:
            out["figures"] = {"canary": state.verdict.canary.to_status(), "rest": state.verdict.rest.to_status()}
    return out
