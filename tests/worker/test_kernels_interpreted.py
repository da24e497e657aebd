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
    from graphkeeper.worker import kv_cache, linear_kernel as lk, norm_kernel as nk
    from graphkeeper.worker.quant import quantize

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
    nk._add_rms_norm_kernel[(5,)](r, d, wn, h, out, 96, 1e-5, 96, 96, 96, 96, BLOCK=128)
    h_ref, out_ref = nk.reference(r, d, wn, 1e-5)
    assert torch.equal(h, h_ref) and rel(out, out_ref) < 1e-6
    # The KV write: one launch stores keys and values of every token at its cache row.
    cache_k, cache_v = torch.zeros(10, 2, 8), torch.zeros(10, 2, 8)
    kk, vv = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    where = torch.tensor([7, 1, 4])
    kv_cache._write_kernel[(3, 2)](kk, vv, cache_k, cache_v, where, 16, 16, ROW=16, BLOCK=16)
    assert torch.equal(cache_k[where], kk) and torch.equal(cache_v[where], vv)
    assert cache_k[[0, 2, 3, 5, 6, 8, 9]].abs().sum() == 0
    print("ok")
''')


def test_kernels_match_their_references_in_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
