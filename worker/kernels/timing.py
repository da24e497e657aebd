"""Timing kernels the way a captured step runs them: as CUDA graph replays, on the GPU's clock.

Tuning (which tile, which kernel) and the one-token step choice measure with these, so Python's
launch cost, which a replayed graph does not pay, is not part of any figure.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

#: Weight bytes a tuning run cycles through: several times an H200's 50 MB L2 cache.
L2_FLUSH_BYTES = 256 * 2**20
#: At most this many copies are made (a small weight would need thousands).
MAX_COPIES = 64


def weight_copies(weight: Tensor) -> list[Tensor]:
    """``weight`` and enough clones of it that cycling through them leaves the L2 cache."""
    nbytes = weight.numel() * weight.element_size()
    return [weight] + [weight.clone() for _ in range(min(MAX_COPIES, -(-L2_FLUSH_BYTES // nbytes)) - 1)]


def graph_time(fn, weights: list[Tensor], replays: int = 5) -> float:
    """Seconds per launch of ``fn(weight)``, replayed from a CUDA graph that launches it once per
    weight copy (at least 20 launches)."""
    launches = max(20, len(weights))

    def record() -> None:
        for i in range(launches):
            fn(weights[i % len(weights)])

    return replay_seconds(record, warm=lambda: [fn(w) for w in weights[:2]], replays=replays) / launches


def replay_seconds(record: Callable[[], None], warm: Callable[[], object] | None = None, replays: int = 5) -> float:
    """GPU seconds per replay of a CUDA graph of ``record()``. ``warm`` (default: ``record``) runs
    first, outside capture, so lazy state exists; one untimed replay precedes the timed ones."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (warm or record)()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            record()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    graph.reset()
    return start.elapsed_time(end) / 1e3 / replays
