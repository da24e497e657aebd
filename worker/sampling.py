"""Turns logits into next tokens: greedy at temperature 0; temperature, top-k and top-p otherwise.

Each sampled sequence draws from its own generator, seeded per request, and draws exactly once
per step, so a seeded request produces the same tokens alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: Tensor, specs: list[SamplingSpec], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[N, vocab]`` (float32); one host sync for the batch."""
    greedy = logits.argmax(dim=-1)
    sampled_rows = [i for i, spec in enumerate(specs) if not spec.greedy]
    if not sampled_rows:
        return greedy.tolist()
    tokens = greedy.clone()
    rows = torch.tensor(sampled_rows, device=logits.device)
    probs = _filtered_probs(logits[rows], [specs[i] for i in sampled_rows])
    for j, row in enumerate(sampled_rows):
        tokens[row] = torch.multinomial(probs[j], 1, generator=generators[row])[0]
    return tokens.tolist()


def _filtered_probs(logits: Tensor, specs: list[SamplingSpec]) -> Tensor:
    """Softmax of temperature-scaled logits with top-k and top-p applied per row."""
    device = logits.device
    temperature = torch.tensor([s.temperature for s in specs], device=device)[:, None]
    scaled = logits / temperature
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs], device=device)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([s.top_p for s in specs], device=device)[:, None]
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    outside = (probs.cumsum(dim=-1) - probs) >= top_p
    probs = probs.masked_fill(outside, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)
