"""The capture job: fills a graph set one (mode, size) at a time, largest first, into one shared
memory pool, within the policy's memory budget; each graph is replayed on a probe batch and
compared with eager execution before the dispatcher may use it, and the step's GPU time replayed
and eager is measured there (what the graph buys). The job can run to the end at startup, or one
size between engine steps during a recapture.

The budget is a bound on what the phase leaves held: a size whose capture took the graph memory
over it is given back at once, and if what is held still exceeds it when the job ends (the shared
pool keeps blocks other graphs use) the most recently captured graphs are given back until it
does not; with no graph left, the pool, the piece buffers and the capture stream's cuBLAS
workspaces go too, so a budget that fits nothing leaves nothing held.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_name
from graphkeeper.worker.executor.graphs.coarse_memory import CoarseMemory, Remembered, remembered_skips
from graphkeeper.worker.executor.graphs.economics import over_budget_drops
from graphkeeper.worker.executor.graphs.graph_set import CapturedGraph, GraphSet, Skipped, device_used
from graphkeeper.worker.executor.graphs.large_steps import judge_coarse, judged_sizes
from graphkeeper.worker.executor.graphs.modes import PIECEWISE, Key
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.model.attention import AttentionMetadata
from graphkeeper.worker.plan import PrefillChunk, StepPlan

log = logging.getLogger(__name__)



@dataclass
class CaptureJob:
    """Captures ``plan`` into ``graphs`` one key at a time, then hands the set to the dispatcher.

    Graph memory is what the allocator holds for the set: its pool's segments and the piece
    buffers (``GraphSet.measure``). It is measured after every key, so the budget is enforced on
    the measured figure and each key is charged with what it added. What sits outside the
    allocator (graph executables, the capture stream's library workspaces) is not graph memory
    here; once no graph is left, any of it still held is reported (``report_held_without_graphs``).
    """

    graphs: GraphSet
    plan: list[Key]
    budget_bytes: int = 0
    inject_failures: frozenset[int] = frozenset()
    tolerance: float = 1e-3
    position: int = 0
    held: int = 0  # graph memory after the last key, measured
    #: Seconds the stage spent, by part (CAPTURE_PARTS): a user waits for all of them, not only
    #: for the recording, which is the smallest part.
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAPTURE_PARTS, 0.0))
    last_cost: int = 0
    stopped_by_budget: bool = False
    primed: set[Probe] = field(default_factory=set)  # probes whose eager step ran (``_prime``)
    #: Each probe's eager step, what the keys it probes are validated against, and its time: a
    #: FULL key is probed with a uniform decode step, a PIECEWISE key with a mixed one (the steps
    #: each serves), so a size with both keys runs two. Kept (in host memory) while a later key
    #: of the plan has the probe.
    references: dict[Probe, Reference] = field(default_factory=dict)
    #: Coarse PIECEWISE sizes judged at ``finish`` (kept only where they pay: ``large_steps.py``)
    #: and the padding ladder they sit in. Empty on a tensor parallel follower: rank 0 judges.
    coarse: tuple[int, ...] = ()
    ladder: tuple[int, ...] = ()
    #: The coarse verdicts of earlier starts (``coarse_memory.py``; None: nothing is remembered),
    #: and those this phase left out of its plan, which it writes back with its own.
    memory: CoarseMemory | None = None
    remembered: dict[int, Remembered] = field(default_factory=dict)
    #: The sizes whose eager step is timed ``EAGER_TIMING_REPEATS`` times (the others' reference
    #: run is their timing): those a coarse verdict reads. Set from the plan, before a tensor
    #: parallel follower drops its coarse sizes, so every rank runs the same eager steps.
    timed_twice: frozenset[int] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        self.timed_twice = judged_sizes(list(self.coarse), list(self.ladder))
        with self._timed("setup"):
            gc.collect()
            torch.cuda.empty_cache()
            self.graphs.baseline_used = device_used()
            self.graphs.baseline_reserved = torch.cuda.memory_reserved()
            if self.memory is not None:
                self.skip_remembered(self.memory.recall(self.coarse, list(self.ladder)))

    def skip_remembered(self, remembered: dict[int, Remembered]) -> None:
        """Leaves the coarse keys remembered as not paying out of the plan, before any key is
        captured: each is skipped as compute bound with its earlier verdict, and its eager timing
        is the set's again (a tensor parallel follower is given rank 0's)."""
        self.plan, skips = remembered_skips(self.plan, remembered)
        for (mode, size), skipped in skips.items():
            self.graphs.skipped[(mode, size)] = skipped
            self.graphs.eager_seconds[size] = remembered[size].eager_seconds
            self.remembered[size] = remembered[size]
            log.info("%s size %d not captured: %s", mode_name(mode), size, skipped.message)

    @property
    def total_seconds(self) -> float:
        """The whole capture stage: every part, the recording being only one of them."""
        return sum(self.parts.values())

    @contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.parts[part] += time.perf_counter() - start

    @property
    def done(self) -> bool:
        return self.position >= len(self.plan)

    def measure(self) -> int:
        """Graph memory now: device memory in use beyond the start, cache returned first."""
        return self.graphs.measure()

    def finish(self) -> None:
        """Ends the phase within the budget: graphs given back, last captured first, while what is
        held exceeds it; with none left, everything held for graphs is given back too."""
        with self._timed("finish"):
            self._finish()

    def _finish(self) -> None:
        self.references.clear()
        self._release_unpaid()
        gc.collect()
        held = self.measure()
        while self.budget_bytes and held > self.budget_bytes and self.graphs.captured:
            order = [(key, entry.device_bytes) for key, entry in self.graphs.captured.items()]
            for mode, size in over_budget_drops(order, held, self.budget_bytes) or [order[-1][0]]:
                self.graphs.drop((mode, size))
                self._skip(mode, size, pb.FALLBACK_REASON_SIZE_OVER_BUDGET,
                           f"graph memory {held} B held at the end of the capture phase exceeded the budget "
                           f"{self.budget_bytes} B")
            self.graphs.renew_pool()
            held = self.measure()
        if not self.graphs.captured:
            self.graphs.free_unused()
            held = self.measure()
        self.graphs.memory_bytes = held
        self.graphs.report_held_without_graphs()

    def _release_unpaid(self) -> None:
        """Coarse graphs whose replay does not beat the eager steps they serve are released; their
        steps run eager with COMPUTE_BOUND (before the budget is judged: what they held goes back)."""
        replay = {size: g.replay_seconds for (mode, size), g in self.graphs.captured.items() if mode == PIECEWISE}
        verdicts = judge_coarse(list(self.coarse), list(self.ladder), replay, self.graphs.eager_seconds)
        for verdict in verdicts:
            if verdict.kept:
                log.info("keeping PIECEWISE size %d: %s", verdict.size, verdict.message())
                continue
            self.graphs.drop((PIECEWISE, verdict.size))
            self.graphs.renew_pool()
            self._skip(PIECEWISE, verdict.size, pb.FALLBACK_REASON_COMPUTE_BOUND, verdict.message())
        if self.memory is not None:
            self.memory.save(verdicts, self.graphs.eager_seconds, self.remembered, list(self.ladder))

    def run_all(self) -> None:
        """Every key at once (a start). The engine froze the heap it built before the phase
        (``gc_pauses.freeze_heap``), so the phase's collections walk only what the phase allocates:
        a full collection of a worker's heap (torch, Dynamo, Inductor, Triton: some 350,000 objects)
        takes 0.1-0.2 s, and a phase made several."""
        while not self.done:
            self.step()

    def over_budget(self) -> bool:
        """Whether the next key is skipped for the budget: what ``step`` decides first."""
        estimate = self.held + self.last_cost if self.graphs.captured else 0
        return bool(self.budget_bytes) and (self.stopped_by_budget or estimate > self.budget_bytes)

    def step(self, over_budget: bool | None = None) -> None:
        """Captures and validates the next key, or skips it with its reason. A tensor parallel
        follower is given rank 0's ``over_budget`` decision instead of making its own, so every
        rank records (and runs the collectives of) the same keys."""
        mode, size = self.plan[self.position]
        skip = self.over_budget() if over_budget is None else over_budget
        self.position += 1
        if skip:
            self._skip(mode, size, pb.FALLBACK_REASON_SIZE_OVER_BUDGET,
                       f"graph memory {self.held} B + about {self.last_cost} B would exceed the budget "
                       f"{self.budget_bytes} B")
            return
        self._capture(mode, size)

    def _capture(self, mode: int, size: int) -> None:
        runner = self.graphs.runner
        kind = probe_of(mode, size)
        probe = probe_plan(runner, size, mixed=kind.mixed)
        began = sum(self.parts.values())
        try:
            with self._timed("prime"):
                self._prime(probe, kind)  # not charged to the key's memory (see _prime)
            reserved_before = torch.cuda.memory_reserved()
            with self._timed("warm_up"):
                runner.prepare(probe, size)
                self.graphs.warm_up(mode, size)
            with self._timed("record"):
                if size in self.inject_failures:
                    raise RuntimeError(f"injected capture failure for size {size}")
                graphs = self.graphs.record(mode, size)
        except Exception as err:  # noqa: BLE001 - one size's failure must never stop the worker
            torch.cuda.synchronize()
            self._skip(mode, size, pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED, f"capture failed: {err}")
            return
        with self._timed("measure"):
            held = self.measure()
        entry = CapturedGraph(mode, size, graphs, 0.0, held - self.held,
                              torch.cuda.memory_reserved() - reserved_before)
        self.graphs.captured[(mode, size)] = entry
        with self._timed("validate"):
            reference = self.references[kind]
            expected = reference.hidden.to(self.graphs.runner.device)
            problem, replayed = validate(self.graphs, mode, size, probe, self.tolerance, expected)
            del expected
            if not problem:
                entry.replay_seconds = least_time(self.graphs.runner, probe, size, functools.partial(
                    self.graphs.replay, mode, size), TIMING_REPEATS - 1, replayed)
                entry.eager_seconds = reference.seconds
                # A size's eager step is priced as the step its PIECEWISE key serves (the mixed
                # probe's) where it has one, whichever key the plan captured first.
                if kind.mixed or size not in self.graphs.eager_seconds:
                    self.graphs.eager_seconds[size] = reference.seconds
            if all(probe_of(*later) != kind for later in self.plan[self.position:]):
                del self.references[kind]
        entry.seconds = sum(self.parts.values()) - began  # everything this key took
        if problem:
            self._drop(mode, size, pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED, f"validation failed: {problem}")
            return
        if self.budget_bytes and held > self.budget_bytes:
            self._over_budget(mode, size)
            return
        self.held = held
        self.last_cost = max(entry.device_bytes, 0)
        log.info("captured %s size %d in %.3f s, %d bytes device, %d bytes reserved",
                 mode_name(mode), size, entry.seconds, entry.device_bytes, entry.reserved_bytes)

    def _prime(self, probe: StepPlan, kind: Probe) -> None:
        """The probe's eager step, and validation's LM head, on the serving stream
        before the key is recorded: the reference its keys are validated against (kept in host
        memory, so that it holds no device memory while graphs are recorded and measured), and its
        time: the reference run's, or for a size a coarse verdict reads the least of
        ``EAGER_TIMING_REPEATS`` runs (the first may pay for allocating the step's memory afresh,
        and a verdict weighs a few percent).

        What a size's first eager step loads for good (kernels loaded lazily for a new shape,
        Triton's or a library's, a larger local-memory pool) belongs to the process: eager steps
        of that size need it as well, and it stays when every graph is released. The set's
        baseline moves by it, so the key is charged only with what its recording adds. Once per
        probe: a later key with the same probe loads nothing new and reuses the reference."""
        if kind in self.primed:
            return
        self.primed.add(kind)
        runner, size = self.graphs.runner, kind.size
        before = self.graphs.settled_used()
        eager = functools.partial(runner.forward_eager, rows=size)
        hidden, first = timed_once(functools.partial(eager, runner.prepare(probe, size)))
        runner.model.logits(hidden[logit_rows(size, runner.device)])
        kept = hidden.cpu()
        del hidden
        repeats = EAGER_TIMING_REPEATS if size in self.timed_twice else 1
        seconds = least_time(runner, probe, size, eager, repeats - 1, first)
        self.references[kind] = Reference(kept, seconds)
        self.graphs.baseline_used += max(self.graphs.settled_used() - before, 0)

    def _over_budget(self, mode: int, size: int) -> None:
        self._drop(mode, size, pb.FALLBACK_REASON_SIZE_OVER_BUDGET,
                   f"capturing it took graph memory over the budget {self.budget_bytes} B")
        self.held = self.measure()
        if self.held > self.budget_bytes:
            self.stopped_by_budget = True  # what the pool keeps cannot be returned: stop here

    def _drop(self, mode: int, size: int, reason: int, message: str) -> None:
        self.graphs.drop((mode, size))
        # Its graphs may have been the pool's only users: then the next capture needs a fresh pool.
        # (The capture stream's workspaces stay while the job runs, to be reused; ``finish`` gives
        # them back when no graph is left.)
        self.graphs.renew_pool()
        self._skip(mode, size, reason, message)

    def _skip(self, mode: int, size: int, reason: int, message: str) -> None:
        self.graphs.skipped[(mode, size)] = Skipped(reason, message)
        log.warning("%s size %d falls back: %s", mode_name(mode), size, message)


class Probe(NamedTuple):
    """Which probe batch a key is validated and timed on: its size, and whether it is a mixed step
    (decode rows and prefill chunks: what a PIECEWISE key serves) or a uniform decode step
    (what a FULL key serves)."""

    size: int
    mixed: bool


def probe_of(mode: int, size: int) -> Probe:
    """The probe of a (mode, size) key."""
    return Probe(size, mode == PIECEWISE)


def probe_plan(runner: ModelRunner, size: int, mixed: bool = False) -> StepPlan:
    """A deterministic batch over scratch slots, every row writing its own position: a decode
    batch, or (``mixed``) a mixed step, its first half decode rows and the rest prefill chunks.

    Scratch rows in one scratch slot are consecutive positions, so the rows after the decode
    rows make one chunk per scratch slot they cover, each attending to the keys before it."""
    generator = torch.Generator().manual_seed(size)
    tokens = torch.randint(0, runner.loaded.config.vocab_size, (size,), generator=generator).numpy().astype(np.int64)
    where = np.array([runner.cache.probe_slot_position(r) for r in range(size)], dtype=np.int64).reshape(-1, 2)
    decode = size // 2 if mixed else size
    chunks = probe_chunks(where[decode:], decode)
    last_rows = np.array([c.row + c.length - 1 for c in chunks], dtype=np.int64)
    sample_rows = np.concatenate([np.arange(decode, dtype=np.int64), last_rows])
    return StepPlan(prompt_tokens=tokens[decode:].tolist(), positions=where[:, 1], slots=where[:, 0],
                    num_decode=decode, prefill=chunks, sample_rows=sample_rows, sample_slots=where[sample_rows, 0],
                    decode_tokens=tokens[:decode])


def probe_chunks(where: np.ndarray, first_row: int) -> list[PrefillChunk]:
    """Prefill chunks over scratch rows ``where`` ``[n, 2]`` (slot, position) starting at batch row
    ``first_row``: one per run of rows in the same slot (pure)."""
    if not len(where):
        return []
    starts = np.flatnonzero(np.diff(where[:, 0], prepend=-1)).tolist()
    ends = [*starts[1:], len(where)]
    return [PrefillChunk(row=first_row + s, length=e - s, slot=int(where[s, 0]), start=int(where[s, 1]))
            for s, e in zip(starts, ends, strict=True)]


#: The parts of the capture stage, in the order a key goes through them ("setup" and "finish" once a
#: phase): what status and the capture metrics report, beside their sum, the whole stage.
CAPTURE_PARTS = ("setup", "prime", "warm_up", "record", "validate", "measure", "finish")


#: Rows of the probe whose logits are compared (hidden states are compared for every row).
VALIDATION_LOGIT_ROWS = 64


#: Timed replays of a key, the validation's the first (the least is kept: the step's time without
#: the host's noise).
TIMING_REPEATS = 3
#: Timed eager runs of a size a coarse verdict reads, in its prime: its reference and one more.
#: Other sizes time their reference run alone: their graphs are kept whatever eager costs, and an
#: eager step is the launch-bound one (7 ms for ``llama-1b``, more for larger models), once for
#: each of some sixty probes at every start.
EAGER_TIMING_REPEATS = 2


@dataclass(frozen=True)
class Reference:
    """A size's eager step on its probe batch: the hidden states (in host memory) and the least
    GPU seconds of its timed runs."""

    hidden: torch.Tensor
    seconds: float


def timed_once(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    """``run()``'s result and its GPU seconds, by CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = run()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) / 1000.0


def least_time(runner: ModelRunner, probe: StepPlan, size: int,
               run: Callable[[AttentionMetadata], torch.Tensor], runs: int, first: float) -> float:
    """The least of ``first`` (a run timed already) and ``runs`` more timed runs of ``run`` on the
    probe batch, in GPU seconds by CUDA events on the current stream; input preparation outside.
    Replayed against eager, the difference is what the graph buys per step: launch overhead
    removed (the eager step is the one the dispatcher falls back to, on the same kernels)."""
    best = first
    for _ in range(runs):
        meta = runner.prepare(probe, size)
        best = min(best, timed_once(functools.partial(run, meta))[1])
    return best


def logit_rows(size: int, device: torch.device) -> torch.Tensor:
    """The rows of a ``size``-row probe whose logits validation compares: up to 64, spread out."""
    return torch.arange(0, size, max(1, size // VALIDATION_LOGIT_ROWS), device=device)


def validate(graphs: GraphSet, mode: int, size: int, probe: StepPlan, tolerance: float,
             expected: torch.Tensor) -> tuple[str, float]:
    """Replays one graph on the probe batch and compares it with ``expected``, the eager step on
    the same batch: ('' when equal, or what differs; the replay's GPU seconds).

    Every row's hidden state is compared; greedy tokens and logits on up to 64 spread rows (the
    LM head is the same eager call on both sides, and a full-vocabulary logits tensor per row
    would cost more memory than the graphs).
    """
    runner = graphs.runner
    rows = logit_rows(size, runner.device)
    meta = runner.prepare(probe, size)
    got, seconds = timed_once(lambda: graphs.replay(mode, size, meta))
    if not torch.isfinite(got).all():
        return "non-finite hidden states", seconds
    rel = ((got - expected).float().norm() / expected.float().norm().clamp_min(1e-12)).item()
    if rel > tolerance:
        return f"hidden states differ by {rel:.2e} (tolerance {tolerance:.0e})", seconds
    got_logits, expected_logits = runner.model.logits(got[rows]), runner.model.logits(expected[rows])
    if not torch.equal(got_logits.argmax(-1), expected_logits.argmax(-1)):
        return "greedy tokens differ from eager execution", seconds
    return "", seconds
