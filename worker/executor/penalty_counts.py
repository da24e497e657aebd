"""Penalty state on the device: each penalised sequence's output-token counts and prompt tokens,
one row per KV slot, updated by the device itself with every token it samples.

Repetition, frequency and presence penalties need every earlier output token of their sequence.
Kept on the host, they would make each step wait for the step before it to reach the host before
its logits could be processed, and rebuild sparse count arrays from Python dictionaries for every
penalised row of every step. Here the device adds each sampled token to its row right after the
sampling that drew it, in stream order, so the next step's penalties read counts that are already
complete, and the host sends only which rows are penalised and their parameters.

A row is (re)initialised, from the host's copy of the sequence, in the first step in which the
sequence samples on that slot (``LogitsBatch.reset_*``): at admission (no output yet) and after a
preemption put it on a new slot (its output so far). Stream order makes the reset safe against a
previous owner's last update: that update was queued by an earlier step.

The rows cover the highest slot a penalised sequence has used, grown by doubling on demand:
at most ``max_num_seqs x vocab x 5`` bytes, nothing while no request asks for a penalty.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphkeeper.worker.executor.transfer import to_device, to_device_all
from graphkeeper.worker.kernels import penalty_kernel
from graphkeeper.worker.kernels.triton_support import available
from graphkeeper.worker.plan import LogitsBatch


class PenaltyCounts:
    """Output-token counts (int32) and prompt-token marks (bool), ``[slots, vocab]``, on the device."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.counts = torch.zeros((0, vocab), dtype=torch.int32, device=device)
        self.prompt = torch.zeros((0, vocab), dtype=torch.bool, device=device)
        #: On CUDA, the step's penalty parameter block (``penalty_kernel``), sent once by
        #: ``penalise`` and read again by ``count_step`` after the sampling.
        self._block: Tensor | None = None

    def release(self) -> None:
        """Drops every row (a sleeping worker runs nothing; a sequence that samples after the wake
        starts its row over, as every sequence does on a slot it has not counted on)."""
        self.counts = self.counts.new_zeros((0, self.vocab))
        self.prompt = self.prompt.new_zeros((0, self.vocab))

    def cover(self, slots: int) -> None:
        """Rows for slots ``0 .. slots - 1`` at least (new rows are zero)."""
        have = self.counts.shape[0]
        if slots <= have:
            return
        rows = max(slots, 2 * have, 8)
        counts = self.counts.new_zeros((rows, self.vocab))
        prompt = self.prompt.new_zeros((rows, self.vocab))
        counts[:have] = self.counts
        prompt[:have] = self.prompt
        self.counts, self.prompt = counts, prompt

    def reset(self, slots: Tensor, prompt: Tensor, output: Tensor) -> None:
        """Rows ``slots`` start over: marks for ``prompt`` ``[2, k]`` (slot, token) and counts for
        ``output`` ``[2, k]`` (slot, token; a token repeated is counted each time)."""
        self.counts.index_fill_(0, slots, 0)
        self.prompt.index_fill_(0, slots, False)
        if prompt.shape[1]:
            marks = torch.ones(prompt.shape[1], dtype=torch.bool, device=self.prompt.device)
            self.prompt.index_put_((prompt[0], prompt[1]), marks)
        if output.shape[1]:
            self.add(output[0], output[1])

    def add(self, slots: Tensor, tokens: Tensor) -> None:
        """One more of ``tokens[i]`` in row ``slots[i]`` (repeats accumulate)."""
        ones = torch.ones(len(slots), dtype=torch.int32, device=self.counts.device)
        self.counts.index_put_((slots, tokens), ones, accumulate=True)

    def penalise(self, sub: Tensor, batch: LogitsBatch) -> None:
        """Applies the batch's penalties in place to ``sub`` (float32, a row per entry of
        ``batch.rows``): on CUDA in one kernel launch, elsewhere through ``apply``."""
        at = batch.penalised
        if available(sub.device):
            block = penalty_kernel.params(at, batch.rows[at], batch.penalty_slots, batch.repetition[at],
                                          batch.frequency[at], batch.presence[at])
            self._block = to_device(block, sub.device)
            penalty_kernel.apply(sub, self.counts, self.prompt, self._block, len(at))
            return
        penalised, slots = to_device_all([at, batch.penalty_slots], sub.device)
        repetition, frequency, presence = to_device_all(
            [batch.repetition[at], batch.frequency[at], batch.presence[at]], sub.device)
        counted = bool(batch.frequency[at].any() or batch.presence[at].any())
        done = self.apply(sub.index_select(0, penalised), slots,
                          repetition if (batch.repetition[at] != 1.0).any() else None,
                          frequency if counted else None, presence if counted else None)
        sub.index_copy_(0, penalised, done)

    def count_step(self, batch: LogitsBatch, tokens: Tensor) -> None:
        """Adds each penalised row's sampled token (``tokens``, per sample row) to its counts."""
        if self._block is not None:
            penalty_kernel.count(tokens, self.counts, self._block, len(batch.penalised))
            self._block = None
            return
        sample_rows, slots = to_device_all([batch.rows[batch.penalised], batch.penalty_slots], tokens.device)
        self.add(slots, tokens.index_select(0, sample_rows))

    def apply(self, logits: Tensor, slots: Tensor, repetition: Tensor | None, frequency: Tensor | None,
              presence: Tensor | None) -> Tensor:
        """``logits`` ``[P, vocab]`` (float32) of the sequences in rows ``slots`` with their
        penalties, vLLM's order and meanings: repetition divides a positive logit and multiplies a
        negative one of every token seen in the prompt or the output; then frequency times the
        count and presence once are subtracted for every token in the output. A parameter given as
        None is neutral for every row (its arithmetic is skipped)."""
        counts = self.counts.index_select(0, slots)
        out = logits
        if repetition is not None:
            seen = (counts > 0) | self.prompt.index_select(0, slots)
            penalty = repetition[:, None]
            out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
        if frequency is not None:
            out = out - (frequency[:, None] * counts + presence[:, None] * (counts > 0))
        return out
