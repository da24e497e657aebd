"""The KV cache's block bookkeeping and the scheduler's use of it, without a model: reference
counts, the prefix cache (chained hashes, LRU eviction, a revision change), admission by blocks,
block-table changes in the plan, and preemption of the youngest sequence with its recompute."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphkeeper.worker.engine.blocks import BlockManager, NoFreeBlocks, block_hashes, blocks_for
from graphkeeper.worker.engine.scheduler import DECODE_RESERVE_BLOCKS, Scheduler, admission_blocks
from graphkeeper.worker.engine.sequence import Sequence
from graphkeeper.worker.plan import SamplingSpec


def seq(prompt: list[int], max_new: int, name: str) -> Sequence:
    return Sequence(request_id=name, tenant="", prompt=prompt, max_new_tokens=max_new, sampling=SamplingSpec())


def table(plan) -> dict[tuple[int, int], int]:
    u = plan.block_updates
    return {} if u is None else {(int(s), int(i)): int(b) for s, i, b in u.T}


def test_blocks_are_counted_shared_and_freed():
    m = BlockManager(4, 16, prefix_caching=False)
    a = m.allocate(3)
    assert len(set(a)) == 3 and m.available == 1 and m.used == 3
    with pytest.raises(NoFreeBlocks):
        m.allocate(2)
    m.free(a[:2])
    assert m.available == 3 and m.cached == 0
    assert blocks_for(33, 16) == 3 and blocks_for(32, 16) == 2


def test_block_hashes_chain_over_tokens_parent_and_revision():
    tokens = list(range(40))
    h = block_hashes(tokens, 16, "r1")
    assert len(h) == 2  # the last 8 tokens fill no block
    assert block_hashes(tokens[:32], 16, "r1") == h
    assert block_hashes([99] + tokens[1:], 16, "r1")[1] != h[1]  # same tokens, another parent
    assert block_hashes(tokens, 16, "r2")[0] != h[0]


def test_cached_blocks_are_reused_then_evicted_least_recently_used_and_dropped_on_a_new_revision():
    m = BlockManager(4, 4, revision="r")
    x, y = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "r"), block_hashes([9, 9, 9, 9], 4, "r")
    bx, by = m.allocate(2), m.allocate(1)
    for block, h in zip(bx + by, x + y, strict=True):
        m.register(block, h)
    m.free(bx)
    m.free(by)
    assert m.cached == 3 and m.available == 4 and m.used == 0
    found = m.peek(x)
    assert found == bx and m.idle(found) == 2
    m.acquire(found, 9)
    assert m.used == 2 and m.cached == 1 and (m.query_tokens, m.hit_tokens) == (9, 8)
    m.free(found)  # x's blocks are now the most recently used
    m.allocate(2)  # one free block, then the oldest cached one: y's
    assert m.peek(y) == [] and m.peek(x) == bx
    m.reset_prefix_cache("r2")
    assert m.peek(x) == [] and m.cached == 0 and m.available == 2


def test_admission_waits_for_blocks_and_the_plan_carries_the_block_tables():
    sched = Scheduler(4, 64, 0, BlockManager(4, 4, prefix_caching=False))
    a, b = seq(list(range(10)), 4, "a"), seq(list(range(20, 27)), 4, "b")
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    # a's 10 tokens take 3 blocks; b's 7 would take 2 of the 1 left: b waits.
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert table(first.plan) == {(a.slot, i): blk for i, blk in enumerate(a.blocks)} and len(a.blocks) == 3
    second = sched.schedule()  # a decodes at position 10, in its third block: nothing new
    assert table(second.plan) == {}
    sched.schedule()
    sched.schedule()  # position 12 starts a fourth block
    assert len(a.blocks) == 4


def test_admission_asks_for_the_prompt_and_a_decode_reserve_and_takes_only_the_prompt():
    assert DECODE_RESERVE_BLOCKS == 1
    assert admission_blocks(8, 100, 4) == 3  # two blocks of prompt, one of output
    assert admission_blocks(8, 1, 4) == 3 and admission_blocks(7, 1, 4) == 2  # never past what the output reaches
    assert admission_blocks(8, 0, 4) == 2
    blocks = BlockManager(5, 4, prefix_caching=False)
    sched = Scheduler(4, 64, 0, blocks)
    a, b, c = seq(list(range(8)), 8, "a"), seq(list(range(8)), 8, "b"), seq(list(range(10, 18)), 1, "c")
    for s in (a, b, c):
        sched.add(s)
    sched.schedule()
    # a needs 3 and takes 2; b needs 3 of the 3 left and takes 2; c asks for one new token, but
    # its position 8 starts a third block, so it needs 3 of the 1 left: it waits.
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert len(a.blocks) == len(b.blocks) == 2 and blocks.available == 1


def test_many_short_requests_all_run_at_once_while_their_blocks_are_free():
    """32 requests on a cache that holds far fewer whole contexts (8 of 256 tokens): each needs the
    blocks of its prompt and one more, so all 32 are admitted in one step and none waits."""
    context, block = 256, 16
    sched = Scheduler(32, 512, 0, BlockManager(8 * context // block, block, prefix_caching=False))
    requests = [seq(list(range(i, i + 12)), 200, f"r{i}") for i in range(32)]
    for r in requests:
        sched.add(r)
    step = sched.schedule()
    assert len(sched.running) == 32 and not sched.waiting and len(step.samplers) == 32
    assert all(len(r.blocks) == 1 for r in requests)


def test_the_youngest_sequence_is_preempted_and_resumes_from_its_tokens():
    blocks = BlockManager(5, 4, prefix_caching=False)
    sched = Scheduler(4, 64, 0, blocks)
    a, b = seq(list(range(8)), 8, "a"), seq(list(range(30, 38)), 8, "b")
    sched.add(a)
    sched.add(b)
    step = sched.schedule()  # both prompts: 2 blocks each, 1 left
    assert step.samplers == [a, b] and blocks.available == 1
    a.output.append(100)
    b.output.append(200)  # the first step's tokens are in
    sched.schedule()  # both decode at position 8: a takes the last block, b preempts itself
    assert sched.running == [a] and list(sched.waiting) == [b] and b.preemptions == 1 and sched.preemptions == 1
    assert b.blocks == [] and b.slot is None and blocks.available == 2  # b now needs 3: it waits
    sched.finish(a)  # a ends: its blocks free
    resumed = sched.schedule()
    # b is recomputed from its prompt and the token it sampled, and samples its second token.
    assert b.recompute == b.prompt + [200] and resumed.plan.prompt_tokens == b.prompt + [200]
    assert resumed.samplers == [b] and list(resumed.plan.sample_rows) == [8]
    assert b.samples_scheduled == 2 and len(b.blocks) == 3  # its second token is the one this step samples


def test_a_preempted_sequence_waits_for_its_token_on_the_way():
    sched = Scheduler(4, 64, 0, BlockManager(4, 4, prefix_caching=False))
    a = seq(list(range(8)), 8, "a")
    sched.add(a)
    sched.schedule()
    sched.schedule()  # a's first token is on its way, its second launched
    sched.preempt(a)
    assert sched.schedule() is None  # not admitted: 2 sampled tokens launched, none received
    a.output += [5, 6]
    step = sched.schedule()
    assert step.plan.prompt_tokens == list(range(8)) + [5, 6]


def test_a_cached_prefix_is_not_computed_again():
    blocks = BlockManager(16, 4)
    sched = Scheduler(4, 64, 0, blocks)
    prefix = list(range(100, 110))
    a = seq(prefix + [1, 2], 2, "a")
    sched.add(a)
    sched.schedule()  # a computes 12 tokens: 3 full blocks registered
    b = seq(prefix + [3, 4, 5], 2, "b")
    sched.add(b)
    step = sched.schedule()
    # b shares a's first two blocks (8 tokens of the prefix; the third block holds a's own tokens).
    assert b.blocks[:2] == a.blocks[:2] and b.cached_prompt_tokens == 8 and blocks.refs[a.blocks[0]] == 2
    chunk = step.plan.prefill[0]
    assert (chunk.start, chunk.length) == (8, 5) and step.plan.prompt_tokens == [108, 109, 3, 4, 5]
    assert table(step.plan)[(b.slot, 0)] == a.blocks[0]
    same = seq(prefix + [1, 2], 2, "same")  # a's whole prompt: the last token is computed again
    sched.add(same)
    step = sched.schedule()
    assert same.cached_prompt_tokens == 8 and step.plan.prefill[0].length == 4
    assert step.plan.prefill[0].start == 8
    assert list(step.plan.positions[step.plan.num_decode:]) == list(np.arange(8, 12))


def test_a_failed_sequence_takes_its_own_blocks_out_of_the_prefix_cache():
    blocks = BlockManager(16, 4)
    sched = Scheduler(4, 64, 0, blocks)
    prefix = list(range(100, 112))
    a = seq(prefix + [1], 2, "a")
    sched.add(a)
    sched.schedule()
    b = seq(prefix + [2, 3, 4, 5, 6], 2, "b")
    sched.add(b)
    sched.schedule()  # b reuses a's 3 blocks and computes 5 tokens: one more full block
    assert b.cached_prompt_tokens == 12 and b.registered == 4
    sched.finish(b, failed=True)  # its step raised: its own block may be half written
    assert blocks.peek(block_hashes(b.prompt, 4, "")) == a.blocks[:3]  # a's blocks are still cached


def test_eviction_takes_a_freed_prefix_from_its_tail_so_its_head_stays_reusable():
    """A lookup stops at the first missing block: evicting a chain's first block would make every
    block after it unreachable. A sequence's blocks are freed tail first, so the least recently
    used is its last block and what is evicted shortens the cached prefix by one block only."""
    blocks = BlockManager(4, 4)
    sched = Scheduler(4, 64, 0, blocks)
    prompt = list(range(100, 113))  # 3 full blocks and one token
    a = seq(prompt, 1, "a")
    sched.add(a)
    sched.schedule()
    held = list(a.blocks)
    sched.finish(a)
    assert blocks.cached == 3 and blocks.used == 0
    hashes = block_hashes(prompt, 4, "")
    assert blocks.peek(hashes) == held[:3]
    blocks.allocate(2)  # the one free block and one cached block
    assert blocks.peek(hashes) == held[:2], "the prefix's head was evicted before its tail"


def test_a_recomputed_sequence_counts_its_prompt_once_in_the_prefix_cache_and_its_summary():
    """After a preemption the sequence's own blocks are found in the prefix cache again: saved
    work, but not a second request's prompt. ``cached_prompt_tokens`` stays within the prompt and
    the worker's prefix queries and hits count each request's prompt once."""
    blocks = BlockManager(6, 4)
    sched = Scheduler(4, 64, 0, blocks)
    a, b = seq(list(range(100, 108)), 12, "a"), seq(list(range(200, 208)), 12, "b")
    sched.add(a)
    sched.add(b)
    step = sched.schedule()  # 2 blocks each, 2 left
    tokens = {a: iter(range(300, 400)), b: iter(range(400, 500))}
    while b.preemptions == 0:
        for s in step.samplers:
            if not s.finished:
                s.output.append(next(tokens[s]))
        step = sched.schedule()
    for s in step.samplers:
        s.output.append(next(tokens[s]))
    queries = blocks.query_tokens
    sched.finish(a)
    resumed = sched.schedule()  # b is recomputed: its prompt's and its own outputs' blocks are cached
    assert b.slot is not None and b.recompute is not None
    assert resumed.plan.prefill[0].start >= 8  # the recompute did reuse its blocks
    assert b.cached_prompt_tokens == 0  # its prompt was computed, at its first admission
    assert blocks.query_tokens == queries == 16 and blocks.hit_tokens <= blocks.query_tokens


def test_a_sequence_preempted_while_a_reload_drains_finishes_on_the_weights_it_started_with():
    """While the engine drains for a model change no new request is admitted, but a running
    sequence preempted for blocks is one that started: it is recomputed and finishes before the
    reload (``drained`` is False while it waits), not resumed on the new weights."""
    blocks = BlockManager(5, 4, prefix_caching=False)
    sched = Scheduler(4, 64, 0, blocks)
    a, b, late = seq(list(range(8)), 8, "a"), seq(list(range(30, 38)), 8, "b"), seq([5, 6], 2, "late")
    sched.add(a)
    sched.add(b)
    sched.schedule()
    a.output.append(100)
    b.output.append(200)
    sched.admitting = False  # a reload is pending
    sched.add(late)
    sched.schedule()  # a takes the last block, b is preempted
    assert list(sched.waiting) == [b, late] and b.preemptions == 1
    assert not sched.drained  # the reload must wait for b
    sched.finish(a)
    step = sched.schedule()
    assert step is not None and step.sequences == [b] and list(sched.waiting) == [late]
    assert not sched.drained
    sched.finish(b)
    assert sched.drained and sched.schedule() is None  # late waits for the new weights


def test_a_request_that_waited_through_a_reload_hashes_its_prompt_under_the_new_revision():
    """Hashes are computed once per waiting request; one computed before a model reload must not
    register the new model's keys under the old revision (the same prompt sent after the reload
    would never find them)."""
    blocks = BlockManager(4, 4, revision="r1")
    sched = Scheduler(4, 64, 0, blocks)
    hog, w = seq(list(range(100, 113)), 1, "hog"), seq(list(range(8)) + [9], 2, "w")
    sched.add(hog)
    sched.add(w)
    sched.schedule()  # hog takes every block; w's hashes are computed and it waits
    assert list(sched.waiting) == [w] and w.block_hashes == block_hashes(w.prompt, 4, "r1")
    sched.finish(hog)
    blocks.reset_prefix_cache("r2")  # the reload (nothing runs)
    sched.schedule()  # w computes its prompt on r2
    assert blocks.peek(block_hashes(w.prompt, 4, "r2")) == w.blocks[:2]


def test_a_step_that_raised_at_launch_hands_its_block_table_changes_to_the_next_plan():
    """z is admitted in the step of x's chunk but gets no rows (x's chunk takes the token
    budget). The step raises before the runner applied its block tables and x, alone in it, fails
    without a re-run: z's table must come with the next plan, or z would write into the blocks its
    slot held before."""
    sched = Scheduler(4, 8, 0, BlockManager(8, 4, prefix_caching=False))
    x, z = seq(list(range(10, 22)), 2, "x"), seq([5, 6, 7], 2, "z")
    sched.add(x)
    sched.add(z)
    step = sched.schedule()
    assert step.sequences == [x] and z in sched.running and table(step.plan)[(z.slot, 0)] == z.blocks[0]
    sched.launch_failed(step)
    sched.finish(x, failed=True)
    again = sched.schedule()
    assert again.sequences == [z] and table(again.plan)[(z.slot, 0)] == z.blocks[0]


def run_to_end(sched: Scheduler, s: Sequence, tokens: list[int]) -> None:
    """Runs ``s`` alone as the engine does: each step's token reaches the host (and the scheduler,
    through ``received``) after the next step was launched."""
    sched.add(s)
    inflight = None
    stream = iter(tokens)
    while not s.finished:
        step = sched.schedule()
        if inflight is not None:
            for q in inflight.samplers:
                if not q.finished:
                    q.output.append(next(stream))
                    sched.received(q)
                    if len(q.output) >= q.max_new_tokens:
                        sched.finish(q)
        inflight = step


def test_blocks_filled_by_decode_are_cached_for_a_prompt_that_extends_prompt_and_output():
    """A chat's next turn (the previous prompt, the model's answer and more) reuses every full
    block of the previous request, the ones its decode steps filled included, not only its
    prompt's. The chain of a decode-filled block equals a prompt block's over the same tokens."""
    blocks = BlockManager(16, 16, revision="r1")
    sched = Scheduler(4, 64, 0, blocks)
    first = seq(list(range(100, 120)), 30, "first")  # 20 prompt tokens, 30 generated: 50, 3 full blocks
    run_to_end(sched, first, list(range(500, 530)))
    assert first.output == list(range(500, 530)) and blocks.used == 0
    assert first.block_hashes == block_hashes(first.prompt + first.output, 16, "r1")
    assert blocks.cached == 3  # the 4th block (2 tokens) is partial: never registered
    turn = seq(first.prompt + first.output + [7, 8, 9, 10, 11], 2, "turn")
    sched.add(turn)
    step = sched.schedule()
    assert turn.cached_prompt_tokens == 48
    assert step.plan.prefill[0].start == 48 and step.plan.prompt_tokens == turn.prompt[48:]


def test_a_block_whose_last_token_was_never_fed_back_is_not_cached():
    """The last generated token's keys are never written (no step feeds it back): a block it
    completes is not registered; a sequence cancelled mid-block registers only full blocks."""
    blocks = BlockManager(8, 4, revision="r")
    sched = Scheduler(2, 64, 0, blocks)
    a = seq([10, 11], 6, "a")  # 8 tokens: block 1 ends with the last generated token
    run_to_end(sched, a, [20, 21, 22, 23, 24, 25])
    assert blocks.cached == 1  # block 0 only
    b = seq([10, 11, 20, 21, 22, 23, 24, 25, 9], 1, "b")
    sched.add(b)
    sched.schedule()
    assert b.cached_prompt_tokens == 4


def test_a_preempted_decoding_sequence_keeps_one_right_chain_and_its_next_turn_hits():
    """A tight cache preempts a decoding sequence: its recompute and its later decode extend one
    chain, equal to the chain of its prompt and output computed at once; each hash is cached
    under one block, and its next turn finds its decode-filled blocks."""
    blocks = BlockManager(7, 4, revision="r")
    sched = Scheduler(4, 64, 0, blocks)
    a, b = seq(list(range(100, 106)), 14, "a"), seq(list(range(200, 206)), 14, "b")
    sched.add(a)
    sched.add(b)
    streams = {a: iter(range(300, 400)), b: iter(range(400, 500))}
    inflight = None
    while not (a.finished and b.finished):
        step = sched.schedule()
        if inflight is not None:
            for q in inflight.samplers:
                if not q.finished:
                    q.output.append(next(streams[q]))
                    sched.received(q)
                    if len(q.output) >= q.max_new_tokens:
                        sched.finish(q)
        inflight = step
    assert a.preemptions + b.preemptions > 0, "7 blocks of 4 for two sequences of 20 tokens must preempt"
    for s in (a, b):
        assert s.block_hashes == block_hashes(s.prompt + s.output, 4, "r")
    assert len(set(blocks._block_of.values())) == len(blocks._block_of) == len(blocks._hash_of)
    # The preempted one finished last: its blocks are cached, every full one but the block ending
    # with its last token (never fed back, so never written).
    s = a if a.preemptions else b
    turn = seq(s.prompt + s.output + [9], 1, "turn")
    sched.add(turn)
    sched.schedule()
    assert turn.cached_prompt_tokens == 16


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.booleans()), min_size=1, max_size=24),
       st.integers(6, 40), st.integers(1, 8))
def test_no_request_waits_while_a_slot_and_its_blocks_are_free(requests, num_blocks, max_num_seqs):
    """Right after every step is planned: either nothing waits, or the head of the queue lacks a
    slot or the blocks of its prompt and decode reserve (admission is in order). Requests arrive
    between steps, tokens come back, and some running ones finish."""
    block = 4
    blocks = BlockManager(num_blocks, block, prefix_caching=False)
    sched = Scheduler(max_num_seqs, 64, 0, blocks)
    # The engine refuses a request the whole cache cannot hold (CannotFit).
    fits = [(p, n, done) for p, n, done in requests if blocks_for(p + n, block) <= num_blocks]
    for i, (prompt, max_new, finish_one) in enumerate(fits):
        sched.add(seq(list(range(100 + i, 100 + i + prompt)), max_new, f"r{i}"))
        step = sched.schedule()
        if sched.waiting:
            head = sched.waiting[0]
            tokens = len(head.prompt) + len(head.output)
            short_of_blocks = admission_blocks(tokens, head.max_new_tokens - len(head.output), block) > blocks.available
            assert len(sched.running) == max_num_seqs or short_of_blocks or head.samples_scheduled > len(head.output)
        for s in step.samplers if step else []:
            s.output.append(7)  # each sampled token arrives before the next step
            if len(s.output) >= s.max_new_tokens:
                sched.finish(s)
        if finish_one and sched.running:
            sched.finish(sched.running[0])


def test_queued_counts_requests_waiting_for_blocks_while_slots_are_free():
    """Admission's queue count (``Scheduler.queued``, what ``--max-queue`` compares): a request that
    waits for KV blocks is queued though slots are free (only slots were counted, so requests piled
    up behind a full cache past the queue limit), and so is every request behind it."""
    blocks = BlockManager(4, 4, prefix_caching=False)
    sched = Scheduler(4, 64, 0, blocks)
    a = seq(list(range(12)), 4, "a")  # needs 4 blocks (3 of prompt, 1 of reserve), takes 3
    sched.add(a)
    sched.schedule()
    assert blocks.available == 1 and sched.queued() == 0
    assert sched.queued(1) == 0 and sched.queued(2) == 1  # the one block left starts one arrival
    sched.schedule()  # a's position 12 takes the last block
    b, c = seq(list(range(20, 27)), 4, "b"), seq([5], 4, "c")  # b needs 3 blocks, c 2
    sched.add(b)
    sched.add(c)
    assert sched.queued() == 2 and sched.queued(1) == 3  # three slots are free, no block is
    sched.schedule()
    assert list(sched.waiting) == [b, c]  # as foreseen
    sched.finish(a)
    assert sched.queued() == 0 and sched.queued(1) == 0 and sched.queued(2) == 1
    sched.schedule()  # b takes 2 of the 4 blocks, c 1 of the 2 left (reserves are checked, not taken)
    assert sched.running == [b, c] and not sched.waiting


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=10),
       st.integers(1, 6), st.integers(4, 24))
def test_queued_foresees_what_the_next_admission_leaves_waiting(requests, slots, num_blocks):
    sched = Scheduler(slots, 64, 0, BlockManager(num_blocks, 4, prefix_caching=False))
    for i, (prompt, max_new) in enumerate(requests):
        sched.add(seq(list(range(prompt)), max_new, f"r{i}"))
    foreseen = sched.queued()
    sched.schedule()
    assert len(sched.waiting) == foreseen
