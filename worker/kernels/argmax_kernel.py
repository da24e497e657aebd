"""The index of each row's largest value (greedy decoding's token) in two short launches.

``torch.argmax`` over one row of a vocabulary-sized tensor runs in one block and took 29 us on
the H200 for 128k float32 logits: a thirtieth of llama-1b's whole decode step at batch 1, a
twentieth of its HBM floor. Here the first kernel cuts each row into chunks, one program per
(row, chunk), and keeps each chunk's maximum and the first index that holds it; the second
reduces a row's chunks. The result equals ``torch.argmax(x, -1)``: the first index of the
maximum, NaN counting as larger than every number (as torch does, when no value is ``+inf``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphkeeper.worker.kernels import pdl
from graphkeeper.worker.kernels.launch_memo import LaunchMemo
from graphkeeper.worker.kernels.triton_support import available, tl, triton

#: Elements each program of the first kernel reduces.
CHUNK = 4096
#: Rows shorter than this go to ``torch.argmax``: one chunk gains nothing.
MIN_COLUMNS = 2 * CHUNK


if triton is not None:
    from graphkeeper.worker.kernels.pdl import await_inputs

    @triton.jit
    def _chunk_kernel(x_ptr, values_ptr, index_ptr, n, stride_x, CHUNKS, CHUNK: tl.constexpr,
                      USE_PDL: tl.constexpr):
        await_inputs(USE_PDL)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch.argmax
        best = tl.max(x, axis=0)
        first = tl.min(tl.where(x == best, cols, n), axis=0)
        tl.store(values_ptr + row * CHUNKS + chunk, best)
        tl.store(index_ptr + row * CHUNKS + chunk, first)

    @triton.jit
    def _row_kernel(values_ptr, index_ptr, out_ptr, n, CHUNKS, CHUNKS_PAD: tl.constexpr, USE_PDL: tl.constexpr):
        await_inputs(USE_PDL)
        row = tl.program_id(0)
        chunks = tl.arange(0, CHUNKS_PAD)
        ok = chunks < CHUNKS
        values = tl.load(values_ptr + row * CHUNKS + chunks, mask=ok, other=float("-inf"))
        index = tl.load(index_ptr + row * CHUNKS + chunks, mask=ok, other=n)
        best = tl.max(values, axis=0)
        # Chunks are in column order, so the smallest index among the best chunks is the first.
        tl.store(out_ptr + row, tl.min(tl.where(values == best, index, n), axis=0).to(tl.int64))

    _chunks = LaunchMemo(_chunk_kernel)
    _rows = LaunchMemo(_row_kernel)


def argmax(x: Tensor) -> Tensor:
    """``torch.argmax(x, dim=-1)`` for a ``[rows, n]`` tensor, as int64; the two kernels on CUDA
    for long rows, ``torch.argmax`` otherwise."""
    if not available(x.device) or x.dim() != 2 or x.shape[1] < MIN_COLUMNS or x.stride(1) != 1:
        return x.argmax(dim=-1)
    rows, n = x.shape
    chunks = triton.cdiv(n, CHUNK)
    values = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    index = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        _chunks.launch((rows, chunks), x, values, index, n, x.stride(0), chunks, CHUNK=CHUNK, num_warps=8,
                       **pdl.launch_options())
        _rows.launch((rows,), values, index, out, n, chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), num_warps=1,
                     **pdl.launch_options())
    return out
