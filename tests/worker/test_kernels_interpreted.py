"""The Triton kernels against their plain PyTorch references on the CPU, through Triton's
interpreter (``TRITON_INTERPRET=1``, set before Triton is imported, hence a subprocess). The
interpreter has no bfloat16 matrix product, so these run in float16 and float32, and it cannot
run loops bounded by loaded values (the attention kernels'); the GPU suite (``tests/gpu``)
checks every kernel in bfloat16 and float32 on the real device."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECKS = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from graphkeeper.worker.kernels import argmax_kernel as ak, linear_kernel as lk, norm_kernel as nk
    from graphkeeper.worker.kernels import kv_write_kernel
    from graphkeeper.worker.kernels import row_kernel as rk
    from graphkeeper.worker.model.loader import load_model
    from graphkeeper.worker.model.llama import apply_rope, make_row_pieces
    from graphkeeper.worker.model.quantization import quantize

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    torch.manual_seed(0)
    # Skinny products: one row, a few rows (16-row dot tiles), many rows (fp8's row tiles).
    for rows in (1, 3, 20):
        x = torch.randn(rows, 128, dtype=torch.float16)
        w = torch.randn(96, 128, dtype=torch.float16) * 0.1
        for tile in (lk.Tile(16, 64), lk.Tile(8, 128), lk.Tile(32, 64)):
            got = lk.skinny_linear(x, w, None, tile)
            assert rel(got, F.linear(x.float(), w.float())) < 2e-3, ("fp16", rows, tile)
        for per_channel in (True, False):
            q, s = quantize(w, per_channel)
            got = lk.skinny_linear(x, q, s)
            assert rel(got, lk.reference(x, q, s)) < 2e-3, ("fp8", rows, per_channel)
    # Residual add + RMSNorm: the sum exactly, the norm to float32 rounding.
    r, d, wn = torch.randn(5, 96), torch.randn(5, 96), torch.rand(96) + 0.5
    h, out = torch.empty_like(r), torch.empty_like(r)
    nk._add_rms_norm_kernel[(5,)](r, d, wn, h, out, 96, 1e-5, 96, 96, 96, 96, BLOCK=128, ADD=True, USE_PDL=False)
    h_ref, out_ref = nk.reference(r, d, wn, 1e-5)
    assert torch.equal(h, h_ref) and rel(out, out_ref) < 1e-6
    nk._add_rms_norm_kernel[(5,)](r, r, wn, r, out, 96, 1e-5, 96, 96, 96, 96, BLOCK=128, ADD=False, USE_PDL=False)
    assert rel(out, F.rms_norm(r, (96,), wn, 1e-5)) < 1e-6
    # The KV write: one launch stores keys and values of every token at its cache row.
    cache_k, cache_v = torch.zeros(10, 2, 8), torch.zeros(10, 2, 8)
    kk, vv = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    where = torch.tensor([7, 1, 4])
    kv_write_kernel._write_kernel[(3, 2)](kk, vv, cache_k, cache_v, where, 16, 16, ROW=16, BLOCK=16, USE_PDL=False)
    assert torch.equal(cache_k[where], kk) and torch.equal(cache_v[where], vv)
    assert cache_k[[0, 2, 3, 5, 6, 8, 9]].abs().sum() == 0
    # Greedy argmax in two launches, against torch.argmax: ties across and within chunks (the first
    # wins), a row of -inf, the maximum in the last (partial) chunk, NaN (it wins, as in torch).
    for dt in (torch.float32, torch.float16):
        x = torch.randn(6, 1000).to(dt)
        x[1, 5] = x[1, 700] = 50.0
        x[2, 130] = x[2, 131] = 50.0
        x[3] = float("-inf")
        x[4, 999] = 60.0
        x[5, 300] = float("nan")
        chunks = -(-1000 // 128)
        values, index = torch.empty(6, chunks), torch.empty(6, chunks, dtype=torch.int32)
        out = torch.empty(6, dtype=torch.int64)
        ak._chunk_kernel[(6, chunks)](x, values, index, 1000, x.stride(0), chunks, CHUNK=128, USE_PDL=False)
        ak._row_kernel[(6,)](values, index, out, 1000, chunks, CHUNKS_PAD=8, USE_PDL=False)
        assert torch.equal(out, x.argmax(-1)) and out[1] == 5 and out[2] == 130, (dt, out, x.argmax(-1))
    # One-row fused products: plain, norm prologue, residual epilogue, GLU, RoPE, fp8; every tile.
    K, N, D = 96, 40, 8
    for dt in (torch.float16, torch.float32):
        x, g = torch.randn(1, K, dtype=dt), (torch.rand(K) + 0.5).to(dt)
        w, r = (torch.randn(N, K) * 0.1).to(dt), torch.randn(1, N, dtype=dt)
        normed = F.rms_norm(x, (K,), g, 1e-5)
        gate, up = F.linear(normed, w).split(N // 2, -1)
        wq = (torch.randn(4 * D, K) * 0.1).to(dt)  # 2 query heads, 1 key head, 1 value head
        angles = 5.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        cos = torch.cat((angles, angles)).cos()[None].to(dt)
        sin = torch.cat((-angles.sin(), angles.sin()))[None].to(dt)
        heads = F.linear(normed, wq).view(1, 4, D)
        rotated = torch.cat((apply_rope(heads[:, :3], cos, sin), heads[:, 3:]), 1).view(1, -1)
        for tile in (rk.RowTile(1, 4), rk.RowTile(4, 4), rk.RowTile(2, 8)):
            assert rel(rk.row_linear(x, w, tile=tile), F.linear(x, w)) < 2e-3, (dt, tile)
            assert rel(rk.row_linear(x, w, norm=g, eps=1e-5, tile=tile), F.linear(normed, w)) < 2e-3, (dt, tile)
            assert rel(rk.row_linear(x, w, residual=r, tile=tile), r + F.linear(x, w)) < 2e-3, (dt, tile)
            got = rk.row_linear(x, w, norm=g, eps=1e-5, glu=True, tile=tile)
            assert rel(got, F.silu(gate) * up) < 3e-3, (dt, tile)
            got = rk.row_linear(x, wq, norm=g, eps=1e-5, rope=(cos, sin, 3 * D, D), tile=tile)
            assert rel(got, rotated) < 3e-3, (dt, tile)
    x = torch.randn(1, K, dtype=torch.float16)
    for per_channel in (True, False):
        q, s = quantize(torch.randn(N, K) * 0.1, per_channel)
        assert rel(rk.row_linear(x, q, s, tile=rk.RowTile(4, 4)), lk.reference(x, q, s)) < 3e-3
    # The one-token step of fused row kernels against the general pieces, on a whole model.
    loaded = load_model("random:tiny@4", device="cpu", dtype="float16", max_positions=32)
    model = loaded.model
    row = make_row_pieces(loaded.config)
    tokens, positions = torch.tensor([17]), torch.tensor([3])
    cos, sin = model.rope(positions)
    a = model.pieces.first(tokens, cos, sin, model.tok_embeddings.weight, *model.layers[0].head_weights())
    b = row.first(tokens, cos, sin, model.tok_embeddings.weight, *model.layers[0].head_weights())
    for mine, theirs in zip(b, a):
        assert mine.shape == theirs.shape and rel(mine, theirs) < 5e-3
    attn = torch.randn(1, loaded.config.n_heads * loaded.config.head_dim, dtype=torch.float16)
    weights = (*model.layers[0].tail_weights(), *model.layers[1].head_weights())
    a = model.pieces.middle(a[0], attn, cos, sin, *weights)
    b = row.middle(b[0], attn, cos, sin, *weights)
    for mine, theirs in zip(b, a):
        assert mine.shape == theirs.shape and rel(mine, theirs) < 5e-3
    tail = (*model.layers[-1].tail_weights(), model.norm.weight)
    assert rel(row.last(b[0], attn, *tail), model.pieces.last(a[0], attn, *tail)) < 5e-3
    print("ok")
''')

PENALTY_CHECKS = textwrap.dedent('''
    import numpy as np
    import torch
    from graphkeeper.worker.executor.penalty_counts import PenaltyCounts
    from graphkeeper.worker.kernels import penalty_kernel as pk

    torch.manual_seed(0)
    V = 3000  # one whole block of 2,048 and a partial one
    pen = PenaltyCounts(V, torch.device("cpu"))
    pen.cover(8)
    pen.counts.copy_(torch.randint(0, 4, (8, V), dtype=torch.int32) * (torch.rand(8, V) < 0.2))
    pen.prompt.copy_(torch.rand(8, V) < 0.1)
    sub = torch.randn(5, V) * 3
    sub[0, :5] = float("-inf")
    sub[2, 10:20] = 0.0
    entries, sample_rows, slots = np.array([0, 2, 4]), np.array([1, 3, 6]), np.array([5, 0, 3])
    rep = np.array([1.3, 1.0, 0.8], np.float32)
    freq, pres = np.array([0.5, 0.0, -0.3], np.float32), np.array([0.5, 0.0, 1.0], np.float32)
    block = torch.from_numpy(pk.params(entries, sample_rows, slots, rep, freq, pres))
    want = sub.clone()
    want[entries] = pen.apply(want[entries], torch.from_numpy(slots), torch.from_numpy(rep), torch.from_numpy(freq),
                              torch.from_numpy(pres))
    got = sub.clone()
    pk.apply(got, pen.counts, pen.prompt, block, 3)
    assert torch.equal(got[[1, 3]], sub[[1, 3]])  # rows not named are not touched
    assert torch.equal(got[2], sub[2])  # repetition 1, frequency and presence 0: exactly as it was
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True), (got - want).abs().max()
    tokens = torch.tensor([9, 2999, 4, 0, 11, 12, 2047])
    expect = pen.counts.clone()
    for r, s in zip(sample_rows, slots):
        expect[s, tokens[r]] += 1
    pk.count(tokens, pen.counts, block, 3)
    assert torch.equal(pen.counts, expect)
    print("ok")
''')


def test_the_penalty_kernels_match_penalty_counts_in_the_triton_interpreter():
    """One launch applies the penalties of the rows a parameter block names (others untouched, a
    neutral row bit for bit) as ``PenaltyCounts.apply`` does; one more counts the sampled tokens."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", PENALTY_CHECKS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


MASK_CHECKS = textwrap.dedent('''
    import torch
    from graphkeeper.worker.executor.logits import unpack_mask
    from graphkeeper.worker.kernels import mask_kernel as mk

    torch.manual_seed(0)
    V = 3000  # two whole blocks of 1,024 and a partial one; 94 words, the last one cut at the vocabulary
    words = torch.randint(-2**31, 2**31 - 1, (3, (V + 31) // 32), dtype=torch.int32)
    words[1] = -1  # a grammar that allows everything: its row stays exactly as it was
    words[2, 5] = 0  # 32 tokens refused at once
    sub = torch.randn(5, V) * 3
    rows = torch.tensor([4, 0, 2])
    want = sub.clone()
    want[rows] = want[rows].masked_fill(~unpack_mask(words, V), float("-inf"))
    got = sub.clone()
    mk.apply(got, words, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3]], sub[[1, 3]]) and torch.equal(got[0], sub[0])
    assert torch.isinf(got[2, 160:192]).all()
    print("ok")
''')


def test_the_mask_kernel_matches_unpacked_masks_in_the_triton_interpreter():
    """One launch applies a step's grammar bitmasks to the rows they name exactly as unpacking
    them and filling does (rows not named, and tokens allowed, untouched)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", MASK_CHECKS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def test_kernels_match_their_references_in_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


PAGED_CHECKS = textwrap.dedent('''
    import builtins
    import numpy as np
    import torch
    from graphkeeper.worker.kernels import decode_kernel as dk, varlen_kernel as vk

    def interpreted_range(*args):
        """The interpreter hands a loaded scalar over as a one-element tensor, which Python's range
        refuses; the compiled kernel takes it as a loop bound. Only this harness patches it."""
        return builtins.range(*(int(np.asarray(a.handle.data if hasattr(a, "handle") else a).reshape(-1)[0])
                                for a in args))

    dk.range = vk.range = interpreted_range
    torch.manual_seed(0)
    bs, kvh, d, heads = 4, 2, 16, 4
    # Two slots whose blocks are scattered over the cache, in no order.
    table = torch.tensor([[5, 2, 9, 0, 4], [7, 1, 3, 11, 6]])

    def reference(q, kf, vf, slot, positions, table=table):
        """Causal attention of q [n, heads, d] at ``positions`` over the slot's keys, read block by block."""
        n_keys = int(positions.max()) + 1
        pos = torch.arange(n_keys)
        rows = table[slot, pos // bs] * bs + pos % bs
        k = kf[rows].float().repeat_interleave(heads // kvh, 1)
        v = vf[rows].float().repeat_interleave(heads // kvh, 1)
        s = torch.einsum('thd,nhd->thn', q.float(), k) * d ** -0.5
        s = s.masked_fill(pos[None, None, :] > positions[:, None, None], float('-inf'))
        return torch.einsum('thn,nhd->thd', torch.softmax(s, -1), v).reshape(len(q), -1)

    for dt in (torch.float32, torch.float16):
        K, V = torch.randn(12, bs, kvh, d).to(dt), torch.randn(12, bs, kvh, d).to(dt)
        kf, vf = K.view(-1, kvh, d), V.view(-1, kvh, d)
        # Decode: each row attends to its slot's first ``length`` keys through the table.
        slots, lengths = torch.tensor([1, 0, 1]), torch.tensor([10, 7, 17])
        q = torch.randn(3, heads, d).to(dt)
        out = dk.decode_attention(q, K, V, slots, lengths, table)
        for r in range(3):
            exp = reference(q[r:r + 1], kf, vf, int(slots[r]), lengths[r:r + 1] - 1)[0]
            assert (out[r].float() - exp).abs().max() < (1e-4 if dt == torch.float32 else 2e-2), ('decode', dt, r)
        # Tables long enough (160 keys) that two half-precision rows split their keys across three
        # programs (flash-decoding: partial softmaxes, then the combining kernel); float32 never splits.
        long_table = torch.randperm(96)[:80].view(2, 40)
        assert dk.decode_splits(2, kvh, 160, dt)[0] == (1 if dt == torch.float32 else 3)
        K2, V2 = torch.randn(96, bs, kvh, d).to(dt), torch.randn(96, bs, kvh, d).to(dt)
        slots, lengths = torch.tensor([1, 0]), torch.tensor([150, 70])
        q = torch.randn(2, heads, d).to(dt)
        out = dk.decode_attention(q, K2, V2, slots, lengths, long_table)
        for r in range(2):
            exp = reference(q[r:r + 1], K2.view(-1, kvh, d), V2.view(-1, kvh, d), int(slots[r]), lengths[r:r + 1] - 1,
                            long_table)[0]
            assert (out[r].float() - exp).abs().max() < (1e-4 if dt == torch.float32 else 2e-2), ('split', dt, r)
        for layout in vk.LAYOUTS:  # every way of launching the blocks computes the same attention
            # Varlen: a decode row of slot 0 at position 6, a chunk of slot 1 at positions 3..12.
            q = torch.randn(11, heads, d).to(dt)
            block_row, block_len = torch.tensor([0, 1]), torch.tensor([1, 10])
            block_slot, block_pos = torch.tensor([0, 1]), torch.tensor([6, 3])
            out = vk.varlen_attention(q, K, V, block_row, block_len, block_slot, block_pos, 2, table,
                                      layout=layout)
            tol = 1e-4 if dt == torch.float32 else 2e-2
            exp = torch.cat([reference(q[:1], kf, vf, 0, torch.tensor([6])),
                             reference(q[1:], kf, vf, 1, torch.arange(3, 13))])
            assert (out.float() - exp).abs().max() < tol, ('varlen', dt, layout)
            # Launched as a recorded step launches it: a program per row of the padded size (16), the
            # work list's entries past its two blocks zeros (as the runner leaves them). Those
            # programs write nothing: the same values, and padding rows left as they were.
            pad = lambda t: torch.cat([t, torch.zeros(14, dtype=t.dtype)])  # noqa: E731
            q16 = torch.cat([q, torch.randn(5, heads, d).to(dt)])
            out16 = torch.full((16, heads * d), 7.0, dtype=dt)
            vk.varlen_attention(q16, K, V, pad(block_row), pad(block_len), pad(block_slot), pad(block_pos), 16, table,
                                out16, layout=layout)
            assert torch.equal(out16[:11], out), ('varlen, fixed grid', dt, layout)
            assert bool((out16[11:] == 7.0).all()), ('varlen, fixed grid: padding rows untouched', dt, layout)
            # A chunk of 17 tokens as the runner cuts it (a block of 16, then a one-token block: the
            # one-row launch's, as decode rows are), then a decode row after it.
            q = torch.randn(18, heads, d).to(dt)
            block_row, block_len = torch.tensor([0, 16, 17]), torch.tensor([16, 1, 1])
            block_slot, block_pos = torch.tensor([1, 1, 0]), torch.tensor([0, 16, 9])
            out = vk.varlen_attention(q, K, V, block_row, block_len, block_slot, block_pos, 3, table,
                                      layout=layout)
            exp = torch.cat([reference(q[:17], kf, vf, 1, torch.arange(0, 17)),
                             reference(q[17:], kf, vf, 0, torch.tensor([9]))])
            assert (out.float() - exp).abs().max() < tol, ('varlen, a one-token tail', dt, layout)
    print("ok")
''')


def test_paged_attention_kernels_read_through_the_block_table_in_the_interpreter():
    """The decode and varlen kernels (float32, float16) over blocks scattered
    through the cache, against attention over the same keys gathered by the table; the decode
    kernel also with its keys split across programs and combined (half precision, long tables);
    the varlen kernel also over a grid larger than its blocks, as a recorded mixed step launches it,
    and over a chunk whose one-token tail goes to the one-row launch."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", PAGED_CHECKS], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


LOGPROB_CHECKS = textwrap.dedent('''
    import torch
    from graphkeeper.worker.kernels import logprob_kernel as lk

    torch.manual_seed(0)
    V, rows, chunk = 3000, 5, 512  # five whole chunks of 512 and a partial one
    chunks = -(-V // chunk)
    for dt in (torch.float32, torch.float16):
        x = (torch.randn(rows, V) * 4).to(dt)
        x[1, 2990:] = 40.0  # every alternative in the partial last chunk, tied: smaller ids first
        x[2, :3] = float("-inf")  # refused tokens stay out of the alternatives
        x[3, 100:120] = 30.0  # twenty alternatives in one chunk: a chunk keeps its own top
        tokens = torch.tensor([0, 2995, 7, 119, V - 1])
        for top in (0, 1, 5, 20):
            maxima, sums = torch.empty(rows, chunks), torch.empty(rows, chunks)
            values = torch.empty(rows, chunks, lk.SLOTS)
            ids = torch.empty(rows, chunks, lk.SLOTS, dtype=torch.int32)
            got = torch.empty(rows, 1 + 2 * top)
            lk._chunk_kernel[(rows, chunks)](x, maxima, sums, values, ids, V, x.stride(0), top, chunks,
                                             CHUNK=chunk, SLOTS=lk.SLOTS, USE_PDL=False)
            lk._row_kernel[(rows,)](x, tokens, maxima, sums, values, ids, got, V, x.stride(0), top, chunks,
                                    CHUNKS_PAD=8, SLOTS=lk.SLOTS, CANDIDATES=256, USE_PDL=False)
            want = lk.reference(x, tokens, top)
            assert torch.allclose(got[:, :1 + top], want[:, :1 + top], atol=1e-5, rtol=1e-6), (dt, top, got, want)
            if top:  # rows 0, 2 and 4 have no ties: the same ids in the same order
                assert torch.equal(got[[0, 2, 4], 1 + top:], want[[0, 2, 4], 1 + top:]), (dt, top)
                tied = min(top, 10)
                assert got[1, 1 + top:1 + top + tied].tolist() == list(range(2990, 2990 + tied))
                assert got[3, 1 + top:].tolist() == list(range(100, 100 + top))
                assert not set(got[2, 1 + top:].tolist()) & {0.0, 1.0, 2.0}
    print("ok")
''')


def test_the_logprob_kernels_match_log_softmax_and_topk_in_the_triton_interpreter():
    """Two launches give each row's chosen token's log probability and its top alternatives as
    ``log_softmax``, ``gather`` and ``topk`` do: ties in a partial chunk (smaller ids first), refused
    tokens, twenty alternatives in one chunk, no alternatives at all."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", LOGPROB_CHECKS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
