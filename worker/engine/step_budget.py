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
past the largest. Without measurements (a CPU worker records no graphs) there is no target and
every step may take the whole budget, as before.

The default target is the measured time of the largest step the worker replays of at most 512
tokens (the default capture ceiling, or the budget when that is smaller; the coarse graphs above
it, ``executor/graphs/large_steps.py``, speed up long prefill steps and never widen the target):
steps with decode rows stay as short as the graph ceiling makes them, so raising
``--max-num-batched-tokens`` speeds up prefill without lengthening any decoding row's wait.
``--itl-target-ms`` sets it instead.

Everything here is pure: the scheduler asks ``StepBudget.prefill_tokens(decode_rows)`` once a step.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import DEFAULT_MAX_CAPTURE_CEILING

if TYPE_CHECKING:
    from graphkeeper.worker.settings import EngineSettings

log = logging.getLogger(__name__)

#: Prompt tokens a step always carries while a prompt waits, whatever the target: one KV block's
#: worth, so a prompt progresses even when the decode rows alone exceed the target (no starvation).
MIN_PREFILL_TOKENS = 16


class TimedGraph(Protocol):
    """What the model reads of a captured graph (``graph_set.CapturedGraph``)."""

    mode: int
    size: int
    replay_seconds: float
    eager_seconds: float


class HeldGraphs(Protocol):
    """What the budget reads of the engine's graphs (``graph_set.GraphSet``, which imports torch)."""

    captured: Mapping[Any, TimedGraph]
    released: Mapping[Any, TimedGraph]


@dataclass(frozen=True)
class StepTimeModel:
    """Predicted GPU time of a step with decode rows and prompt tokens, from capture measurements.

    ``replay``: (captured size, seconds) for the graphs a step *with prompt tokens* replays
    (PIECEWISE; empty when the mode runs such steps eager). ``eager``: (size, seconds) of the same
    steps run eager, measured beside each replay.
    """

    replay: tuple[tuple[int, float], ...]
    eager: tuple[tuple[int, float], ...]

    @classmethod
    def from_captured(cls, captured: Iterable[TimedGraph], released: Iterable[TimedGraph] = ()) -> StepTimeModel | None:
        """The model from captured graphs' timings; None when nothing was timed. A graph released
        after sitting idle replays no more (its steps run eager) but its eager timing still holds."""
        timed = [g for g in captured if g.replay_seconds > 0 and g.eager_seconds > 0]
        gone = [g for g in released if g.eager_seconds > 0]
        if not timed and not gone:
            return None
        mixed = [g for g in timed if g.mode == pb.GRAPH_MODE_PIECEWISE]
        return cls(replay=tuple(sorted((g.size, g.replay_seconds) for g in mixed)),
                   eager=_rising(_by_size((g.size, g.eager_seconds) for g in [*timed, *gone])))

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
        return _linear(self.eager, tokens)

    def largest_within(self, target: float, limit: int) -> int:
        """The most tokens (at most ``limit``) a step may have and still be predicted within
        ``target`` seconds; 0 when even the smallest step is predicted slower."""
        best = 0
        for size, secs in self.replay:
            if size <= limit and secs <= target:
                best = max(best, size)
        start = self.ceiling + 1  # above every graph (from 1 when mixed steps never replay): eager
        if start <= limit:
            best = max(best, _solve_linear(self.eager, target, start, limit))
        return best


@dataclass(frozen=True)
class StepBudget:
    """The per-step token budget: ``tokens`` in all, prefill bounded by ``target`` seconds while
    decode rows share the step. ``target`` None: no bound (a fixed budget)."""

    tokens: int
    target: float | None = None
    model: StepTimeModel | None = None
    source: str = "a fixed budget"
    #: Where ``tokens`` came from: ``--max-num-batched-tokens`` or sized to the device (token_budget.py).
    tokens_source: str = "--max-num-batched-tokens"
    #: The most tokens a step with decode rows may have (decode rows included): precomputed.
    with_decode: int = 0

    @classmethod
    def fixed(cls, tokens: int, source: str = "a fixed budget",
              tokens_source: str = "--max-num-batched-tokens") -> StepBudget:
        return cls(tokens=tokens, source=source, with_decode=tokens, tokens_source=tokens_source)

    @classmethod
    def for_target(cls, tokens: int, target: float, model: StepTimeModel, source: str,
                   tokens_source: str = "--max-num-batched-tokens") -> StepBudget:
        return cls(tokens=tokens, target=target, model=model, source=source,
                   with_decode=model.largest_within(target, tokens), tokens_source=tokens_source)

    def prefill_tokens(self, decode_rows: int) -> int:
        """Prompt tokens the next step may carry beside ``decode_rows`` decode rows."""
        room = self.tokens - decode_rows
        if decode_rows == 0 or self.target is None:
            return room
        return max(min(room, self.with_decode - decode_rows), min(room, MIN_PREFILL_TOKENS))

    def describe(self) -> str:
        """One line for the log: the budget, the target and where it came from."""
        if self.target is None:
            return f"{self.tokens} tokens a step ({self.tokens_source}; {self.source})"
        return (f"{self.tokens} tokens a step with no decode row ({self.tokens_source}); with decode rows at most "
                f"{self.with_decode} (inter-token target {self.target * 1e3:.2f} ms, {self.source})")

    def to_proto(self) -> pb.StepBudgetStatus:
        return pb.StepBudgetStatus(tokens=self.tokens, tokens_with_decode=self.with_decode,
                                   itl_target_seconds=self.target or 0.0, source=self.source,
                                   tokens_source=self.tokens_source)


def plan_step_budget(tokens: int, itl_target_ms: float, captured: Iterable[TimedGraph], device: str,
                     released: Iterable[TimedGraph] = (),
                     tokens_source: str = "--max-num-batched-tokens") -> StepBudget:
    """The budget a worker runs with once its graphs are captured (and again after a recapture,
    or after idle graphs were released: the steps they served run eager now).

    The derived target is the time of the largest replayed step of at most
    ``DEFAULT_MAX_CAPTURE_CEILING`` tokens: the coarse graphs above it (1,024 to 8,192 tokens,
    ``large_steps.py``) make long prefill steps cheaper, never the bound on a step decode rows wait for."""
    model = StepTimeModel.from_captured(captured, released)
    if model is None:
        return StepBudget.fixed(tokens, f"no step times measured (no graphs recorded on {device})", tokens_source)
    if itl_target_ms > 0:
        return StepBudget.for_target(tokens, itl_target_ms / 1e3, model, "--itl-target-ms", tokens_source)
    ceiling = DEFAULT_MAX_CAPTURE_CEILING
    timed = model.ceiling_within(ceiling) or max((s for s, _ in model.eager if s <= ceiling), default=model.eager[0][0])
    largest = min(timed, tokens)
    target = model.seconds(largest)
    return StepBudget.for_target(tokens, target, model,
                                 f"derived: a {largest}-token step measured at {target * 1e3:.2f} ms at capture",
                                 tokens_source)


def install_step_budget(settings: EngineSettings, graphs: HeldGraphs | None, device: str,
                        kept: StepBudget | None = None) -> StepBudget:
    """``plan_step_budget`` for the graphs the engine holds, logged: the engine's call after every
    capture phase (a recapture measures new step times and derives the target again) and after
    idle graphs were released (``kept``: the budget in force, whose target stays; only what a step
    is predicted to cost changes, since the released graphs' steps run eager)."""
    captured = graphs.captured.values() if graphs else ()
    released = graphs.released.values() if graphs else ()
    budget = plan_step_budget(settings.max_num_batched_tokens, settings.itl_target_ms, captured, device, released,
                              settings.max_num_batched_tokens_source)
    if kept is not None and kept.target is not None and budget.model is not None:
        budget = StepBudget.for_target(budget.tokens, kept.target, budget.model,
                                       f"{kept.source}; graphs released since", budget.tokens_source)
    log.info("step budget: %s", budget.describe())
    return budget


def _by_size(points: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    """One point per size (the least time: graphs of two modes may time the same eager step)."""
    out: dict[int, float] = {}
    for size, secs in points:
        out[size] = min(secs, out.get(size, secs))
    return list(out.items())


def _rising(points: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """Sorted by size, each time at least the one before (timing noise never makes a larger eager
    step predicted faster: the line stays non-decreasing, which ``_solve_linear`` relies on)."""
    out, most = [], 0.0
    for size, secs in sorted(points):
        most = max(most, secs)
        out.append((size, most))
    return tuple(out)


def _linear(points: tuple[tuple[int, float], ...], x: int) -> float:
    """Piecewise-linear through ``points``, extended past both ends by the nearest segment's slope
    (never falling: a larger step is never predicted faster)."""
    if len(points) == 1:
        size, secs = points[0]
        return secs * x / size
    sizes = [s for s, _ in points]
    i = min(max(bisect_left(sizes, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 + slope * (x - x0), 0.0)


def _solve_linear(points: tuple[tuple[int, float], ...], target: float, low: int, high: int) -> int:
    """The largest ``x`` in [low, high] with ``_linear(points, x) <= target`` (0 if none); binary
    search, as the line is non-decreasing past the measured range."""
    if _linear(points, low) > target:
        return 0
    lo, hi = low, high
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _linear(points, mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo
