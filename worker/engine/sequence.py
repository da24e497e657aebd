"""One request's state in the engine, from admission to its last token."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.plan import SamplingSpec


@dataclass(eq=False)
class Sequence:
    """One request's state in the engine. ``stream`` is the API layer's handle for its outputs."""

    request_id: str
    tenant: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingSpec
    stream: Any = None
    stop_ids: frozenset[int] = frozenset()
    #: Every id that ends the sequence as EOS (empty with ignore_eos).
    eos_ids: frozenset[int] = frozenset()
    seed: int = 0
    #: Penalty counts and grammar matcher (``logits_state``); None for a request that asks for none.
    logits: Any = None
    output: list[int] = field(default_factory=list)  # tokens the host has received
    slot: int | None = None
    #: The KV blocks the sequence holds, in order (its block table), and the chained hashes of the
    #: full blocks of what it prefills and then of each block its received tokens fill (one hashed
    #: per completed block), registered in the prefix cache as their keys are written.
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    hashed_revision: str | None = None  # the model revision ``block_hashes`` were chained over
    registered: int = 0  # leading blocks registered in the prefix cache
    cached_blocks: int = 0  # leading blocks found in the prefix cache at admission (written by others)
    #: What the next prefill computes: the prompt, or after a preemption the prompt and the tokens
    #: sampled so far (recomputed, so that decoding resumes where it stopped). None: the prompt.
    recompute: list[int] | None = None
    preemptions: int = 0
    cached_prompt_tokens: int = 0  # tokens served from the prefix cache instead of computed
    computed: int = 0  # tokens whose keys and values are in the cache or being written by a launched step
    samples_scheduled: int = 0  # tokens sampled or being sampled by a launched step
    finished: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: How a cancelled sequence finishes: CANCELLED (the client went away) or STOP (the API layer
    #: matched a stop string in its text and ended it early, a normal finish).
    cancel_reason: int = pb.FINISH_REASON_CANCELLED
    #: The ``requests_total`` outcome a cancelled sequence counts under instead of its reason's
    #: name (``write_timeout``: its HTTP client took no bytes for ``--write-timeout``).
    cancel_outcome: str | None = None
    graph_steps: Counter = field(default_factory=Counter)  # (mode, size) -> steps
    eager_steps: Counter = field(default_factory=Counter)  # reason -> steps
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def to_prefill(self) -> list[int]:
        return self.prompt if self.recompute is None else self.recompute

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.to_prefill)

    @property
    def wants_samples(self) -> bool:
        return self.samples_scheduled < self.max_new_tokens

    def stop_reason(self) -> int:
        """The finish reason after the latest received token, or UNSPECIFIED to continue."""
        last = self.output[-1]
        if last in self.stop_ids:
            return pb.FINISH_REASON_STOP
        if self.logits is not None and self.logits.matcher is not None:
            # A grammar ends its output (its EOS included); an EOS id the grammar read as text
            # (a model whose EOS is an ordinary token) does not.
            if self.logits.grammar_done:
                return pb.FINISH_REASON_STOP
        elif last in self.eos_ids:
            return pb.FINISH_REASON_EOS
        if len(self.output) >= self.max_new_tokens:
            return pb.FINISH_REASON_LENGTH
        return pb.FINISH_REASON_UNSPECIFIED


@dataclass(frozen=True)
class Limits:
    """What a request may ask of the model being served (the API layer checks requests against it)."""

    vocab_size: int
    max_seq_len: int
    #: Whether the served model carries a tokenizer, so that ``prompt_text`` can be served.
    text_prompts: bool = False
    #: Whether its tokenizer has a chat template, so that ``messages`` can be served.
    chat: bool = False
    #: The most bytes of text one token of the tokenizer stands for (0: not known). A text prompt
    #: of B bytes needs at least ceil(B / max_token_bytes) tokens, so one that cannot fit the
    #: context is refused from its length alone, before any tokenizing.
    max_token_bytes: int = 0


def sequence_for(req: pb.GenerateRequest, stream: Any, eos_ids: frozenset[int]) -> Sequence:
    """A new sequence for an admitted request (token ids; text was tokenized by the API layer)."""
    sp = req.sampling
    seed = sp.seed if sp.HasField("seed") else random.getrandbits(63)
    return Sequence(
        request_id=req.request_id or f"req-{random.getrandbits(48):012x}", tenant=req.tenant,
        prompt=list(req.prompt_token_ids), max_new_tokens=req.stopping.max_new_tokens,
        sampling=SamplingSpec(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p or 1.0), stream=stream,
        stop_ids=frozenset(req.stopping.stop_token_ids), eos_ids=frozenset() if req.stopping.ignore_eos else eos_ids,
        seed=seed & (2**63 - 1),
    )
