"""Logits processing between the LM head and the sampler: grammar masks, logit biases,
repetition, frequency and presence penalties and min-p, with vLLM's meanings and, in effect, its
order; and the log probabilities a request asks for.

This runs after the step's graph (or eager step) has produced the hidden states, on the
sampled rows' logits only, so nothing here is recorded in a graph and no request's parameters
need a capture: each step's parameters are small per-row tensors copied in with the step. Rows
that ask for nothing are never written: their logits, and so their tokens, are bit for bit what
they would be in a batch where no row asks for anything.

Order: the logit bias, the penalties (repetition, then frequency and presence; their counts are
on the device, ``penalty_counts.py``), the grammar's mask, then, for drawn rows, min-p on the
temperature-scaled distribution (before top-k and top-p). vLLM v1 masks first; the result is the
same: a masked token is ``-inf``, which a finite bias, a positive repetition factor and finite
count penalties leave ``-inf``, and an allowed token is not touched by the mask. Masking last lets
the masks be computed (on llguidance's threads) while the LM head, bias and penalties are
launched. The step's index arrays reach the device in one copy. Log probabilities are those of
the model's own distribution, before any of this (vLLM's default, ``raw_logprobs``): the runner
takes them from the LM head's output (``kernels/logprob_kernel.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from graphkeeper.worker.executor.penalty_counts import PenaltyCounts
from graphkeeper.worker.executor.sampling import sample
from graphkeeper.worker.executor.transfer import to_device, to_device_all
from graphkeeper.worker.kernels import mask_kernel
from graphkeeper.worker.kernels.argmax_kernel import argmax
from graphkeeper.worker.kernels.triton_support import available
from graphkeeper.worker.plan import LogitsBatch, SamplingBatch


def sample_processed(head: Tensor, batch: LogitsBatch, sampling: SamplingBatch | None,
                     penalties: PenaltyCounts) -> Tensor:
    """The step's tokens from the LM head's logits ``head`` with the batch's rows processed.

    A step with no drawn row (``sampling`` None) processes only the rows that ask, in float32, and
    takes every other row's argmax on the head's own output, then puts the processed rows' in:
    the whole batch is neither converted to float32 nor copied back (three passes over every
    row's vocabulary, each step a request asks for anything). A row's token is the argmax of the
    same values either way. A step with a drawn row samples the whole processed batch, as
    ``sample`` does."""
    if not len(batch.rows):  # log probabilities only: nothing to process
        return sample(head, sampling)
    if sampling is not None:
        return sample(process(head, batch, sampling, penalties), sampling)
    rows, processed = process_rows(head, batch, None, penalties)
    return argmax(head).index_copy_(0, rows, argmax(processed))


def process(logits: Tensor, batch: LogitsBatch, sampling: SamplingBatch | None, penalties: PenaltyCounts) -> Tensor:
    """Float32 logits with the batch's rows processed; every other row keeps its values.
    ``penalties`` holds the penalised sequences' counts; the batch's resets are applied first."""
    out = logits.float()
    if not len(batch.rows):
        return out
    if out.data_ptr() == logits.data_ptr():
        out = out.clone()  # the head's own output stays untouched
    rows, sub = process_rows(out, batch, sampling, penalties)
    return out.index_copy_(0, rows, sub)


def process_rows(logits: Tensor, batch: LogitsBatch, sampling: SamplingBatch | None,
                 penalties: PenaltyCounts) -> tuple[Tensor, Tensor]:
    """The batch's rows (on the device) and their logits processed, float32 ``[len(rows), vocab]``
    (``logits`` is left as it is)."""
    device = logits.device
    rows, mask_rows, bias_at, reset_slots, reset_prompt, reset_output = to_device_all(
        [batch.rows, batch.mask_rows, batch.bias[0], batch.reset_slots, batch.reset_prompt, batch.reset_output],
        device)
    sub = logits.index_select(0, rows).float()
    if batch.bias[1].size:
        sub.index_put_((bias_at[0], bias_at[1]), to_device(batch.bias[1], device), accumulate=True)
    if len(batch.reset_slots):
        penalties.cover(int(batch.reset_slots.max()) + 1)
        penalties.reset(reset_slots, reset_prompt, reset_output)
    if len(batch.penalised):
        penalties.penalise(sub, batch)
    if len(batch.mask_rows):  # last of the three: its masks computed meanwhile (-inf stays -inf through them)
        apply_masks(sub, to_device(batch.finished_masks(), device), mask_rows)
    if sampling is not None and batch.min_p.any():
        _min_p(sub, batch.min_p, sampling.temperature[batch.rows])
    return rows, sub


def count_sampled(penalties: PenaltyCounts, batch: LogitsBatch, tokens: Tensor) -> None:
    """Adds each penalised row's sampled token to its sequence's counts, on the device, queued
    right after the sampling: the next step's penalties find them there."""
    if len(batch.penalised):
        penalties.count_step(batch, tokens)


def _min_p(sub: Tensor, min_p: np.ndarray, temperature: np.ndarray) -> None:
    """Drops the tokens of drawn rows whose probability at the row's temperature is below
    ``min_p`` times the most likely one's: ``p_i >= min_p * p_max`` is ``l_i >= l_max + T ln min_p``."""
    drawn = (min_p > 0) & (temperature > 0)
    if not drawn.any():
        return
    idx = np.flatnonzero(drawn)
    offset = temperature[idx].astype(np.float64) * np.log(min_p[idx].astype(np.float64))
    where = to_device(idx, sub.device)
    part = sub[where]
    floor = part.max(dim=-1, keepdim=True).values + to_device(offset.astype(np.float32), sub.device)[:, None]
    sub[where] = part.masked_fill(part < floor, float("-inf"))


def apply_masks(sub: Tensor, masks: Tensor, rows: Tensor) -> None:
    """Sets to ``-inf``, in ``sub``'s rows ``rows``, every token their grammars' bitmasks
    ``masks`` (``[len(rows), words]`` int32) do not allow: on CUDA in one launch
    (``mask_kernel``), elsewhere by unpacking the masks."""
    if available(sub.device):
        mask_kernel.apply(sub, masks, rows)
        return
    allowed = unpack_mask(masks, sub.shape[-1])
    sub[rows] = sub[rows].masked_fill(~allowed, float("-inf"))


def unpack_mask(words: Tensor, vocab: int) -> Tensor:
    """Bool ``[rows, vocab]`` from a grammar's bitmask ``[rows, ceil(vocab / 32)]`` of int32
    (bit ``j`` of word ``w`` allows token ``32 w + j``)."""
    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    allowed = (words[:, :, None] >> bits) & 1
    return allowed.reshape(words.shape[0], -1)[:, :vocab].bool()
