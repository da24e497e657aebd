"""The Events a reconcile run posts about its policy, decided from what the run saw (pure).

Events are for what a person wants to see: one per kind per run, never one per worker, and a
failure, a paused rollout or an invalid spec once when it starts (``Told`` remembers what the
runs before said), not on every run while it lasts. Normal Events (pushes, reloads, waits) are
rate-limited per reason, as client-go's event recorder does: a burst of ``NORMAL_BURST``, then
one per ``NORMAL_EVERY_SECONDS``; under an edit burst the status says what each generation did,
and an Event per generation and batch would be most of the operator's API requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from graphkeeper.operator.rollout import RolloutPlan, Wait
from graphkeeper.operator.status import FAILURE_REASONS, WorkerObservation, WorkerState
from graphkeeper.operator.sync import PUSH, RELOAD

#: Workers a message names before it says how many more there are.
NAMED = 5
#: Failing workers a Warning details.
DETAILED = 3
#: Normal Events of one reason a policy may post at once, and how often one more is allowed;
#: the first of a new generation is allowed anyway when the last was this long ago.
NORMAL_BURST = 3
NORMAL_EVERY_SECONDS = 5.0
NEW_GENERATION_SECONDS = 1.0


@dataclass(frozen=True)
class Event:
    kind: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Told:
    """What the Events of the runs before said: each worker's state, the paused rollout, the
    invalid spec."""

    worker_states: Mapping[str, WorkerState] = field(default_factory=dict)
    paused: tuple[str, ...] = ()
    invalid: str | None = None
    #: The key of the last wait told (with its generation), so that each wait is told once.
    wait: tuple = ()
    #: Normal Events' allowance by reason: (Events left, when it was last counted, the generation
    #: and the time of the last one posted).
    allowance: Mapping[str, tuple[float, float, int, float]] = field(default_factory=dict)


def run_events(told: Told, *, generation: int, observations: Sequence[WorkerObservation],
               fired: Mapping[str, Sequence[str]], invalid: str | None,
               plan: RolloutPlan | None, wait: Wait | None = None, now: float = 0.0) -> tuple[list[Event], Told]:
    """The Events of one run, and what has been told after it.

    ``fired``: the pushes and reloads the run started, by kind; ``plan``: the run's rollout plan
    (None when nothing was planned, as for an invalid spec); ``wait``: what the rollout waits
    on, told once per generation and kind of wait (a deleted worker is a kind of its own);
    ``now``: a monotonic clock, for the Normal Events' allowance.
    """
    events: list[Event] = []
    if fired[PUSH]:
        events.append(Event("Normal", "PolicyPushed", f"pushed generation {generation} to {names(fired[PUSH])}"))
    if fired[RELOAD]:
        events.append(Event("Normal", "ModelRevisionLoad",
                            f"asked to load a new model revision: {names(fired[RELOAD])}"))
    fresh: dict[WorkerState, list[WorkerObservation]] = {}
    states: dict[str, WorkerState] = {}
    for o in observations:
        states[o.name] = o.state
        if o.state in FAILURE_REASONS and told.worker_states.get(o.name) != o.state:
            fresh.setdefault(o.state, []).append(o)
    for state, obs in fresh.items():
        detail = "; ".join(f"{o.name}: {o.message}" for o in obs[:DETAILED])
        more = f"; and {len(obs) - DETAILED} more" if len(obs) > DETAILED else ""
        events.append(Event("Warning", FAILURE_REASONS[state], detail + more))
    paused = plan.failed if plan is not None and plan.paused else ()
    if paused and not told.paused:
        events.append(Event("Warning", "RolloutPaused",
                            f"generation {generation}: not handed to more workers until "
                            f"{names(list(paused))} recover(s) or the spec changes"))
    elif told.paused and not paused and plan is not None:
        events.append(Event("Normal", "RolloutResumed", f"generation {generation}"))
    if invalid is not None and told.invalid != invalid:
        events.append(Event("Warning", "InvalidPolicy", invalid))
    waited = told.wait
    if wait is not None and (generation, *wait.key) != told.wait:
        waited = (generation, *wait.key)
        events.append(Event("Normal", wait.reason, f"generation {generation}: {wait.message}"))
    allowance = dict(told.allowance)
    events = [e for e in events if e.kind != "Normal" or _allowed(allowance, e.reason, now, generation)]
    return events, Told(states, paused, invalid, waited, allowance)


def _allowed(allowance: dict[str, tuple[float, float, int, float]], reason: str, now: float,
             generation: int) -> bool:
    """Takes one Event of ``reason`` from its allowance (a token bucket) if one is left, or lets
    the first of a new generation through when the last one posted is a second old."""
    left, at, told_generation, posted = allowance.get(reason, (float(NORMAL_BURST), now, 0, -math.inf))
    left = min(float(NORMAL_BURST), left + (now - at) / NORMAL_EVERY_SECONDS)
    fresh = generation != told_generation and now - posted >= NEW_GENERATION_SECONDS
    allowed = left >= 1.0 or fresh
    if allowed:
        left, told_generation, posted = max(0.0, left - 1.0), generation, now
    allowance[reason] = (left, now, told_generation, posted)
    return allowed


def names(workers: Sequence[str]) -> str:
    shown = ", ".join(workers[:NAMED])
    more = f" and {len(workers) - NAMED} more" if len(workers) > NAMED else ""
    return f"{len(workers)} worker(s): {shown}{more}"
