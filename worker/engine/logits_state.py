"""What a sequence's logits processing remembers between steps, and the step's ``LogitsBatch``
built from it (host data; the device work is ``executor/logits.py``).

A sequence that asks for nothing beyond temperature, top-k and top-p has no state here and adds
nothing to a step. One that asks for penalties keeps its output tokens' counts (and, for the
repetition penalty, its prompt's distinct tokens); one with a grammar keeps the grammar's matcher,
advanced by each token it receives. Both need every earlier token before their next row is
sampled (``LogitsSpec.needs_history``): the engine queues such a step's forward pass, then reads
the step before it and feeds its tokens to these states (``OutputProcessor.accept_ahead``; the
device computes meanwhile), builds the batch here and queues the sampling; the step before is
published after that, off the path between the two steps' sampling. Bias, min-p and log
probabilities need nothing of the kind and are built with the plan.
"""

from __future__ import annotations

from collections import Counter
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
    """One sequence's penalty counts and grammar matcher."""

    def __init__(self, spec: LogitsSpec, prompt: list[int], matcher: Any = None) -> None:
        self.spec = spec
        self.matcher = matcher
        self.counts: Counter[int] = Counter()
        #: Output tokens consumed so far: a token fed ahead of its step's publication is not fed twice.
        self.accepted = 0
        #: The prompt's log probabilities as the prefill computes them (one per prompt token after
        #: the first), and the prompt positions whose chunks were scheduled to compute them.
        self.prompt_entries: list = []
        self.prompt_scheduled = 0
        self.prompt_tokens = (np.unique(np.asarray(prompt, dtype=np.int64)) if spec.repetition_penalty != 1.0
                              else np.zeros(0, dtype=np.int64))

    def accept(self, token: int) -> None:
        """A token the sequence received (once per token, in order)."""
        if self.spec.penalised:
            self.counts[token] += 1
        if self.matcher is not None:
            self.matcher.consume_token(token)
        self.accepted += 1

    @property
    def grammar_done(self) -> bool:
        """The grammar is complete (or failed): nothing more may be generated."""
        return self.matcher is not None and self.matcher.is_stopped()

    def mask(self) -> np.ndarray:
        """The grammar's allowed-token bitmask for the next token, int32 words."""
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)


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


def logits_state_for(req: pb.GenerateRequest, prompt: list[int], grammars: Any, tokenizer: Any, vocab_size: int,
                     eos_id: int) -> LogitsState | None:
    """The state of a new sequence; None when it asks for nothing (the common case)."""
    spec = logits_spec(req)
    if spec == LogitsSpec():
        return None
    matcher = grammars.matcher(req.constraint, tokenizer, vocab_size, eos_id) if spec.constrained else None
    return LogitsState(spec, prompt, matcher)


def build_logits_batch(states: list[LogitsState | None]) -> LogitsBatch | None:
    """A step's ``LogitsBatch`` for its sample rows' states (None when no row asks for anything)."""
    if all(s is None for s in states):
        return None
    rows = [i for i, s in enumerate(states) if s is not None and s.spec.changes_logits]
    specs = [states[i].spec for i in rows]
    counts, seen, bias_at, bias, mask_rows, masks = [], [], [], [], [], []
    for k, i in enumerate(rows):
        state = states[i]
        spec = state.spec
        if spec.presence_penalty or spec.frequency_penalty:
            tokens = np.fromiter(state.counts.keys(), dtype=np.int64, count=len(state.counts))
            times = np.fromiter(state.counts.values(), dtype=np.int64, count=len(state.counts))
            counts.append(np.stack([np.full(len(tokens), k), tokens, times]))
        if spec.repetition_penalty != 1.0:
            tokens = np.union1d(state.prompt_tokens, np.fromiter(state.counts.keys(), dtype=np.int64))
            seen.append(np.stack([np.full(len(tokens), k), tokens]))
        for token, value in spec.logit_bias:
            bias_at.append((k, token))
            bias.append(value)
        if state.matcher is not None and not state.grammar_done:  # done: its row's token is dropped
            mask_rows.append(k)
            masks.append(state.mask())
    f32 = np.float32
    return LogitsBatch(
        rows=np.asarray(rows, dtype=np.int64),
        presence=np.array([s.presence_penalty for s in specs], dtype=f32),
        frequency=np.array([s.frequency_penalty for s in specs], dtype=f32),
        repetition=np.array([s.repetition_penalty for s in specs], dtype=f32),
        min_p=np.array([s.min_p for s in specs], dtype=f32),
        counts=np.concatenate(counts, axis=1) if counts else np.zeros((3, 0), dtype=np.int64),
        seen=np.concatenate(seen, axis=1) if seen else np.zeros((2, 0), dtype=np.int64),
        bias=(np.asarray(bias_at, dtype=np.int64).reshape(-1, 2).T.copy(), np.asarray(bias, dtype=f32)),
        mask_rows=np.asarray(mask_rows, dtype=np.int64),
        masks=np.stack(masks) if masks else np.zeros((0, 0), dtype=np.int32),
        logprobs=np.array([-1 if s is None else s.spec.logprobs for s in states], dtype=np.int64),
    )
