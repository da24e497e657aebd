"""The step loop's decisions without a model: scheduling ahead of the previous step's
tokens, the decode batch as arrays, length limits known ahead, finished and cancelled sequences
leaving the batch, and the API layer's one-pass fan-out with coalescing."""

from __future__ import annotations

import asyncio

import numpy as np

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.scheduler import Scheduler, sub_step
from graphkeeper.worker.engine.sequence import Sequence
from graphkeeper.worker.plan import SamplingSpec
from graphkeeper.worker.serving.streams import MAX_FLUSH_GAP, StreamHub, TokenStream


def seq(prompt_len: int, max_new: int, name: str = "s", temperature: float = 0.0) -> Sequence:
    return Sequence(request_id=name, tenant="", prompt=list(range(3, 3 + prompt_len)), max_new_tokens=max_new,
                    sampling=SamplingSpec(temperature=temperature), seed=len(name))


def test_a_sub_step_keeps_exactly_its_sequences_rows():
    """What a failed step re-runs without its culprit: each kept sequence's rows, positions, slots,
    chunk and sampling row as in the full step, renumbered; the others' rows are gone."""
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk=0)
    a, b = seq(3, 8, "a", temperature=0.5), seq(3, 8, "b")
    sched.add(a)
    sched.add(b)
    sched.schedule()  # both prompts; both decode from here
    c, d = seq(5, 8, "c"), seq(4, 8, "d", temperature=0.7)
    sched.add(c)
    sched.add(d)
    full = sched.schedule()  # decode a, b; prefill c (5 rows), d (4 rows)
    assert full.plan.num_decode == 2 and [ch.length for ch in full.plan.prefill] == [5, 4]
    sub = sub_step(full, {b, d})
    plan = sub.plan
    assert sub.sequences == [b, d] and sub.samplers == [b, d]
    assert plan.num_decode == 1 and plan.num_tokens == 5
    assert list(plan.positions) == [3, 0, 1, 2, 3] and list(plan.slots) == [b.slot] + [d.slot] * 4
    assert plan.prompt_tokens == d.prompt
    assert [(ch.row, ch.length, ch.slot, ch.start) for ch in plan.prefill] == [(1, 4, d.slot, 0)]
    assert list(plan.sample_rows) == [0, 4] and list(plan.sample_slots) == [b.slot, d.slot]
    assert list(plan.sampling.temperature) == [0.0, np.float32(0.7)]
    assert list(plan.sampling.sample_index) == [1, 0]
    alone = sub_step(full, {c})
    assert alone.plan.num_decode == 0 and alone.plan.prompt_tokens == c.prompt and alone.samplers == [c]
    assert list(alone.plan.sample_rows) == [4]


def test_steps_are_scheduled_ahead_without_the_previous_tokens():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk=0)
    a, b = seq(5, 4, "a"), seq(20, 3, "b", temperature=0.5)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    # a's whole prompt and 11 tokens of b's; a samples its first token at row 4.
    assert first.plan.num_decode == 0 and first.plan.num_tokens == 16
    assert list(first.plan.sample_rows) == [4] and first.samplers == [a]
    second = sched.schedule()  # no tokens have come back: a decodes from its device-side token
    assert second.plan.num_decode == 1 and list(second.plan.positions[:1]) == [5]
    assert list(second.plan.slots[:1]) == [a.slot]
    assert [c.length for c in second.plan.prefill] == [9]  # the rest of b
    third = sched.schedule()
    assert third.plan.uniform_decode and list(third.plan.positions) == [6, 20]
    sampling = third.plan.sampling  # built because b samples: which token of its request each row draws
    assert list(sampling.sample_index) == [2, 1] and list(sampling.temperature) == [0.0, 0.5]


def test_a_length_limit_is_known_ahead_and_costs_no_extra_step():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk=0)
    a = seq(3, 3)
    sched.add(a)
    samples = 0
    while (step := sched.schedule()) is not None:
        samples += step.samplers.count(a)
        assert samples <= 3
    assert samples == 3
    assert a.slot is not None  # its slot is held until its last token arrives
    sched.finish(a)
    assert sched.free_slots == [1, 0] and not sched.running


def test_a_sequence_that_stops_early_leaves_the_batch_and_its_slot_is_reused():
    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=8, prefill_chunk=0)
    a, b = seq(2, 50, "a"), seq(2, 5, "b")
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.schedule()
    sched.finish(a)  # an end-of-sequence token arrived a step late
    assert a.finished and len(sched.decode) == 0
    step = sched.schedule()
    assert step.sequences == [b] and b.slot == 0


def test_the_decode_batch_advances_by_vector_and_writes_back_on_leave():
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=0)
    seqs = [seq(4, 10, str(i)) for i in range(8)]
    for s in seqs:
        sched.add(s)
    for _ in range(5):
        sched.schedule()
    assert np.array_equal(sched.decode.positions, np.full(8, 8))
    sched.finish(seqs[3])
    assert (seqs[3].computed, seqs[3].samples_scheduled) == (8, 5)
    assert len(sched.decode) == 7 and seqs[3] not in sched.decode.seqs


def test_fan_out_is_one_callback_per_step_and_a_slow_stream_gets_its_tokens_together():
    async def scenario() -> tuple[list[int], bool]:
        hub = StreamHub(asyncio.get_running_loop())
        fast, slow = TokenStream(), TokenStream()
        for step in range(5):
            hub.publish([(fast, [step], None), (slow, [10 + step], None)])
        await asyncio.sleep(0.01)
        return slow.tokens, slow.wake.is_set()

    tokens, woken = asyncio.run(scenario())
    assert tokens == [10, 11, 12, 13, 14] and woken  # five steps wait as one message


def test_steps_published_before_the_loop_runs_wake_it_once_and_keep_their_order():
    async def scenario() -> tuple[list[int], list[int]]:
        loop = asyncio.get_running_loop()
        hub, wakes = StreamHub(loop), []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(1), real(*a))[1]
        stream = TokenStream()
        for step in range(5):  # the loop does not run between these: one wake carries all five
            hub.publish([(stream, [step], None)])
        await asyncio.sleep(0.01)
        counts = [len(wakes)]
        hub.publish([(stream, [5], None)])  # the loop has drained: the next step wakes it again
        await asyncio.sleep(0.01)
        counts.append(len(wakes))
        return stream.tokens, counts

    tokens, wakes = asyncio.run(scenario())
    assert tokens == [0, 1, 2, 3, 4, 5]
    assert wakes == [1, 2]


def test_a_streams_end_cuts_its_pacing_gap_short():
    """A handler waiting out its pacing gap is released by its stream's end (the completion goes
    out at once); a pause after the end does not wait; one with no end waits its gap and leaves
    nothing behind."""
    async def scenario() -> tuple[list[int], object, bool, object]:
        hub = StreamHub(asyncio.get_running_loop())
        plain, ending = TokenStream(), TokenStream()
        await plain.pause(0.001)  # no end: the gap passes
        paused = asyncio.ensure_future(ending.pause(60.0))
        await asyncio.sleep(0)
        assert not paused.done()
        hub.publish([(ending, [7], pb.Completion(request_id="r"))])
        await asyncio.wait_for(paused, 10)  # released by the end, far before its 60 s
        await asyncio.wait_for(ending.pause(60.0), 10)  # ended already: no wait at all
        return ending.tokens, ending.end, ending.wake.is_set(), plain.pausing

    tokens, end, woken, left = asyncio.run(scenario())
    assert tokens == [7] and end.request_id == "r" and woken and left is None


def test_pacing_grows_with_open_streams_and_is_off_for_one():
    hub = StreamHub(asyncio.new_event_loop())
    hub.open_streams = 1
    assert hub.flush_gap() == 0.0
    hub.open_streams = 8
    small = hub.flush_gap()
    hub.open_streams = 64
    assert 0 < small < hub.flush_gap() <= MAX_FLUSH_GAP
    hub.open_streams = 10_000
    assert hub.flush_gap() == MAX_FLUSH_GAP
    hub.loop.close()
