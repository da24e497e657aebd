"""The step plan: what the scheduler hands the runner for one step, as plain host data.

This is the contract between the engine (which decides which rows run) and the executor (which
runs them on the device), as vLLM's ``SchedulerOutput`` is: numpy arrays and small dataclasses,
no torch, so the scheduler and its tests never load the device stack.
"""

from __future__ import annotations

import functools
from array import array
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


class TokenLogprob(NamedTuple):
    """A sampled token's log probability under the model and its ``top`` alternatives, as
    ``(token, logprob)`` pairs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


#: A sampled token's log probabilities as the engine sends them: the ``computed`` alternatives'
#: line of the step's table (``kernels/logprob_kernel.py``: ``[chosen, computed values, computed
#: ids]`` as float32 bytes) and how many of them its request asked for. Bytes and two ints pickle in
#: a few hundred nanoseconds; ``TokenLogprob`` objects are built from them where they are served.
PackedLogprob = tuple[int, int, bytes]  # (computed, asked, line)


def line_logprob(token: int, line: list[float], computed: int, asked: int) -> TokenLogprob:
    """The ``TokenLogprob`` a table line (``[chosen, computed values, computed ids]``) holds for
    ``token``: its ``asked`` alternatives."""
    chosen, ids, values = line_parts(line, computed, asked)
    return TokenLogprob(token, chosen, tuple(zip(ids, values, strict=True)))


def line_parts(line: list[float], computed: int, asked: int) -> tuple[float, list[int], list[float]]:
    """A table line's chosen token's log probability and its ``asked`` alternatives' ids and log
    probabilities, most likely first (the one place that reads the line's layout)."""
    return line[0], [int(i) for i in line[1 + computed:1 + computed + asked]], line[1:1 + asked]


def packed_parts(packed: PackedLogprob) -> tuple[float, list[int], list[float]]:
    """``line_parts`` of a packed line."""
    computed, asked, line = packed
    return line_parts(array("f", line).tolist(), computed, asked)


def unpack_logprob(token: int, packed: PackedLogprob) -> TokenLogprob:
    """The ``TokenLogprob`` a packed line holds for ``token``: its ``asked`` alternatives."""
    computed, asked, line = packed
    return line_logprob(token, array("f", line).tolist(), computed, asked)  # a quarter of numpy's time


class PackedEntry(NamedTuple):
    """A token with its log probabilities as the engine sent them: a stream keeps this, and the
    front end that serves it reads the line once, into its own message (gRPC) or through
    ``unpacked`` (HTTP). A ``TokenLogprob`` is a tuple of tuples, seven objects the collector
    tracks for each token; this is one."""

    token: int
    packed: PackedLogprob


def unpacked(entries: list) -> list:
    """``entries`` with every ``PackedEntry`` as its ``TokenLogprob`` (others as they are)."""
    return [unpack_logprob(*e) if isinstance(e, PackedEntry) else e for e in entries]


class Sampled(list):
    """A stream's new token ids in an update, with ``logprobs`` (one ``TokenLogprob`` per id)
    for a request that asked for them, and with its first token the prompt's (``prompt_logprobs``,
    one per prompt token after the first) for a request that asked for those. A list, so every
    consumer of plain token lists (the gRPC and HTTP streams, the engine-core channel, which
    pickles the attributes with it) takes it unchanged; the ones that serve log probabilities
    read the attributes.

    The engine passes its log probabilities ``packed`` (one ``PackedLogprob`` per id): the engine
    thread, which sets the step's pace, neither builds nor pickles an object per alternative;
    ``logprobs`` unpacks them on first read, in the API process."""

    def __init__(self, tokens: list[int], logprobs: list[TokenLogprob] | None,
                 prompt_logprobs: list[TokenLogprob] | None = None,
                 packed: list[PackedLogprob] | None = None) -> None:
        super().__init__(tokens)
        self._logprobs = logprobs
        self._packed = packed
        self.prompt_logprobs = prompt_logprobs

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        if self._packed is not None:
            self._logprobs = [unpack_logprob(t, p) for t, p in zip(self, self._packed, strict=True)]
            self._packed = None
        return self._logprobs

    def logprob_entries(self) -> list[TokenLogprob | PackedEntry] | None:
        """The tokens' log probabilities for a stream to keep: still packed (``PackedEntry``) when
        the engine sent them so, else as ``logprobs`` holds them."""
        if self._packed is not None:
            return [PackedEntry(t, p) for t, p in zip(self, self._packed, strict=True)]
        return self._logprobs


@dataclass(frozen=True)
class PromptLogprobs:
    """Prompt log probabilities a prefill chunk computes: the chunk's first ``len(targets)`` rows
    each give the log probability of ``targets[i]``, the prompt token after the row's."""

    chunk: int  # index into the plan's ``prefill``
    top: int
    targets: np.ndarray  # int64


@dataclass(frozen=True)
class LogitsSpec:
    """What one request asks of its logits beyond temperature, top-k and top-p (vLLM's meanings).

    Neutral values change nothing: penalties 0 (repetition 1), no bias, ``min_p`` 0, no grammar.
    ``logprobs`` is -1 for none, else the count of alternatives returned beside each token.
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int = -1
    constrained: bool = False
    #: Alternatives for each prompt token's log probability; -1: the prompt's are not computed.
    prompt_logprobs: int = -1

    @functools.cached_property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @functools.cached_property
    def changes_logits(self) -> bool:
        """Whether the row's logits differ from the model's before temperature (not logprobs)."""
        return self.penalised or bool(self.logit_bias) or self.min_p > 0.0 or self.constrained

    @property
    def needs_history(self) -> bool:
        """Whether the row needs every earlier token on the host before its logits are processed
        (the grammar's state), so the step before it must be read first. Penalties need no such
        thing: their counts are kept on the device (``executor/penalty_counts.py``)."""
        return self.constrained

    @functools.cached_property
    def row_parameters(self) -> tuple[float, float, float, float]:
        """(presence, frequency, repetition, min-p): the row's entries in a ``LogitsBatch``.

        These four and the two flags above are read for every row of every step; a spec never
        changes, so each is computed once (``cached_property`` writes the instance's ``__dict__``,
        which a frozen dataclass allows; equality still compares the fields alone)."""
        return self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.min_p


@dataclass
class LogitsBatch:
    """A step's logits processing, host arrays; built only when some sample row asks for any.

    ``rows`` are the sample rows whose logits change; the per-row arrays follow ``rows``.
    ``penalised`` indexes the entries of ``rows`` with penalties and ``penalty_slots`` holds their
    KV slots: their counts live on the device, a row per slot (``executor/penalty_counts.py``),
    and the ``reset_*`` arrays (re)start the rows of sequences sampling on a slot for the first
    time: ``reset_prompt`` and ``reset_output`` are ``[2, k]`` (slot, token). Token lists are
    sparse: ``bias`` is ``(index into rows, token)`` pairs and their values. ``masks`` holds a
    grammar's allowed-token bitmask (32 tokens an int32 word) for each index in ``mask_rows``, or
    the future of it while llguidance computes it (``finished_masks`` waits for it).
    ``logprobs`` has one entry per sample row (-1: none).
    """

    rows: np.ndarray  # int64
    presence: np.ndarray  # float32, per entry of rows
    frequency: np.ndarray
    repetition: np.ndarray
    min_p: np.ndarray
    bias: tuple[np.ndarray, np.ndarray]  # ([2, k] int64 (index into rows, token), [k] float32)
    mask_rows: np.ndarray  # int64 indices into rows
    masks: Any  # [len(mask_rows), words] int32: numpy, a pinned CPU tensor (`transfer.pinned_masks`), or its Future
    logprobs: np.ndarray  # int64, per sample row
    penalised: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # indices into rows
    penalty_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # per penalised
    reset_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    reset_prompt: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), dtype=np.int64))
    reset_output: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), dtype=np.int64))

    def finished_masks(self) -> Any:
        """The grammar masks, once computed: a step's masks are computed on llguidance's threads
        while the engine thread launches the step's LM head and other processing
        (``logits_state.grammar_masks``); whatever reads them, or hands the batch on, waits here."""
        if isinstance(self.masks, Future):
            self.masks = self.masks.result()
        return self.masks

    @property
    def top_logprobs(self) -> int:
        """The most alternatives any row asked for (-1: no row asked for log probabilities)."""
        return int(self.logprobs.max()) if len(self.logprobs) else -1

    def select(self, keep: list[int]) -> LogitsBatch:
        """The batch for the sample rows ``keep`` (in that order), for a step re-run without a
        culprit. Every reset stays: starting a row over twice is the same as once."""
        new_of = {old: new for new, old in enumerate(keep)}
        entries = [i for i, row in enumerate(self.rows) if int(row) in new_of]
        renumber = np.full(len(self.rows) + 1, -1, dtype=np.int64)
        renumber[entries] = np.arange(len(entries))
        bias_kept = renumber[self.bias[0][0]] >= 0
        mask_kept = renumber[self.mask_rows] >= 0 if len(self.mask_rows) else np.zeros(0, dtype=bool)
        penalised_kept = renumber[self.penalised] >= 0 if len(self.penalised) else np.zeros(0, dtype=bool)
        bias_at = self.bias[0][:, bias_kept]
        return LogitsBatch(
            rows=np.array([new_of[int(self.rows[i])] for i in entries], dtype=np.int64),
            presence=self.presence[entries], frequency=self.frequency[entries],
            repetition=self.repetition[entries], min_p=self.min_p[entries],
            bias=(np.stack([renumber[bias_at[0]], bias_at[1]]), self.bias[1][bias_kept]),
            mask_rows=renumber[self.mask_rows[mask_kept]], masks=self.finished_masks()[mask_kept],
            logprobs=self.logprobs[keep],
            penalised=renumber[self.penalised[penalised_kept]], penalty_slots=self.penalty_slots[penalised_kept],
            reset_slots=self.reset_slots, reset_prompt=self.reset_prompt, reset_output=self.reset_output,
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
    #: Penalties, biases, min-p, grammar masks and log probabilities; None when no row asks.
    logits: LogitsBatch | None = None
    #: Prefill chunks whose prompt log probabilities are asked for.
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
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
