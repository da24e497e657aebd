"""Proof before rollout: a set chosen from traffic serves on a canary before the rest get it (pure).

In Apply mode with ``fromTraffic.canary``, a new set goes first to ``canary.workers`` workers (the
first ready ones by pod name: every run picks the same), while the rest keep the sizes in effect.
Once every canary worker serves the new set, a window of ``windowSeconds`` opens; at its end the
canary's serving counters over the window are compared with the rest's (``compare``), on the same
traffic, and the set is promoted (the normal rollout to the rest) or reverted (the canary gets the
previous sizes back). Why these judges: tokens/s per sequence and ITL p99 are what a user of the
worker feels; a set that replays less (more eager steps) is the first sign the traffic was misread.
Coverage, padding and graph memory are reported beside them, to explain a verdict.

Each worker reports counters cumulative since its last adoption (``GraphStatus.serving``); a
window is the difference between a reading at the window's start (``Canary.baseline``) and one at
its end, or the whole reading when the worker adopted something meanwhile.

No flapping: a reverted set is not proposed again before ``minIntervalSeconds`` (the revert is
recorded as an applied set of the previous sizes, so ``traffic.decide_apply`` holds back the next
one for the interval), and a new proposal still needs ``minImprovementPercent``.

The state machine is data (``Canary``): Idle -> Canary -> Promoted | Reverted, moved by
``start_canary`` and ``advance``; ``canary_rollout.py`` carries out what it decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from graphkeeper.operator.traffic import Applied, CanarySettings
from graphkeeper.proto import worker_pb2 as pb

IDLE, CANARY, PROMOTED, REVERTED = "Idle", "Canary", "Promoted", "Reverted"
PROMOTE, REVERT, WAIT = "Promote", "Revert", "Wait"
#: A canary still undecided this many windows after it started (it never captured the proposal, or
#: too little traffic came to judge it) is reverted: no proposal holds a policy's rollout forever.
GIVE_UP_WINDOWS = 4
PHASES = (IDLE, CANARY, PROMOTED, REVERTED)
#: Steps each side must have served in the window before it is judged.
MIN_WINDOW_STEPS = 100
#: The canary may run this much more of its steps eager than the rest (a share, 0..1).
MAX_EAGER_SHARE_INCREASE = 0.05


@dataclass(frozen=True)
class Window:
    """One worker's (or one side's) serving over the window: counter differences."""

    graph_steps: int = 0
    eager_steps: int = 0
    generated_tokens: int = 0
    sequence_seconds: float = 0.0
    replayed_tokens: int = 0
    padded_tokens: int = 0
    itl_bounds: tuple[float, ...] = ()
    itl_counts: tuple[int, ...] = ()
    graph_memory_bytes: int = 0
    workers: int = 1


def window(start: pb.ServingCounters | None, end: pb.ServingCounters, graph_memory_bytes: int = 0) -> Window:
    """``end`` less ``start``; the whole of ``end`` when the worker started counting afresh after
    ``start`` (an adoption) or there is no ``start``."""
    if start is None or start.since_unix_seconds != end.since_unix_seconds:
        start = pb.ServingCounters()
    before = list(start.itl_counts) or [0] * len(end.itl_counts)
    return Window(
        graph_steps=end.graph_steps - start.graph_steps, eager_steps=end.eager_steps - start.eager_steps,
        generated_tokens=end.generated_tokens - start.generated_tokens,
        sequence_seconds=end.sequence_seconds - start.sequence_seconds,
        replayed_tokens=end.replayed_tokens - start.replayed_tokens,
        padded_tokens=end.padded_tokens - start.padded_tokens, itl_bounds=tuple(end.itl_bounds_seconds),
        itl_counts=tuple(b - a for a, b in zip(before, end.itl_counts, strict=False)),
        graph_memory_bytes=graph_memory_bytes)


def combined(windows: Sequence[Window]) -> Window:
    """One side's windows added up (graph memory: the mean per worker)."""
    if not windows:
        return Window(workers=0)
    bounds = windows[0].itl_bounds
    counts = [0] * len(windows[0].itl_counts)
    for w in windows:
        if w.itl_bounds == bounds:
            counts = [a + b for a, b in zip(counts, w.itl_counts, strict=False)]
    return Window(
        graph_steps=sum(w.graph_steps for w in windows), eager_steps=sum(w.eager_steps for w in windows),
        generated_tokens=sum(w.generated_tokens for w in windows),
        sequence_seconds=sum(w.sequence_seconds for w in windows),
        replayed_tokens=sum(w.replayed_tokens for w in windows), padded_tokens=sum(w.padded_tokens for w in windows),
        itl_bounds=bounds, itl_counts=tuple(counts),
        graph_memory_bytes=sum(w.graph_memory_bytes for w in windows) // len(windows), workers=len(windows))


def percentile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float:
    """The ``q`` quantile of a bucketed histogram, interpolated inside its bucket (the last,
    unbounded bucket reads as the largest bound)."""
    total = sum(counts)
    if total == 0 or not bounds:
        return 0.0
    target, seen = q * total, 0
    for i, n in enumerate(counts):
        if n and seen + n >= target:
            if i >= len(bounds):
                return bounds[-1]
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (target - seen) / n
        seen += n
    return bounds[-1]


@dataclass(frozen=True)
class Figures:
    """What one side served over the window."""

    workers: int
    steps: int
    #: Share of steps replayed; padding: share of replayed rows that were padding.
    coverage: float
    padding: float
    eager_share: float
    tokens_per_second_per_sequence: float
    itl_p99_seconds: float
    graph_memory_bytes: int

    def to_status(self) -> dict[str, Any]:
        return {"workers": self.workers, "steps": self.steps, "coverage": round(self.coverage, 4),
                "padding": round(self.padding, 4), "eagerShare": round(self.eager_share, 4),
                "tokensPerSecondPerSequence": round(self.tokens_per_second_per_sequence, 3),
                "itlP99Seconds": round(self.itl_p99_seconds, 6), "graphMemoryBytes": self.graph_memory_bytes}


def figures(w: Window) -> Figures:
    steps = w.graph_steps + w.eager_steps
    return Figures(
        workers=w.workers, steps=steps, coverage=w.graph_steps / steps if steps else 0.0,
        padding=w.padded_tokens / w.replayed_tokens if w.replayed_tokens else 0.0,
        eager_share=w.eager_steps / steps if steps else 0.0,
        tokens_per_second_per_sequence=w.generated_tokens / w.sequence_seconds if w.sequence_seconds > 0 else 0.0,
        itl_p99_seconds=percentile(w.itl_bounds, w.itl_counts, 0.99), graph_memory_bytes=w.graph_memory_bytes)


@dataclass(frozen=True)
class Verdict:
    decision: str  # PROMOTE, REVERT or WAIT
    reason: str
    canary: Figures | None = None
    rest: Figures | None = None


def compare(canary_windows: Sequence[Window], rest_windows: Sequence[Window], settings: CanarySettings,
            min_steps: int = MIN_WINDOW_STEPS) -> Verdict:
    """Promote, revert or wait, from the canary's and the rest's windows, with the figures and a
    one-line reason. Judges, in order: enough steps on both sides, the eager share, tokens/s per
    sequence, ITL p99."""
    canary, rest = figures(combined(canary_windows)), figures(combined(rest_windows))
    if canary.steps < min_steps or rest.steps < min_steps:
        return Verdict(WAIT, f"too few steps to judge: canary {canary.steps}, rest {rest.steps} "
                             f"(at least {min_steps} each)", canary, rest)
    if canary.tokens_per_second_per_sequence <= 0 or rest.tokens_per_second_per_sequence <= 0:
        return Verdict(WAIT, "no tokens generated on one side yet", canary, rest)
    more_eager = canary.eager_share - rest.eager_share
    if more_eager > MAX_EAGER_SHARE_INCREASE:
        return Verdict(REVERT, f"canary ran {canary.eager_share:.1%} of its steps eager against "
                               f"{rest.eager_share:.1%} on the rest (limit +{MAX_EAGER_SHARE_INCREASE:.0%} points)",
                       canary, rest)
    slowdown = 1 - canary.tokens_per_second_per_sequence / rest.tokens_per_second_per_sequence
    if slowdown > settings.max_slowdown:
        return Verdict(REVERT, f"canary {slowdown:.1%} slower per sequence than the rest "
                               f"(limit {settings.max_slowdown:.0%})", canary, rest)
    itl_rise = canary.itl_p99_seconds / rest.itl_p99_seconds - 1 if rest.itl_p99_seconds > 0 else 0.0
    if itl_rise > settings.max_itl_p99_increase:
        return Verdict(REVERT, f"canary ITL p99 {itl_rise:.1%} higher than the rest's "
                               f"({canary.itl_p99_seconds * 1e3:.2f} ms against {rest.itl_p99_seconds * 1e3:.2f} ms; "
                               f"limit {settings.max_itl_p99_increase:.0%})", canary, rest)
    if abs(slowdown) < 0.0005:
        speed = "as fast per sequence as the rest"
    else:
        speed = f"{abs(slowdown):.1%} {'faster' if slowdown < 0 else 'slower'} per sequence than the rest"
    return Verdict(PROMOTE, f"canary {speed}, ITL p99 {itl_rise:+.1%} "
                            f"(limits {settings.max_slowdown:.0%}, {settings.max_itl_p99_increase:.0%})",
                   canary, rest)


# --- the state machine -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """One worker as the canary sees it in a run."""

    #: READY (or SLEEPING: the graphs are kept) with the proposed set adopted (for a canary
    #: worker) and nothing pending.
    holds_proposal: bool
    counters: pb.ServingCounters | None
    graph_memory_bytes: int = 0
    #: Its capture of the proposed set failed (a canary worker).
    failed: bool = False


@dataclass(frozen=True)
class Canary:
    """The canary of one policy: Idle -> Canary(started, workers, proposed) -> Promoted | Reverted."""

    phase: str = IDLE
    workers: tuple[str, ...] = ()
    proposed: Applied = field(default_factory=Applied)
    #: The set in effect when the canary started (what the rest keep, and a revert restores).
    previous: Applied = field(default_factory=Applied)
    #: Unix seconds: proposed, window opened (0: not yet), decided (0: not yet).
    started: float = 0.0
    window_start: float = 0.0
    finished: float = 0.0
    window_seconds: int = 0
    #: Every worker's counters when the window opened, by pod key.
    baseline: Mapping[str, pb.ServingCounters] = field(default_factory=dict, compare=False)
    verdict: Verdict | None = None

    @property
    def running(self) -> bool:
        return self.phase == CANARY


def canary_workers(ready: Sequence[str], settings: CanarySettings) -> tuple[str, ...] | None:
    """The first ``settings.workers`` ready workers by name, or None when no worker would be left
    to compare them with."""
    ordered = sorted(ready)
    if len(ordered) <= settings.workers:
        return None
    return tuple(ordered[:settings.workers])


def start_canary(previous: Applied, proposed: Applied, ready: Sequence[str], settings: CanarySettings,
                 now: float) -> Canary | None:
    """A canary of ``proposed`` on the first ready workers, or None when too few are ready."""
    workers = canary_workers(ready, settings)
    if workers is None:
        return None
    return Canary(CANARY, workers, proposed, previous, started=now, window_seconds=settings.window_seconds)


def advance(canary: Canary, readings: Mapping[str, Reading], settings: CanarySettings, now: float,
            min_steps: int = MIN_WINDOW_STEPS) -> Canary:
    """The canary after one run's readings (by pod key, every owned worker): the window opens once
    every canary worker holds the proposal; at its end the verdict moves it to Promoted or
    Reverted; meanwhile ``verdict`` says how it stands."""
    if not canary.running:
        return canary
    gone = [w for w in canary.workers if w not in readings]
    failed = [w for w in canary.workers if w in readings and readings[w].failed]
    if gone or failed:
        why = (f"canary worker(s) {', '.join(failed)} failed to capture the proposed sizes" if failed
               else f"canary worker(s) {', '.join(gone)} gone before the verdict")
        return replace(canary, phase=REVERTED, finished=now, verdict=Verdict(REVERT, why))
    overdue = now - canary.started >= GIVE_UP_WINDOWS * settings.window_seconds
    if not canary.window_start:
        if overdue:
            why = (f"the canary did not hold the proposed sizes within {GIVE_UP_WINDOWS} windows "
                   f"({GIVE_UP_WINDOWS * settings.window_seconds}s)")
            return replace(canary, phase=REVERTED, finished=now, verdict=Verdict(REVERT, why))
        if all(readings[w].holds_proposal for w in canary.workers):
            baseline = {k: r.counters for k, r in readings.items() if r.counters is not None}
            return replace(canary, window_start=now, baseline=baseline,
                           verdict=Verdict(WAIT, f"window open for {settings.window_seconds}s"))
        return replace(canary, verdict=Verdict(WAIT, "waiting for the canary to capture the proposed sizes"))
    canary_windows = [window(canary.baseline.get(k), r.counters, r.graph_memory_bytes)
                      for k, r in readings.items() if k in canary.workers and r.counters is not None]
    rest_windows = [window(canary.baseline.get(k), r.counters, r.graph_memory_bytes)
                    for k, r in readings.items()
                    if k not in canary.workers and r.counters is not None and k in canary.baseline]
    verdict = compare(canary_windows, rest_windows, settings, min_steps)
    left = settings.window_seconds - (now - canary.window_start)
    if left > 0:
        return replace(canary, verdict=Verdict(WAIT, f"window ends in {left:.0f}s; so far: {verdict.reason}",
                                               verdict.canary, verdict.rest))
    if verdict.decision == PROMOTE:
        return replace(canary, phase=PROMOTED, finished=now, verdict=verdict)
    if verdict.decision == REVERT:
        return replace(canary, phase=REVERTED, finished=now, verdict=verdict)
    if overdue:
        why = f"still undecided after {GIVE_UP_WINDOWS} windows ({verdict.reason})"
        return replace(canary, phase=REVERTED, finished=now, verdict=Verdict(REVERT, why, verdict.canary, verdict.rest))
    return replace(canary, verdict=verdict)


def reverted_set(canary: Canary, now: float) -> Applied:
    """What a revert applies: the previous sizes under a sequence past the proposal's (a worker
    takes only a newer generation), stamped now, so that the interval holds the next proposal back."""
    return Applied(canary.previous.sizes, canary.proposed.sequence + 1, now, canary.proposed.mode)
