"""How many prompt tokens a step may carry: decode rows first, then prefill sized to a latency target.

A step that carries decode rows delays every one of those rows' next token by its whole duration,
so the prefill it carries is what sets inter-token latency. A fixed token budget either starves
prefill (small budget: a long prompt waits many steps for its first token) or stalls decode rows
behind thousands of prompt tokens (large budget). Here the budget is chosen per step (the idea of
Sarathi-Serve's stall-free batching): a step with decode rows carries prefill only up to the size
whose *measured* step time stays within the target; a step with no decode row carries the whole
budget, since nobody waits on it between tokens.

The step-time model comes from what the worker measured at capture (``CapturedGraph``: replay and
eager GPU time of a step at each captured size), never from constants: a step of ``t`` tokens that
replays costs the replay time of the captured size it pads to; a step above every captured size
runs eager and costs the eager time, interpolated between measured sizes and extrapolated linearly
past the largest (at least as steeply as a token adds to a replay). Eager timings are read from
below (``eager_envelope``): a launch-bound eager step's time is inflated by any host hiccup, and
one slow small size must not price every larger step above it. Without measurements
(a CPU worker records no graphs) there is no target and every step may take the whole budget, as
before.

The default target is the measured time of the largest step the worker replays of at most 512
tokens (the default capture ceiling, or the budget when that is smaller; the coarse graphs above
it, ``executor/graphs/large_steps.py``, speed up long prefill steps and never widen the target):
steps with decode rows stay as short as the graph ceiling makes them, so raising
``--max-num-batched-tokens`` speeds up prefill without lengthening any decoding row's wait.
``--itl-target-ms`` sets it instead.

A target tight enough for decode rows can starve prefill under load: with 64 streams there is
almost always a decode row, so nearly every step is held to the target and a long prompt waits for
its first token behind many short steps. The *TTFT guard* stretches a step only for such a prompt:
once the oldest prompt still waiting for its first token (queued, or mid-prefill) has waited
``ttft_target`` seconds, a step with decode rows may carry prefill up to the largest step predicted
within the stretch ceiling ``itl_max`` (never less than the normal bound), and no further than the
late prompts need (the prefill up to the last admitted late one, ``Scheduler.late_prefill``), so a
late short prompt lengthens its step by its own tokens only. Decode rows then wait at most
``itl_max`` for a token, and only while a prompt is late; short-prompt traffic served within the
TTFT target never stretches. A stretched step stops at the largest graph within the ceiling when
one lies above the normal bound, and runs eager past every graph only when none does (``_stretch``:
a replay's price holds under load, an eager step's does not). Defaults, from the measured target
T: ``itl_max`` = 2.5 x T (the ~12 ms the latency acceptance allows over the ~4.8 ms ceiling step on
an H200) and ``ttft_target`` = 10 x T (a prompt is stretched for only once it has waited about ten
steps). ``--itl-max-ms`` and ``--ttft-target-ms`` set them instead. Without measurements there is
no target and no guard.

Everything here is pure: the scheduler asks ``StepBudget.prefill_tokens(decode_rows, waited)`` once a
step, with how long the oldest prompt has waited for its first token.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import DEFAULT_MAX_CAPTURE_CEILING
from graphkeeper.worker.executor.graphs.economics import eager_envelope

if TYPE_CHECKING:
    from graphkeeper.worker.settings import EngineSettings

log = logging.getLogger(__name__)

#: Prompt tokens a step always carries while a prompt waits, whatever the target: one KV block's
#: worth, so a prompt progresses even when the decode rows alone exceed the target (no starvation).
MIN_PREFILL_TOKENS = 16

#: The derived stretch ceiling, in units of the inter-token target: 2.5 x a ~4.8 ms target is the
#: 12 ms inter-token bound the long-prompt acceptance allows.
ITL_MAX_FACTOR = 2.5
#: The derived TTFT target, in units of the inter-token target: a prompt is stretched for once it has
#: waited about ten steps at the target, so short prompts, answered within a few steps, never are.
TTFT_TARGET_FACTOR = 10.0


class TimedGraph(Protocol):
    """What the model reads of a captured graph (``graph_set.CapturedGraph``)."""

    mode: int
    size: int
    replay_seconds: float
    eager_seconds: float


class HeldGraphs(Protocol):
    """What the budget reads of the engine's graphs (``graph_set.GraphSet``, which imports torch)."""

    captured: Mapping[Any, TimedGraph]
    eager_seconds: Mapping[int, float]


@dataclass(frozen=True)
class StepTimeModel:
    """Predicted GPU time of a step with decode rows and prompt tokens, from capture measurements.

    ``replay``: (captured size, seconds) for the graphs a step *with prompt tokens* replays
    (PIECEWISE; empty when the mode runs such steps eager). ``eager``: (size, seconds) of the same
    steps run eager, measured at capture, as ``eager_envelope`` reads them (a size's time at most
    that of any larger size), including sizes whose graphs were given back: a coarse size found
    compute bound is the measured price of the long prefill steps that now run eager.
    """

    replay: tuple[tuple[int, float], ...]
    eager: tuple[tuple[int, float], ...]
    #: Seconds a token adds past the largest eager timing, at least: what a token adds to a replay
    #: across the measured sizes (the GPU's work per token). An eager step is launch bound up to
    #: hundreds of tokens, so its measured line can be flat at its end and says nothing of how the
    #: work grows past it; without this a flat end would price a step of any size at its last time.
    tail_slope: float = 0.0

    @classmethod
    def from_captured(cls, captured: Iterable[TimedGraph], eager: Mapping[int, float] | None = None,
                      ) -> StepTimeModel | None:
        """The model from captured graphs' timings; None when nothing was timed. ``eager`` adds
        eager times by size (``GraphSet.eager_seconds``, every validated size's: it keeps those of
        graphs released idle or given back as compute bound, which replay no more but whose eager
        timing still holds)."""
        timed = [g for g in captured if g.replay_seconds > 0 and g.eager_seconds > 0]
        # The steps priced are steps with prompt tokens: the PIECEWISE keys' timings (their probe is
        # such a step; a FULL key's is a decode step), or every key's when the mode has none.
        priced = [g for g in timed if g.mode == pb.GRAPH_MODE_PIECEWISE] or timed
        points = [(g.size, g.eager_seconds) for g in priced]
        points += [(size, secs) for size, secs in (eager or {}).items() if secs > 0]
        if not points:
            return None
        mixed = tuple(sorted((g.size, g.replay_seconds) for g in priced if g.mode == pb.GRAPH_MODE_PIECEWISE))
        line = mixed or tuple(sorted((g.size, g.replay_seconds) for g in timed))
        return cls(replay=mixed, eager=eager_envelope(points), tail_slope=_rising_slope(line))

    @property
    def ceiling(self) -> int:
        """The largest step with prompt tokens that replays a graph (0: every such step is eager)."""
        return self.replay[-1][0] if self.replay else 0

    def ceiling_within(self, most: int) -> int:
        """The largest replayed size of at most ``most`` tokens (0: none)."""
        return max((size for size, _ in self.replay if size <= most), default=0)

    def seconds(self, tokens: int) -> float:
        """Time of a step of ``tokens`` tokens (decode rows and prompt tokens together)."""
        sizes = [s for s, _ in self.replay]
        i = bisect_left(sizes, tokens)
        if i < len(sizes):
            return self.replay[i][1]  # padded up to the captured size: the padding is paid for
        return _linear(self.eager, tokens, self.tail_slope)

    def largest_replayed_within(self, target: float, limit: int) -> int:
        """The largest replayed size of at most ``limit`` tokens predicted within ``target`` seconds
        (0: none)."""
        return max((size for size, secs in self.replay if size <= limit and secs <= target), default=0)

    def largest_within(self, target: float, limit: int) -> int:
        """The most tokens (at most ``limit``) a step may have and still be predicted within
        ``target`` seconds; 0 when even the smallest step is predicted slower."""
        best = self.largest_replayed_within(target, limit)
        start = self.ceiling + 1  # above every graph (from 1 when mixed steps never replay): eager
        if start <= limit:
            best = max(best, _solve_linear(self.eager, target, start, limit, self.tail_slope))
        return best


@dataclass(frozen=True)
class TTFTGuard:
    """When a step with decode rows may stretch past the target: ``ttft_target`` seconds after the
    oldest prompt waiting for its first token arrived, up to ``itl_max`` seconds a step."""

    itl_max: float
    ttft_target: float
    #: Where the two came from: the flags, or derived from the target (multiples stated).
    source: str

    @classmethod
    def plan(cls, target: float, itl_max_ms: float = 0.0, ttft_target_ms: float = 0.0) -> TTFTGuard:
        """The guard for inter-token target ``target`` (seconds): each value from its flag when set
        (milliseconds, > 0), else the stated multiple of the target."""
        parts = []
        if itl_max_ms > 0:
            itl_max, came = itl_max_ms / 1e3, "--itl-max-ms"
        else:
            itl_max, came = ITL_MAX_FACTOR * target, f"{ITL_MAX_FACTOR:g} x the target"
        parts.append(f"stretch ceiling: {came}")
        if ttft_target_ms > 0:
            ttft, came = ttft_target_ms / 1e3, "--ttft-target-ms"
        else:
            ttft, came = TTFT_TARGET_FACTOR * target, f"{TTFT_TARGET_FACTOR:g} x the target"
        parts.append(f"TTFT target: {came}")
        return cls(itl_max=itl_max, ttft_target=ttft, source="; ".join(parts))


@dataclass(frozen=True)
class StepBudget:
    """The per-step token budget: ``tokens`` in all, prefill bounded by ``target`` seconds while
    decode rows share the step, stretched to ``guard.itl_max`` while a prompt has waited past
    ``guard.ttft_target`` for its first token. ``target`` None: no bound (a fixed budget), no guard."""

    tokens: int
    target: float | None = None
    model: StepTimeModel | None = None
    source: str = "a fixed budget"
    #: Where ``tokens`` came from: ``--max-num-batched-tokens`` or sized to the device (token_budget.py).
    tokens_source: str = "--max-num-batched-tokens"
    #: The most tokens a step with decode rows may have (decode rows included): precomputed.
    with_decode: int = 0
    guard: TTFTGuard | None = None
    #: The most tokens a stretched step with decode rows may have (at least ``with_decode``).
    stretched: int = 0

    @classmethod
    def fixed(cls, tokens: int, source: str = "a fixed budget",
              tokens_source: str = "--max-num-batched-tokens") -> StepBudget:
        return cls(tokens=tokens, source=source, with_decode=tokens, tokens_source=tokens_source, stretched=tokens)

    @classmethod
    def for_target(cls, tokens: int, target: float, model: StepTimeModel, source: str,
                   tokens_source: str = "--max-num-batched-tokens", guard: TTFTGuard | None = None) -> StepBudget:
        with_decode = model.largest_within(target, tokens)
        stretched = max(with_decode, _stretch(model, guard.itl_max, tokens, with_decode)) if guard else with_decode
        return cls(tokens=tokens, target=target, model=model, source=source, with_decode=with_decode,
                   tokens_source=tokens_source, guard=guard, stretched=stretched)

    @property
    def ttft_target(self) -> float | None:
        """How long a prompt may wait for its first token before steps stretch (None: no guard)."""
        return self.guard.ttft_target if self.guard and self.target is not None else None

    @property
    def decode_wait(self) -> float | None:
        """The longest a step with decode rows is meant to take, so the longest a decoding row waits
        for its next token: the stretch ceiling, or the target without a guard (None: no target)."""
        if self.target is None:
            return None
        return self.guard.itl_max if self.guard is not None else self.target

    @property
    def can_stretch(self) -> bool:
        """Whether any wait would stretch a step: a guard, and a stretched bound above the normal one
        (the scheduler looks up how long a prompt has waited only then)."""
        return self.ttft_target is not None and self.stretched > self.with_decode

    def stretches(self, waited: float) -> bool:
        """Whether a step with decode rows stretches, the oldest prompt having waited ``waited`` s."""
        return self.can_stretch and waited >= self.ttft_target

    def prefill_tokens(self, decode_rows: int, waited: float = 0.0, late: int | None = None) -> int:
        """Prompt tokens the next step may carry beside ``decode_rows`` decode rows, the oldest prompt
        still waiting for its first token having waited ``waited`` seconds (0: none waits).

        A stretched step grows only as far as the late prompts need: ``late`` is the prefill, in
        the order it is served, up to and including the last admitted prompt past the TTFT target
        (None: not known, the whole stretch). A short late prompt in short-prompt traffic then
        lengthens its step by its own tokens, not to the ceiling; long late prompts take it all."""
        room = self.tokens - decode_rows
        if decode_rows == 0 or self.target is None:
            return room
        bound = self.with_decode
        if self.stretches(waited):
            need = self.stretched if late is None else decode_rows + late
            bound = min(self.stretched, max(self.with_decode, need))
        return max(min(room, bound - decode_rows), min(room, MIN_PREFILL_TOKENS))

    def describe(self) -> str:
        """One line for the log: the budget, the target, the guard and where they came from."""
        if self.target is None:
            return f"{self.tokens} tokens a step ({self.tokens_source}; {self.source})"
        line = (f"{self.tokens} tokens a step with no decode row ({self.tokens_source}); with decode rows at most "
                f"{self.with_decode} (inter-token target {self.target * 1e3:.2f} ms, {self.source})")
        if self.guard is not None:
            line += (f"; at most {self.stretched} once a prompt has waited {self.guard.ttft_target * 1e3:.2f} ms "
                     f"for its first token (stretch ceiling {self.guard.itl_max * 1e3:.2f} ms; {self.guard.source})")
        return line

    def to_proto(self) -> pb.StepBudgetStatus:
        guard = self.guard if self.target is not None else None
        return pb.StepBudgetStatus(tokens=self.tokens, tokens_with_decode=self.with_decode,
                                   itl_target_seconds=self.target or 0.0, source=self.source,
                                   tokens_source=self.tokens_source,
                                   itl_max_seconds=guard.itl_max if guard else 0.0,
                                   ttft_target_seconds=guard.ttft_target if guard else 0.0,
                                   tokens_stretched=self.stretched if guard else self.with_decode,
                                   guard_source=guard.source if guard else "")


def _stretch(model: StepTimeModel, itl_max: float, tokens: int, with_decode: int) -> int:
    """The most tokens a stretched step with decode rows may carry: the largest captured size within
    ``itl_max`` when one lies above the normal bound, else the largest step the model predicts
    within it, eager past every graph.

    Graphs first, because a replay's price holds under load and an eager step's does not: eager
    timings are taken at capture, on short synthetic steps and a quiet host, while under load an
    eager step is launch bound beside the worker's other threads. Measured on an H100 (llama-1b,
    64 long-prompt streams): a 1,084-token step, one past the 1,024-token graph and priced at the
    6.48 ms ceiling, took 13.35 ms, 12.13 of them the host launching it (ITL p99 17.45 ms); stopping
    at the graph, ITL p99 read 10.74 ms. With no graph above the normal bound (coarse graphs given back as compute
    bound) the eager line is all there is, and a late prompt still gets its stretch."""
    graphed = model.largest_replayed_within(itl_max, tokens)
    return graphed if graphed > with_decode else model.largest_within(itl_max, tokens)


def plan_step_budget(tokens: int, itl_target_ms: float, captured: Iterable[TimedGraph], device: str,
                     tokens_source: str = "--max-num-batched-tokens", itl_max_ms: float = 0.0,
                     ttft_target_ms: float = 0.0, eager: Mapping[int, float] | None = None) -> StepBudget:
    """The budget a worker runs with once its graphs are captured (and again after a recapture,
    or after idle graphs were released: the steps they served run eager now).

    The derived target is the time of the largest replayed step of at most
    ``DEFAULT_MAX_CAPTURE_CEILING`` tokens: the coarse graphs above it (1,024 to 8,192 tokens,
    ``large_steps.py``) make long prefill steps cheaper, never the bound on a step decode rows wait for.
    The TTFT guard's stretch ceiling and TTFT target are ``itl_max_ms`` and ``ttft_target_ms`` when
    set (> 0), else multiples of the target (``TTFTGuard.plan``)."""
    model = StepTimeModel.from_captured(captured, eager)
    if model is None:
        return StepBudget.fixed(tokens, f"no step times measured (no graphs recorded on {device})", tokens_source)
    if itl_target_ms > 0:
        target, source = itl_target_ms / 1e3, "--itl-target-ms"
    else:
        ceiling = DEFAULT_MAX_CAPTURE_CEILING
        timed = model.ceiling_within(ceiling) or max((s for s, _ in model.eager if s <= ceiling),
                                                     default=model.eager[0][0])
        largest = min(timed, tokens)
        target = model.seconds(largest)
        source = f"derived: a {largest}-token step measured at {target * 1e3:.2f} ms at capture"
    guard = TTFTGuard.plan(target, itl_max_ms, ttft_target_ms)
    return StepBudget.for_target(tokens, target, model, source, tokens_source, guard)


def install_step_budget(settings: EngineSettings, graphs: HeldGraphs | None, device: str,
                        kept: StepBudget | None = None) -> StepBudget:
    """``plan_step_budget`` for the graphs the engine holds, logged: the engine's call after every
    capture phase (a recapture measures new step times and derives the target again) and after
    idle graphs were released (``kept``: the budget in force, whose target and TTFT guard stay;
    only what a step is predicted to cost changes, since the released graphs' steps run eager)."""
    captured = graphs.captured.values() if graphs else ()
    budget = plan_step_budget(settings.max_num_batched_tokens, settings.itl_target_ms, captured, device,
                              settings.max_num_batched_tokens_source, settings.itl_max_ms, settings.ttft_target_ms,
                              graphs.eager_seconds if graphs else None)
    if kept is not None and kept.target is not None and budget.model is not None:
        budget = StepBudget.for_target(budget.tokens, kept.target, budget.model,
                                       f"{kept.source}; graphs released since", budget.tokens_source, kept.guard)
    log.info("step budget: %s", budget.describe())
    return budget


def _rising_slope(line: tuple[tuple[int, float], ...]) -> float:
    """Seconds per token from the first to the last of ``line``'s (size, seconds) points, sorted by
    size (0 with fewer than two sizes, or a falling line)."""
    if len(line) < 2 or line[-1][0] <= line[0][0]:
        return 0.0
    return max((line[-1][1] - line[0][1]) / (line[-1][0] - line[0][0]), 0.0)


def _linear(points: tuple[tuple[int, float], ...], x: int, tail_slope: float = 0.0) -> float:
    """Piecewise-linear through ``points``, extended past both ends by the nearest segment's slope,
    past the last point by at least ``tail_slope`` (never falling: a larger step is never predicted
    faster)."""
    if len(points) == 1:
        size, secs = points[0]
        return secs * x / size
    sizes = [s for s, _ in points]
    i = min(max(bisect_left(sizes, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    if x > x1:
        return y1 + max(slope, tail_slope) * (x - x1)
    return max(y0 + slope * (x - x0), 0.0)


def _solve_linear(points: tuple[tuple[int, float], ...], target: float, low: int, high: int,
                  tail_slope: float = 0.0) -> int:
    """The largest ``x`` in [low, high] with ``_linear(points, x, tail_slope) <= target`` (0 if
    none); binary search, as the line is non-decreasing past the measured range."""
    if _linear(points, low, tail_slope) > target:
        return 0
    lo, hi = low, high
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _linear(points, mid, tail_slope) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo
