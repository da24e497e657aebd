"""Decode attention in one Triton kernel that reads keys and values straight from the paged cache.

A decode row attends to its own sequence's keys up to its length, found through the sequence's
row of the block table (key ``p`` is in block ``table[slot, p // BLOCK_SIZE]``). Gathering each row's slot into
a batch (what plain SDPA needs) copies the whole slot for every row and every layer: memory
traffic at large batches and, inside a graph's pool, hundreds of MiB that every graph must keep.
This kernel instead takes the slot index and the length as inputs, loops over the keys that
exist, and keeps a running softmax. One program handles one row, one key/value head (with all
the query heads of that group) and one split of the keys: at small batches the keys are split
across programs and a second kernel combines their partial softmaxes (flash-decoding). Shapes
depend only on the row count, so it records into FULL graphs; it runs eagerly too, so eager and
replay agree.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphkeeper.worker.kernels import compile_ahead, pdl
from graphkeeper.worker.kernels.triton_support import tl, triton

if triton is not None:
    from graphkeeper.worker.kernels.pdl import await_inputs

    @triton.jit
    def online_softmax_step(q, k, v, visible, scale, m_i, l_i, acc, IEEE: tl.constexpr):
        """One key tile of flash attention: scores, the running maximum and sum, the weighted values.

        Shared by the decode and the varlen kernels; ``visible`` masks keys a query row may not see.
        """
        if IEEE:  # noqa: SIM108 - constexpr branch, resolved at compile time
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:  # noqa: SIM108 - constexpr branch, resolved at compile time
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def load_kv_tile(table, k_base, v_base, start, end, dims, stride_kb, stride_kl,
                     BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Keys ``start .. start + BLOCK_N`` of one slot and one key/value head, read in place from
        the paged cache through the slot's row of the block table (``table``); keys at or past
        ``end`` read as zeros. Returns the key positions, which of them exist, and the key and
        value tiles. Shared by the decode and the varlen kernels (Triton inlines it).
        """
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        kv_block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offsets = (kv_block * stride_kb + (keys % BLOCK_SIZE) * stride_kl)[:, None] + dims[None, :]
        k = tl.load(k_base + offsets, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_base + offsets, mask=key_ok[:, None], other=0.0)
        return keys, key_ok, k, v

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, stats_ptr, slots_ptr, lengths_ptr, table_ptr, scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_ob, stride_oh, stride_t,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_KEYS: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        await_inputs(USE_PDL)  # everything below reads what earlier kernels wrote
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        slot = tl.load(slots_ptr + row)
        length = tl.load(lengths_ptr + row)
        first = split * SPLIT_KEYS
        end = tl.minimum(length, first + SPLIT_KEYS)
        heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
        head_ok = tl.arange(0, GROUP_PAD) < GROUP
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=head_ok[:, None], other=0.0)
        table = table_ptr + slot * stride_t
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_kh
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(first, end, BLOCK_N):
            _, key_ok, k, v = load_kv_tile(table, k_base, v_base, start, end, dims, stride_kb, stride_kl,
                                           BLOCK_SIZE, BLOCK_N)
            m_i, l_i, acc = online_softmax_step(q, k, v, key_ok[None, :], scale, m_i, l_i, acc, IEEE)
        if SPLITS == 1:
            acc = acc / l_i[:, None]
            tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
        else:
            # Partial results of this split: unnormalised values and the running max and sum,
            # laid out [row, head, split, ...] for the combining kernel.
            n_heads = tl.num_programs(1) * GROUP
            base = (row * n_heads + heads) * SPLITS + split
            tl.store(part_ptr + base[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None])
            tl.store(stats_ptr + base * 2, m_i, mask=head_ok)
            tl.store(stats_ptr + base * 2 + 1, l_i, mask=head_ok)

    @triton.jit
    def _combine_kernel(part_ptr, stats_ptr, out_ptr, stride_ob, stride_oh, SPLITS: tl.constexpr,
                        SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr):
        await_inputs(USE_PDL)
        row = tl.program_id(0)
        head = tl.program_id(1)
        n_heads = tl.num_programs(1)
        splits = tl.arange(0, SPLITS_PAD)
        ok = splits < SPLITS
        base = (row * n_heads + head) * SPLITS + splits
        m = tl.load(stats_ptr + base * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(stats_ptr + base * 2 + 1, mask=ok, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.where(ok & (l_s > 0), tl.exp(m - m_max), 0.0)
        dims = tl.arange(0, HEAD_DIM)
        part = tl.load(part_ptr + base[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
        acc = tl.sum(part * w[:, None], 0) / tl.sum(l_s * w, 0)
        tl.store(out_ptr + row * stride_ob + head * stride_oh + dims, acc.to(out_ptr.dtype.element_ty))


#: Programs that keep every SM of an H200 (132) busy about twice over.
TARGET_PROGRAMS = 264
BLOCK_N = 64


def decode_splits(rows: int, kv_heads: int, max_len: int, dtype: torch.dtype) -> tuple[int, int]:
    """(splits, keys per split) for a decode batch (pure; depends only on shapes, so graphs can
    record it). A small batch has too few (row, head) programs to load the GPU, so each row's
    keys are cut into splits whose partial softmaxes a second kernel combines (flash-decoding).
    float32 never splits: its results must not depend on the batch's size."""
    programs = rows * kv_heads
    if dtype == torch.float32 or programs * 2 >= TARGET_PROGRAMS:
        return 1, max_len
    wanted = -(-TARGET_PROGRAMS // programs)
    keys = max(BLOCK_N, BLOCK_N * -(-max_len // (wanted * BLOCK_N)))
    return -(-max_len // keys), keys


def table_keys(block_table: Tensor, k_cache: Tensor) -> int:
    """Keys a slot's row of the block table reaches: the length the split sizes are cut from."""
    return block_table.shape[1] * k_cache.shape[1]


def variant_rows(rows: list[int], kv_heads: int, max_len: int, dtype: torch.dtype) -> list[int]:
    """One row count for each compiled variant that decode steps of ``rows`` rows launch (pure):
    the kernels specialize on the split count and the keys per split (``decode_splits``), not on
    the row count, so a warm-up that runs every row count compiles only these."""
    firsts: dict[tuple[int, int], int] = {}
    for n in rows:
        firsts.setdefault(decode_splits(n, kv_heads, max_len, dtype), n)
    return sorted(firsts.values())


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor,
                     block_table: Tensor, out: Tensor | None = None) -> Tensor:
    """``q [B, heads, d]`` over ``k_cache/v_cache [blocks, block_size, kv_heads, d]`` through
    ``block_table [slots, max_blocks]`` -> ``[B, heads * d]``, written into ``out`` (contiguous
    ``[B, heads * d]``) when given.

    Reads only each row's live keys (``lengths``, on the device); splits them across programs
    when the batch is small (``decode_splits``).
    """
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    block_size = k_cache.shape[1]
    splits, split_keys = decode_splits(rows, kv_heads, table_keys(block_table, k_cache), q.dtype)
    if out is None:
        out = torch.empty(rows, heads, head_dim, dtype=q.dtype, device=q.device)
    else:
        out = out.view(rows, heads, head_dim)
    part = stats = out
    if splits > 1:
        part = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
    compile_ahead.launcher(_decode_kernel, (rows, kv_heads, splits))(
        q, k_cache, v_cache, out, part, stats, slots, lengths, block_table, head_dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(2), k_cache.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=BLOCK_N,
        SPLIT_KEYS=split_keys, SPLITS=splits, IEEE=q.dtype == torch.float32, num_warps=4, **pdl.launch_options(),
    )
    if splits > 1:
        compile_ahead.launcher(_combine_kernel, (rows, heads))(
            part, stats, out, out.stride(0), out.stride(1), SPLITS=splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(splits)), HEAD_DIM=head_dim, num_warps=1, **pdl.launch_options())
    return out.view(rows, heads * head_dim)
