"""Varlen attention for a whole mixed step in one Triton kernel launch per layer, reading keys and
values in place from the paged cache through each slot's row of the block table.

A step's rows are decode tokens (one per sequence) and prefill chunks (many consecutive tokens
of one sequence). The host cuts the step into *blocks*: one per decode row, and each prefill
chunk cut into runs of ``BLOCK_Q`` tokens. A block is (first row, rows, slot, position of the
first row); its tokens attend causally to their own slot, token ``i`` of the block seeing keys
``0 .. position + i``. One program handles one block and one key/value head, with all the query
heads of that group stacked as tile rows, so grouped-query attention reads each key once per
group. Keys are visited in tiles with a running softmax (flash attention), so no mask tensor
and no per-chunk Python loop exist.

A block of one row (every decode row, and the one-token tail of a chunk) is tiled as that token's
query heads alone (padded to 16 rows, as the decode kernel tiles a decode row), not as ``BLOCK_Q``
tokens of which one is real: a mixed step is mostly decode rows, and with the ``BLOCK_Q``-token
tile each of them computed sixteen times the scores and weighted values it needs. Longer blocks
keep the ``BLOCK_Q``-token tile, and entries past the work list do nothing. By default
(``LAYOUT``) one launch does both, each program choosing its tile from its block's rows: on an
H100 that attended a 60-decode-row, 68-prompt-token step in 0.72x the time of one tile for all, and
in 0.64x the time of two launches, whose second (the prompt blocks, the longest programs) waited
for the first (``bench/results/performance-iii-95ddd56-h100.md``). The grid is the work list's
length, fixed by the padded size where a recorded step launches it; a block's key/value heads are
neighbours in it (the grid's first axis), so the work list's order is the launch's: the host lists
the longest blocks first (``fill_work_list``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from graphkeeper.worker.kernels.launch_memo import LaunchMemo
from graphkeeper.worker.kernels.triton_support import tl, triton

if TYPE_CHECKING:
    from graphkeeper.worker.plan import PrefillChunk

#: Query tokens per block (a prefill chunk of n tokens makes ceil(n / BLOCK_Q) blocks).
BLOCK_Q = 16
#: How a step's blocks are launched, each launch its ``(ONE_TILE, MIN_ROWS)``: "blocks", one launch,
#: every block through the ``BLOCK_Q``-token tile; "split", two launches over the work list, one-row
#: blocks through the one-token tile, then the longer ones; "branch", one launch, each program
#: choosing its tile by its block's rows (one compiled kernel holding both tiles).
LAYOUTS = {"blocks": ((False, 1),), "split": ((True, BLOCK_Q + 1), (False, 2)), "branch": ((True, 2),)}
LAYOUT = "branch"


if triton is not None:
    from graphkeeper.worker.kernels.decode_kernel import load_kv_tile, online_softmax_step

    @triton.jit
    def _attend(
        q_ptr, k_ptr, v_ptr, out_ptr, block_row_ptr, block_slot_ptr, block_pos_ptr, table_ptr, block, kv_head, n_rows,
        scale, stride_qt, stride_qh, stride_kb, stride_kh, stride_kl, stride_ot, stride_oh, stride_t,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One block of ``n_rows`` (at most ``BLOCK_Q``) tokens and one key/value head: the group's
        query heads of each token are the rows of one tile."""
        first_row = tl.load(block_row_ptr + block)
        slot = tl.load(block_slot_ptr + block)
        first_pos = tl.load(block_pos_ptr + block)
        # Tile row r is token r // GROUP_PAD of the block, query head r % GROUP_PAD of the group
        # (BLOCK_Q 1: tile row r is query head r of the group).
        r = tl.arange(0, BLOCK_Q * GROUP_PAD)
        token = r // GROUP_PAD
        head_in_group = r % GROUP_PAD
        row_ok = (token < n_rows) & (head_in_group < GROUP)
        # Rows past the block's end compute as its last token (finite values) and are not stored.
        pos = first_pos + tl.minimum(token, n_rows - 1)
        head = kv_head * GROUP + head_in_group
        dims = tl.arange(0, HEAD_DIM)
        q_offsets = (first_row + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None], other=0.0)
        table = table_ptr + slot * stride_t
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_kh
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
        end = first_pos + n_rows  # keys the block's last token sees
        for start in range(0, end, BLOCK_N):
            keys, _, k, v = load_kv_tile(table, k_base, v_base, start, end, dims, stride_kb, stride_kl,
                                         BLOCK_SIZE, BLOCK_N)
            visible = keys[None, :] <= pos[:, None]
            m_i, l_i, acc = online_softmax_step(q, k, v, visible, scale, m_i, l_i, acc, IEEE)
        acc = acc / l_i[:, None]
        o_offsets = (first_row + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _varlen_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_row_ptr, block_len_ptr, block_slot_ptr, block_pos_ptr, table_ptr,
        scale, stride_qt, stride_qh, stride_kb, stride_kh, stride_kl, stride_ot, stride_oh, stride_t,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROW_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        ONE_TILE: tl.constexpr, MIN_ROWS: tl.constexpr,
    ):
        """``ONE_TILE``: this launch attends one-row blocks through the one-token tile (``ROW_PAD``
        rows); blocks of at least ``MIN_ROWS`` rows (none past ``BLOCK_Q``) through the
        ``BLOCK_Q``-token tile. Entries past the work list (no rows) are nobody's."""
        kv_head = tl.program_id(0)
        block = tl.program_id(1)
        n_rows = tl.load(block_len_ptr + block)
        if ONE_TILE:  # noqa: SIM102 - a constexpr, resolved at compile time (the inner test is per program)
            if n_rows == 1:
                _attend(q_ptr, k_ptr, v_ptr, out_ptr, block_row_ptr, block_slot_ptr, block_pos_ptr, table_ptr, block,
                        kv_head, n_rows, scale, stride_qt, stride_qh, stride_kb, stride_kh, stride_kl, stride_ot,
                        stride_oh, stride_t, BLOCK_SIZE, GROUP, ROW_PAD, 1, HEAD_DIM, BLOCK_N, IEEE)
        if MIN_ROWS <= BLOCK_Q:  # noqa: SIM102 - constexprs, resolved at compile time
            if n_rows >= MIN_ROWS:
                _attend(q_ptr, k_ptr, v_ptr, out_ptr, block_row_ptr, block_slot_ptr, block_pos_ptr, table_ptr, block,
                        kv_head, n_rows, scale, stride_qt, stride_qh, stride_kb, stride_kh, stride_kl, stride_ot,
                        stride_oh, stride_t, BLOCK_SIZE, GROUP, GROUP_PAD, BLOCK_Q, HEAD_DIM, BLOCK_N, IEEE)

    _varlen = LaunchMemo(_varlen_kernel)


def fill_work_list(out: np.ndarray, prefill: Sequence[PrefillChunk], positions: np.ndarray,
                   slots: np.ndarray) -> int:
    """Write a step's work list into ``out`` (four rows: first row, rows, slot, position of the
    first row; a column per block) and return its length: each prefill chunk cut into blocks of
    ``BLOCK_Q`` tokens, then one block per decode row (``positions`` and ``slots`` are the decode
    rows', row ``i`` of the step being decode row ``i``).

    Longest work first: a launch runs its programs about in the list's order and holds fewer of
    them at once than a step has, so work listed last starts last. The chunks' blocks (a
    ``BLOCK_Q``-token tile each, the longest programs) come first, then the decode rows from the
    longest context down (ties in row order): the programs still starting when the first ones end
    are the shortest. The order is the launch's, not the output's: each block writes its own rows.
    Columns past the returned length are left as they are."""
    b = 0
    for chunk in prefill:
        starts = np.arange(0, chunk.length, BLOCK_Q)
        k = len(starts)
        out[0, b:b + k] = chunk.row + starts
        out[1, b:b + k] = np.minimum(BLOCK_Q, chunk.length - starts)
        out[2, b:b + k] = chunk.slot
        out[3, b:b + k] = chunk.start + starts
        b += k
    nd = len(positions)
    order = np.argsort(-positions, kind="stable")
    out[0, b:b + nd] = order
    out[1, b:b + nd] = 1
    out[2, b:b + nd] = slots[order]
    out[3, b:b + nd] = positions[order]
    return b + nd


def varlen_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_row: Tensor, block_len: Tensor, block_slot: Tensor,
    block_pos: Tensor, num_blocks: int, block_table: Tensor, out: Tensor | None = None, layout: str = "",
) -> Tensor:
    """``q [T, heads, d]`` over ``k_cache/v_cache [blocks, block_size, kv_heads, d]`` through
    ``block_table [slots, max_blocks]`` -> ``[T, heads * d]``, written into ``out`` (contiguous
    ``[T, heads * d]``) when given. (The kernel's *blocks* are runs of query rows, its work list;
    the cache's blocks are runs of key positions.)

    Rows that no block covers (padding) are left as they are in ``out`` (zeros when allocated here):
    they belong to no sequence, and only their finiteness matters. ``layout``: how the blocks are
    launched (``LAYOUTS``; ``LAYOUT`` when empty), for the benchmarks that compare them.
    """
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    if out is None:
        out = torch.zeros(rows, heads, head_dim, dtype=q.dtype, device=q.device)
    out3 = out.view(rows, heads, head_dim)
    if num_blocks:
        group_pad = triton.next_power_of_2(group)
        args = (q, k_cache, v_cache, out3, block_row, block_len, block_slot, block_pos, block_table, head_dim ** -0.5,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(2), k_cache.stride(1),
                out3.stride(0), out3.stride(1), block_table.stride(0))
        # One-row blocks: one token's query heads, padded to the 16 rows a tensor-core product takes,
        # as the decode kernel tiles a decode row.
        shared = {"BLOCK_SIZE": k_cache.shape[1], "GROUP": group, "GROUP_PAD": group_pad,
                  "ROW_PAD": max(16, group_pad), "BLOCK_Q": BLOCK_Q, "HEAD_DIM": head_dim,
                  "BLOCK_N": 32 if head_dim > 64 else 64, "IEEE": q.dtype == torch.float32}
        warps = 8 if group_pad >= 8 else 4
        for one_tile, min_rows in LAYOUTS[layout or LAYOUT]:
            only_one_row = min_rows > BLOCK_Q
            _varlen.launch((kv_heads, num_blocks), *args, **shared, ONE_TILE=one_tile, MIN_ROWS=min_rows,
                           num_warps=4 if only_one_row else warps)
    return out.view(rows, heads * head_dim)
