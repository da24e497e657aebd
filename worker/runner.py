"""Runs one step of the model: fills the static input buffers, then executes the step eagerly,
as a FULL graph replay, or as PIECEWISE graph replays around eager attention.

The runner owns every buffer a graph reads or writes, allocated once at the largest size, so
their addresses never move: step inputs (tokens, positions, KV slots, context lengths) in one
device tensor filled by a single host-to-device copy, and the hidden states the step produces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from graphkeeper.worker.attention import AttentionMetadata, PrefillChunk, SlotAttention
from graphkeeper.worker.kv_cache import KVCache
from graphkeeper.worker.loader import LoadedModel


@dataclass
class StepPlan:
    """A scheduled step, flat: decode rows first, then prefill chunks.

    ``sample_rows`` are the rows whose next token is needed: every decode row, and the last row
    of a prefill chunk that completes its prompt.
    """

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    num_decode: int
    prefill: list[PrefillChunk] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def uniform_decode(self) -> bool:
        return not self.prefill and self.num_decode == len(self.tokens)


class ModelRunner:
    """Executes steps for one loaded model and one KV cache."""

    TOKENS, POSITIONS, SLOTS, LENGTHS, KV_ROWS = range(5)

    def __init__(self, loaded: LoadedModel, cache: KVCache, max_tokens: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.cache = cache
        self.device = loaded.device
        self.max_tokens = max_tokens
        self.attention = SlotAttention(loaded.config, cache)
        self.inputs = torch.zeros(5, max_tokens, dtype=torch.long, device=self.device)
        self.hidden = torch.zeros(max_tokens, loaded.config.dim, dtype=loaded.dtype, device=self.device)

    # --- inputs ---------------------------------------------------------------------------

    def prepare(self, plan: StepPlan, rows: int) -> AttentionMetadata:
        """Copies the plan into the static buffers, padded to ``rows`` with inert rows."""
        n, nd = plan.num_tokens, plan.num_decode
        # Built with numpy: a handful of host operations per step instead of a dozen torch ones.
        host = np.empty((5, rows), dtype=np.int64)
        host[self.TOKENS, :n] = plan.tokens
        host[self.POSITIONS, :n] = plan.positions
        host[self.SLOTS, :n] = plan.slots
        # Padded rows: token 0 at position 0 in the dummy slot, attending to a length of 1.
        host[self.TOKENS, n:] = 0
        host[self.POSITIONS, n:] = 0
        host[self.SLOTS, n:] = self.cache.dummy_slot
        host[self.LENGTHS, :nd] = host[self.POSITIONS, :nd] + 1
        host[self.LENGTHS, nd:] = 1
        host[self.KV_ROWS] = self.cache.row_index(host[self.SLOTS], host[self.POSITIONS])
        # Pageable and synchronous: the previous step already synced (its tokens went to the
        # host), and pinned staging buffers interfere with graph capture's host allocator.
        self.inputs[:, :rows].copy_(torch.from_numpy(host))
        return self.metadata(rows, nd, plan.prefill)

    def metadata(self, rows: int, num_decode: int, prefill: list[PrefillChunk]) -> AttentionMetadata:
        return AttentionMetadata(
            slots=self.inputs[self.SLOTS, :rows],
            positions=self.inputs[self.POSITIONS, :rows],
            lengths=self.inputs[self.LENGTHS, :rows],
            kv_rows=self.inputs[self.KV_ROWS, :rows],
            num_decode=num_decode,
            prefill=prefill,
        )

    def tokens(self, rows: int) -> Tensor:
        return self.inputs[self.TOKENS, :rows]

    def positions(self, rows: int) -> Tensor:
        return self.inputs[self.POSITIONS, :rows]

    # --- execution ------------------------------------------------------------------------

    def forward_eager(self, meta: AttentionMetadata, rows: int) -> Tensor:
        """Hidden states for ``rows`` rows, computed eagerly (also the capture-time reference)."""
        self.attention.bind(meta)
        return self.model(self.tokens(rows), self.positions(rows), self.attention)

    def logits(self, hidden: Tensor, plan: StepPlan) -> Tensor:
        """Float32 logits for the plan's sample rows; decode rows come first, so usually a slice."""
        rows = plan.sample_rows
        if rows == list(range(len(rows))):
            return self.model.logits(hidden[: len(rows)])
        index = torch.tensor(rows, device=hidden.device)
        return self.model.logits(hidden.index_select(0, index))

    def warm_up(self, rows: int) -> None:
        """One eager step on inert rows: loads kernels and libraries before capture or serving."""
        plan = StepPlan(tokens=[0] * rows, positions=[0] * rows, slots=[self.cache.dummy_slot] * rows,
                        num_decode=rows)
        meta = self.prepare(plan, rows)
        self.model.logits(self.forward_eager(meta, rows))
