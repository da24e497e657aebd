"""Attention over the paged KV cache, and what the backend can record in a CUDA graph.

Every read goes through the cache's block table (``kv_cache.py``): a row's keys are found from its
slot's row of the table, so sequences hold blocks anywhere in the cache and share cached ones.

A step's tokens are laid out flat: first one row per decoding sequence, then the prefill chunks,
then padding. A uniform decode step is attended by the decode kernel, whose shapes depend only on
the row count, so it can be recorded in a FULL graph. A mixed or prefill step is attended, on
CUDA, by one varlen kernel launch per layer over the whole batch (decode rows and every chunk).
Its work list (the step's query blocks) lives in the runner's static buffers; launched over one
program per row of the padded size, the blocks a step does not have doing nothing, its grid
depends only on that size, so the PIECEWISE graph of a size records it too and a mixed step is
one replay (``records_mixed``). With that off (``--no-record-mixed-attention``) it runs eagerly
between the pieces, over exactly the step's blocks. On the CPU, SDPA is the reference: per
decode batch and per prefill chunk.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from graphkeeper.worker.kernels import decode_kernel, varlen_kernel
from graphkeeper.worker.kernels.triton_support import available
from graphkeeper.worker.kernels.varlen_kernel import BLOCK_Q
from graphkeeper.worker.model.config import ModelConfig
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.plan import PrefillChunk

__all__ = ["BLOCK_Q", "AttentionMetadata", "GraphSupport", "PrefillChunk", "SlotAttention"]


class GraphSupport(enum.IntEnum):
    """What an attention backend can record (vLLM's AttentionCGSupport, simplified)."""

    NEVER = 0
    UNIFORM_DECODE = 1  # only steps where every row is one decode token
    ALWAYS = 2


@dataclass
class AttentionMetadata:
    """Device tensors and host facts describing one step's attention.

    ``slots``, ``positions``, ``lengths`` (context length including the row's token) and
    ``kv_rows`` (where each row's keys go in the cache) cover every row including padding (padded
    rows point at the dummy slot, position 0). The block table (``num_blocks`` entries of
    ``block_*``) is the varlen kernel's work list for a mixed step; a recorded one launches a
    program per row of its size, and the entries past the step's blocks hold no rows.
    """

    slots: Tensor
    positions: Tensor
    lengths: Tensor
    kv_rows: Tensor
    num_decode: int
    prefill: list[PrefillChunk] = field(default_factory=list)
    num_blocks: int = 0
    block_row: Tensor | None = None
    block_len: Tensor | None = None
    block_slot: Tensor | None = None
    block_pos: Tensor | None = None


class SlotAttention:
    """Attention over the paged cache, addressed by slot (a slot's block-table row): decode rows
    through the Triton kernel on CUDA (no gather) or SDPA elsewhere; prefill chunks through SDPA.

    Grouped-query attention without repeating keys: the query heads of a group become the
    query-length axis of one SDPA call over the group's key head.
    """

    graph_support = GraphSupport.UNIFORM_DECODE

    def __init__(self, config: ModelConfig, cache: KVCache, record_mixed: bool = True) -> None:
        self.cache = cache
        self.n_heads, self.n_kv, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.group = config.group_size
        self.key_positions = torch.arange(cache.max_seq_len, device=cache.k.device)
        self.meta: AttentionMetadata | None = None
        self.triton_decode = self.triton_varlen = available(cache.k.device)
        #: Whether PIECEWISE graphs record the mixed step's attention too (one graph a step): only
        #: the varlen kernel can be launched over a grid fixed by the padded size.
        self.records_mixed = record_mixed and self.triton_varlen
        self.name = "triton-decode+triton-varlen" if self.triton_varlen else "sdpa"

    def bind(self, meta: AttentionMetadata) -> None:
        """Sets the metadata the next forward pass attends with."""
        self.meta = meta

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None = None) -> Tensor:
        """Writes the layer's keys and values and attends ``q``; into ``out`` ``[rows, heads * d]``
        when given (PIECEWISE replay passes the next piece's input buffer), else a new tensor."""
        meta = self.meta
        assert meta is not None, "attention metadata not bound for this step"
        rows = q.shape[0]
        cache = self.cache
        cache.write(layer, _first(meta.kv_rows, rows), k, v)
        if meta.num_decode == rows:
            slots, lengths = _first(meta.slots, rows), _first(meta.lengths, rows)
            if self.triton_decode:
                return decode_kernel.decode_attention(q, cache.k_layers[layer], cache.v_layers[layer], slots, lengths,
                                                      cache.block_table, out)
            return _into(out, self._decode(layer, q, slots, lengths))
        if self.triton_varlen:
            return varlen_kernel.varlen_attention(
                q, cache.k_layers[layer], cache.v_layers[layer], meta.block_row, meta.block_len, meta.block_slot,
                meta.block_pos, meta.num_blocks, cache.block_table, out)
        result = q.new_zeros(rows, self.n_heads * self.head_dim)
        nd = meta.num_decode
        if nd:
            result[:nd] = self._decode(layer, q[:nd], meta.slots[:nd], meta.lengths[:nd])
        for chunk in meta.prefill:
            span = slice(chunk.row, chunk.row + chunk.length)
            result[span] = self._prefill(layer, q[span], chunk)
        return _into(out, result)

    def _rows(self, slots: Tensor, span: int) -> Tensor:
        """Flat cache rows of positions ``0 .. span - 1`` of each slot: ``[len(slots), span]``."""
        bs = self.cache.block_size
        pos = self.key_positions[:span]
        return self.cache.block_table[slots][:, pos // bs] * bs + pos % bs

    def _gather(self, layer: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values at flat cache ``rows`` (any shape) -> ``[*rows.shape, n_kv, d]``."""
        k = self.cache.k_layers[layer].view(-1, self.n_kv, self.head_dim)
        v = self.cache.v_layers[layer].view(-1, self.n_kv, self.head_dim)
        return k[rows], v[rows]

    def _decode(self, layer: int, q: Tensor, slots: Tensor, lengths: Tensor) -> Tensor:
        """SDPA over each row's keys, gathered through the block table (the CPU's decode path)."""
        b = q.shape[0]
        # On the CPU, read only the rows some sequence has (a host read costs nothing there): a
        # model with a long context would otherwise copy every slot's whole cache every step.
        span = int(lengths.max()) if q.device.type == "cpu" else self.cache.max_seq_len
        keys, values = self._gather(layer, self._rows(slots, span))
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, n_kv, span, d]
        query = q.view(b, self.n_kv, self.group, self.head_dim)
        mask = (self.key_positions[None, :span] < lengths[:, None]).view(b, 1, 1, -1)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
        return out.reshape(b, self.n_heads * self.head_dim)

    def _prefill(self, layer: int, q: Tensor, chunk: PrefillChunk) -> Tensor:
        n, g = chunk.length, self.group
        context = chunk.start + n
        rows = self._rows(torch.tensor([chunk.slot], device=q.device), context)[0]
        keys, values = self._gather(layer, rows)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [n_kv, context, d]
        # [n, n_kv, g, d] -> [n_kv, n * g, d]: row t*g + j is token t, head j of the group.
        query = q.view(n, self.n_kv, g, self.head_dim).permute(1, 0, 2, 3).reshape(self.n_kv, n * g, -1)
        token_pos = torch.arange(chunk.start, context, device=q.device).repeat_interleave(g)
        mask = self.key_positions[None, :context] <= token_pos[:, None]
        out = F.scaled_dot_product_attention(query[None], keys[None], values[None], attn_mask=mask)
        return out[0].view(self.n_kv, n, g, self.head_dim).permute(1, 0, 2, 3).reshape(n, -1)


def _into(out: Tensor | None, value: Tensor) -> Tensor:
    """``value``, copied into ``out`` when one is given."""
    if out is None:
        return value
    return out.copy_(value)


def _first(t: Tensor, rows: int) -> Tensor:
    """``t[:rows]``, without a new view when ``t`` already has ``rows`` rows (every layer asks)."""
    return t if t.shape[0] == rows else t[:rows]
