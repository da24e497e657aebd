"""Logits processing between the LM head and the sampler: grammar masks, logit biases,
repetition, frequency and presence penalties and min-p, with vLLM's meanings and order; and the
log probabilities a request asks for.

This runs after the step's graph (or eager step) has produced the hidden states, on the
sampled rows' logits only, so nothing here is recorded in a graph and no request's parameters
need a capture: each step's parameters are small per-row tensors copied in with the step. Rows
that ask for nothing are never written: their logits, and so their tokens, are bit for bit what
they would be in a batch where no row asks for anything.

Order, as vLLM v1 applies it: the grammar's mask (before the sampler), then the logit bias,
then the penalties (repetition, then frequency and presence), then, for drawn rows, min-p on
the temperature-scaled distribution (before top-k and top-p). Log probabilities are those of the
model's own distribution, before any of this (vLLM's default, ``raw_logprobs``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from graphkeeper.worker.executor.transfer import to_device
from graphkeeper.worker.plan import LogitsBatch, SamplingBatch


def process(logits: Tensor, batch: LogitsBatch, sampling: SamplingBatch | None) -> Tensor:
    """Float32 logits with the batch's rows processed; every other row keeps its values."""
    out = logits.float()
    if not len(batch.rows):
        return out
    if out.data_ptr() == logits.data_ptr():
        out = out.clone()  # the head's own output stays untouched
    device = out.device
    rows = to_device(batch.rows, device)
    sub = out.index_select(0, rows)
    if len(batch.mask_rows):
        where = to_device(batch.mask_rows, device)
        allowed = unpack_mask(to_device(batch.masks, device), sub.shape[-1])
        sub[where] = sub[where].masked_fill(~allowed, float("-inf"))
    (index, bias) = batch.bias
    if bias.size:
        at = (to_device(index[0], device), to_device(index[1], device))
        sub.index_put_(at, to_device(bias, device), accumulate=True)
    if batch.seen.size:
        r, t = to_device(batch.seen[0], device), to_device(batch.seen[1], device)
        penalty = to_device(batch.repetition, device)[r]
        values = sub[r, t]
        sub[r, t] = torch.where(values > 0, values / penalty, values * penalty)
    if batch.counts.size:
        r, t = to_device(batch.counts[0], device), to_device(batch.counts[1], device)
        count = to_device(batch.counts[2], device).float()
        minus = to_device(batch.frequency, device)[r] * count + to_device(batch.presence, device)[r]
        sub.index_put_((r, t), -minus, accumulate=True)
    if sampling is not None and batch.min_p.any():
        _min_p(sub, batch.min_p, sampling.temperature[batch.rows])
    return out.index_copy_(0, rows, sub)


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


def unpack_mask(words: Tensor, vocab: int) -> Tensor:
    """Bool ``[rows, vocab]`` from a grammar's bitmask ``[rows, ceil(vocab / 32)]`` of int32
    (bit ``j`` of word ``w`` allows token ``32 w + j``)."""
    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    allowed = (words[:, :, None] >> bits) & 1
    return allowed.reshape(words.shape[0], -1)[:, :vocab].bool()


def raw_logprobs(logits: Tensor) -> Tensor:
    """The model's log probabilities in float32 (before any processing)."""
    return logits.float().log_softmax(dim=-1)


def pick_logprobs(logprobs: Tensor, tokens: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's chosen token's log probability ``[N]`` and its ``top`` most likely tokens'
    values and ids ``[N, top]`` (most likely first)."""
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    values, ids = logprobs.topk(max(top, 0), dim=-1) if top > 0 else (logprobs[:, :0], tokens[:, None][:, :0])
    return chosen, values, ids

