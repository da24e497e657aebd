"""Capture sizes chosen from observed traffic: a pure, exact selection (the operator and the sweep share it).

Workers count the shapes of the steps they run (``GraphStatus.traffic``: real tokens per step,
decode-only or mixed). Given that histogram, a graph mode, the largest size a policy may capture
and a limit (at most ``max_graphs`` graphs and/or a memory budget), ``choose_sizes`` picks the
sizes that minimise the expected step time over the histogram:

- a step of ``t`` real tokens that a chosen size ``s >= t`` serves replays a graph of size ``s``
  (it computes ``s - t`` padded tokens);
- a step above the largest chosen size, above ``max_capture_size``, or that the mode does not
  serve (mixed steps under ``FULL``/``FULL_DECODE_ONLY``) runs eager, which costs more than a
  replay.

Step times come from the workers' own measurements when they report them (``CapturedSize``'s
``replay_seconds`` and ``eager_seconds``, interpolated linearly between measured sizes). Without
them the documented default model is used, in token units: a replay of size ``s`` costs
``DEFAULT_FIXED_TOKENS + s`` (a step has a fixed part, the weights read once, whatever its
size: why padding a decode step of 1 to 8 costs little), and an eager step of ``t`` tokens costs
``DEFAULT_EAGER_RATIO`` times the replay of ``t`` (launch overhead and host work).

The optimum is exact, by dynamic programming over the sorted distinct token counts (a classic
one-dimensional k-bucket problem: an optimal size is always an observed token count, the largest
of the steps it serves). With a memory budget, the search counts memory in units: exact ones when
the budget and every size's estimate share a divisor that leaves at most ``BUDGET_UNITS`` of them,
else 1/``BUDGET_UNITS`` of the budget with each size's memory rounded up, so the chosen set always
fits the budget and is optimal among the sets that fit it so rounded.
Histograms with more than ``MAX_CANDIDATES`` distinct token counts are first coarsened onto a grid
(token counts rounded up to a multiple of ``grid``), which the result states.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_has_full, mode_has_graphs, mode_has_piecewise
from graphkeeper.proto.policy import default_ladder

#: Default step-time model (token units), used for a kind of step no worker measured.
DEFAULT_FIXED_TOKENS = 64.0
DEFAULT_EAGER_RATIO = 2.0
#: Default per-graph memory and capture time when no worker reported a captured size:
#: 62 graphs of llama-1b at token budget 512 took 228 MiB and 2.3 s on an H200.
DEFAULT_GRAPH_BYTES = 4 * 2**20
DEFAULT_GRAPH_CAPTURE_SECONDS = 0.04
#: Distinct token counts the exact search considers; above this the histogram is coarsened.
MAX_CANDIDATES = 128
#: The memory budget is divided into this many units for the exact search.
BUDGET_UNITS = 512


# --- the traffic -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Steps by real token count, decode-only and mixed apart (a merged ``StepHistogram``)."""

    decode: Mapping[int, int] = field(default_factory=dict)
    mixed: Mapping[int, int] = field(default_factory=dict)
    #: Steps counted but not binned (the workers' tables were full): they count as eager.
    overflow: int = 0
    #: Histograms merged, and the oldest start of counting among them (Unix seconds; 0 unknown).
    workers: int = 0
    since: float = 0.0

    @property
    def steps(self) -> int:
        return sum(self.decode.values()) + sum(self.mixed.values()) + self.overflow


def merge_histograms(histograms: Iterable[pb.StepHistogram]) -> Traffic:
    """The workers' histograms added up (shapes of equal token count and kind merge; ``num_seqs``
    does not matter to padding)."""
    decode: dict[int, int] = {}
    mixed: dict[int, int] = {}
    overflow = workers = 0
    since = 0.0
    for h in histograms:
        workers += 1
        overflow += max(0, h.overflow_steps)
        if h.since_unix_seconds > 0:
            since = h.since_unix_seconds if since == 0 else min(since, h.since_unix_seconds)
        for shape in h.shapes:
            if shape.num_tokens < 1 or shape.steps < 1:
                continue
            out = decode if shape.uniform_decode else mixed
            out[shape.num_tokens] = out.get(shape.num_tokens, 0) + shape.steps
    return Traffic(decode, mixed, overflow, workers, since)


# --- what a graph costs and what a step takes -------------------------------------------------


def _interpolate(points: Mapping[int, float], x: float) -> float | None:
    """Piecewise-linear through ``points`` (size -> value); flat beyond the ends."""
    if not points:
        return None
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    i = bisect_left(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _mean_by_size(values: Iterable[tuple[int, float]]) -> dict[int, float]:
    sums: dict[int, list[float]] = {}
    for size, value in values:
        sums.setdefault(size, []).append(value)
    return {s: sum(v) / len(v) for s, v in sums.items()}


@dataclass(frozen=True)
class Measurements:
    """What workers measured of the graphs they captured, by runtime mode (FULL, PIECEWISE) and
    size, averaged over workers. Empty: the defaults are used."""

    graph_bytes: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    capture_seconds: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    replay_seconds: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    eager_seconds: Mapping[int, Mapping[int, float]] = field(default_factory=dict)

    @property
    def timed(self) -> bool:
        return any(self.replay_seconds.values()) and any(self.eager_seconds.values())


def measurements_from(captured: Iterable[pb.CapturedSize]) -> Measurements:
    """Averages the workers' ``CapturedSize`` entries by (runtime mode, size); zeros are not
    measurements (a graph released while idle keeps its numbers)."""
    entries = list(captured)

    def table(attr: str) -> dict[int, dict[int, float]]:
        out: dict[int, dict[int, float]] = {}
        for mode in (pb.GRAPH_MODE_FULL, pb.GRAPH_MODE_PIECEWISE):
            got = _mean_by_size((c.size, float(getattr(c, attr))) for c in entries
                                if c.mode == mode and getattr(c, attr) > 0)
            if got:
                out[mode] = got
        return out

    return Measurements(table("device_bytes"), table("capture_seconds"), table("replay_seconds"),
                        table("eager_seconds"))


def runtime_modes(mode: int) -> list[int]:
    """The runtime modes a policy mode records for every size (FULL graphs are recorded for the
    sizes decode steps pad to; counted for every size, so estimates never fall short)."""
    out = []
    if mode_has_full(mode):
        out.append(pb.GRAPH_MODE_FULL)
    if mode_has_piecewise(mode):
        out.append(pb.GRAPH_MODE_PIECEWISE)
    return out


def graph_keys(sizes: Sequence[int], mode: int, full_limit: int) -> list[tuple[int, int]]:
    """The (runtime mode, size) graphs a worker records for ``sizes``, as its capture plan does:
    PIECEWISE for every size, FULL only for the sizes uniform decode steps of up to ``full_limit``
    rows pad to (a size whose predecessor in the set is below the limit). A size above every
    decode step's padded size costs one graph under FULL_AND_PIECEWISE, not two."""
    keys = []
    prev = 0
    for size in sorted(set(sizes)):
        if mode_has_full(mode) and prev < full_limit:
            keys.append((pb.GRAPH_MODE_FULL, size))
        if mode_has_piecewise(mode):
            keys.append((pb.GRAPH_MODE_PIECEWISE, size))
        prev = size
    return keys


def decode_rows_limit(traffic: Traffic, full_limit: int = 0) -> int:
    """The most rows a uniform decode step has: the workers' ``max_num_seqs`` when known, else the
    largest decode step observed (at least 1: the smallest size always serves decode steps)."""
    return full_limit or max(traffic.decode, default=1)


@dataclass(frozen=True)
class CostModel:
    """Per-size memory and capture time, and per-step replay and eager time, for one mode."""

    mode: int
    measured: Measurements = field(default_factory=Measurements)

    @staticmethod
    def _one(table: Mapping[int, Mapping[int, float]], runtime: int, size: int, default: float) -> float:
        value = _interpolate(table.get(runtime, {}), size)
        if value is None:  # this runtime mode unmeasured: the other's figure, else the default
            others = [v for t in table.values() for v in [_interpolate(t, size)] if v is not None]
            value = max(others) if others else default
        return value

    def key_bytes(self, runtime: int, size: int) -> int:
        """Graph memory of one (runtime mode, size) graph."""
        return math.ceil(self._one(self.measured.graph_bytes, runtime, size, DEFAULT_GRAPH_BYTES))

    def key_capture_seconds(self, runtime: int, size: int) -> float:
        return self._one(self.measured.capture_seconds, runtime, size, DEFAULT_GRAPH_CAPTURE_SECONDS)

    def graph_bytes(self, size: int) -> int:
        """Graph memory of a size in every runtime mode the policy mode records (an upper bound:
        a worker records FULL only for the sizes decode steps pad to, see ``graph_keys``)."""
        return sum(self.key_bytes(rt, size) for rt in runtime_modes(self.mode))

    @property
    def units(self) -> str:
        return "seconds" if self.measured.timed else "token-equivalents"

    def _runtime(self, decode: bool) -> int:
        return pb.GRAPH_MODE_FULL if decode and mode_has_full(self.mode) else pb.GRAPH_MODE_PIECEWISE

    def replay(self, size: int, decode: bool) -> float:
        """Time of one step replayed at ``size``."""
        if self.measured.timed:
            rt = self._runtime(decode)
            value = _interpolate(self.measured.replay_seconds.get(rt, {}), size)
            if value is None:
                value = _interpolate(next(iter(v for v in self.measured.replay_seconds.values() if v)), size)
            return float(value)
        return DEFAULT_FIXED_TOKENS + size

    def eager(self, tokens: int, decode: bool) -> float:
        """Time of one step of ``tokens`` real tokens run eager."""
        if self.measured.timed:
            rt = self._runtime(decode)
            value = _interpolate(self.measured.eager_seconds.get(rt, {}), tokens)
            if value is None:
                value = _interpolate(next(iter(v for v in self.measured.eager_seconds.values() if v)), tokens)
            return float(value)
        return DEFAULT_EAGER_RATIO * (DEFAULT_FIXED_TOKENS + tokens)


# --- the result --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeReason:
    """Why a size was chosen: the steps it serves (real token counts ``low``..``size``)."""

    size: int
    low: int
    steps: int
    decode_steps: int
    mixed_steps: int
    #: Share of all eligible steps this size serves.
    share: float
    padded_tokens: int
    memory_bytes: int
    capture_seconds: float

    def text(self) -> str:
        span = f"{self.low}" if self.low == self.size else f"{self.low}-{self.size}"
        return (f"serves {self.steps} steps of {span} tokens ({self.share:.1%} of eligible; "
                f"{self.decode_steps} decode, {self.mixed_steps} mixed), {self.padded_tokens} padded tokens")


@dataclass(frozen=True)
class SizeChoice:
    """A capture-size set and what it is expected to buy on the traffic it was judged on."""

    sizes: tuple[int, ...]
    reasons: tuple[SizeReason, ...]
    #: Steps the histogram counted, steps the mode could replay, and those the sizes serve.
    steps: int
    eligible_steps: int
    covered_steps: int
    #: Padded tokens (sum over the histogram) and their share of the tokens replayed.
    padded_tokens: int
    padding_waste: float
    #: Expected step time over the histogram, with these sizes and with no graph at all.
    cost: float
    eager_cost: float
    cost_units: str
    memory_bytes: int
    capture_seconds: float
    graphs: int
    #: Token counts were rounded up to multiples of this before the search (1: exact).
    grid: int = 1
    note: str = ""
    #: Expected step time of the Default ladder on the same traffic and model (0: not judged).
    default_cost: float = 0.0
    default_graphs: int = 0

    @property
    def throughput_vs_default(self) -> float:
        """Expected steps per second with these sizes over those with the Default ladder (1.0: as
        fast; 0 when not judged): what applying them is expected to cost or buy in throughput."""
        return self.default_cost / self.cost if self.default_cost and self.cost else 0.0

    @property
    def coverage(self) -> float:
        """Steps a graph replays / all steps, given the mode: the prediction of what workers count
        as served (replays / (replays + eager steps)). One meaning everywhere: a mixed step that
        FULL_DECODE_ONLY cannot replay lowers it, as it lowers the served figure (0 with no step)."""
        return self.covered_steps / self.steps if self.steps else 0.0

    @property
    def eligible_coverage(self) -> float:
        """Steps a graph replays / the steps this mode could replay (0 when none could): how well
        the sizes fit the mode's share of the traffic, not what the traffic gets."""
        return self.covered_steps / self.eligible_steps if self.eligible_steps else 0.0


def _eligible(traffic: Traffic, mode: int) -> tuple[dict[int, int], dict[int, int]]:
    decode = dict(traffic.decode) if mode_has_graphs(mode) else {}
    mixed = dict(traffic.mixed) if mode_has_piecewise(mode) else {}
    return decode, mixed


def evaluate_sizes(traffic: Traffic, sizes: Iterable[int], mode: int, model: CostModel | None = None,
                   *, max_capture_size: int = 0, note: str = "", grid: int = 1, full_limit: int = 0) -> SizeChoice:
    """What a given size set (a ladder, a hand-picked list, a chosen set) is expected to buy on
    ``traffic``: coverage, padding, cost, memory, capture time, and which steps each size serves.
    Sizes above ``max_capture_size`` (when given) are dropped, as a worker would never capture them.
    ``full_limit`` is the most rows a decode step has (``decode_rows_limit``): it says which sizes
    get a FULL graph, so graphs and memory count what a worker records."""
    model = model or CostModel(mode)
    chosen = sorted({s for s in sizes if s > 0 and (not max_capture_size or s <= max_capture_size)})
    decode, mixed = _eligible(traffic, mode)
    eligible = sum(decode.values()) + sum(mixed.values())
    cost = eager_cost = 0.0
    for table, is_decode in ((decode, True), (mixed, False)):
        eager_cost += sum(n * model.eager(t, is_decode) for t, n in table.items())
    ineligible = _ineligible_cost(traffic, mode, model)
    per: dict[int, list[int]] = {s: [0, 0, 0] for s in chosen}  # decode, mixed, padded steps/tokens
    covered = padded = real = 0
    for table, is_decode in ((decode, True), (mixed, False)):
        for t, n in table.items():
            i = bisect_left(chosen, t)
            if i == len(chosen):
                cost += n * model.eager(t, is_decode)
                continue
            s = chosen[i]
            cost += n * model.replay(s, is_decode)
            entry = per[s]
            entry[0 if is_decode else 1] += n
            entry[2] += n * (s - t)
            covered += n
            padded += n * (s - t)
            real += n * t
    reasons = []
    low = 1
    keys = graph_keys(chosen, mode, decode_rows_limit(traffic, full_limit))
    for s in chosen:
        d, m, p = per[s]
        mine = [rt for rt, size in keys if size == s]
        reasons.append(SizeReason(size=s, low=low, steps=d + m, decode_steps=d, mixed_steps=m,
                                  share=(d + m) / eligible if eligible else 0.0, padded_tokens=p,
                                  memory_bytes=sum(model.key_bytes(rt, s) for rt in mine),
                                  capture_seconds=sum(model.key_capture_seconds(rt, s) for rt in mine)))
        low = s + 1
    return SizeChoice(
        sizes=tuple(chosen), reasons=tuple(reasons), steps=traffic.steps, eligible_steps=eligible,
        covered_steps=covered, padded_tokens=padded,
        padding_waste=padded / (padded + real) if padded + real else 0.0,
        cost=cost + ineligible, eager_cost=eager_cost + ineligible, cost_units=model.units,
        memory_bytes=sum(r.memory_bytes for r in reasons),
        capture_seconds=sum(r.capture_seconds for r in reasons),
        graphs=len(keys), grid=grid, note=note)


def _ineligible_cost(traffic: Traffic, mode: int, model: CostModel) -> float:
    """Steps no size set changes: mixed steps the mode does not serve (and every step under NONE)."""
    cost = 0.0
    if not mode_has_piecewise(mode):
        cost += sum(n * model.eager(t, False) for t, n in traffic.mixed.items())
    if not mode_has_graphs(mode):
        cost += sum(n * model.eager(t, True) for t, n in traffic.decode.items())
    return cost


# --- the choice --------------------------------------------------------------------------------


def _grid_for(counts: Sequence[int], limit: int) -> int:
    """The smallest multiple-of-8 grid (1 when none is needed) that leaves at most ``limit``
    distinct token counts once each is rounded up onto it."""
    if len(counts) <= limit:
        return 1
    grid = 8
    while len({-(-t // grid) * grid for t in counts}) > limit:
        grid *= 2
    return grid


def choose_sizes(
    traffic: Traffic,
    *,
    mode: int,
    max_capture_size: int,
    max_graphs: int = 0,
    memory_budget_bytes: int = 0,
    model: CostModel | None = None,
    full_limit: int = 0,
) -> SizeChoice:
    """The capture sizes that minimise expected step time over ``traffic`` (see the module doc).

    ``max_graphs`` counts graphs as a worker records them (``graph_keys``: a size that no decode
    step pads to is one graph under FULL_AND_PIECEWISE, a size decode steps use is two);
    ``memory_budget_bytes`` bounds the estimated graph memory; 0 means no limit for either. Sizes
    never exceed ``max_capture_size``. ``full_limit``: the most rows of a decode step (the workers'
    ``max_num_seqs``; 0: the largest observed). The result carries the Default ladder's expected
    step time on the same traffic (``throughput_vs_default``).
    """
    if max_capture_size < 1:
        raise ValueError(f"max_capture_size must be at least 1, got {max_capture_size}")
    if max_graphs < 0 or memory_budget_bytes < 0:
        raise ValueError("max_graphs and memory_budget_bytes must not be negative")
    model = model or CostModel(mode)
    limit = decode_rows_limit(traffic, full_limit)
    default = evaluate_sizes(traffic, default_ladder(max_capture_size), mode, model, full_limit=limit)
    choice = _choose(traffic, mode, max_capture_size, max_graphs, memory_budget_bytes, model, limit)
    return replace(choice, default_cost=default.cost, default_graphs=default.graphs)


def _choose(traffic: Traffic, mode: int, max_capture_size: int, max_graphs: int, memory_budget_bytes: int,
            model: CostModel, limit: int) -> SizeChoice:
    def judged(sizes: Iterable[int], note: str = "", grid: int = 1) -> SizeChoice:
        return evaluate_sizes(traffic, sizes, mode, model, grid=grid, note=note, full_limit=limit)

    decode, mixed = _eligible(traffic, mode)
    counts = sorted(t for t in set(decode) | set(mixed) if t <= max_capture_size)
    if not mode_has_graphs(mode):
        return judged((), "mode None captures no graph")
    if not counts:
        return judged((), f"no eligible step at or below the maximum capture size {max_capture_size} was observed")
    grid = _grid_for(counts, MAX_CANDIDATES)
    cands = counts
    note = ""
    if grid > 1:
        # Coarsened: the Default ladder's sizes are candidates too, so the search never misses a
        # set as good as the ladder because the grid is coarser than the ladder's steps.
        cands = sorted({min(-(-t // grid) * grid, max_capture_size) for t in counts}
                       | set(default_ladder(max_capture_size)))
        note = f"token counts rounded up to multiples of {grid} ({len(counts)} distinct)"
    first_graphs = len(graph_keys(cands[:1], mode, limit))
    if max_graphs and max_graphs < first_graphs:
        return judged((), f"maxGraphs {max_graphs} fits no size (the smallest is {first_graphs} graphs in this "
                      "mode)", grid)
    found = _search(cands, decode, mixed, mode, model, limit, max_graphs, memory_budget_bytes, max_capture_size)
    if found is None:
        smallest = min(model.key_bytes(rt, s) for s in cands for rt in runtime_modes(mode))
        return judged((), f"memory budget {memory_budget_bytes} bytes fits no graph (the smallest candidate needs "
                      f"an estimated {smallest} bytes)", grid)
    if not found:
        note = (note + "; " if note else "") + "no size set beats running every step eager"
    return judged(found, note, grid)


#: Cells of the search's table (graphs x candidates x memory units) above which memory is counted
#: in coarser units, so that a search with both limits stays a fraction of a second.
MAX_SEARCH_CELLS = 1 << 21


def _search(cands: list[int], decode: Mapping[int, int], mixed: Mapping[int, int], mode: int, model: CostModel,
            limit: int, max_graphs: int, budget: int, max_capture_size: int) -> list[int] | None:
    """The optimal size set among ``cands`` (a list, possibly empty: nothing beats eager), or None
    when the memory budget fits no graph.

    Dynamic programming over the candidates in increasing order: ``best[g, j, u]`` is the least cost
    of serving every bucket up to ``cands[j]`` with ``cands[j]`` the largest size, ``g`` graphs and
    ``u`` memory units. A size adds its PIECEWISE graph and, when the previous size is below the
    decode-row limit (decode steps pad to it), its FULL graph: ``graph_keys``, counted exactly.
    """
    m = len(cands)
    wd, wm, eager = np.zeros(m), np.zeros(m), np.zeros(m)
    for table, is_decode, w in ((decode, True, wd), (mixed, False, wm)):
        for t, n in table.items():
            if t > max_capture_size:
                continue
            i = bisect_left(cands, t)
            w[i] += n
            eager[i] += n * model.eager(t, is_decode)
    rd = np.array([model.replay(s, True) for s in cands])
    rm = np.array([model.replay(s, False) for s in cands])
    cum_d, cum_m = np.concatenate([[0], np.cumsum(wd)]), np.concatenate([[0], np.cumsum(wm)])
    eager_above = np.concatenate([np.cumsum(eager[::-1])[::-1], [0.0]])  # eager cost of buckets >= j

    has_full, has_pw = mode_has_full(mode), mode_has_piecewise(mode)
    g_pw, g_full = int(has_pw), int(has_full)
    bytes_pw = [model.key_bytes(pb.GRAPH_MODE_PIECEWISE, s) if has_pw else 0 for s in cands]
    bytes_full = [model.key_bytes(pb.GRAPH_MODE_FULL, s) if has_full else 0 for s in cands]
    layers = max_graphs + 1 if max_graphs else 1
    if budget:
        units = max(1, min(BUDGET_UNITS, MAX_SEARCH_CELLS // (layers * m)))
        exact = math.gcd(budget, *bytes_pw, *bytes_full)  # exact units when they are few enough
        unit = exact if budget // exact <= units else -(-budget // units)
        capacity = budget // unit
        mem_pw = np.array([-(-b // unit) for b in bytes_pw], dtype=np.int64)
        mem_full = np.array([-(-b // unit) for b in bytes_full], dtype=np.int64)
    else:
        capacity, mem_pw, mem_full = 0, np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
    if not ((mem_pw + mem_full) <= capacity).any():
        return None
    width = capacity + 1
    below = np.array([c < limit for c in cands])  # a size after one of these gets a FULL graph

    def step(j: int, after_below: bool) -> tuple[int, int]:
        """(graphs, memory units) that size ``j`` adds after a size below the limit, or not."""
        full = has_full and after_below
        graphs = (g_pw + g_full * full) if max_graphs else 0
        return graphs, int(mem_pw[j] + mem_full[j] * full)

    best = np.full((layers, m, width), math.inf)
    parent = np.full((layers, m, width), -1, dtype=np.int64)
    for j in range(m):  # the smallest size: every decode step from 1 row pads to it
        g, u = step(j, True)
        if g < layers and u < width:
            best[g, j, u] = rd[j] * cum_d[j + 1] + rm[j] * cum_m[j + 1]
    for j in range(1, m):
        for group in (np.flatnonzero(below[:j]), np.flatnonzero(~below[:j])):
            if not len(group):
                continue
            g, u = step(j, bool(below[group[0]]))
            if g >= layers or u >= width:
                continue
            # Buckets group[i]+1..j replay at cands[j], after a best set whose largest is cands[group[i]].
            bucket = rd[j] * (cum_d[j + 1] - cum_d[group + 1]) + rm[j] * (cum_m[j + 1] - cum_m[group + 1])
            cand = best[:layers - g, group, :width - u] + bucket[None, :, None]
            arg = np.argmin(cand, axis=1)
            val = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
            cur = best[g:, j, u:]
            better = val < cur
            best[g:, j, u:] = np.where(better, val, cur)
            parent[g:, j, u:] = np.where(better, group[arg], parent[g:, j, u:])
    total = best + eager_above[1:][None, :, None]  # buckets above the largest size run eager
    g, j, u = np.unravel_index(int(np.argmin(total)), total.shape)  # ties: the fewest graphs
    if not total[g, j, u] <= eager_above[0]:
        return []
    chosen = []
    while True:
        chosen.append(cands[j])
        i = int(parent[g, j, u])
        if i < 0:
            return chosen
        dg, du = step(j, bool(below[i]))
        g, j, u = g - dg, i, u - du
