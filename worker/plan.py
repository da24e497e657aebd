"""The step plan: what the scheduler hands the runner for one step, as plain host data.

This is the contract between the engine (which decides which rows run) and the executor (which
runs them on the device), as vLLM's ``SchedulerOutput`` is: numpy arrays and small dataclasses,
no torch, so the scheduler and its tests never load the device stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PrefillChunk:
    """A run of one prompt's tokens in a step: ``length`` rows from ``row``, at ``start`` in ``slot``."""

    row: int  # first row of the chunk in the flat batch
    length: int  # tokens in the chunk
    slot: int
    start: int  # position of the chunk's first token


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SamplingBatch:
    """Per-sample-row parameters of a step that has at least one non-greedy row (host arrays)."""

    temperature: np.ndarray  # float32, 0 for greedy rows
    top_k: np.ndarray  # int64, 0 for no limit
    top_p: np.ndarray  # float32
    seeds: np.ndarray  # int64
    sample_index: np.ndarray  # int64: which token of its request each row samples

    @classmethod
    def build(cls, specs: list[SamplingSpec], seeds: list[int], sample_index: np.ndarray) -> SamplingBatch:
        return cls(
            temperature=np.array([s.temperature for s in specs], dtype=np.float32),
            top_k=np.array([s.top_k for s in specs], dtype=np.int64),
            top_p=np.array([s.top_p for s in specs], dtype=np.float32),
            seeds=np.array(seeds, dtype=np.int64), sample_index=np.asarray(sample_index, dtype=np.int64),
        )


@dataclass
class StepPlan:
    """A scheduled step, flat: decode rows first, then prefill chunks.

    Decode rows carry no token here: each reads its slot's latest sampled token on the device.
    A row's keys go to its slot's blocks (the KV cache's block table, which ``block_updates``
    changes), at its position.
    ``sample_rows`` are the rows whose next token is needed (every decode row, and the last row
    of a prefill chunk that completes its prompt); ``sample_slots`` their slots.
    """

    prompt_tokens: list[int]
    positions: np.ndarray
    slots: np.ndarray
    num_decode: int
    prefill: list[PrefillChunk] = field(default_factory=list)
    sample_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sample_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sampling: SamplingBatch | None = None
    decode_tokens: np.ndarray | None = None  # given only by probes and warm-up, which have no history
    #: Block-table changes ``[3, k]`` (slot, index in the slot's table, block), applied before the
    #: step runs; each (slot, index) at most once. None when the step changes no table.
    block_updates: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def num_samples(self) -> int:
        return len(self.sample_rows)

    @property
    def uniform_decode(self) -> bool:
        return not self.prefill and self.num_decode == self.num_tokens
