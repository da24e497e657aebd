"""Postprocessing without a model (engine/outputs.py): a sampled token is appended and streamed, a
stop token, end of sequence or length limit finishes its sequence with the right reason, a
completion and a free slot, a finished sequence's late token is dropped, and ``end`` fails each
unfinished sequence once."""

from __future__ import annotations

import time

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.outputs import OutputProcessor, direct_publish
from graphkeeper.worker.engine.scheduler import Scheduler
from graphkeeper.worker.engine.sequence import Sequence
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.plan import SamplingSpec

FULL, PIECEWISE = pb.GRAPH_MODE_FULL, pb.GRAPH_MODE_PIECEWISE
RECAPTURING = pb.FALLBACK_REASON_RECAPTURING


class Stream:
    """What ``direct_publish`` hands each stream: its new tokens and its end."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ends: list[object] = []

    def __call__(self, tokens: list[int], end: object) -> None:
        self.tokens.extend(tokens)
        if end is not None:
            self.ends.append(end)


def running(scheduler: Scheduler, *seqs: Sequence) -> None:
    """Admits and prefills ``seqs``, so that each holds a slot and decodes."""
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.schedule() is not None
    assert all(s.slot is not None for s in seqs)


def sequence(max_new_tokens: int = 4, stop: frozenset[int] = frozenset(), eos: int | None = None,
             request_id: str = "r") -> Sequence:
    return Sequence(request_id=request_id, tenant="", prompt=[1, 2, 3], max_new_tokens=max_new_tokens,
                    sampling=SamplingSpec(), stream=Stream(), stop_ids=stop,
                    eos_ids=frozenset() if eos is None else frozenset({eos}))


def processor() -> tuple[OutputProcessor, Scheduler]:
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk=0)
    return OutputProcessor(scheduler, WorkerMetrics()), scheduler


def requests(out: OutputProcessor, outcome: str) -> float:
    return out.metrics.requests.labels(outcome)._value.get()


def test_a_token_is_appended_and_streamed_without_an_end():
    out, scheduler = processor()
    seq = sequence()
    running(scheduler, seq)
    updates = out.step_outputs([seq], [7], time.perf_counter())
    assert updates == [(seq.stream, [7], None)]
    assert seq.output == [7] and not seq.finished and seq in scheduler.running
    assert out.metrics.generated_tokens._value.get() == 1
    direct_publish(updates)
    assert seq.stream.tokens == [7] and seq.stream.ends == []


def test_a_stop_token_finishes_with_stop_and_frees_the_slot():
    out, scheduler = processor()
    seq = sequence(stop=frozenset({9}))
    running(scheduler, seq)
    slot = seq.slot
    [(stream, tokens, end)] = out.step_outputs([seq], [9], time.perf_counter())
    assert (stream, tokens) == (seq.stream, [9])
    assert end.finish_reason == pb.FINISH_REASON_STOP
    assert (end.request_id, end.prompt_tokens, end.generated_tokens) == ("r", 3, 1)
    assert seq.finished and seq.slot is None and slot in scheduler.free_slots and not scheduler.running
    assert requests(out, "stop") == 1


def test_end_of_sequence_finishes_with_eos():
    out, scheduler = processor()
    seq = sequence(eos=2)
    running(scheduler, seq)
    assert out.step_outputs([seq], [5], time.perf_counter())[0][2] is None
    end = out.step_outputs([seq], [2], time.perf_counter())[0][2]
    assert end.finish_reason == pb.FINISH_REASON_EOS and end.generated_tokens == 2
    assert requests(out, "eos") == 1 and requests(out, "stop") == 0


def test_a_stop_token_wins_over_end_of_sequence_and_length():
    out, scheduler = processor()
    seq = sequence(max_new_tokens=1, stop=frozenset({2}), eos=2)
    running(scheduler, seq)
    assert out.step_outputs([seq], [2], time.perf_counter())[0][2].finish_reason == pb.FINISH_REASON_STOP


def test_the_length_limit_finishes_with_length_and_a_completion_summary():
    out, scheduler = processor()
    seq = sequence(max_new_tokens=2)
    running(scheduler, seq)
    seq.graph_steps.update({(PIECEWISE, 8): 1, (FULL, 4): 2})
    seq.eager_steps.update({RECAPTURING: 1})
    started = time.perf_counter()
    first = out.step_outputs([seq], [11], started)
    end = out.step_outputs([seq], [12], started + 0.5)[0][2]
    assert first[0][2] is None
    assert end.finish_reason == pb.FINISH_REASON_LENGTH
    assert (end.prompt_tokens, end.generated_tokens) == (3, 2)
    assert list(end.execution.graph_steps) == [pb.GraphStepCount(mode=PIECEWISE, size=8, steps=1),
                                               pb.GraphStepCount(mode=FULL, size=4, steps=2)]
    assert list(end.execution.eager_steps) == [pb.FallbackCount(reason=RECAPTURING, steps=1)]
    assert end.total_seconds >= end.time_to_first_token_seconds > 0
    assert out.metrics.inter_token_latency._sum.get() == 0.5
    assert requests(out, "length") == 1


def test_a_finished_sequences_late_token_is_dropped():
    out, scheduler = processor()
    done, going = sequence(stop=frozenset({9}), request_id="done"), sequence(request_id="going")
    running(scheduler, done, going)
    out.step_outputs([done, going], [9, 4], time.perf_counter())
    # The step scheduled before the stop token arrived brings one more token for ``done``.
    updates = out.step_outputs([done, going], [5, 6], time.perf_counter())
    assert updates == [(going.stream, [6], None)]
    assert done.output == [9] and going.output == [4, 6]
    assert out.metrics.generated_tokens._value.get() == 3


def test_end_fails_each_unfinished_sequence_once():
    out, scheduler = processor()
    finished, waiting = sequence(stop=frozenset({9}), request_id="finished"), sequence(request_id="waiting")
    first, second = sequence(request_id="a"), sequence(request_id="b")
    running(scheduler, finished, first, second)
    scheduler.add(waiting)
    out.step_outputs([finished], [9], time.perf_counter())
    err = RuntimeError("the step failed")
    updates = out.end([finished, first, second, waiting], err, "error")
    assert updates == [(first.stream, [], err), (second.stream, [], err), (waiting.stream, [], err)]
    assert all(s.finished for s in (first, second, waiting))
    assert not scheduler.running and not scheduler.waiting and len(scheduler.free_slots) == 4
    assert requests(out, "error") == 3
    assert out.end([finished, first, second, waiting], err, "error") == []
    assert requests(out, "error") == 3
    direct_publish(updates)
    assert first.stream.ends == [err] and finished.stream.ends == []


def test_end_without_an_outcome_fails_the_stream_but_counts_no_request():
    out, scheduler = processor()
    seq = sequence()
    running(scheduler, seq)
    err = RuntimeError("shutdown")
    assert out.end([seq], err) == [(seq.stream, [], err)]
    assert seq.finished and not scheduler.running
    assert sum(requests(out, outcome) for outcome in ("length", "stop", "eos", "cancelled", "error")) == 0


def test_tokens_fed_ahead_to_the_logits_state_are_not_fed_again_when_the_step_is_published():
    """A step whose rows need every earlier token feeds the step before's tokens to the grammar
    matchers before that step is published (``accept_ahead``); publishing it then appends the
    token without feeding it twice. A finished sequence's token is fed to nothing."""
    import torch

    from graphkeeper.worker.engine.logits_state import LogitsState
    from graphkeeper.worker.engine.outputs import InFlight
    from graphkeeper.worker.engine.scheduler import ScheduledStep
    from graphkeeper.worker.executor.runner import Launched
    from graphkeeper.worker.plan import LogitsSpec

    out, scheduler = processor()
    seq, done = sequence(max_new_tokens=8, request_id="a"), sequence(max_new_tokens=8, request_id="b")
    running(scheduler, seq, done)
    for s in (seq, done):
        s.logits = LogitsState(LogitsSpec(constrained=True), Consumed(), vocab_size=64)
    done.finished = True  # cancelled: its late token is dropped
    step = ScheduledStep(plan=None, sequences=[seq, done], samplers=[seq, done])
    inflight = InFlight(step, None, None, Launched(torch.tensor([7, 8]), None, 2), 0.0)
    out.accept_ahead(inflight)
    assert seq.logits.matcher.tokens == [7] and seq.logits.accepted == 1 and seq.output == []
    assert done.logits.matcher.tokens == []
    out.accept_ahead(inflight)  # a second look feeds nothing more
    assert seq.logits.matcher.tokens == [7]
    out.step_outputs([seq, done], [7, 8], time.perf_counter())
    assert seq.output == [7] and seq.logits.matcher.tokens == [7] and seq.logits.accepted == 1
    out.step_outputs([seq], [7], time.perf_counter())  # the next token, not fed ahead: fed here
    assert seq.logits.matcher.tokens == [7, 7] and seq.logits.accepted == 2


class Consumed:
    """What a grammar matcher is told, in order (llguidance's ``consume_token``/``is_stopped``)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def consume_token(self, token: int) -> bool:
        self.tokens.append(token)
        return True

    def is_stopped(self) -> bool:
        return False
