"""Turns logits into next tokens on the device: greedy at temperature 0; temperature, top-k and
top-p otherwise. No host synchronisation: the tokens stay on the device until the step loop
copies them back in one asynchronous copy.

Sampling draws by the exponential race (the index of the largest ``p / E`` with ``E`` standard
exponential is a draw from ``p``), with noise from a counter-based hash of the request's seed
and the index of the token being sampled. A seeded request therefore gets the same tokens alone
or in any batch, in any row, with any neighbours, and sampling is one set of vector operations
for the whole batch instead of a generator call per row.

Both argmaxes go through ``argmax_kernel.argmax``: torch's result, reduced in parallel over the
vocabulary.

Every accepted parameter is numerically safe: logits are shifted by their row maximum before
the temperature divides them, so the largest scaled logit is 0 and nothing overflows, even at a
temperature of 1e-45.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphkeeper.worker.executor.transfer import to_device
from graphkeeper.worker.kernels.argmax_kernel import argmax
from graphkeeper.worker.plan import SamplingBatch

# splitmix64 constants, as signed 64-bit integers (torch has no unsigned 64-bit arithmetic).
_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def sample(logits: Tensor, batch: SamplingBatch | None) -> Tensor:
    """One token per row of ``logits`` ``[N, vocab]``, as a device tensor of int64.

    Greedy steps read the logits in whatever dtype the LM head made them (the argmax of bf16
    values is the argmax of their float32 copies); sampling computes in float32.
    """
    greedy = argmax(logits)
    if batch is None:
        return greedy
    logits = logits.float()
    device = logits.device
    temperature = to_device(batch.temperature, device)
    sampled = temperature > 0
    probs = filtered_probs(logits, temperature.clamp_min(1e-45)[:, None], to_device(batch.top_k, device)[:, None],
                           to_device(batch.top_p, device)[:, None])
    noise = exponential_noise(to_device(batch.seeds, device), to_device(batch.sample_index, device),
                              logits.shape[-1])
    drawn = argmax(probs / noise)
    return torch.where(sampled, drawn, greedy)


def filtered_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Softmax of temperature-scaled logits with top-k and top-p applied per row; every row is a
    finite distribution for any temperature > 0."""
    shifted = logits - logits.max(dim=-1, keepdim=True).values  # <= 0: division cannot overflow
    scaled = shifted / temperature
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    limit = torch.where(top_k > 0, top_k, vocab)
    sorted_logits = sorted_logits.masked_fill(ranks >= limit, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    outside = (probs.cumsum(dim=-1) - probs) >= torch.where(top_p > 0, top_p, 1.0)
    probs = probs.masked_fill(outside, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def exponential_noise(seeds: Tensor, sample_index: Tensor, vocab: int) -> Tensor:
    """Standard exponential noise ``[N, vocab]``, a pure function of (seed, sample index, token)."""
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    counter = _mix(seeds * _GOLDEN + sample_index)[:, None] + token * _GOLDEN
    bits = _shr(_mix(counter), 40)  # the top 24 bits
    uniform = (bits.float() + 0.5) / float(1 << 24)  # in (0, 1): the logarithm is finite
    return -torch.log(uniform)


def _shr(x: Tensor, n: int) -> Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(z: Tensor) -> Tensor:
    """splitmix64's finaliser: every output bit depends on every input bit."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)
