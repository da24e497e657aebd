"""Repetition, frequency and presence penalties in one launch, and a step's sampled tokens counted
into the penalty rows in another.

Done with PyTorch operations, a step's penalties cost about thirty launches from Python (two
index selections, comparisons, two ``where``, the arithmetic, an ``index_put_`` with accumulation
for the counts). The device work is small; the host's is not: on the H200, with half of 64 decode
streams penalised, the engine thread spent about 1.5 ms of a 4.6 ms step on them (a py-spy profile,
``bench/results/sampling-h200.md``), and the engine thread is what limits such a step. Here the
host sends one int32 parameter block per step and launches two kernels.

The parameter block, ``[6, P]`` int32 for ``P`` penalised rows: the row in the processed logits,
the sample row whose token is counted, the row's KV slot (its row of counts), then the repetition,
frequency and presence parameters as float32 bits. Arithmetic as ``PenaltyCounts.apply``: a
repetition of 1 and frequency and presence of 0 leave a row's logits exactly as they were.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from graphkeeper.worker.kernels.launch_memo import LaunchMemo
from graphkeeper.worker.kernels.triton_support import tl, triton

#: Vocabulary entries one program of the penalty kernel processes.
BLOCK = 2048

if triton is not None:

    @triton.jit
    def _apply_kernel(logits_ptr, stride_l, counts_ptr, prompt_ptr, params_ptr, P, V, BLOCK: tl.constexpr):
        k = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        row = tl.load(params_ptr + k).to(tl.int64)
        slot = tl.load(params_ptr + 2 * P + k).to(tl.int64)
        repetition = tl.load(params_ptr + 3 * P + k).to(tl.float32, bitcast=True)
        frequency = tl.load(params_ptr + 4 * P + k).to(tl.float32, bitcast=True)
        presence = tl.load(params_ptr + 5 * P + k).to(tl.float32, bitcast=True)
        x = tl.load(logits_ptr + row * stride_l + cols, mask=ok, other=0.0)
        counts = tl.load(counts_ptr + slot * V + cols, mask=ok, other=0)
        in_prompt = tl.load(prompt_ptr + slot * V + cols, mask=ok, other=0) != 0
        seen = (counts > 0) | in_prompt
        # Division rounded to nearest, as PyTorch's (Triton may lower a float32 "/" to an approximate one).
        x = tl.where(seen, tl.where(x > 0, tl.div_rn(x, repetition), x * repetition), x)
        x = x - (frequency * counts.to(tl.float32) + presence * (counts > 0).to(tl.float32))
        tl.store(logits_ptr + row * stride_l + cols, x, mask=ok)

    @triton.jit
    def _count_kernel(tokens_ptr, counts_ptr, params_ptr, P, V):
        k = tl.program_id(0)
        sample_row = tl.load(params_ptr + P + k).to(tl.int64)
        slot = tl.load(params_ptr + 2 * P + k).to(tl.int64)
        token = tl.load(tokens_ptr + sample_row).to(tl.int64)
        tl.atomic_add(counts_ptr + slot * V + token, 1)

    _apply = LaunchMemo(_apply_kernel)
    _count = LaunchMemo(_count_kernel)


def params(entries: np.ndarray, sample_rows: np.ndarray, slots: np.ndarray, repetition: np.ndarray,
           frequency: np.ndarray, presence: np.ndarray) -> np.ndarray:
    """The parameter block ``[6, P]`` int32 (see the module's docstring), built on the host."""
    ints = np.stack([entries, sample_rows, slots]).astype(np.int32)
    floats = np.stack([repetition, frequency, presence]).astype(np.float32).view(np.int32)
    return np.concatenate([ints, floats])


def apply(logits: Tensor, counts: Tensor, prompt: Tensor, block: Tensor, penalised: int) -> None:
    """Applies the penalties in place to ``logits`` ``[N, V]`` (float32, rows contiguous) for the
    ``penalised`` rows the parameter ``block`` (int32, on the device) names."""
    vocab = logits.shape[1]
    # The prompt marks as bytes: the same memory, a pointer type every Triton build loads alike.
    _apply.launch((penalised, triton.cdiv(vocab, BLOCK)), logits, logits.stride(0), counts, prompt.view(torch.uint8),
                  block, penalised, vocab, BLOCK=BLOCK, num_warps=4)


def count(tokens: Tensor, counts: Tensor, block: Tensor, penalised: int) -> None:
    """Adds each penalised row's sampled token (``tokens``, per sample row) to its slot's counts."""
    _count.launch((penalised,), tokens, counts, block, penalised, counts.shape[1], num_warps=1)
