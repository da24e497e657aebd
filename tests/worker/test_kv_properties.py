"""Properties of the paged KV cache's bookkeeping under random traffic, without a model.

A small simulated device runs every step the scheduler plans, as the engine does: block-table
changes first, then each row writes its key (here: the revision and the token it carries) at its
position in its slot's block, then each row reads every position before it. Tokens come back one
step late (the engine schedules ahead); some prompts extend an earlier request's prompt and output
(a chat's next turn, which reuses blocks filled by decode), sequences stop early, are cancelled, fail in a step (that
raised before it ran, or whose rows wrote garbage) and are preempted when blocks run out; the
model revision changes. The properties: every read sees exactly its own sequence's tokens under
the current revision (so no cached block is reused while written, no prefix hit is stale, no
block is shared by mistake), a sequence runs on the revision it began on, reference counts
always equal the holders, and every block comes back when the requests end.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphkeeper.worker.engine.blocks import BlockManager
from graphkeeper.worker.engine.scheduler import ScheduledStep, Scheduler, sub_step
from graphkeeper.worker.engine.sequence import Sequence
from graphkeeper.worker.plan import SamplingSpec

EOS = 1
GARBAGE = ("garbage", -1)


def generated(name: str, i: int, vocab: int) -> int:
    """The ``i``-th token the 'model' samples for request ``name`` (deterministic, EOS possible)."""
    return 2 + int.from_bytes(hashlib.blake2b(f"{name}/{i}".encode(), digest_size=4).digest(), "little") % vocab


@dataclass
class Device:
    """The KV cache's contents and the per-slot state the runner keeps on the device."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    revision: str = "r0"
    cache: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)  # (block, offset) -> key
    tables: dict[tuple[int, int], int] = field(default_factory=dict)  # (slot, index) -> block
    last_token: dict[int, int] = field(default_factory=dict)  # slot -> token sampled last
    started_on: dict[Sequence, str] = field(default_factory=dict)  # the revision each sequence began on

    def run(self, step: ScheduledStep, streams: dict[Sequence, list[int]], garbage: bool = False) -> list[int]:
        """Runs a step; returns its sampled tokens. ``garbage``: the step failed part way and its rows
        wrote nonsense (a launch that raised)."""
        plan, bs = step.plan, self.block_size
        if plan.block_updates is not None:
            for s, i, b in plan.block_updates.T:
                self.tables[(int(s), int(i))] = int(b)
        rows = []  # (seq, slot, position, input token)
        nd = plan.num_decode
        for r in range(nd):
            slot = int(plan.slots[r])
            rows.append((step.sequences[r], slot, int(plan.positions[r]), self.last_token[slot]))
        for j, chunk in enumerate(plan.prefill):
            seq = step.sequences[nd + j]
            for k in range(chunk.length):
                r = chunk.row + k
                rows.append((seq, chunk.slot, int(plan.positions[r]), plan.prompt_tokens[r - nd]))
        for _seq, slot, pos, token in rows:
            block = self.tables[(slot, pos // bs)]
            self.cache[(block, pos % bs)] = GARBAGE if garbage else (self.revision, token)
        if garbage:
            return []
        for seq, slot, pos, token in rows:
            stream = streams[seq]
            began = self.started_on.setdefault(seq, self.revision)
            assert began == self.revision, f"{seq.request_id} began on {began}, runs on {self.revision}"
            assert token == stream[pos], f"{seq.request_id} fed {token} at {pos}, its token is {stream[pos]}"
            for q in range(pos + 1):  # attention reads every position up to its own
                block = self.tables[(slot, q // bs)]
                assert self.cache.get((block, q % bs)) == (self.revision, stream[q]), (
                    f"{seq.request_id} at {pos} reads position {q} (block {block}): "
                    f"{self.cache.get((block, q % bs))}, expected {(self.revision, stream[q])}")
        tokens = []
        for r, slot in zip(plan.sample_rows, plan.sample_slots, strict=True):
            seq = rows[int(r)][0]
            tok = streams[seq][int(plan.positions[r]) + 1]
            self.last_token[int(slot)] = tok
            tokens.append(tok)
        return tokens


def check_counts(sched: Scheduler) -> None:
    """Reference counts equal the holders; every block is free, cached-and-idle or held, once."""
    m = sched.blocks
    holders = [0] * m.num_blocks
    for seq in sched.running:
        assert len(set(seq.blocks)) == len(seq.blocks), f"{seq.request_id} lists a block twice"
        for b in seq.blocks:
            holders[b] += 1
    for seq in sched.waiting:
        assert seq.blocks == [] and seq.slot is None
    assert m.refs == holders
    free, idle = set(m._free), set(m._evictable)
    assert len(free) == len(m._free) and not free & idle
    assert all(m.refs[b] == 0 for b in free | idle)
    assert not free & set(m._hash_of) and idle <= set(m._hash_of)
    assert {m._block_of[h] for h in m._block_of} == set(m._hash_of)
    assert len(free) + len(idle) + sum(1 for r in m.refs if r) == m.num_blocks
    assert 0 <= m.hit_tokens <= m.query_tokens


events = st.lists(st.tuples(
    st.sampled_from(["arrive"] * 3 + ["step"] * 4 + ["cancel", "fail", "reload", "reload"]),
    st.integers(0, 10**6)), min_size=8, max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events, num_blocks=st.integers(6, 14), max_num_seqs=st.integers(1, 4),
       budget=st.sampled_from([4, 8, 64]), chunk=st.sampled_from([0, 3]), prefix=st.booleans())
def test_random_traffic_reads_only_its_own_tokens_and_returns_every_block(events, num_blocks, max_num_seqs, budget,
                                                                          chunk, prefix):
    bs = 4
    budget = max(budget, max_num_seqs)
    blocks = BlockManager(num_blocks, bs, prefix_caching=prefix, revision="r0")
    sched = Scheduler(max_num_seqs, budget, chunk, blocks)
    device = Device(num_blocks, bs, max_num_seqs)
    streams: dict[Sequence, list[int]] = {}
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # a common prefix, so that prefix hits happen
    inflight: ScheduledStep | None = None
    reload_pending = False
    n = 0
    live: list[Sequence] = []

    def deliver(step: ScheduledStep | None, tokens: list[int]) -> None:
        if step is None:
            return
        for seq, tok in zip(step.samplers, tokens, strict=True):
            if seq.finished:
                continue
            seq.output.append(tok)
            sched.received(seq)  # as the engine's output processor does: decode-filled blocks are cached
            if tok == EOS or len(seq.output) >= seq.max_new_tokens:
                sched.finish(seq)

    def one_step(fail: str = "") -> None:
        """``fail``: "" runs the step; "late" raises with its rows half written; "early" raises
        before the runner ran (nothing written, no block-table change applied)."""
        nonlocal inflight
        for seq in sched.reap_cancelled():
            assert seq.finished
        step = sched.schedule()
        tokens: list[int] = []
        if step is not None and fail == "late":
            device.run(step, streams, garbage=True)
        elif step is not None and not fail:
            tokens = device.run(step, streams)
        deliver(inflight, inflight_tokens[0])  # the previous step's tokens, after the next launch
        if step is not None and fail:  # isolated: one culprit fails, the others run again
            sched.launch_failed(step)
            culprit = step.sequences[-1]
            rest = {s for s in step.sequences if s is not culprit}
            if rest:
                sub = sub_step(step, rest)
                deliver(sub, device.run(sub, streams))
            if not culprit.finished:
                sched.finish(culprit, failed=True)
            step = None
        inflight, inflight_tokens[0] = step, tokens
        check_counts(sched)

    inflight_tokens: list[list[int]] = [[]]
    for kind, x in events:
        if kind == "arrive" and not reload_pending:
            for k in range(1 + x % 3):  # a burst of one to three requests
                y = hashlib.blake2b(f"{x}/{k}".encode(), digest_size=8).digest()
                y = int.from_bytes(y, "little")
                prompt_len = 1 + y % 18
                tail = [2 + (y >> 5) % 50] * 20
                prompt = (shared + tail)[:prompt_len] if y % 3 else [2 + (y >> 8) % 90] * prompt_len
                done = [s for s in live if s.output]
                if done and y % 4 == 0:  # a chat's next turn: an earlier prompt + its output (+ a new turn)
                    prior = done[(y >> 16) % len(done)]
                    prompt = prior.prompt + prior.output + [3 + (y >> 20) % 7] * ((y >> 24) % 6)
                    prompt_len = len(prompt)
                max_new = 1 + (y >> 12) % 16
                if -(-(prompt_len + max_new) // bs) > num_blocks:
                    continue  # the engine refuses it at submit (CannotFit)
                name = f"s{n}"
                n += 1
                seq = Sequence(request_id=name, tenant="", prompt=prompt, max_new_tokens=max_new,
                               sampling=SamplingSpec())
                streams[seq] = prompt + [generated(name, i, 40 if y % 5 else 2) for i in range(max_new)]
                sched.add(seq)
                live.append(seq)
        elif kind == "step":
            one_step()
        elif kind == "fail":
            one_step(fail="early" if x % 2 else "late")
        elif kind == "cancel" and live:
            live[x % len(live)].cancelled.set()
        elif kind == "reload":
            reload_pending = True
        if reload_pending:
            sched.admitting = False
            if inflight is None and sched.drained:
                device.revision = f"r{x}"
                blocks.reset_prefix_cache(device.revision)
                sched.admitting, reload_pending = True, False
    sched.admitting = True
    for _ in range(2000):
        if not (sched.running or sched.waiting or inflight):
            break
        one_step()
    assert not sched.running and not sched.waiting
    for seq in live:
        assert seq.finished and seq.blocks == [] and seq.slot is None
        assert seq.cached_prompt_tokens <= len(seq.prompt) - 1  # the last prompt token is always computed
    assert blocks.query_tokens <= sum(len(s.prompt) for s in live)  # each prompt counted once at most
    assert blocks.used == 0 and all(r == 0 for r in blocks.refs)
    assert blocks.available == num_blocks and sorted(sched.free_slots) == list(range(max_num_seqs))
    if not prefix:
        assert blocks.cached == 0 and blocks.query_tokens == 0
    np.testing.assert_array_equal(sched.decode.positions, np.zeros(0))
