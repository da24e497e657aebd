"""Postprocessing: what a step's tokens do to their sequences. Each token is appended, a stop
token, end of sequence or length limit finishes its sequence and frees its slot, and every
stream's update for the step (new tokens, and a completion or an error) is returned as one list
for the engine to publish in one call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.scheduler import ScheduledStep, Scheduler
from graphkeeper.worker.engine.sequence import Sequence
from graphkeeper.worker.executor.graphs.dispatcher import BatchDescriptor, Decision
from graphkeeper.worker.metrics import WorkerMetrics, observe_many
from graphkeeper.worker.plan import PackedLogprob, Sampled, TokenLogprob

if TYPE_CHECKING:  # the API process imports this module; the runner (and Triton) is the engine core's
    from graphkeeper.worker.executor.runner import Launched

Update = tuple[Any, list[int], Any]  # (stream, new tokens, end: Completion, an exception, or None)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, metrics: WorkerMetrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics

    def step_outputs(self, samplers: list[Sequence], tokens: list[int], now: float,
                     logprobs: list[tuple[int, bytes] | None] | None = None) -> list[Update]:
        """The updates for one step's sampled tokens; tokens of finished sequences are dropped.
        A sequence that asked for log probabilities gets its token as ``Sampled`` with them."""
        updates, first, gaps = [], [], []
        for i, (seq, token) in enumerate(zip(samplers, tokens, strict=True)):
            if seq.finished:
                continue  # cancelled, or stopped a step ago: this token was never wanted
            if seq.first_token_at is None:
                seq.first_token_at = now
                first.append(now - seq.arrived)
            else:
                gaps.append(now - seq.last_token_at)
            seq.last_token_at = now
            new = self._sampled(seq, token, logprobs[i] if logprobs is not None else None)
            updates.append((seq.stream, new, self._append(seq, token)))
        m = self.metrics
        m.generated_tokens.inc(len(updates))
        observe_many(m.time_to_first_token, first)
        observe_many(m.inter_token_latency, gaps)
        return updates

    @staticmethod
    def _sampled(seq: Sequence, token: int, entry: tuple[int, bytes] | None) -> list[int]:
        """The token as its stream gets it: with its log probabilities (the alternatives its
        request asked for), and with the first token the prompt's, when the request asked."""
        state = seq.logits
        if state is None or (state.spec.logprobs < 0 and state.spec.prompt_logprobs < 0):
            return [token]
        wants = entry is not None and state.spec.logprobs >= 0
        prompt = state.prompt_entries if state.spec.prompt_logprobs >= 0 and not seq.output else None
        packed: list[PackedLogprob] | None = [(entry[0], state.spec.logprobs, entry[1])] if wants else None
        return Sampled([token], None, prompt, packed=packed)

    @staticmethod
    def accept_ahead(inflight: InFlight | None) -> None:
        """Feeds a launched step's tokens to its sequences' logits states before the step is
        published, so the step after it, whose rows need every earlier token (penalties, a
        grammar), builds its logits batch and queues its sampling first; the publication follows
        (``_append`` then feeds nothing twice). A step that cannot be read is left to its
        publication, which fails its sequences."""
        if inflight is None:
            return
        try:
            tokens = inflight.launched.tokens().tolist()
        except Exception:  # noqa: BLE001 - reported where the step is read and published
            return
        for seq, token in zip(inflight.step.samplers, tokens, strict=True):
            state = seq.logits
            if state is not None and not seq.finished and state.accepted == len(seq.output):
                state.accept(token)

    def prompt_logprobs(self, sequences: list[Sequence], num_decode: int,
                        computed: list[tuple[int, list[TokenLogprob]]]) -> None:
        """Keeps a step's prompt log probabilities with their sequences (prefill chunk ``j`` is
        ``sequences[num_decode + j]``), before the step's tokens are handed out."""
        for chunk, entries in computed:
            sequences[num_decode + chunk].logits.prompt_entries.extend(entries)

    def _append(self, seq: Sequence, token: int) -> pb.Completion | None:
        seq.output.append(token)
        if seq.logits is not None and seq.logits.accepted < len(seq.output):  # not fed ahead already
            seq.logits.accept(token)
        self.scheduler.received(seq)
        reason = seq.stop_reason()
        if reason == pb.FINISH_REASON_UNSPECIFIED:
            return None
        self.scheduler.finish(seq)
        return self.completion(seq, reason)

    def completion(self, seq: Sequence, reason: int, outcome: str | None = None) -> pb.Completion:
        """The last message of a stream, counted once in ``requests_total`` by outcome (the
        reason's name unless ``outcome`` says otherwise)."""
        outcome = outcome or pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
        self.metrics.requests.labels(outcome).inc()
        summary = pb.ExecutionSummary(
            graph_steps=[pb.GraphStepCount(mode=m, size=s, steps=n) for (m, s), n in sorted(seq.graph_steps.items())],
            eager_steps=[pb.FallbackCount(reason=r, steps=n) for r, n in sorted(seq.eager_steps.items())],
            preemptions=seq.preemptions, cached_prompt_tokens=seq.cached_prompt_tokens,
        )
        return pb.Completion(
            request_id=seq.request_id, finish_reason=reason, prompt_tokens=len(seq.prompt),
            generated_tokens=len(seq.output),
            time_to_first_token_seconds=(seq.first_token_at - seq.arrived) if seq.first_token_at is not None else 0.0,
            total_seconds=time.perf_counter() - seq.arrived, execution=summary,
            prompt_logprobs=[pb.TokenLogprob(token_id=e.token, logprob=e.logprob,
                                             top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top])
                             for e in (seq.logits.prompt_entries if seq.logits is not None else ())],
        )

    def end(self, sequences: list[Sequence], err: BaseException, outcome: str | None = None) -> list[Update]:
        """Ends every unfinished sequence with ``err`` (a failed step, shutdown, a dead engine)."""
        updates = []
        for seq in sequences:
            if not seq.finished:
                self.scheduler.finish(seq, failed=outcome == "error")
                if outcome:
                    self.metrics.requests.labels(outcome).inc()
                updates.append((seq.stream, [], err))
        return updates


def direct_publish(updates: list[tuple[Any, list[int], Any]]) -> None:
    """Without an API layer (tests, benchmarks): each stream is a callable ``(tokens, end)``."""
    for stream, tokens, end in updates:
        if stream is not None:
            stream(tokens, end)


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    step: ScheduledStep
    decision: Decision
    desc: BatchDescriptor
    launched: Launched
    started: float
    launch_seconds: float = 0.0  # host time launching it (from dispatch to sampling queued)
