"""A set of CUDA graphs recorded against one runner's addresses: recording and replay.

A ``GraphSet`` holds the graphs recorded against one set of addresses (weights, KV cache, the
runner's buffers), which it reads from the runner. Whatever can move those addresses builds a new
set; an old set is released, never replayed. FULL keys are one graph of the whole uniform-decode
step. PIECEWISE keys serve mixed and prefill steps: one graph of the whole step, its varlen
attention included, where the attention records it (``SlotAttention.records_mixed``: a step is
then one replay, not a replay per piece and two launches per layer from the host); else one graph
per piece between attention calls, replayed with eager attention between them.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from graphkeeper.proto.enums import mode_name
from graphkeeper.worker.executor.graphs.modes import FULL, Key
from graphkeeper.worker.executor.graphs.pool_memory import pool_bytes
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.model.attention import AttentionMetadata

log = logging.getLogger(__name__)


class StaleGraphError(RuntimeError):
    """A graph recorded for other weights or buffers was about to be replayed."""


@dataclass
class CapturedGraph:
    mode: int
    size: int
    graphs: list[torch.cuda.CUDAGraph]
    seconds: float
    device_bytes: int
    reserved_bytes: int
    #: GPU time of one step at this size, replayed and eager (CUDA events, at validation).
    replay_seconds: float = 0.0
    eager_seconds: float = 0.0


@dataclass
class Skipped:
    reason: int  # SIZE_OVER_BUDGET or SIZE_CAPTURE_FAILED
    message: str


#: What "nothing held" means for graph memory: cudaMemGetInfo moves in the driver's 2 MiB pages.
NO_GRAPH_SLACK_BYTES = 2 << 20


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


class GraphSet:
    """Graphs recorded against one runner's addresses, keyed by (mode, padded size)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        #: PIECEWISE keys recorded whole, attention included (one graph each), or as pieces.
        self.whole_mixed: bool = runner.attention.records_mixed
        self.addresses = runner.addresses()
        self.captured: dict[Key, CapturedGraph] = {}
        self.skipped: dict[Key, Skipped] = {}
        #: Graphs released after sitting idle: their figures stay for status, their graphs are gone.
        self.released: dict[Key, CapturedGraph] = {}
        #: Each size's eager step time, of the sizes with a key that passed validation: what the
        #: coarse sizes are judged by and the step-time model prices eager steps with, kept for a
        #: size whose graph was given back (compute bound, over the budget, idle): its steps run eager.
        self.eager_seconds: dict[int, float] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=runner.device)
        self._piece_buffers: dict[str, Tensor] | None = None
        #: Modes whose functions ran on the capture stream since its library workspaces were made
        #: (``warm_up``); emptied when they are given back.
        self._warm_modes: set[int] = set()
        self.memory_bytes = 0  # graph memory (``measure``) when the phase ended or graphs were released
        #: Device memory in use before any of this set's graphs: what is still held beyond it once
        #: no graph is left is reported (``report_held_without_graphs``), never counted as graphs.
        self.baseline_used = device_used()
        self.baseline_reserved = 0  # torch's reserved memory at the same point (what a leak report compares)

    # --- replay ---------------------------------------------------------------------------

    def check_fresh(self) -> None:
        """Refuses to replay against moved weights or buffers (cheap pointer comparison)."""
        if self.runner.addresses() != self.addresses:
            raise StaleGraphError("weights or KV cache moved since these graphs were recorded")

    def replay(self, mode: int, size: int, meta: AttentionMetadata) -> Tensor:
        """Replays the graph the dispatcher chose; returns hidden states ``[size, dim]``."""
        entry = self.captured.get((mode, size))
        if entry is None:
            raise RuntimeError(f"no {mode_name(mode)} graph of size {size}: replay never captures")
        if mode == FULL or self.whole_mixed:
            entry.graphs[0].replay()
        else:
            self._replay_pieces(entry.graphs, size, meta)
        return self.runner.output(size)

    def _replay_pieces(self, pieces: list[torch.cuda.CUDAGraph], size: int, meta: AttentionMetadata) -> None:
        """The pieces in order, each layer's attention between them writing straight into the
        next piece's input (host work per layer: two launches and a replay)."""
        buf = self._buffers()
        q, k, v, o = buf["q"][:size], buf["k"][:size], buf["v"][:size], buf["o"][:size]
        attention = self.runner.attention
        attention.bind(meta)
        pieces[0].replay()
        for layer, piece in enumerate(pieces[1:]):
            attention(layer, q, k, v, out=o)
            piece.replay()

    def release(self) -> None:
        """Every graph goes, and everything held for them: the pool, the piece buffers, the
        capture stream's library workspaces."""
        torch.cuda.synchronize()  # no replay still running on what is released
        for entry in self.captured.values():
            self._reset(entry)
        self.captured.clear()
        self.free_unused()

    def drop(self, key: Key) -> CapturedGraph:
        """Resets one key's graphs (its blocks go back to the shared pool; the pool itself goes
        back to the device once no graph uses it, see ``free_unused``)."""
        entry = self.captured.pop(key)
        self._reset(entry)
        return entry

    @staticmethod
    def _reset(entry: CapturedGraph) -> None:
        for graph in entry.graphs:
            graph.reset()
        entry.graphs = []

    def release_idle(self, keys: set[Key]) -> None:
        """Releases graphs no step replayed for the policy's idle time; their memory is given back
        (all of it once the last graph of the set goes, see ``free_unused``)."""
        going = [key for key in sorted(keys) if key in self.captured]
        for key in going:
            self._reset(self.captured[key])
        if len(going) == len(self.captured):
            self._give_back()  # no graph alive any more
        gc.collect()
        # Published in this order for readers on other threads (status): the memory first, then
        # the keys as released, then gone from the captured ones. A reader never sees a graph
        # vanish, nor every graph released beside the memory they held.
        self.memory_bytes = self.measure()  # the allocator's cache goes back first
        self.released = {**self.released, **{key: self.captured[key] for key in going}}
        self.captured = {k: v for k, v in self.captured.items() if k not in self.released}
        self.report_held_without_graphs()

    def renew_pool(self) -> None:
        """With no graph left, the pool was freed with its last graph: the next capture needs a
        fresh handle (capturing into a freed pool fails an allocator assert)."""
        if not self.captured:
            self._new_pool()

    def _new_pool(self) -> None:
        gc.collect()
        self.pool = torch.cuda.graph_pool_handle()

    def free_unused(self) -> None:
        """With no graph left, gives back what was held only for graphs: the piece buffers, the
        shared pool and the cuBLAS/cuBLASLt workspaces, which cuBLAS keeps per (handle, stream)
        for the life of the process (32 MiB each on Hopper: the capture stream's is what a budget
        that fits nothing used to leave held with 0 graphs).

        Safe only with no graph alive (a graph may have recorded a workspace's address). torch can
        only clear every stream's workspaces at once, so one eager row is run afterwards on the
        current stream: it re-creates what eager steps hold anyway, the state the set's baseline
        was measured in, and graph memory is measured against like.
        """
        if not self.captured:
            self._give_back()

    def _give_back(self) -> None:
        """``free_unused``'s work, for a caller that knows no graph is alive."""
        self._piece_buffers = None
        self._new_pool()  # the old pool went with its last graph
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        self._warm_modes.clear()
        self._eager_row()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _eager_row(self) -> None:
        """One eager decode row on the KV cache's dummy slot (where padding rows write), LM head included."""
        runner = self.runner
        runner.model.head(runner.forward_eager(runner.prepare(runner.inert_decode(1), 1), 1))

    @staticmethod
    def settled_used() -> int:
        """Device memory in use once queued work finished and the allocator's unused cache went back."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return device_used()

    def measure(self) -> int:
        """Graph memory now, as the allocator holds it: this set's pool's segments and the piece
        buffers, once queued work finished and freeable pool segments went back. No other memory
        on the device moves it (a second model during a reload, the old one's freed memory), as it
        moved the difference of two device-wide readings this used to be."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return pool_bytes(self.pool) + self.buffer_bytes()

    def buffer_bytes(self) -> int:
        """The piece buffers' bytes (allocated by the first PIECEWISE key, shared by every size)."""
        return sum(t.numel() * t.element_size() for t in (self._piece_buffers or {}).values())

    def report_held_without_graphs(self) -> None:
        """With no graph left, the device should hold what it held before the set's first graph
        (within the driver's 2 MiB page); more is said, with the part torch's allocator holds, not
        left silent (graph memory reads 0 then: the pool is gone, the rest is not the graphs')."""
        if self.captured:
            return
        left = self.settled_used() - self.baseline_used
        if left <= NO_GRAPH_SLACK_BYTES:
            return
        in_torch = torch.cuda.memory_reserved() - self.baseline_reserved
        log.warning("%d B more device memory in use than before the first graph, with no graph left: torch's "
                    "allocator holds %+d B more, %d B are outside it (driver, libraries)",
                    left, in_torch, left - max(in_torch, 0))

    # --- recording ------------------------------------------------------------------------

    def warm_up(self, mode: int, size: int) -> None:
        """Runs the key's functions once on the capture stream, outside capture, the first time a
        key of ``mode`` is recorded on it: what a stream needs before it records (cuBLAS's
        workspace for the stream, the piece buffers) then exists, and is not recorded into the
        pool nor charged to the key. Later keys of the mode skip it: their size's kernels were
        loaded by its eager prime on the serving stream (a process-wide load), so a second run on
        this stream would load nothing (for ``llama-8b`` it was 1.0 s of the capture stage), and
        every key is still validated against eager execution after recording."""
        if mode in self._warm_modes:
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # inputs were filled on the main stream
        with torch.cuda.stream(self.stream):
            for fn in self._fns(mode, size):
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        self._warm_modes.add(mode)

    def record(self, mode: int, size: int) -> list[torch.cuda.CUDAGraph]:
        """Records the graphs for one key on the capture stream into the shared pool."""
        graphs = []
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for fn in self._fns(mode, size):
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    fn()
                finally:
                    graph.capture_end()
                graphs.append(graph)
        torch.cuda.current_stream().wait_stream(self.stream)
        return graphs

    def _fns(self, mode: int, size: int) -> list[Callable[[], None]]:
        if mode == FULL:
            return [self._whole_fn(size, decode_rows=size)]
        return [self._whole_fn(size, decode_rows=0)] if self.whole_mixed else self._piece_fns(size)

    def _whole_fn(self, size: int, decode_rows: int) -> Callable[[], None]:
        """The whole step at ``size`` rows: a uniform decode step (``decode_rows == size``: the
        decode kernel) or any step (``decode_rows == 0``: the varlen kernel launched over a
        program per row, reading the work list ``prepare`` writes before each replay)."""
        runner = self.runner

        def step() -> None:
            meta = runner.metadata(size, decode_rows, [], blocks=0 if decode_rows else size)
            runner.output(size).copy_(runner.forward_eager(meta, size))

        return step

    def _piece_fns(self, size: int) -> list[Callable[[], None]]:
        model, runner, buf = self.runner.model, self.runner, self._buffers()
        tokens, positions = runner.tokens(size), runner.positions(size)

        def store(h: Tensor, q: Tensor, k: Tensor, v: Tensor) -> None:
            for name, value in (("h", h), ("q", q), ("k", k), ("v", v)):
                buf[name][:size].copy_(value)

        def first() -> None:
            store(*model.first_piece(tokens, *model.rope(positions)))

        def middle(layer: int) -> Callable[[], None]:
            return lambda: store(*model.middle_piece(layer, buf["h"][:size], buf["o"][:size], *model.rope(positions)))

        def last() -> None:
            runner.output(size).copy_(model.last_piece(buf["h"][:size], buf["o"][:size]))

        n_layers = model.config.n_layers
        return [first, *(middle(i) for i in range(1, n_layers)), last]

    def _buffers(self) -> dict[str, Tensor]:
        """Piece inputs and outputs, shared by every size: one size runs at a time."""
        if self._piece_buffers is None:
            c, m = self.runner.loaded.config, self.runner.max_tokens
            kw = {"device": self.runner.device, "dtype": self.runner.loaded.dtype}
            self._piece_buffers = {
                "h": torch.zeros(m, c.dim, **kw),
                "q": torch.zeros(m, c.n_heads, c.head_dim, **kw),
                "k": torch.zeros(m, c.n_kv_heads, c.head_dim, **kw),
                "v": torch.zeros(m, c.n_kv_heads, c.head_dim, **kw),
                "o": torch.zeros(m, c.n_heads * c.head_dim, **kw),
            }
        return self._piece_buffers
