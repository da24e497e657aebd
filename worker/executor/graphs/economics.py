"""Which graphs are worth keeping: the policy's maximum number of graphs, idle release, and the
memory budget's bound, as pure decisions (no device), so each is testable anywhere.

- ``limit_plan``: at most ``max_graphs`` keys of a capture plan. The keys kept are the ones the
  observed traffic used most (the steps that would have padded to each key under the full plan),
  ties and keys no step used in ladder order, smallest size first (small decode batches are the
  latency-bound steps a graph helps most). The plan's own order (largest first, which sizes the
  shared pool) is kept; the keys left out are skipped with SIZE_OVER_MAX_GRAPHS. The padding
  ladder is not changed: a step whose padded size was left out runs eager with that reason.
- ``idle_keys``: the graphs no step replayed for ``idle_seconds``; ``IdleRelease`` holds the
  adopted policy's idle-release time and how often to look (the capture controller owns one).
- ``over_budget_drops``: which graphs to give back, most recently captured first (the smallest
  of the largest-first plan), until what stays is within the budget.
- ``compute_bound_above``: whether steps larger than every graph are compute bound (the largest
  graph measured no faster than the same step eager), so their eager steps say COMPUTE_BOUND.
- ``eager_envelope``: the eager step times by size as the decisions read them, each at most the
  time of any larger size (a slower smaller size says nothing about a larger step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping

from graphkeeper.proto.policy import padding_table
from graphkeeper.worker.executor.graphs.modes import FULL, PIECEWISE, Key

#: Seconds between two looks for idle graphs (a look is a dict scan; releasing is rare).
IDLE_CHECK_SECONDS = 1.0


def key_for_step(num_tokens: int, uniform_decode: bool, keys: Collection[Key], table: list[int]) -> Key | None:
    """The key a step of ``num_tokens`` real tokens would replay if every key in ``keys`` were
    captured (the dispatcher's choice: FULL for uniform decode, else PIECEWISE); None when none."""
    if num_tokens < 1 or num_tokens >= len(table):
        return None
    padded = table[num_tokens]
    if uniform_decode and (FULL, padded) in keys:
        return FULL, padded
    if (PIECEWISE, padded) in keys:
        return PIECEWISE, padded
    return None


def traffic_per_key(plan: Iterable[Key], ladder: list[int], traffic: Mapping[tuple[int, bool], int]) -> dict[Key, int]:
    """Steps of ``traffic`` ((real tokens, uniform decode) -> steps) each key of ``plan`` would serve."""
    keys = set(plan)
    table = padding_table(ladder)
    out = dict.fromkeys(keys, 0)
    for (tokens, uniform), steps in traffic.items():
        key = key_for_step(tokens, uniform, keys, table)
        if key is not None:
            out[key] += steps
    return out


def limit_plan(plan: list[Key], max_graphs: int, ladder: list[int],
               traffic: Mapping[tuple[int, bool], int] | None = None) -> tuple[list[Key], list[Key]]:
    """(kept, left out): at most ``max_graphs`` keys of ``plan`` (0: no limit), in plan order."""
    if max_graphs <= 0 or len(plan) <= max_graphs:
        return list(plan), []
    used = traffic_per_key(plan, ladder, traffic or {})
    position = {key: i for i, key in enumerate(plan)}
    # Most steps first; then smallest size; then the plan's order (FULL before PIECEWISE).
    ranked = sorted(plan, key=lambda k: (-used[k], k[1], position[k]))
    chosen = set(ranked[:max_graphs])
    return [k for k in plan if k in chosen], [k for k in plan if k not in chosen]


def idle_keys(last_used: Mapping[Key, float], now: float, idle_seconds: float) -> set[Key]:
    """The keys whose last replay (or capture, for one never replayed) is ``idle_seconds`` or more
    before ``now``; none when ``idle_seconds`` is 0 (never release)."""
    if idle_seconds <= 0:
        return set()
    return {key for key, last in last_used.items() if now - last >= idle_seconds}


class IdleRelease:
    """The adopted policy's idle-release time, and when the graphs were last looked at.

    A look that finds nothing is not repeated for ``check_seconds``; one that finds graphs is not
    remembered, so the caller can finish the step in flight and look again at once (a graph that
    step replayed is no longer idle).
    """

    def __init__(self, check_seconds: float = IDLE_CHECK_SECONDS) -> None:
        self.check_seconds = check_seconds
        #: The adopted policy's idle-release time (0: graphs are never released while idle).
        self.seconds = 0
        self._checked = 0.0

    def due(self, captured: Collection[Key], last_used: Callable[[], Mapping[Key, float]],
            now: float | None = None) -> set[Key]:
        """The keys of ``captured`` idle at ``now`` (time.monotonic()); ``last_used`` is read only
        when a look is due."""
        if not self.seconds or not captured:
            return set()
        now = time.monotonic() if now is None else now
        if now - self._checked < self.check_seconds:
            return set()
        found = idle_keys({k: t for k, t in last_used().items() if k in captured}, now, self.seconds)
        if not found:
            self._checked = now
        return found


def over_budget_drops(captured_order: list[tuple[Key, int]], held: int, budget: int) -> list[Key]:
    """Keys to give back so that graph memory ``held`` ends within ``budget`` (0: unlimited).

    ``captured_order`` is (key, bytes it added) in capture order; the last captured go first.
    What a key gives back is estimated by what it added (the shared pool keeps blocks others use,
    so the caller measures again after each drop and asks again).
    """
    if budget <= 0 or held <= budget:
        return []
    drops, left = [], held
    for key, cost in reversed(captured_order):
        if left <= budget:
            break
        drops.append(key)
        left -= max(cost, 0)
    return drops


#: A graph within this share of its step's eager time buys nothing measurable.
COMPUTE_BOUND_MARGIN = 0.03


def compute_bound_above(timings: Iterable[tuple[int, int, float, float]]) -> bool:
    """Whether a step larger than every captured size is compute bound: at the largest size with a
    PIECEWISE graph (the mode a step with prompt tokens replays; FULL when there is none) the
    measured replay is no faster than eager, within ``COMPUTE_BOUND_MARGIN``. ``timings`` are
    (mode, size, replay seconds, eager seconds) of the captured graphs; unmeasured ones count
    for nothing (pure)."""
    measured = [t for t in timings if t[2] > 0 and t[3] > 0]
    if not measured:
        return False
    top = max(measured, key=lambda t: (t[0] == PIECEWISE, t[1]))
    return top[3] <= top[2] * (1 + COMPUTE_BOUND_MARGIN)


def eager_envelope(points: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """(size, seconds) sorted by size, one point a size (its least time), each time lowered to the
    least time of any larger size.

    The decisions that read eager times price *larger* steps from smaller ones (the step-time
    model past the capture ceiling, a coarse graph's range). An eager step is launch bound up to
    hundreds of tokens: its GPU time, by CUDA events, includes the waits for the host's launches,
    so a host hiccup only ever lengthens it, and small sizes may take a path with more host work
    (on an H100 with a 1B model, 2-16 tokens timed 8.2-8.7 ms eager against 7.0-7.8 ms from 24 to
    512). Neither says anything about a step of more tokens, which the larger size's own timing
    bounds. Raising the larger sizes to a slower smaller one instead carried those 8.7 ms to every
    step past 512, above the stretch ceiling."""
    least: dict[int, float] = {}
    for size, secs in points:
        least[size] = min(secs, least.get(size, secs))
    out, bound = [], float("inf")
    for size in sorted(least, reverse=True):
        bound = min(bound, least[size])
        out.append((size, bound))
    return tuple(reversed(out))
