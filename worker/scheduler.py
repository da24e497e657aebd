"""Continuous batching: which sequences run in the next step, and how many tokens each brings.

Requests join and leave between steps. Each step takes every decoding sequence (one token each)
first, then prefill chunks, within ``max_num_seqs`` running sequences and a token budget per
step; long prompts are prefilled in chunks. A sequence holds one KV slot from admission until it
finishes or is cancelled.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.attention import PrefillChunk
from graphkeeper.worker.runner import StepPlan
from graphkeeper.worker.sampling import SamplingSpec


@dataclass(eq=False)
class Sequence:
    """One request's state in the engine. ``emit`` is called from the engine thread only."""

    request_id: str
    tenant: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingSpec
    emit: Callable[[str, Any], None]  # ("tokens", [ids]) or ("completion", pb.Completion)
    stop_ids: frozenset[int] = frozenset()
    eos_id: int | None = None
    seed: int | None = None
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    computed: int = 0  # tokens whose keys and values are in the cache
    generator: torch.Generator | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    graph_steps: Counter = field(default_factory=Counter)  # (mode, size) -> steps
    eager_steps: Counter = field(default_factory=Counter)  # reason -> steps
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def stop_reason(self) -> int:
        """The finish reason after the latest token, or UNSPECIFIED to continue."""
        last = self.output[-1]
        if last in self.stop_ids:
            return pb.FINISH_REASON_STOP
        if self.eos_id is not None and last == self.eos_id:
            return pb.FINISH_REASON_EOS
        if len(self.output) >= self.max_new_tokens:
            return pb.FINISH_REASON_LENGTH
        return pb.FINISH_REASON_UNSPECIFIED


@dataclass
class ScheduledStep:
    plan: StepPlan
    sequences: list[Sequence]  # every sequence with a row in the step
    samplers: list[Sequence]  # the sequence of each sample row, in row order


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk: int) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("the token budget per step must be at least max_num_seqs")
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.admitting = True  # False while the engine drains for a model change

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def reap_cancelled(self) -> list[Sequence]:
        """Removes cancelled sequences, freeing their slots; returns them."""
        gone = [s for s in self.running if s.cancelled.is_set()]
        gone += [s for s in self.waiting if s.cancelled.is_set()]
        for seq in gone:
            self.finish(seq)
        return gone

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when there is nothing to run."""
        self._admit()
        budget = self.token_budget
        tokens, positions, slots, samplers, sequences = [], [], [], [], []
        for seq in self.running:
            if not seq.prefilling:
                tokens.append(seq.output[-1])
                positions.append(seq.length - 1)
                slots.append(seq.slot)
                samplers.append(seq)
                sequences.append(seq)
        num_decode = len(tokens)
        budget -= num_decode
        sample_rows = list(range(num_decode))
        chunks: list[PrefillChunk] = []
        for seq in self.running:
            if not seq.prefilling or budget <= 0:
                continue
            n = min(budget, self.prefill_chunk, len(seq.prompt) - seq.computed)
            chunks.append(PrefillChunk(row=len(tokens), length=n, slot=seq.slot, start=seq.computed))
            tokens.extend(seq.prompt[seq.computed:seq.computed + n])
            positions.extend(range(seq.computed, seq.computed + n))
            slots.extend([seq.slot] * n)
            sequences.append(seq)
            budget -= n
            if seq.computed + n == len(seq.prompt):
                sample_rows.append(len(tokens) - 1)
                samplers.append(seq)
        if not tokens:
            return None
        plan = StepPlan(tokens, positions, slots, num_decode, chunks, sample_rows)
        return ScheduledStep(plan, sequences, samplers)

    def _admit(self) -> None:
        while self.admitting and self.waiting and self.free_slots and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.computed = 0
            self.running.append(seq)

    def advance(self, step: ScheduledStep) -> None:
        """Marks the step's tokens as computed (their keys and values are now in the cache)."""
        for chunk, seq in zip(step.plan.prefill, [s for s in step.sequences if s.prefilling], strict=True):
            seq.computed += chunk.length
        for seq in step.sequences[: step.plan.num_decode]:
            seq.computed = seq.length
