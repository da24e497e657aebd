"""A set of CUDA graphs recorded against one runner's addresses: recording and replay.

A ``GraphSet`` holds the graphs recorded against one set of addresses (weights, KV cache, the
runner's buffers), which it reads from the runner. Whatever can move those addresses builds a new
set; an old set is released, never replayed. FULL keys are one graph of the whole step; PIECEWISE
keys are one graph per piece between attention calls, replayed with eager attention between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from graphkeeper.proto.policy import mode_name
from graphkeeper.worker.executor.graphs.modes import FULL, Key
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.model.attention import AttentionMetadata


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


@dataclass
class Skipped:
    reason: int  # SIZE_OVER_BUDGET or SIZE_CAPTURE_FAILED
    message: str


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


class GraphSet:
    """Graphs recorded against one runner's addresses, keyed by (mode, padded size)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.addresses = runner.addresses()
        self.captured: dict[Key, CapturedGraph] = {}
        self.skipped: dict[Key, Skipped] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=runner.device)
        self._piece_buffers: dict[str, Tensor] | None = None
        self.memory_bytes = 0  # device memory the capture phase added, measured when it ends

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
        if mode == FULL:
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
        for entry in self.captured.values():
            for graph in entry.graphs:
                graph.reset()
        self.captured.clear()
        self._piece_buffers = None

    # --- recording ------------------------------------------------------------------------

    def warm_up(self, mode: int, size: int) -> None:
        """Runs the key's functions once on the capture stream, outside capture, so that lazy
        library state and the regular allocator's blocks exist before recording (and before the
        recording's memory is measured)."""
        self.stream.wait_stream(torch.cuda.current_stream())  # inputs were filled on the main stream
        with torch.cuda.stream(self.stream):
            for fn in self._fns(mode, size):
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)

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
        return [self._full_fn(size)] if mode == FULL else self._piece_fns(size)

    def _full_fn(self, size: int) -> Callable[[], None]:
        runner = self.runner

        def step() -> None:
            meta = runner.metadata(size, size, [])
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
