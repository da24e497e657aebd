"""What both front ends share (the gRPC servers and the OpenAI HTTP server): a request's one
way in, its tokens' one way out, and the name the model goes by in public.

- ``admitted``: a request checked against the served model and its text tokenized (long
  prompts off the event loop, on low-priority threads), so gRPC Generate and the HTTP
  completions admit exactly alike.
- ``TokenStream`` and ``StreamHub``: the engine thread never talks to a client. At the end of
  each step it hands the step's tokens to ``StreamHub.publish`` once; the hub crosses to the
  event loop in one call and fans the tokens out to the streams in one pass. Each stream
  coroutine writes whatever has accumulated since its last write, so a client slower than the
  engine gets several tokens per message instead of a queue of one message per token, and the
  engine never waits for a client. ``StreamHub.flush_gap`` paces every front end's writes alike.
- ``count_refusal``: a request refused on its way into the engine, counted under the outcome of
  its row in the engine's errors table (``engine.classify``), which each front end answers with.
- ``public_model_info``: what an unauthenticated client may learn of the model.
- ``token_logprobs``: a gRPC chunk's log probabilities (the HTTP shapes are ``openai_sampling``'s).

The front ends import this module and never each other.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import UNKNOWN_ERROR, ChatError, EngineFace, NotServing, classify
from graphkeeper.worker.plan import PackedEntry, Sampled, TokenLogprob, packed_parts
from graphkeeper.worker.serving import heap
from graphkeeper.worker.serving.admission import AdmissionError, validate_request, validate_tokenized

log = logging.getLogger(__name__)

#: Prompts longer than this are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 4096
#: Pacing under load: a stream writes at most once per (this many seconds x open streams), at most
#: MAX_FLUSH_GAP, so the API layer's writes stay bounded while the engine runs at the GPU's pace;
#: tokens that arrive in between go out together in the next message. Each write costs the event
#: loop tens of microseconds: on the H200 with 64 decoding streams, when the engine thread still
#: shared the API process's interpreter, 0.1 ms per stream held the engine to 0.72 of its FULL-graph
#: step and 0.2 ms let it reach 0.89 (bench/results/README.md).
FLUSH_GAP_PER_STREAM = 0.0002
#: The cap is also the longest a token waits for its stream's next write, so it bounds the
#: inter-token gaps a client sees whenever steps are slower than half of it: with 64 streams and
#: long prompts (7 ms steps) a 12.8 ms gap left one token per message 12.8 ms after the last, and
#: put the p99 inter-token gap at 13.8 ms although no step was planned above 8.5 ms. 8 ms keeps
#: that gap under the slowest step the step budget plans; the engine core's own process no longer
#: pays for the writes.
MAX_FLUSH_GAP = 0.008
#: Niceness of the threads that tokenize long prompts, which also run under SCHED_IDLE: the lowest
#: priority, so that a flood of expensive requests gets only CPU time that the engine core, the
#: event loop and the streams leave over (niceness alone still cost the streams 0.8 of their pace on
#: two busy CPUs, SCHED_IDLE 0.97); on a machine with spare cores it changes nothing
#: (bench/attack_bench.py).
TOKENIZE_NICENESS = 19


def _background_priority() -> None:
    """Lowers the calling thread's CPU priority (Linux: niceness and the scheduling policy are per
    thread, and lowering them needs no privilege)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZE_NICENESS)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
    except (OSError, AttributeError):  # not Linux: the thread keeps the process's priority
        log.debug("cannot lower the tokenizer threads' priority here")


def _trimmed(encode: Callable[[], list[int]]) -> list[int]:
    """``encode()``, then the heap it freed back to the system (``heap.trim``), even when it raised."""
    try:
        return encode()
    finally:
        heap.trim()


TOKENIZE_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenize", initializer=_background_priority)


@dataclass(eq=False)
class TokenStream:
    """One Generate call's mailbox on the event loop: the hub appends, the handler drains."""

    tokens: list[int] = field(default_factory=list)
    #: The tokens' log probabilities (``TokenLogprob``), for a request that asked for them.
    logprobs: list = field(default_factory=list)
    #: The prompt's log probabilities, with the first token, for a request that asked for them.
    prompt_logprobs: list | None = None
    end: pb.Completion | BaseException | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: The handler's wait between two writes, while it lasts (``pause``).
    pausing: asyncio.Future | None = field(default=None, repr=False)

    async def pause(self, seconds: float) -> None:
        """The pacing gap between two writes (``StreamHub.flush_gap``), cut short when the stream
        ends: its last tokens and its completion leave at once, not up to a gap later (half a
        gap on average: 4 ms at 64 streams, on every answer)."""
        if self.end is not None:
            return
        loop = asyncio.get_running_loop()
        waiter = self.pausing = loop.create_future()
        timer = loop.call_later(seconds, _release, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.pausing = None

    def finish(self, end: pb.Completion | BaseException) -> None:
        """Event loop: the stream's end arrived (a completion, or the exception that fails it); the
        hub wakes the handler, as for any update."""
        self.end = end
        if self.pausing is not None:
            _release(self.pausing)


def _release(waiter: asyncio.Future) -> None:
    """Ends a pause: its timer or the stream's end, whichever comes first (the other finds it done)."""
    if not waiter.done():
        waiter.set_result(None)


class StreamHub:
    """Carries each step's outputs from the engine thread to the streams, in one loop callback.

    Steps published while the loop has not yet run the last callback join it, so the engine
    wakes the loop (a write to its self-pipe) at most once per loop pass rather than once per step.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.open_streams = 0
        self._pending: list[list[tuple[Any, list[int], Any]]] = []
        self._lock = threading.Lock()

    def flush_gap(self) -> float:
        """Seconds a stream waits after a write before its next one (0 with a single stream)."""
        return 0.0 if self.open_streams <= 1 else min(MAX_FLUSH_GAP, FLUSH_GAP_PER_STREAM * self.open_streams)

    def publish(self, updates: list[tuple[Any, list[int], Any]]) -> None:
        """Engine thread: ``(stream, new tokens, end)`` for each stream; ``end`` is a Completion, an
        exception that fails the stream, or None while it continues."""
        if not updates:
            return
        with self._lock:
            self._pending.append(updates)
            wake = len(self._pending) == 1
        if wake:
            self.loop.call_soon_threadsafe(self._fan_out)

    def _fan_out(self) -> None:
        """Event loop: every step published since the last pass, in the order the engine made them."""
        with self._lock:
            steps, self._pending = self._pending, []
        for updates in steps:
            for stream, tokens, end in updates:
                if tokens:
                    stream.tokens.extend(tokens)
                    if isinstance(tokens, Sampled) and (logprobs := tokens.logprob_entries()) is not None:
                        stream.logprobs.extend(logprobs)
                    if (prompt := getattr(tokens, "prompt_logprobs", None)) is not None:
                        stream.prompt_logprobs = prompt
                if end is not None:
                    stream.finish(end)
                stream.wake.set()


async def admitted(engine: EngineFace, request: pb.GenerateRequest, fill_context: bool = False) -> pb.GenerateRequest:
    """The request checked against the served model, a text prompt tokenized (off the event
    loop when long) and checked again as token ids; raises AdmissionError or NotServing. Both
    front ends (``grpc_server`` and ``http_server``) admit through this one function.

    Every size check runs before anything is copied or tokenized: a prompt that cannot fit
    the context costs its length checks, not its tokenization (``validate_text_length``).
    ``fill_context``: the client set no output length, so ``max_new_tokens`` (sent as 1) becomes
    whatever the context leaves after the prompt, as OpenAI-compatible servers do.
    """
    limits = engine.limits()
    if limits is None:
        raise NotServing("model not loaded yet")
    validate_request(request, limits)  # sizes and rules before any tokenizing
    if not request.prompt_text and not request.messages:
        if fill_context:
            request.stopping.max_new_tokens = max(1, limits.max_seq_len - len(request.prompt_token_ids))
        return request
    tokenizer = engine.tokenizer
    if request.messages:
        chat = [(m.role, m.content) for m in request.messages]
        encode, size = (lambda: tokenizer.encode_chat(chat)), sum(len(m.content) for m in request.messages)
    else:
        encode, size = (lambda: tokenizer.encode_ids(request.prompt_text)), len(request.prompt_text)
    try:
        ids = await asyncio.get_running_loop().run_in_executor(TOKENIZE_POOL, _trimmed, encode) \
            if size > INLINE_TOKENIZE_CHARS else encode()
    except ChatError as err:
        raise AdmissionError(err.field, str(err).removeprefix(f"{err.field}: ")) from None
    tokenized = pb.GenerateRequest()
    tokenized.CopyFrom(request)
    if fill_context:
        tokenized.stopping.max_new_tokens = max(1, limits.max_seq_len - len(ids))
    validate_tokenized(ids, tokenized.stopping.max_new_tokens, limits,
                       "messages" if request.messages else "prompt_text")
    tokenized.ClearField("prompt_text")
    tokenized.ClearField("messages")
    tokenized.prompt_token_ids.extend(ids)
    return tokenized


def count_refusal(engine: EngineFace, err: Exception) -> None:
    """Counts a request that failed on its way into the engine under its row's outcome. An error
    the table does not know is a bug here or in the engine: it is logged with its traceback,
    which the client's answer does not carry."""
    status = classify(err)
    if status is UNKNOWN_ERROR:
        log.error("a request failed on its way into the engine", exc_info=err)
    engine.metrics.requests.labels(status.outcome).inc()


def token_logprobs(entries: list) -> list[pb.TokenLogprob]:
    """A gRPC ``TokenChunk``'s log probabilities from the stream's entries."""
    return [logprob_message(e) for e in entries]


def logprob_message(entry: PackedEntry | TokenLogprob) -> pb.TokenLogprob:
    """One entry's message: a packed line is read straight into it (no ``TokenLogprob`` built on
    the way: 7x fewer collections of the young generation under log probabilities)."""
    if isinstance(entry, PackedEntry):
        chosen, ids, values = packed_parts(entry.packed)
        token, top = entry.token, zip(ids, values, strict=True)
    else:
        token, chosen, top = entry
    return pb.TokenLogprob(token_id=token, logprob=chosen, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def public_model_info(info: pb.GetModelInfoResponse) -> pb.GetModelInfoResponse:
    """What the unauthenticated inference port tells anyone about the model: the source's last
    path component (its name), never the full path, which shows the node's directory layout."""
    public = pb.GetModelInfoResponse()
    public.CopyFrom(info)
    if not info.source.startswith("random:"):
        public.source = PurePosixPath(info.source).name
    return public

