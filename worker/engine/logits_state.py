"""What a sequence's logits processing remembers between steps, and the step's ``LogitsBatch``
built from it (host data; the device work is ``executor/logits.py``).

A sequence that asks for nothing beyond temperature, top-k and top-p has no state here and adds
nothing to a step. One with a grammar keeps the grammar's matcher, advanced by each token it
receives; it needs every earlier token before its next row is sampled
(``LogitsSpec.needs_history``): the engine queues such a step's forward pass, then reads the step
before it and feeds its tokens to the matchers (``OutputProcessor.accept_ahead``; the device
computes meanwhile), builds the batch here and queues the sampling; the step before is published
after that, off the path between the two steps' sampling. The masks of a step's grammars are
computed together, on llguidance's threads, while the engine thread launches the step's LM head.

Penalties keep their counts on the device (``executor/penalty_counts.py``, a row per KV slot that
the device updates with each token it samples); the host only says, the first time a sequence
samples on a slot, what its row starts from (its prompt and its output so far). Bias, min-p, log
probabilities and penalties are built with the plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.plan import LogitsBatch, LogitsSpec, PromptLogprobs


def logits_spec(req: pb.GenerateRequest) -> LogitsSpec:
    """The request's logits processing (admission has checked every value)."""
    s = req.sampling
    return LogitsSpec(
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0, min_p=s.min_p,
        logit_bias=tuple(sorted(s.logit_bias.items())), logprobs=s.logprobs if s.HasField("logprobs") else -1,
        constrained=req.HasField("constraint") and req.constraint.WhichOneof("kind") is not None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else -1,
    )


class LogitsState:
    """One sequence's grammar matcher and where its penalty counts live."""

    def __init__(self, spec: LogitsSpec, matcher: Any = None, vocab_size: int = 0) -> None:
        self.spec = spec
        self.matcher = matcher
        #: Words of the grammar's bitmask (32 tokens a word).
        self.mask_words = (vocab_size + 31) // 32
        #: The KV slot whose device row holds this sequence's penalty counts; None until a step
        #: that samples it on its slot is queued (the scheduler clears it when the slot is given up).
        self.counted_slot: int | None = None
        #: Output tokens consumed so far: a token fed ahead of its step's publication is not fed twice.
        self.accepted = 0
        #: The prompt's log probabilities as the prefill computes them (one per prompt token after
        #: the first), and the prompt positions whose chunks were scheduled to compute them.
        self.prompt_entries: list = []
        self.prompt_scheduled = 0

    def accept(self, token: int) -> None:
        """A token the sequence received (once per token, in order)."""
        if self.matcher is not None:
            self.matcher.consume_token(token)
        self.accepted += 1

    @property
    def grammar_done(self) -> bool:
        """The grammar is complete (or failed): nothing more may be generated."""
        return self.matcher is not None and self.matcher.is_stopped()


def schedule_prompt_logprobs(seq: Any, start: int, length: int) -> PromptLogprobs | None:
    """What a prefill chunk of ``seq`` (rows from position ``start``) computes for its prompt log
    probabilities, with the chunk index 0 for the scheduler to set; None when it computes none:
    not asked for, or computed already (a recompute after a preemption starts over at 0)."""
    state = seq.logits
    if state is None or state.spec.prompt_logprobs < 0 or start != state.prompt_scheduled:
        return None
    state.prompt_scheduled = start + length
    end = min(start + length + 1, len(seq.prompt))
    if start + 1 >= end:
        return None
    return PromptLogprobs(0, state.spec.prompt_logprobs, np.asarray(seq.prompt[start + 1:end], dtype=np.int64))


def logits_state_for(req: pb.GenerateRequest, grammars: Any, tokenizer: Any, vocab_size: int,
                     eos_id: int) -> LogitsState | None:
    """The state of a new sequence; None when it asks for nothing (the common case)."""
    spec = logits_spec(req)
    if spec == LogitsSpec():
        return None
    matcher = grammars.matcher(req.constraint, tokenizer, vocab_size, eos_id) if spec.constrained else None
    return LogitsState(spec, matcher, vocab_size)


def build_logits_batch(samplers: list[Any]) -> LogitsBatch | None:
    """A step's ``LogitsBatch`` for its sample rows' sequences (each with ``logits``, ``slot``,
    ``prompt`` and ``output``); None when no row asks for anything.

    One pass over the rows, reading each spec's flags and parameters as computed once
    (``LogitsSpec.row_parameters``): this runs on the engine thread for every step that has a
    parameterised row, between the step's forward pass and its sampling."""
    logprobs: list[int] = []
    rows: list[int] = []
    params: list[tuple[float, float, float, float]] = []
    penalised, penalty_slots, bias_at, bias, grammars = [], [], [], [], []
    resets = _Resets()
    asked = False
    for i, seq in enumerate(samplers):
        state: LogitsState | None = seq.logits
        if state is None:
            logprobs.append(-1)
            continue
        asked = True
        spec = state.spec
        logprobs.append(spec.logprobs)
        if not spec.changes_logits:
            continue
        k = len(rows)
        rows.append(i)
        params.append(spec.row_parameters)
        if spec.penalised:
            penalised.append(k)
            penalty_slots.append(seq.slot)
            if state.counted_slot != seq.slot:
                resets.add(seq, state)
        for token, value in spec.logit_bias:
            bias_at.append((k, token))
            bias.append(value)
        if state.matcher is not None and not state.grammar_done:  # done: its row's token is dropped
            grammars.append((k, state))
    if not asked:
        return None
    f32 = np.float32
    presence, frequency, repetition, min_p = np.array(params, dtype=f32).reshape(-1, 4).T.copy()
    return LogitsBatch(
        rows=np.asarray(rows, dtype=np.int64),
        presence=presence, frequency=frequency, repetition=repetition, min_p=min_p,
        bias=(np.asarray(bias_at, dtype=np.int64).reshape(-1, 2).T.copy(), np.asarray(bias, dtype=f32)),
        mask_rows=np.asarray([k for k, _ in grammars], dtype=np.int64),
        masks=grammar_masks([state for _, state in grammars]),
        logprobs=np.asarray(logprobs, dtype=np.int64),
        penalised=np.asarray(penalised, dtype=np.int64),
        penalty_slots=np.asarray(penalty_slots, dtype=np.int64),
        **resets.arrays(),
    )


def mark_counted(samplers: list[Any]) -> None:
    """After a step's sampling is queued: its penalised sequences' rows are set up on their slots
    (a step that failed before marks nothing, and the next step starts the rows over again). Only
    a step whose batch started rows over has any to mark."""
    for seq in samplers:
        state = seq.logits
        if state is not None and state.spec.penalised:
            state.counted_slot = seq.slot


class _Resets:
    """The penalty rows a step starts over: each sequence sampling on its slot for the first time."""

    def __init__(self) -> None:
        self.slots: list[int] = []
        self.prompt: list[np.ndarray] = []
        self.output: list[np.ndarray] = []

    def add(self, seq: Any, state: LogitsState) -> None:
        self.slots.append(seq.slot)
        if state.spec.repetition_penalty != 1.0:
            tokens = np.unique(np.asarray(seq.prompt, dtype=np.int64))
            self.prompt.append(np.stack([np.full(len(tokens), seq.slot), tokens]))
        if seq.output:
            tokens = np.asarray(seq.output, dtype=np.int64)
            self.output.append(np.stack([np.full(len(tokens), seq.slot), tokens]))

    def arrays(self) -> dict[str, np.ndarray]:
        def pairs(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts, axis=1) if parts else np.zeros((2, 0), dtype=np.int64)

        return {"reset_slots": np.asarray(self.slots, dtype=np.int64), "reset_prompt": pairs(self.prompt),
                "reset_output": pairs(self.output)}


def _numpy_masks(shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    array = np.empty(shape, dtype=np.int32)
    return array, array


#: Makes a step's mask array: ``shape -> (the int32 array llguidance fills, what the batch carries
#: to the device)``. A numpy array by default; an engine on a GPU installs pinned host memory
#: (``executor/transfer.pinned_masks``) through ``use_mask_buffer``, which keeps torch out of
#: this module (the scheduler imports it).
_mask_buffer: Callable[[tuple[int, int]], tuple[np.ndarray, Any]] = _numpy_masks


def use_mask_buffer(make: Callable[[tuple[int, int]], tuple[np.ndarray, Any]]) -> None:
    """Where the masks of later steps are written (``_mask_buffer``)."""
    global _mask_buffer
    _mask_buffer = make


def grammar_masks(states: list[LogitsState]) -> Any:
    """The future of the next token's allowed-token bitmasks of these sequences' grammars,
    ``[n, words]`` int32 (``LogitsBatch.finished_masks`` waits for it), computed together on
    llguidance's threads (a mask takes tens of microseconds at a large vocabulary; one after
    another they would add up on the step's path), written straight into the array
    ``use_mask_buffer`` installed: on a GPU pinned host memory, whose copy to the device is queued
    as it is (``executor/transfer.py``).

    Started from a thread of its own, as the step's batch is built: llguidance computes without
    the interpreter lock, so the engine thread launches the step's LM head, bias and penalties
    meanwhile (the mask is applied last). Nothing touches these matchers until the masks are
    finished: the engine waits for them before the step's sampling is queued, before a
    tensor-parallel step's batch is sent, and before the step before is published."""
    if not states:
        return np.zeros((0, 0), dtype=np.int32)
    fill, masks = _mask_buffer((len(states), states[0].mask_words))
    pairs = [(s.matcher, j) for j, s in enumerate(states)]
    return _mask_thread().submit(_fill_masks, pairs, fill, masks)


def _fill_masks(pairs: list[tuple[Any, int]], fill: np.ndarray, masks: Any) -> Any:
    from llguidance.numpy import fill_next_token_bitmask_par

    fill.fill(-1)  # every token allowed where a matcher writes nothing
    fill_next_token_bitmask_par(_executor(), pairs, fill)
    return masks


@functools.cache
def _mask_thread() -> ThreadPoolExecutor:
    """The one thread that hands a step's masks to llguidance, made once."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")


@functools.cache
def _executor() -> Any:
    """llguidance's thread pool for masks, made once."""
    import llguidance

    return llguidance.LLExecutor()
