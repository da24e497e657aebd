"""Graphs for large steps: coarse PIECEWISE sizes above the default capture ceiling, kept only where
a measurement says they pay.

The default ladder stops at 512 tokens (vLLM's ceiling): past it a step's matmuls are long enough
to hide the kernel launches a graph removes, and each size costs capture time and pool memory. But
with a budget sized to a large GPU (8,192 tokens, ``engine/token_budget.py``) prefill steps of
thousands of tokens are common, and whether they are compute bound depends on the model and the
device. So when the budget exceeds the ceiling and the policy leaves the ceiling to the worker,
the plan adds a few coarse sizes, doubling from 1,024 up to the budget (and the budget itself),
PIECEWISE only (decode batches never get that large); each is captured, validated and timed like
every graph (``CaptureJob``), and the phase keeps it only if it pays.

What a coarse graph of size ``s`` pays is judged on the steps it serves: every step of more
tokens than the ladder size below it (``p``) and at most ``s`` pads up to ``s``. Replaying costs
``replay(s)`` for each of them; running them eager costs between ``eager(p)`` and ``eager(s)``,
on average their mean (steps spread over the range; the eager times as ``eager_envelope`` reads
them, so a smaller size's inflated timing does not make the graph look better than it is). The
graph is kept when that average beats the replay by more than ``COMPUTE_BOUND_MARGIN`` (3%);
otherwise it is released at the end of the phase and its steps run eager, labelled
``compute_bound`` (the dispatcher reads the size's skip reason, its one decision point). Judging
on ``eager(s)`` alone would keep graphs that make the short end of their range slower: a
1,100-token step padded to 2,048 pays twice the work to save launches.

Everything here is pure: which sizes are planned for a budget, which are kept given the timings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_has_piecewise
from graphkeeper.proto.policy import DEFAULT_MAX_CAPTURE_CEILING, MAX_CAPTURE_SIZE_LIMIT
from graphkeeper.worker.executor.graphs.economics import COMPUTE_BOUND_MARGIN, eager_envelope


def coarse_sizes(budget: int, ceiling: int = DEFAULT_MAX_CAPTURE_CEILING,
                 limit: int = MAX_CAPTURE_SIZE_LIMIT) -> list[int]:
    """The coarse sizes above ``ceiling`` for a token budget: 2x, 4x, ... the ceiling below the
    budget, then the budget itself (so every step the budget allows pads to one), none past
    ``limit`` (the largest size a policy may name). Empty when the budget is within the ceiling."""
    top = min(budget, limit)
    sizes, size = [], 2 * ceiling
    while size < top:
        sizes.append(size)
        size *= 2
    return [*sizes, top] if top > ceiling else []


def planned_coarse_sizes(sizes: pb.CaptureSizes, effective_mode: int, budget: int) -> list[int]:
    """The coarse sizes a policy's capture sizes get on a worker with this budget: only a ladder
    whose ceiling the policy left to the worker (no ``max_capture_size``, no explicit list: those
    say exactly what to capture) and a mode with PIECEWISE graphs (the mode mixed and prefill steps
    replay)."""
    if sizes.max_capture_size or sizes.WhichOneof("sizes") == "explicit" or not mode_has_piecewise(effective_mode):
        return []
    return coarse_sizes(budget)


@dataclass(frozen=True)
class Verdict:
    """What a coarse graph buys: the replay against the eager steps it serves, and whether it stays."""

    size: int
    replay_seconds: float
    eager_seconds: float  # the mean eager time of the steps it serves
    kept: bool

    def message(self) -> str:
        verb = "beats" if self.kept else "does not beat"
        return (f"replaying {self.size} tokens ({self.replay_seconds * 1e3:.3f} ms) {verb} the steps it serves "
                f"run eager ({self.eager_seconds * 1e3:.3f} ms on average) by {COMPUTE_BOUND_MARGIN:.0%}")


def size_below(size: int, ladder: list[int]) -> int:
    """The ladder size just below ``size`` (0: none), where the steps a coarse graph serves start
    (pure)."""
    return max((s for s in ladder if s < size), default=0)


def judged_sizes(coarse: list[int], ladder: list[int]) -> frozenset[int]:
    """The sizes whose eager times a verdict reads (pure): each coarse size and the ladder size
    below it (``judge_coarse``)."""
    return frozenset(set(coarse) | ({size_below(size, ladder) for size in coarse} - {0}))


def judge_coarse(coarse: list[int], ladder: list[int], replay: Mapping[int, float],
                 eager: Mapping[int, float]) -> list[Verdict]:
    """A verdict for each coarse size that was captured and timed (``replay`` and ``eager``: GPU
    seconds by size, as measured at capture); ``ladder`` is the whole padding ladder, coarse sizes
    included. A size without a timing (its capture failed or went over the memory budget) already
    has its reason and gets no verdict."""
    verdicts = []
    timed = dict(eager_envelope((size, secs) for size, secs in eager.items() if secs > 0))
    for size in coarse:
        if replay.get(size, 0) <= 0 or size not in timed:
            continue
        below = size_below(size, ladder)
        served = (timed[below] + timed[size]) / 2 if below in timed else timed[size]
        verdicts.append(Verdict(size, replay[size], served, served > replay[size] * (1 + COMPUTE_BOUND_MARGIN)))
    return verdicts
