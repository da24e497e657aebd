"""A step's log probabilities in two short launches: each row's chosen token's log probability
and its ``top`` most likely alternatives, packed in one float32 table for one copy back.

Why: PyTorch's path (a float32 ``log_softmax`` of the rows that asked, ``gather``, ``topk`` over
a 128k vocabulary, three copies back) is a dozen launches, allocations and pinned copies per step.
On the H100 a batch of 64 with half its rows asking for ``logprobs=5`` spent 0.3 ms of host time
per step there, and the engine thread, which sets the step's pace, had no slack left
(``bench/results``). Here the first kernel cuts each row into chunks, one program per
(row, chunk): the chunk's maximum, its sum of ``exp(x - max)`` and its own ``top`` largest values;
the second kernel, one program per row, combines the chunks into the row's log-sum-exp, subtracts
it from the chosen token's logit and picks the row's ``top`` among the chunks' candidates (the
row's top ``top`` are among them: each chunk kept its own top ``top``).

The table's row is ``[chosen, top values..., top ids...]``, width ``1 + 2 * top``; ids travel as
float32, exact below 2**24 (every vocabulary here is under 300k). ``top`` is a runtime loop
bound, so one compiled kernel serves every request's count up to ``SLOTS``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphkeeper.worker.kernels import pdl
from graphkeeper.worker.kernels.launch_memo import LaunchMemo
from graphkeeper.worker.kernels.triton_support import available, tl, triton

#: Elements each program of the first kernel reduces.
CHUNK = 4096
#: The most alternatives a row may ask for here (OpenAI's and vLLM's limit); more go to PyTorch.
SLOTS = 20
#: Ids travel as float32 in the table: exact below this.
MAX_VOCAB = 1 << 24


if triton is not None:
    from graphkeeper.worker.kernels.pdl import await_inputs

    @triton.jit(do_not_specialize=["top"])
    def _chunk_kernel(x_ptr, max_ptr, sum_ptr, val_ptr, idx_ptr, n, stride_x, top, CHUNKS,
                      CHUNK: tl.constexpr, SLOTS: tl.constexpr, USE_PDL: tl.constexpr):
        await_inputs(USE_PDL)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
        best = tl.max(x, axis=0)
        shift = tl.where(best == float("-inf"), 0.0, best)
        at = row * CHUNKS + chunk
        tl.store(max_ptr + at, best)
        tl.store(sum_ptr + at, tl.sum(tl.exp(x - shift), axis=0))
        i = 0
        while i < top:
            value = tl.max(x, axis=0)
            first = tl.min(tl.where(x == value, cols, n), axis=0)
            tl.store(val_ptr + at * SLOTS + i, value)
            tl.store(idx_ptr + at * SLOTS + i, first)
            x = tl.where(cols == first, float("-inf"), x)
            i += 1

    @triton.jit(do_not_specialize=["top"])
    def _row_kernel(x_ptr, tokens_ptr, max_ptr, sum_ptr, val_ptr, idx_ptr, out_ptr, n, stride_x, top, CHUNKS,
                    CHUNKS_PAD: tl.constexpr, SLOTS: tl.constexpr, CANDIDATES: tl.constexpr,
                    USE_PDL: tl.constexpr):
        await_inputs(USE_PDL)
        row = tl.program_id(0)
        chunks = tl.arange(0, CHUNKS_PAD)
        ok = chunks < CHUNKS
        maxima = tl.load(max_ptr + row * CHUNKS + chunks, mask=ok, other=float("-inf"))
        sums = tl.load(sum_ptr + row * CHUNKS + chunks, mask=ok, other=0.0)
        best = tl.max(maxima, axis=0)
        shift = tl.where(best == float("-inf"), 0.0, best)
        scale = tl.where(maxima == float("-inf"), 0.0, tl.exp(maxima - shift))
        lse = shift + tl.log(tl.sum(sums * scale, axis=0))
        width = 1 + 2 * top
        token = tl.load(tokens_ptr + row)
        tl.store(out_ptr + row * width, tl.load(x_ptr + row * stride_x + token).to(tl.float32) - lse)
        j = tl.arange(0, CANDIDATES)
        kept = (j // SLOTS < CHUNKS) & (j % SLOTS < top)
        values = tl.load(val_ptr + row * CHUNKS * SLOTS + j, mask=kept, other=float("-inf"))
        ids = tl.load(idx_ptr + row * CHUNKS * SLOTS + j, mask=kept, other=n)
        i = 0
        while i < top:
            value = tl.max(values, axis=0)
            first = tl.min(tl.where(values == value, ids, n), axis=0)  # ties: the smaller id first
            tl.store(out_ptr + row * width + 1 + i, value - lse)
            tl.store(out_ptr + row * width + 1 + top + i, first.to(tl.float32))
            values = tl.where(ids == first, float("-inf"), values)
            i += 1

    _chunks = LaunchMemo(_chunk_kernel)
    _rows = LaunchMemo(_row_kernel)


def supported(logits: Tensor, top: int) -> bool:
    """Whether ``packed`` takes these logits: CUDA with Triton, a contiguous ``[rows, vocab]``,
    a vocabulary whose ids float32 holds exactly, at most ``SLOTS`` alternatives."""
    return (available(logits.device) and logits.dim() == 2 and logits.stride(1) == 1
            and logits.shape[1] < MAX_VOCAB and 0 <= top <= SLOTS)


def packed(logits: Tensor, tokens: Tensor, top: int) -> Tensor:
    """Every row's ``[log p(token), top log probabilities..., their ids...]`` (float32, ``[rows,
    1 + 2 * top]``) under ``log_softmax(logits)``, the most likely first; ``supported`` first."""
    rows, n = logits.shape
    chunks = triton.cdiv(n, CHUNK)
    device = logits.device
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    sums = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    values = torch.empty(rows, chunks, SLOTS, dtype=torch.float32, device=device)
    ids = torch.empty(rows, chunks, SLOTS, dtype=torch.int32, device=device)
    out = torch.empty(rows, 1 + 2 * top, dtype=torch.float32, device=device)
    if rows:
        options = pdl.launch_options()
        _chunks.launch((rows, chunks), logits, maxima, sums, values, ids, n, logits.stride(0), top, chunks,
                       CHUNK=CHUNK, SLOTS=SLOTS, num_warps=8, **options)
        _rows.launch((rows,), logits, tokens, maxima, sums, values, ids, out, n, logits.stride(0), top, chunks,
                     CHUNKS_PAD=triton.next_power_of_2(chunks), SLOTS=SLOTS,
                     CANDIDATES=triton.next_power_of_2(chunks * SLOTS), num_warps=4, **options)
    return out


def table(logits: Tensor, tokens: Tensor, top: int) -> Tensor:
    """``packed`` where ``supported`` (two launches on CUDA), else ``reference`` (PyTorch)."""
    return packed(logits, tokens, top) if supported(logits, top) else reference(logits, tokens, top)


def reference(logits: Tensor, tokens: Tensor, top: int) -> Tensor:
    """``packed`` in PyTorch operations (any device, any vocabulary): the CPU's path and the
    kernels' reference."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, tokens[:, None].long())
    values, ids = lp.topk(top, dim=-1) if top > 0 else (lp[:, :0], lp[:, :0])
    return torch.cat([chosen, values, ids.float()], dim=1)
