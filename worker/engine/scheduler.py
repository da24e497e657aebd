"""Continuous batching: which sequences run in the next step, and how many tokens each brings.

Requests join and leave between steps. Each step takes every decoding sequence (one token each)
first, then prefill chunks, within ``max_num_seqs`` running sequences and a token budget per
step; long prompts are prefilled in chunks. A sequence holds one slot (its row of the KV cache's
block table) and the KV blocks of its tokens from admission until it finishes or is cancelled.

KV memory is paged (``blocks.py``). A waiting sequence is admitted, not when a whole context is
free, but while a slot and the blocks for its prompt and a small decode reserve (its first
``DECODE_RESERVE_BLOCKS`` blocks of output, ``admission_blocks``) remain, after reusing the cached
blocks of its prompt's longest cached prefix (prefix caching: those tokens are not computed
again; at least the last prompt token always is, so there are logits to sample). The reserve is
only checked, not taken: it keeps a sequence just admitted from preempting another at its first
decode steps. A decoding sequence takes a new block when its next token starts one; when
none is left the youngest running sequence is *preempted*: its blocks and slot are freed and it
waits at the head of the queue, to be recomputed (prompt and the tokens sampled so far, as one
prefill) once blocks are free again, so memory that is momentarily short fails no request. The
plan carries the block tables' changes to the runner as plain data.

Scheduling never waits for the previous step's tokens: the step loop schedules step N+1 while
step N still runs on the device. A decoding row's input token is the one its sequence sampled
last, which the runner takes from a device buffer indexed by slot, so the scheduler only needs
positions, which it knows ahead. What it learns late is an end-of-sequence or stop token: such a
sequence may be scheduled for one more step, whose token is discarded. Length limits are known
ahead and cost nothing.

The decode batch is kept as arrays (slots, positions) that change only when a sequence joins or
leaves it; a step advances every position with one vector operation, so the per-step Python work
grows with the sequences that changed, not with the batch.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from graphkeeper.worker.engine.blocks import BlockManager, block_hashes, blocks_for, chain_hash
from graphkeeper.worker.engine.logits_state import build_logits_batch, schedule_prompt_logprobs
from graphkeeper.worker.engine.sequence import Sequence
from graphkeeper.worker.engine.step_budget import StepBudget
from graphkeeper.worker.plan import PrefillChunk, PromptLogprobs, SamplingBatch, StepPlan

#: Blocks of output a sequence must find free beside its prompt's to be admitted (checked, not taken).
DECODE_RESERVE_BLOCKS = 1


def admission_blocks(tokens: int, remaining: int, block_size: int) -> int:
    """The blocks a sequence of ``tokens`` tokens (prompt, or prompt and output to recompute) with
    ``remaining`` tokens still to generate needs free to be admitted (pure): its tokens and the
    decode reserve, never past what its output can reach (so never past the context)."""
    return blocks_for(tokens + min(remaining, DECODE_RESERVE_BLOCKS * block_size), block_size)


@dataclass
class ScheduledStep:
    plan: StepPlan
    sequences: list[Sequence]  # every sequence with a row in the step
    samplers: list[Sequence]  # the sequence of each sample row, in row order
    #: A sample row needs every earlier token on the host (penalties, a grammar): the plan's
    #: ``logits`` is built by the engine once the step before has been read (``Engine._start``).
    needs_history: bool = False


class DecodeBatch:
    """The decoding sequences in a stable order, with their slots, next positions, next sample
    indices and remaining samples as arrays: a step advances them all with vector operations,
    and a sequence's own counters are written back only when it leaves."""

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []
        self.slots = np.zeros(0, dtype=np.int64)
        self.positions = np.zeros(0, dtype=np.int64)
        self.sample_index = np.zeros(0, dtype=np.int64)
        self.remaining = np.zeros(0, dtype=np.int64)
        self.held = np.zeros(0, dtype=np.int64)  # blocks each sequence holds

    def __len__(self) -> int:
        return len(self.seqs)

    def join(self, seq: Sequence) -> None:
        self.seqs.append(seq)
        self.slots = np.append(self.slots, seq.slot)
        self.positions = np.append(self.positions, seq.computed)
        self.sample_index = np.append(self.sample_index, seq.samples_scheduled)
        self.remaining = np.append(self.remaining, seq.max_new_tokens - seq.samples_scheduled)
        self.held = np.append(self.held, len(seq.blocks))

    def advance(self) -> None:
        """Every row's token was launched: one position and one sample on."""
        self.positions += 1
        self.sample_index += 1
        self.remaining -= 1

    def leave(self, gone: set[Sequence]) -> None:
        keep = np.array([s not in gone for s in self.seqs], dtype=bool)
        for i in np.flatnonzero(~keep):
            seq = self.seqs[i]
            seq.computed, seq.samples_scheduled = int(self.positions[i]), int(self.sample_index[i])
        self.seqs = [s for s, k in zip(self.seqs, keep, strict=True) if k]
        self.slots, self.positions = self.slots[keep], self.positions[keep]
        self.sample_index, self.remaining = self.sample_index[keep], self.remaining[keep]
        self.held = self.held[keep]

    def sampled_out(self) -> set[Sequence]:
        """Sequences whose last sample is already launched."""
        return {self.seqs[i] for i in np.flatnonzero(self.remaining <= 0)}


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk: int,
                 blocks: BlockManager | None = None) -> None:
        """``blocks`` manages the KV cache's blocks (None: 256 blocks of 16 tokens per sequence,
        no prefix caching: what tests of scheduling alone need)."""
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("the token budget per step must be at least max_num_seqs")
        self.blocks = blocks or BlockManager(max_num_seqs * 256, 16, prefix_caching=False)
        self.block_size = self.blocks.block_size
        self._table_updates: dict[tuple[int, int], int] = {}  # (slot, index) -> block, for the next plan
        self.preemptions = 0
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        #: Prefill tokens a step may carry beside its decode rows (the engine sets a latency target
        #: once step times are measured; until then every step may take the whole budget).
        self.step_budget = StepBudget.fixed(max_num_batched_tokens)
        #: Steps with decode rows that carried more prefill than the target allows, for a prompt
        #: past the TTFT target (the TTFT guard, step_budget.py).
        self.steps_stretched = 0
        self.prefill_chunk = prefill_chunk or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []
        self.decode = DecodeBatch()
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        #: False while the engine drains for a model change: no new sequence starts, but one
        #: preempted for blocks (it started on the weights serving now) is still recomputed.
        self.admitting = True
        self.sampled_running = 0  # running sequences that sample (not greedy)
        self.logits_running = 0  # running sequences with logits processing or log probabilities
        #: Decoding sequences whose received tokens filled a block not yet registered (its last
        #: token's keys are written by the step that feeds it back); checked after each launch.
        self._decoded: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def queued(self, arriving: int = 0) -> int:
        """Requests that will wait: the waiting ones and ``arriving`` ones not added yet, less
        those the next admission starts (admission's queue limit counts this).

        The next admission is foreseen as ``_admit`` runs it, in order: a sequence starts while a
        slot and the blocks for its prompt and decode reserve are left, and none starts behind
        one that waits, so requests waiting for KV blocks are queued even while slots are free.
        Cached prefix blocks are not looked up (nothing is taken off the engine thread's lock-free
        state): a prompt whose prefix is cached may be counted as waiting although it would start.
        An arriving request's prompt is not known here: it is counted as needing one block.
        Read from other threads: ``waiting`` is copied first (one C call, atomic under the GIL).
        """
        waiting = list(self.waiting)
        slots = max(self.max_num_seqs - len(self.running), 0)
        free, bs = self.blocks.available, self.block_size
        starting = 0
        for seq in waiting:
            if not slots or (not self.admitting and not seq.preemptions) or seq.samples_scheduled > len(seq.output):
                break
            tokens = len(seq.prompt) + len(seq.output)
            if admission_blocks(tokens, seq.max_new_tokens - len(seq.output), bs) > free:
                break
            free, slots, starting = free - blocks_for(tokens, bs), slots - 1, starting + 1  # the reserve is not taken
        else:  # everything waiting starts: arrivals take the slots left, one block each at least
            starting += min(arriving, slots, free) if self.admitting else 0
        return len(waiting) + arriving - starting

    @property
    def drained(self) -> bool:
        """No sequence that started runs or waits to be recomputed (what a reload waits for).
        Preempted sequences wait at the head of the queue, ahead of every new one."""
        return not self.running and not (self.waiting and self.waiting[0].preemptions)

    def reap_cancelled(self) -> list[Sequence]:
        """Removes cancelled sequences, freeing their slots; returns them."""
        gone = [s for s in self.running if s.cancelled.is_set()]
        gone += [s for s in self.waiting if s.cancelled.is_set()]
        for seq in gone:
            self.finish(seq)
        return gone

    def finish(self, seq: Sequence, failed: bool = False) -> None:
        """Ends a sequence: it leaves every list and its slot is free for the next admission.
        A ``failed`` sequence's blocks leave the prefix cache too: the step that failed may have
        written them only in part.

        A step already launched may still write the slot; the next one to use it is launched
        after that step on the same stream, so its own writes come later.
        """
        seq.finished = True
        if seq.slot is not None:
            self._release_slot(seq)
            if failed:
                self.blocks.forget(seq.blocks[seq.cached_blocks:])
            else:
                self._register(seq)  # full blocks whose last token was fed back by a launched step
            self.blocks.free(seq.blocks)
            seq.blocks = []
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks and slot and puts it at the head of the queue, to be
        recomputed from its prompt and the tokens sampled so far once blocks are free again.

        Steps already launched may still write its blocks; whoever takes them next is launched
        after those steps on the same stream, as with a freed slot.
        """
        self._release_slot(seq)
        self._register(seq)  # what launched steps wrote stays cached: the recompute may reuse it
        self.blocks.free(seq.blocks)
        seq.blocks, seq.registered, seq.cached_blocks, seq.computed = [], 0, 0, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _release_slot(self, seq: Sequence) -> None:
        """Takes a running sequence out of the batch and gives its slot back (finish and preempt)."""
        self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        else:
            self._leave_decode({seq})
        self.free_slots.append(seq.slot)
        self.sampled_running -= not seq.sampling.greedy
        self.logits_running -= seq.logits is not None
        if seq.logits is not None:
            seq.logits.counted_slot = None  # its penalty counts start over on the next slot
        seq.slot = None

    def _leave_decode(self, gone: set[Sequence]) -> None:
        if any(s in gone for s in self.decode.seqs):
            self.decode.leave(gone)

    def schedule(self, now: float | None = None) -> ScheduledStep | None:
        """The next step, or None when there is nothing to run. Marks its work as launched.
        ``now`` (``time.perf_counter``, the clock of ``Sequence.arrived``; default: read it) is
        when the step is planned, for how long the oldest prompt has waited (the TTFT guard)."""
        self._retire_sampled_out()
        self._grow()
        self._admit()
        batch = self.decode
        nd = len(batch)
        waited, late = 0.0, None
        if nd and self.step_budget.can_stretch:  # the wait matters only then
            now = time.perf_counter() if now is None else now
            waited = self.oldest_wait(now)
            late = self.late_prefill(now) if self.step_budget.stretches(waited) else None
        budget = self.step_budget.prefill_tokens(nd, waited, late)
        normal = self.step_budget.prefill_tokens(nd) if late is not None else budget  # not stretching: the same
        prompt_tokens: list[int] = []
        positions: list[np.ndarray] = [batch.positions]
        slots: list[np.ndarray] = [batch.slots]
        chunks: list[PrefillChunk] = []
        prompt_logprobs: list[PromptLogprobs] = []
        sample_rows: list[int] = list(range(nd))
        samplers: list[Sequence] = list(batch.seqs)
        sample_index: list[int] = []
        sequences: list[Sequence] = list(batch.seqs)
        completed: list[Sequence] = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            tokens = seq.to_prefill
            n = min(budget, self.prefill_chunk, len(tokens) - seq.computed)
            row = nd + len(prompt_tokens)
            if seq.logits is not None and (wanted := schedule_prompt_logprobs(seq, seq.computed, n)) is not None:
                prompt_logprobs.append(dataclasses.replace(wanted, chunk=len(chunks)))
            chunks.append(PrefillChunk(row=row, length=n, slot=seq.slot, start=seq.computed))
            prompt_tokens.extend(tokens[seq.computed:seq.computed + n])
            positions.append(np.arange(seq.computed, seq.computed + n, dtype=np.int64))
            slots.append(np.full(n, seq.slot, dtype=np.int64))
            sequences.append(seq)
            seq.computed += n
            budget -= n
            self._register(seq)
            if not seq.prefilling:
                sample_rows.append(row + n - 1)
                samplers.append(seq)
                sample_index.append(seq.samples_scheduled)
                seq.samples_scheduled += 1
                completed.append(seq)
        if not sequences:
            return None
        if len(prompt_tokens) > normal:
            self.steps_stretched += 1  # carried more prefill than the target alone allows
        history = bool(self.logits_running) and any(
            s.logits is not None and s.logits.spec.needs_history for s in samplers)
        plan = StepPlan(
            prompt_tokens=prompt_tokens, positions=np.concatenate(positions), slots=np.concatenate(slots),
            num_decode=nd, prefill=chunks, sample_rows=np.asarray(sample_rows, dtype=np.int64),
            sample_slots=np.array([s.slot for s in samplers], dtype=np.int64),
            sampling=self._sampling(samplers, np.concatenate([batch.sample_index, np.asarray(sample_index, np.int64)])),
            logits=build_logits_batch(samplers) if self.logits_running and not history else None,
            block_updates=self._take_table_updates(), prompt_logprobs=prompt_logprobs,
        )
        # Launched: decoding sequences move one position on, and finished prefills join the batch.
        batch.advance()
        for seq in completed:
            self.prefilling.remove(seq)
            if seq.wants_samples:
                batch.join(seq)
        if self._decoded:
            self._register_decoded()
        return ScheduledStep(plan, sequences, samplers, history)

    def oldest_wait(self, now: float) -> float:
        """Seconds the oldest prompt still waiting for its first token has waited at ``now``: one
        queued, or admitted and mid-prefill (0: none). Sequences that already sampled (a preempted
        one being recomputed) do not count. Cheap: the prefilling list is at most ``max_num_seqs``,
        and the queue is in arrival order behind the preempted sequences at its head, so it is read
        only up to its first new sequence."""
        oldest = min((s.arrived for s in self.prefilling if not s.samples_scheduled), default=now)
        for seq in self.waiting:
            if not seq.samples_scheduled:
                oldest = min(oldest, seq.arrived)
            if not seq.preemptions:
                break
        return max(now - oldest, 0.0)

    def late_prefill(self, now: float) -> int:
        """Prompt tokens still to prefill, in the order steps serve them, up to and including the
        last admitted prompt that has waited at least the TTFT target for its first token (0: none):
        what a stretched step needs to carry (``StepBudget.prefill_tokens``)."""
        ttft = self.step_budget.ttft_target
        if ttft is None:
            return 0
        ahead = late = 0
        for seq in self.prefilling:
            ahead += len(seq.to_prefill) - seq.computed
            if not seq.samples_scheduled and now - seq.arrived >= ttft:
                late = ahead
        return late

    def _sampling(self, samplers: list[Sequence], sample_index: np.ndarray) -> SamplingBatch | None:
        """Per-row sampling parameters, built only while some running sequence samples."""
        if not self.sampled_running:
            return None
        return SamplingBatch.build([s.sampling for s in samplers], [s.seed for s in samplers], sample_index)

    def _retire_sampled_out(self) -> None:
        """Sequences whose last token is already on its way leave the decode batch (they still hold
        their slot until that token arrives and finishes them)."""
        done = self.decode.sampled_out()
        if done:
            self.decode.leave(done)

    def _admit(self) -> None:
        """Admits waiting sequences in order while a slot and blocks for the prompt and the decode
        reserve remain (``admission_blocks``; the cached blocks of its longest cached prefix are
        reused, not counted). Only the prompt's blocks are taken."""
        bs, blocks = self.block_size, self.blocks
        while self.waiting and self.free_slots and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.admitting and not seq.preemptions:
                break  # draining for a model change: only sequences that started are recomputed
            if seq.samples_scheduled > len(seq.output):
                break  # preempted with a token still on its way: it resumes once that token is in
            tokens = seq.prompt + seq.output if seq.output else seq.prompt
            if blocks.prefix_caching and (len(seq.block_hashes) != len(tokens) // bs
                                          or seq.hashed_revision != blocks.revision):
                # Once, not at every try; again after a reload (a new revision computes other keys).
                seq.block_hashes, seq.hashed_revision = block_hashes(tokens, bs, blocks.revision), blocks.revision
            hashes = seq.block_hashes
            # At most the blocks before the last token: that one is always computed, for its logits.
            cached = blocks.peek(hashes[:(len(tokens) - 1) // bs]) if not _computes_prompt(seq) else []
            fresh = blocks_for(len(tokens), bs) - len(cached)
            needed = admission_blocks(len(tokens), seq.max_new_tokens - len(seq.output), bs) - len(cached)
            if needed > blocks.available - blocks.idle(cached):
                break
            self.waiting.popleft()
            # A recompute after a preemption reuses its own blocks: saved work, but neither a
            # prompt looked up again nor prompt tokens served from the cache.
            first = not seq.preemptions
            blocks.acquire(cached, len(tokens) if first else 0)
            seq.recompute = tokens if seq.output else None
            seq.blocks = cached + blocks.allocate(fresh)
            seq.registered, seq.cached_blocks = len(cached), len(cached)
            seq.computed = len(cached) * bs
            if first:
                seq.cached_prompt_tokens = seq.computed
            seq.slot = self.free_slots.pop()
            for i, block in enumerate(seq.blocks):
                self._table_updates[(seq.slot, i)] = block
            self.running.append(seq)
            self.prefilling.append(seq)
            self.sampled_running += not seq.sampling.greedy
            self.logits_running += seq.logits is not None

    def _grow(self) -> None:
        """Gives every decoding sequence whose next token starts a block a new block, preempting
        the youngest running sequence (possibly the one growing) while none is left."""
        batch, bs = self.decode, self.block_size
        while len(short := np.flatnonzero(batch.positions // bs >= batch.held)):
            i = int(short[0])
            if not self.blocks.available:
                self.preempt(self.running[-1])
                continue
            seq = batch.seqs[i]
            seq.blocks += self.blocks.allocate(1)
            batch.held[i] += 1
            self._table_updates[(seq.slot, len(seq.blocks) - 1)] = seq.blocks[-1]

    def received(self, seq: Sequence) -> None:
        """The host received a token of ``seq`` (appended to its output). When it completes a
        block, that block's hash is chained onto ``seq.block_hashes`` (one block hashed, never
        the whole sequence) and the block waits to be registered once a launched step has fed
        its last token back, i.e. written its keys and values (``_register_decoded``).

        Hashes cover only received tokens, so a token still on its way, or one discarded after a
        stop, is never hashed; a partial block never is. Hashes chained over another revision
        (a reload came between) are left for admission to recompute and nothing is registered."""
        blocks, bs = self.blocks, self.block_size
        if not blocks.prefix_caching or seq.hashed_revision != blocks.revision:
            return
        hashes = seq.block_hashes
        total = len(seq.prompt) + len(seq.output)
        if (len(hashes) + 1) * bs > total:
            return
        while (len(hashes) + 1) * bs <= total:
            i = len(hashes)
            parent = hashes[-1] if hashes else blocks.revision.encode()
            hashes.append(chain_hash(parent, _tokens(seq, i * bs, (i + 1) * bs)))
        if seq.slot is not None and not seq.finished:
            self._decoded.append(seq)

    def _register_decoded(self) -> None:
        """Registers the decode-filled blocks of ``_decoded`` whose last token a launched step
        fed back; a sequence that left the decode batch (finished, preempted, sampled out)
        registered what it could when it left, or registers it then (``finish``)."""
        batch = self.decode
        row = {s: i for i, s in enumerate(batch.seqs)}
        waiting = []
        for seq in self._decoded:
            i = row.get(seq)
            if i is None:
                if seq.slot is not None and not seq.finished and seq not in self.prefilling:
                    self._register(seq)  # sampled out: its counters were written back on leaving
                continue
            self._register(seq, int(batch.positions[i]))
            if seq.registered < len(seq.block_hashes):
                waiting.append(seq)
        self._decoded = waiting

    def _register(self, seq: Sequence, computed: int | None = None) -> None:
        """Registers the full blocks whose tokens are known (hashed) and whose keys and values a
        launched step has written (``computed`` tokens; default ``seq.computed``, which a decoding
        sequence updates only when it leaves the decode batch) in the prefix cache."""
        if seq.hashed_revision != self.blocks.revision:
            return  # chained over weights no longer served: admission hashes again
        if computed is None:
            computed = seq.computed
        full = min(computed // self.block_size, len(seq.block_hashes), len(seq.blocks))
        for i in range(seq.registered, full):
            self.blocks.register(seq.blocks[i], seq.block_hashes[i])
        seq.registered = max(seq.registered, full)

    def launch_failed(self, step: ScheduledStep) -> None:
        """``step`` raised at launch, perhaps before its block-table changes were applied: they are
        carried by the next plan again (a sequence admitted in that step without rows of its own,
        or a re-run that never comes, would otherwise keep the slot's previous blocks and write
        into blocks other sequences hold). A newer change to the same cell wins; re-applying one
        is harmless."""
        u = step.plan.block_updates
        if u is not None:
            for s, i, b in u.T:
                self._table_updates.setdefault((int(s), int(i)), int(b))

    def _take_table_updates(self) -> np.ndarray | None:
        """The block-table changes since the last plan, ``[3, k]`` (slot, index, block)."""
        if not self._table_updates:
            return None
        cells = np.array([(s, i, b) for (s, i), b in self._table_updates.items()], dtype=np.int64).T
        self._table_updates.clear()
        return cells


def _tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """``(seq.prompt + seq.output)[start:end]`` without copying the whole sequence."""
    p = len(seq.prompt)
    if end <= p:
        return seq.prompt[start:end]
    if start >= p:
        return seq.output[start - p:end - p]
    return seq.prompt[start:] + seq.output[:end - p]


def _computes_prompt(seq: Sequence) -> bool:
    """Whether the sequence's prompt must be computed whole (its log probabilities were asked for)."""
    return seq.logits is not None and seq.logits.spec.prompt_logprobs >= 0


def sub_step(step: ScheduledStep, keep: set[Sequence]) -> ScheduledStep:
    """The rows of ``step`` that belong to ``keep``, as a step of their own.

    Used to re-run a failed step without its culprit: each kept row keeps its position, slot and
    sampling row, so the sub-step computes exactly what the full step would have for those
    sequences (the scheduler's state already counts the step as launched). Pure.
    """
    plan = step.plan
    nd = plan.num_decode
    decode = [i for i in range(nd) if step.sequences[i] in keep]
    prompt_tokens: list[int] = []
    positions, slots = [plan.positions[decode]], [plan.slots[decode]]
    chunks: list[PrefillChunk] = []
    sequences = [step.sequences[i] for i in decode]
    sample_rows, sample_from = list(range(len(decode))), list(decode)  # new row, index of the old sample row
    old_sample = {int(row): k for k, row in enumerate(plan.sample_rows[nd:], start=nd)}
    row = len(decode)
    new_chunk: dict[int, int] = {}
    for j, chunk in enumerate(plan.prefill):
        seq = step.sequences[nd + j]
        if seq not in keep:
            continue
        new_chunk[j] = len(chunks)
        start = chunk.row - nd  # the chunk's tokens in prompt_tokens
        prompt_tokens.extend(plan.prompt_tokens[start:start + chunk.length])
        positions.append(plan.positions[chunk.row:chunk.row + chunk.length])
        slots.append(plan.slots[chunk.row:chunk.row + chunk.length])
        chunks.append(PrefillChunk(row=row, length=chunk.length, slot=chunk.slot, start=chunk.start))
        sequences.append(seq)
        if (k := old_sample.get(chunk.row + chunk.length - 1)) is not None:
            sample_rows.append(row + chunk.length - 1)
            sample_from.append(k)
        row += chunk.length
    sampling = plan.sampling
    if sampling is not None:
        sampling = SamplingBatch(sampling.temperature[sample_from], sampling.top_k[sample_from],
                                 sampling.top_p[sample_from], sampling.seeds[sample_from],
                                 sampling.sample_index[sample_from])
    sub = StepPlan(
        prompt_tokens=prompt_tokens, positions=np.concatenate(positions), slots=np.concatenate(slots),
        num_decode=len(decode), prefill=chunks, sample_rows=np.asarray(sample_rows, dtype=np.int64),
        sample_slots=plan.sample_slots[sample_from], sampling=sampling,
        logits=plan.logits.select(sample_from) if plan.logits is not None else None,
        block_updates=plan.block_updates,  # idempotent: the failed step may or may not have applied them
        prompt_logprobs=[dataclasses.replace(p, chunk=new_chunk[p.chunk]) for p in plan.prompt_logprobs
                         if p.chunk in new_chunk],
    )
    return ScheduledStep(sub, sequences, [step.samplers[k] for k in sample_from], step.needs_history)
