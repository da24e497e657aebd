"""The launch memo on an NVIDIA GPU: a kernel launched straight through its compiled launcher writes
exactly what Triton's own launch writes, for every call site that uses the memo, across the changes
a step makes between calls (another layer's cache, other rows, other lengths, a misaligned view).

Each check runs the same call twice, once with the memo's direct path and once with it turned off
(every call through ``kernel[grid]``), and compares the results bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from graphkeeper.worker.kernels import argmax_kernel, kv_write_kernel, mask_kernel, varlen_kernel

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]


class Counting:
    """A kernel's stand-in that counts the launches that went through Triton, and makes them."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.kernel[grid]


def both(memos, call, *args):
    """``call(*args)`` with the memos' direct paths, then through Triton; each result cloned, and how
    many launches of the first run went through Triton (misses: a key seen for the first time)."""
    counters = []
    for memo in memos:
        assert memo._direct, "the direct path is off on this Triton: LaunchMemo.CHECKED_VERSIONS"
        memo.kernel = Counting(memo.kernel)
        counters.append(memo.kernel)
    try:
        direct = [t.clone() for t in call(*args)]
        misses = sum(c.calls for c in counters)  # counted before the second run, which is all Triton
        for memo in memos:
            memo._direct = False
        through_triton = [t.clone() for t in call(*args)]
    finally:
        for memo, counter in zip(memos, counters, strict=True):
            memo._direct, memo.kernel = True, counter.kernel
    return direct, through_triton, misses


def write(kv, rows, k_layer, v_layer):
    """The keys and values of ``kv`` ``[t, 3, heads, d]`` written at ``rows`` of zeroed caches."""
    k_layer.zero_(), v_layer.zero_()
    kv_write_kernel.write(kv[:, 1], kv[:, 2], k_layer, v_layer, rows)
    return k_layer, v_layer


def attend(q, k, v, work, blocks, table):
    """``varlen_attention`` over the first ``blocks`` of the work list ``work`` ``[4, 16]``."""
    return (varlen_kernel.varlen_attention(q, k, v, work[0], work[1], work[2], work[3], blocks, table),)


def masked(logits, words, rows):
    """A copy of ``logits`` with the grammar bitmasks ``words`` applied to its ``rows``."""
    out = logits.clone()
    mask_kernel.apply(out, words, rows)
    return (out,)


def test_kv_writes_through_the_memo_equal_triton_launches_across_layers_and_views():
    memo = kv_write_kernel._write
    torch.manual_seed(0)
    layers = [(torch.zeros(64, 2, 64, device="cuda", dtype=torch.bfloat16),
               torch.zeros(64, 2, 64, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
    misses = 0
    for step in range(3):
        t = 5 + 3 * step
        kv = torch.randn(t, 3, 2, 64, device="cuda", dtype=torch.bfloat16)  # q, k, v heads side by side
        rows = torch.randperm(64, device="cuda")[:t]
        for k_layer, v_layer in layers:
            direct, through_triton, missed = both([memo], write, kv, rows, k_layer, v_layer)
            misses += missed
            assert all(torch.equal(a, b) for a, b in zip(direct, through_triton, strict=True))
            assert torch.equal(direct[0][rows], kv[:, 1]) and torch.equal(direct[1][rows], kv[:, 2])
    assert misses <= 1  # every layer and step after the first launched directly
    # A view one element in: not 16-byte aligned, so a specialization of its own, and still right.
    seen = len(memo)
    flat = torch.zeros(64 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    k_odd = flat[1:].view(64, 2, 64)
    kv = torch.randn(4, 3, 2, 64, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(4, device="cuda")
    direct, through_triton, missed = both([memo], write, kv, rows, k_odd, layers[0][1])
    assert missed == 1
    assert torch.equal(direct[0], through_triton[0]) and torch.equal(direct[0][:4], kv[:, 1])
    assert len(memo) == seen + 1


def test_varlen_attention_through_the_memo_equals_triton_launches():
    memo = varlen_kernel._varlen
    torch.manual_seed(1)
    heads, kv_heads, d, block_size, slots = 8, 2, 64, 16, 4
    table = torch.arange(slots * 8, device="cuda").view(slots, 8)
    caches = [(torch.randn(slots * 8, block_size, kv_heads, d, device="cuda", dtype=torch.bfloat16),
               torch.randn(slots * 8, block_size, kv_heads, d, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
    misses = 0
    for entries in ([(0, 40, 1), (1, 0, 20)], [(2, 7, 1), (3, 90, 1), (1, 3, varlen_kernel.BLOCK_Q + 5)]):
        blocks, row = [], 0
        for slot, start, n in entries:
            q_block = varlen_kernel.BLOCK_Q
            blocks += [(row + b, min(q_block, n - b), slot, start + b) for b in range(0, n, q_block)]
            row += n
        work = torch.zeros(4, 16, device="cuda", dtype=torch.long)  # fixed rows, as the runner's inputs
        work[:, :len(blocks)] = torch.tensor(blocks, device="cuda").T
        q = torch.randn(row, heads, d, device="cuda", dtype=torch.bfloat16)
        for k, v in caches:
            direct, through_triton, missed = both([memo], attend, q, k, v, work, len(blocks), table)
            misses += missed
            assert torch.equal(direct[0], through_triton[0])
            assert direct[0].isfinite().all()
    # Other caches, rows and work lists: one specialization per launch (one-row blocks, longer blocks).
    assert misses <= 2


def test_argmax_through_the_memo_equals_triton_launches_and_torch():
    torch.manual_seed(2)
    missed = []
    for rows in (7, 7, 64):
        x = torch.randn(rows, 128_256, device="cuda", dtype=torch.float32)
        direct, through_triton, misses = both([argmax_kernel._chunks, argmax_kernel._rows],
                                              lambda t: (argmax_kernel.argmax(t),), x)
        missed.append(misses)
        assert torch.equal(direct[0], through_triton[0]) and torch.equal(direct[0], x.argmax(dim=-1))
    assert missed[1] == 0  # the same shape again: both kernels launched directly


def test_grammar_masks_through_the_memo_equal_triton_launches_and_unpacked_masks():
    """At llama's vocabulary: the mask kernel, launched directly and through Triton, writes what
    unpacking the bitmasks and filling writes; a second step of other rows launches directly."""
    from graphkeeper.worker.executor.logits import unpack_mask

    vocab = 128_256
    g = torch.Generator(device="cuda").manual_seed(3)
    missed = []
    for rows in ([0, 5, 9], [2, 3, 11]):
        at = torch.tensor(rows, device="cuda")
        words = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), device="cuda", dtype=torch.int32,
                              generator=g)
        words[1] = -1  # allows everything: the row stays as it was
        sub = torch.randn(12, vocab, device="cuda", generator=g)
        want = sub.clone()
        want[at] = want[at].masked_fill(~unpack_mask(words, vocab), float("-inf"))
        direct, through_triton, misses = both([mask_kernel._mask], masked, sub, words, at)
        missed.append(misses)
        assert torch.equal(direct[0], through_triton[0]) and torch.equal(direct[0], want)
        assert torch.equal(direct[0][rows[1]], sub[rows[1]])
    assert missed[1] == 0
