"""Runs one step of the model: fills the static input buffers, executes the step (eagerly, as a
FULL graph replay, or as a PIECEWISE key's replay: one graph, or pieces around eager attention),
samples on the device and starts one asynchronous copy of the sampled tokens back to the host.

The runner owns the step's buffers, allocated once at the largest size, so their addresses never
move: step inputs (tokens, positions, KV slots, context lengths, the attention's block table,
sample rows) in one device tensor filled by a single host-to-device copy, the hidden states the
step produces, and ``last_tokens``, each slot's latest sampled token. (PIECEWISE graphs add the
buffers between their pieces, which the graph set owns.) A decoding row's input token is read
from ``last_tokens`` on the device, so the host can prepare and launch step N+1 before step N's
tokens have reached it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from graphkeeper.worker.executor.graphs.dispatcher import Decision
from graphkeeper.worker.executor.logits import count_sampled, sample_processed
from graphkeeper.worker.executor.penalty_counts import PenaltyCounts
from graphkeeper.worker.executor.sampling import sample
from graphkeeper.worker.executor.transfer import to_device
from graphkeeper.worker.kernels import compile_ahead, decode_kernel, logprob_kernel, varlen_kernel
from graphkeeper.worker.kernels.linear_kernel import warm_rows
from graphkeeper.worker.model.attention import BLOCK_Q, AttentionMetadata, SlotAttention
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.model.loader import LoadedModel
from graphkeeper.worker.plan import (
    LogitsBatch,
    PrefillChunk,
    PromptLogprobs,
    SamplingBatch,
    SamplingSpec,
    StepPlan,
    TokenLogprob,
    line_logprob,
)

log = logging.getLogger(__name__)


@dataclass
class StepLogprobs:
    """A step's log probabilities on their way to the host: ``table`` holds, for each sample row
    in ``rows`` (the rows that asked), the line ``lines[k]`` ``[chosen, top values..., top ids...]``
    (``logprob_kernel``'s layout, width ``1 + 2 * top``)."""

    rows: np.ndarray
    lines: np.ndarray
    table: Tensor
    top: int


@dataclass
class Launched:
    """A step on its way: its tokens land in ``host`` once ``done`` has completed, and so do the
    log probabilities when a row asked for them."""

    host: Tensor
    done: torch.cuda.Event | None
    count: int
    logprobs: StepLogprobs | None = None
    #: Per prefill chunk that computes its prompt's log probabilities: (chunk index, targets, top,
    #: the host table: a ``logprob_kernel`` line per target).
    prompt: list[tuple[int, np.ndarray, int, Tensor]] | None = None

    def tokens(self) -> np.ndarray:
        """Waits for the step's copy (the one host synchronisation of a step) and returns its tokens."""
        if self.done is not None:
            self.done.synchronize()
        return self.host[: self.count].numpy()

    def token_logprobs(self) -> list[tuple[int, bytes] | None] | None:
        """Each sample row's log probabilities as the engine sends them: the count of alternatives
        the step computed and the row's table line as float32 bytes (``OutputProcessor`` makes the
        ``plan.PackedLogprob`` with the count its request asked for); None for a row that did not
        ask (after ``tokens``); None when no row asked."""
        if self.logprobs is None:
            return None
        top = self.logprobs.top
        lines = self.logprobs.table.numpy()[self.logprobs.lines]
        out: list[tuple[int, bytes] | None] = [None] * self.count
        for k, row in enumerate(self.logprobs.rows.tolist()):
            out[row] = (top, lines[k].tobytes())
        return out

    def prompt_logprobs(self) -> list[tuple[int, list[TokenLogprob]]]:
        """(chunk index, the log probability of each prompt token the chunk's rows predict)."""
        return [(chunk, [line_logprob(int(t), line, top, top) for t, line in zip(targets, table.tolist(), strict=True)])
                for chunk, targets, top, table in self.prompt or ()]


def warm_logits_batch(rows: int, vocab: int) -> LogitsBatch:
    """A logits batch where each of ``rows`` sample rows asks for everything the logits warm-up
    loads: an all-allowing grammar mask, the three penalties (their counts on slots ``0 ..
    rows - 1``, started over in this step) and five log probabilities."""
    index = np.arange(rows, dtype=np.int64)
    half = np.full(rows, 0.5, dtype=np.float32)
    return LogitsBatch(
        rows=index, presence=half, frequency=half, repetition=np.full(rows, 1.1, dtype=np.float32),
        min_p=np.zeros(rows, dtype=np.float32), bias=(np.zeros((2, 0), dtype=np.int64), np.zeros(0, np.float32)),
        mask_rows=index, masks=np.full((rows, -(-vocab // 32)), -1, dtype=np.int32),
        logprobs=np.full(rows, 5, dtype=np.int64), penalised=index, penalty_slots=index, reset_slots=index)


class ModelRunner:
    """Executes steps for one loaded model and one KV cache."""

    ROWS = ("tokens", "positions", "slots", "lengths", "kv_rows",
            "block_row", "block_len", "block_slot", "block_pos", "sample_rows", "sample_slots")
    (TOKENS, POSITIONS, SLOTS, LENGTHS, KV_ROWS,
     BLOCK_ROW, BLOCK_LEN, BLOCK_SLOT, BLOCK_POS, SAMPLE_ROWS, SAMPLE_SLOTS) = range(11)

    def __init__(self, loaded: LoadedModel, cache: KVCache, max_tokens: int, record_mixed: bool = True) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.cache = cache
        self.device = loaded.device
        self.max_tokens = max_tokens
        self.attention = SlotAttention(loaded.config, cache, record_mixed)
        self.inputs = torch.zeros(len(self.ROWS), max_tokens, dtype=torch.long, device=self.device)
        self.hidden = torch.zeros(max_tokens, loaded.config.dim, dtype=loaded.dtype, device=self.device)
        self.last_tokens = torch.zeros(cache.num_slots + cache.scratch_slots, dtype=torch.long, device=self.device)
        #: Penalised sequences' output-token counts, a row per slot, made as penalised requests come.
        self.penalties = PenaltyCounts(loaded.config.vocab_size, self.device)
        cuda = self.device.type == "cuda"
        # Two pinned buffers each way, taken in turn with an event recorded after each copy. In:
        # a copy from pageable memory may make the host wait for the step still running, one from
        # pinned memory does not, and a buffer is refilled only once the copy that read it is done.
        # Out: step N's tokens are read while step N+1's copy may be under way.
        self._staging = [torch.zeros(len(self.ROWS) * max_tokens, dtype=torch.long, pin_memory=cuda)
                         for _ in range(2)]
        self._staged = [torch.cuda.Event() if cuda else None for _ in range(2)]
        # Block-table changes travel the same way: flat table indices then their blocks, in a
        # pinned buffer per turn, scattered into the table on the device before the step runs.
        cells = cache.block_table.numel()
        self._table_staging = [torch.zeros(2 * cells, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._table_device = torch.zeros(2 * cells, dtype=torch.long, device=self.device)
        self._stage_turn = 0
        self._host = [torch.zeros(max_tokens, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._sent = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._turn = 0
        self._logprob_host: list[Tensor] | None = None
        # Views of the static buffers, made once per (row, length): slicing is host work on the
        # step's hot path, and these buffers never move while the runner lives.
        self._views: dict[tuple[int | None, int], Tensor] = {}
        self._staged_views: dict[tuple[int, int], tuple[Tensor, np.ndarray]] = {}

    # --- inputs ---------------------------------------------------------------------------

    def prepare(self, plan: StepPlan, rows: int) -> AttentionMetadata:
        """Copies the plan into the static buffers, padded to ``rows`` with inert rows.

        Decode rows' tokens are then gathered on the device from ``last_tokens``. The varlen
        attention's work list is written for every step: a PIECEWISE graph that recorded the
        attention reads it even when every row is a decode row (an eager uniform decode step
        runs the decode kernel and ignores it).
        """
        n, nd = plan.num_tokens, plan.num_decode
        staged, host, turn = self._stage(rows)
        self._apply_blocks(plan.block_updates, turn)
        host.fill(0)
        host[self.TOKENS, nd:n] = plan.prompt_tokens
        if plan.decode_tokens is not None:
            host[self.TOKENS, :nd] = plan.decode_tokens
        host[self.POSITIONS, :n] = plan.positions
        host[self.SLOTS, :n] = plan.slots
        # Padded rows: token 0 at position 0 in the dummy slot, attending to a length of 1.
        host[self.SLOTS, n:] = self.cache.dummy_slot
        host[self.LENGTHS] = host[self.POSITIONS] + 1
        host[self.KV_ROWS] = self.cache.row_index(host[self.SLOTS], host[self.POSITIONS])
        # The varlen attention's work list, longest work first. Entries past the step's blocks stay
        # zeros (no rows) up to ``rows``: a recorded varlen launch has a program for each.
        count = varlen_kernel.fill_work_list(host[self.BLOCK_ROW:self.BLOCK_POS + 1], plan.prefill,
                                             host[self.POSITIONS, :nd], host[self.SLOTS, :nd])
        ns = plan.num_samples
        host[self.SAMPLE_ROWS, :ns] = plan.sample_rows
        host[self.SAMPLE_SLOTS, :ns] = plan.sample_slots
        self._row(None, rows).copy_(staged, non_blocking=True)
        if self._staged[turn] is not None:
            self._staged[turn].record()
        if nd and plan.decode_tokens is None:
            torch.index_select(self.last_tokens, 0, self._row(self.SLOTS, nd), out=self._row(self.TOKENS, nd))
        return self.metadata(rows, nd, plan.prefill, count)

    def _row(self, row: int | None, n: int) -> Tensor:
        """``inputs[row, :n]`` (``inputs[:, :n]`` for ``row=None``), made once and kept."""
        view = self._views.get((row, n))
        if view is None:
            view = self._views[(row, n)] = self.inputs[:, :n] if row is None else self.inputs[row, :n]
        return view

    def _stage(self, rows: int) -> tuple[Tensor, np.ndarray, int]:
        """The next pinned staging buffer as a contiguous ``[len(ROWS), rows]`` tensor and its
        numpy view, once the copy that last read it has completed; and its turn."""
        turn = self._stage_turn
        self._stage_turn ^= 1
        if self._staged[turn] is not None:
            self._staged[turn].synchronize()
        views = self._staged_views.get((turn, rows))
        if views is None:
            staged = self._staging[turn][: len(self.ROWS) * rows].view(len(self.ROWS), rows)
            views = self._staged_views[(turn, rows)] = (staged, staged.numpy())
        return (*views, turn)

    def _apply_blocks(self, updates: np.ndarray | None, turn: int) -> None:
        """Applies the plan's block-table changes ``[3, k]`` (slot, index, block) to the cache's
        host table (slot mappings read it) and, by one copy and one scatter, to its device table."""
        if updates is None or not updates.shape[1]:
            return
        cache = self.cache
        cache.update_host(updates)
        k = updates.shape[1]
        pinned = self._table_staging[turn]
        host = pinned.numpy()
        host[:k] = updates[0] * cache.max_blocks_per_seq + updates[1]
        host[k:2 * k] = updates[2]
        device = self._table_device[:2 * k]
        device.copy_(pinned[:2 * k], non_blocking=True)
        cache.block_table.view(-1).index_copy_(0, device[:k], device[k:])

    def metadata(self, rows: int, num_decode: int, prefill: list[PrefillChunk], blocks: int = 0) -> AttentionMetadata:
        row, m = self._row, self.max_tokens
        return AttentionMetadata(
            slots=row(self.SLOTS, rows), positions=row(self.POSITIONS, rows), lengths=row(self.LENGTHS, rows),
            kv_rows=row(self.KV_ROWS, rows), num_decode=num_decode, prefill=prefill, num_blocks=blocks,
            block_row=row(self.BLOCK_ROW, m), block_len=row(self.BLOCK_LEN, m), block_slot=row(self.BLOCK_SLOT, m),
            block_pos=row(self.BLOCK_POS, m),
        )

    def tokens(self, rows: int) -> Tensor:
        return self._row(self.TOKENS, rows)

    def output(self, rows: int) -> Tensor:
        """The hidden states a step of ``rows`` rows leaves (a graph's output buffer)."""
        return self.hidden[:rows]

    def addresses(self) -> tuple[int, ...]:
        """The device addresses a recorded step reads or writes: weights, KV cache, input and
        output buffers. Graphs recorded against other addresses are stale."""
        model = self.model
        weights = model.tok_embeddings.weight.data_ptr(), model.layers[0].attention.wqkv.weight.data_ptr()
        return (*weights, *self.cache.addresses(), self.inputs.data_ptr(), self.hidden.data_ptr())

    def positions(self, rows: int) -> Tensor:
        return self._row(self.POSITIONS, rows)

    # --- execution ------------------------------------------------------------------------

    def execute(self, plan: StepPlan, decision: Decision, graphs) -> Tensor:
        """Hidden states of the step's rows, by the dispatcher's decision (the one place a step runs)."""
        if decision.eager:
            return self.forward_eager(self.prepare(plan, plan.num_tokens), plan.num_tokens)
        graphs.check_fresh()
        meta = self.prepare(plan, decision.size)
        return graphs.replay(decision.mode, decision.size, meta)

    def forward_eager(self, meta: AttentionMetadata, rows: int) -> Tensor:
        """Hidden states for ``rows`` rows, computed eagerly (also the capture-time reference)."""
        self.attention.bind(meta)
        return self.model(self.tokens(rows), self.positions(rows), self.attention)

    def sample_rows(self, hidden: Tensor, plan: StepPlan) -> Tensor:
        """The hidden states of the plan's sample rows; decode rows come first, so usually a slice."""
        ns = plan.num_samples
        if not plan.prefill:
            return hidden[:ns]
        return hidden.index_select(0, self._row(self.SAMPLE_ROWS, ns))

    def sample_and_send(self, hidden: Tensor, plan: StepPlan) -> Launched:
        """Samples on the device, records each slot's new token, and starts the copy back."""
        ns = plan.num_samples
        head = self.model.head(self.sample_rows(hidden, plan))
        extra, logprobs = plan.logits, None
        if extra is None:
            tokens = sample(head, plan.sampling)
        else:  # the rows that ask for nothing keep their logits bit for bit; head stays raw
            tokens = sample_processed(head, extra, plan.sampling, self.penalties)
        if extra is not None:
            count_sampled(self.penalties, extra, tokens)
        self.last_tokens.index_copy_(0, self._row(self.SAMPLE_SLOTS, ns), tokens)
        turn = self._turn
        host, done = self._host[turn], self._sent[turn]
        self._turn ^= 1
        host[:ns].copy_(tokens, non_blocking=True)
        if extra is not None and (wanted := np.flatnonzero(extra.logprobs >= 0)).size:
            logprobs = self._send_logprobs(head, tokens, wanted, extra.top_logprobs, turn)
        prompt = [self._prompt_logprobs(hidden, plan, p) for p in plan.prompt_logprobs] or None
        if done is not None:
            done.record()
        return Launched(host, done, ns, logprobs, prompt)

    def _send_logprobs(self, head: Tensor, tokens: Tensor, wanted: np.ndarray, top: int, turn: int) -> StepLogprobs:
        """The log probabilities of the model's own distribution (before any processing) for the
        sample rows ``wanted``, copied back behind the tokens. On CUDA, ``logprob_kernel``'s two
        launches take every row (cheaper than selecting the rows that asked) into this turn's
        pinned table; elsewhere PyTorch computes the rows that asked."""
        if logprob_kernel.supported(head, top):
            table = logprob_kernel.packed(head, tokens, top)
            pinned = self._logprob_pinned(turn)[: table.numel()].view(table.shape)
            pinned.copy_(table, non_blocking=True)
            return StepLogprobs(wanted, wanted, pinned, top)
        at = to_device(wanted, self.device)
        table = logprob_kernel.reference(head.index_select(0, at), tokens.index_select(0, at), top)
        return StepLogprobs(wanted, np.arange(len(wanted)), table.to("cpu", non_blocking=True), top)

    def _logprob_pinned(self, turn: int) -> Tensor:
        """This turn's pinned log-probability table (made when a step first asks): a line of the
        widest layout per token the step could sample."""
        if self._logprob_host is None:
            width = 1 + 2 * logprob_kernel.SLOTS
            self._logprob_host = [torch.empty(self.max_tokens * width, dtype=torch.float32, pin_memory=True)
                                  for _ in range(2)]
        return self._logprob_host[turn]

    def _prompt_logprobs(self, hidden: Tensor, plan: StepPlan, wanted: PromptLogprobs) -> tuple:
        """A chunk's prompt log probabilities: the LM head on its rows, each row's next prompt token,
        in ``logprob_kernel``'s table (its two launches on CUDA, PyTorch elsewhere)."""
        row = plan.prefill[wanted.chunk].row
        n = len(wanted.targets)
        targets = to_device(wanted.targets, self.device)
        table = logprob_kernel.table(self.model.head(hidden[row:row + n]), targets, wanted.top)
        return wanted.chunk, wanted.targets, wanted.top, table.to("cpu", non_blocking=True)

    def inert_decode(self, rows: int) -> StepPlan:
        """A decode step of ``rows`` rows on the KV cache's dummy slot (where padding rows write)."""
        dummy = self.cache.dummy_slot
        return StepPlan(prompt_tokens=[], positions=np.zeros(rows, dtype=np.int64),
                        slots=np.full(rows, dummy, dtype=np.int64), num_decode=rows,
                        sample_rows=np.arange(rows), sample_slots=np.full(rows, dummy),
                        decode_tokens=np.zeros(rows, dtype=np.int64))

    def warm_up(self, rows: int, every_row_count: bool | None = None) -> None:
        """Eager steps on inert rows, so that every kernel a served step can launch is compiled
        and loaded before capture or serving, not at a request's expense: a decode step of
        ``rows`` rows (the first call, which a compiled step traces at), a prefill chunk (the
        varlen attention, which capture never runs), and the LM head with greedy and drawn
        sampling at every row count the skinny products bucket (Triton specializes on it).

        On a GPU (``every_row_count`` None) the whole decode step runs at each of those row counts
        too: the body's products are kernels of their own for each count, and what loading one
        takes (its code, a larger local-memory pool for the device) stays for the process. Loaded
        here, before the capture phase's baseline, it is not charged to the graphs (it stays when
        every graph is released). A CPU has nothing to load; tests ask for it there by name."""
        dummy = self.cache.dummy_slot
        row_counts = self._warm_counts(every_row_count)
        self.compile_attention_ahead([rows, *row_counts])  # found compiled where a start compiled them ahead
        plan = self.inert_decode(rows)
        self.sample_and_send(self.forward_eager(self.prepare(plan, rows), rows), plan).tokens()
        for m in row_counts:
            self.forward_eager(self.prepare(self.inert_decode(m), m), m)
        n = min(BLOCK_Q + 1, self.max_tokens, self.cache.max_seq_len)
        chunk = StepPlan(prompt_tokens=[0] * n, positions=np.arange(n, dtype=np.int64),
                         slots=np.full(n, dummy, dtype=np.int64), num_decode=0,
                         prefill=[PrefillChunk(row=0, length=n, slot=dummy, start=0)],
                         sample_rows=np.array([n - 1]), sample_slots=np.array([dummy]))
        self.sample_and_send(self.forward_eager(self.prepare(chunk, n), n), chunk).tokens()
        self.warm_up_sampling()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_up_sampling(self) -> None:
        """The LM head with greedy sampling at every row count the skinny products bucket, drawn
        sampling, and every kind of logits processing (``warm_up_logits``): the warm-up's launches
        after its steps, which a start also makes dry, ahead (``launches_ahead``)."""
        for m in warm_rows(self.max_tokens):
            sample(self.model.head(self.hidden[:m]), None)
        drawn = SamplingBatch.build([SamplingSpec(temperature=1.0, top_k=8, top_p=0.9)], [0], np.zeros(1, np.int64))
        sample(self.model.head(self.hidden[:1]), drawn)
        self.warm_up_logits()

    def launches_ahead(self, rows: int) -> None:
        """What a start compiles ahead while it tunes kernels (``compile_ahead.started``: made dry,
        nothing runs): the attention launches of ``warm_up(rows)``'s steps and its sampling launches
        (argmax, grammar mask, penalties, counts, log probabilities). The sampling kernels compiled
        one after another at the warm-up's own launches, on the engine thread: some fifteen variants,
        most of the 6-7 s an H100's cold start spent in the warm-up's first step outside Dynamo and
        Inductor (``bench/results``, 2026-12-07). Their outputs are left as allocated and read by
        nothing but the inert rows' discarded tokens (on a GPU nothing indexes by them; the dummy
        slot's last tokens they were copied to are zeroed after); before tuning the LM head is
        torch's product, so no skinny tile is compiled here that tuning would not choose."""
        self.attention_launches(self.warm_up_rows(rows))
        if self.device.type == "cuda":
            self.warm_up_sampling()
            self.last_tokens.zero_()

    def compile_attention_ahead(self, rows: list[int]) -> None:
        """Compiles the attention kernels that the warm-up's steps of ``rows`` rows launch, side by
        side on threads (``compile_ahead``), before the warm-up launches them: Triton compiled each
        at its first launch, one after another on the engine thread, about half of the time a cold
        start spent compiling our own kernels. CUDA with the Triton kernels only. A failure here is
        logged, not raised: the warm-up's launches then compile them, as before."""
        if not self._compiles_attention():
            return
        try:
            with compile_ahead.compiling("attention"):
                self.attention_launches(rows)
        except Exception as err:  # noqa: BLE001 - an optimization of the start, never a failed start
            log.warning("compiling the attention ahead failed (its warm-up launches compile it): %s", err)

    def _compiles_attention(self) -> bool:
        """Whether this runner's attention is Triton kernels (on CUDA), which compile ahead."""
        attention = self.attention
        return self.device.type == "cuda" and (attention.triton_decode or attention.triton_varlen)

    def attention_launches(self, rows: list[int]) -> None:
        """The attention launches steps of ``rows`` rows make, one per compiled variant: the decode
        attention's, one per split count (``decode_kernel.variant_rows``), and the varlen
        attention's (prefill and mixed steps), one. Made inside a compile-ahead block (dry: nothing
        runs). They take this runner's own input rows and the cache's first layer, so they
        specialize as the real launches do. Nothing where the attention does not compile (a CPU, SDPA)."""
        if not self._compiles_attention():
            return
        attention, cache, dtype = self.attention, self.cache, self.loaded.dtype
        row = self._row
        if attention.triton_decode:
            max_len = decode_kernel.table_keys(cache.block_table, cache.k_layers[0])
            for m in decode_kernel.variant_rows(rows, attention.n_kv, max_len, dtype):
                q = torch.empty(m, attention.n_heads, attention.head_dim, dtype=dtype, device=self.device)
                decode_kernel.decode_attention(q, cache.k_layers[0], cache.v_layers[0], row(self.SLOTS, m),
                                               row(self.LENGTHS, m), cache.block_table)
        if attention.triton_varlen:
            m = self.max_tokens
            q = torch.empty(m, attention.n_heads, attention.head_dim, dtype=dtype, device=self.device)
            varlen_kernel.varlen_attention(q, cache.k_layers[0], cache.v_layers[0], row(self.BLOCK_ROW, m),
                                           row(self.BLOCK_LEN, m), row(self.BLOCK_SLOT, m), row(self.BLOCK_POS, m),
                                           1, cache.block_table)

    def warm_up_rows(self, rows: int) -> list[int]:
        """Every row count ``warm_up(rows)`` runs a decode step at (its attention's variants: a
        start compiles them ahead while it tunes kernels, ``compile_ahead.started``)."""
        return [rows, *self._warm_counts(None)]

    def _warm_counts(self, every_row_count: bool | None) -> list[int]:
        """The row counts the warm-up runs a whole decode step at: on a GPU (None), every count the
        skinny products bucket."""
        if every_row_count is None:
            every_row_count = self.device.type == "cuda"
        return warm_rows(self.max_tokens) if every_row_count else []

    #: Penalised rows of the logits warm-up's steps: Triton specializes the penalty kernels' row
    #: count as one, a multiple of sixteen, or any other.
    WARM_LOGITS_ROWS = (1, 2, 16)

    def warm_up_logits(self) -> None:
        """Decode steps on inert rows whose every row asks for each kind of logits processing (a
        grammar mask that allows every token, the three penalties, log probabilities), so that the
        kernels they launch (mask, penalties, counts, log probabilities) are compiled and loaded
        before the worker is ready: on a fresh worker the first request that asked held every
        stream while Triton compiled them (1.3 s on an H100, ``bench/results``). Only the sampling
        runs, on the hidden-state buffer as it is (the model's forward loads nothing new here).
        The penalty rows it counted are dropped afterwards. A failure here is logged, not raised:
        serving compiles the kernels when first asked, as it did before."""
        try:
            for rows in self.WARM_LOGITS_ROWS:
                if rows > self.max_tokens:
                    break
                plan = self.inert_decode(rows)
                plan.logits = warm_logits_batch(rows, self.loaded.config.vocab_size)
                self.prepare(plan, rows)  # the sample rows' slots, where the tokens are recorded
                self.sample_and_send(self.output(rows), plan).tokens()
        except Exception as err:  # noqa: BLE001 - an optimization of the first such request, never a failed start
            log.warning("the logits-processing warm-up failed (its kernels compile at the first request that "
                        "asks): %s", err)
        finally:
            self.penalties.release()
