"""Skinny matrix products that reach memory bandwidth: ``x [M, K] @ W[N, K]^T`` for small ``M``.

A decode step at a small batch reads every weight once and does almost no arithmetic with it, so
its speed is the speed at which the weights stream from memory. cuBLAS picks GEMM tiles meant for
large ``M`` and leaves bandwidth unused on these shapes; this kernel gives each program a band of
``BLOCK_N`` output columns, streams that band of ``W`` in ``BLOCK_K`` tiles with several loads in
flight, and keeps the few rows of ``x`` beside it. Rows of ``x`` beyond one are handled by
``tl.dot`` on a 16-row tile (padding costs no memory traffic).

The same kernel reads fp8 (e4m3) weights, half the bytes, scaled per output channel (or per
tensor, as a scale of one element) after the dot product: exact for a per-channel scale.

``choose(rows, weight)`` is the one decision: this kernel (and which tile) or
``torch.nn.functional.linear``. It follows what ``tune`` measured at warm-up on this GPU for each
weight shape and row bucket, cuBLAS included: the kernel replaces cuBLAS only where it is faster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from graphkeeper.worker.kernels import compile_ahead
from graphkeeper.worker.kernels.launch_memo import LaunchMemo
from graphkeeper.worker.kernels.timing import graph_time, weight_copies
from graphkeeper.worker.kernels.triton_support import tl, triton

#: Up to this many rows the bandwidth kernel may replace cuBLAS for bf16/fp16 weights.
SKINNY_ROWS = 16
#: fp8 weights always use this kernel: above ``SKINNY_ROWS`` rows its grid tiles rows 64 at a time.
ROW_TILE = 64
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Tile:
    """One launch configuration of the kernel."""

    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 4


#: Candidates for one row (a [BLOCK_N, BLOCK_K] multiply-accumulate) and for 2..16 rows (16-row dots).
ONE_ROW = (Tile(16, 256), Tile(16, 512, 8, 3), Tile(32, 256, 8), Tile(8, 512), Tile(32, 512, 8, 3),
           Tile(8, 1024, 8, 2), Tile(16, 1024, 8, 2), Tile(4, 1024, 4, 3))
FEW_ROWS = (Tile(16, 128), Tile(32, 128), Tile(64, 64), Tile(16, 256, 4, 3), Tile(32, 256, 8, 3))
#: Used untuned: fp8 at any size, and until tuning has measured a shape.
DEFAULT_ONE, DEFAULT_FEW, DEFAULT_MANY = Tile(16, 512, 8, 3), Tile(32, 128), Tile(64, 64)

#: What tuning measured: (n, k, weight dtype, row bucket) -> the fastest tile, or None for torch.
_choices: dict[tuple[int, int, str, int], Tile | None] = {}


#: Row counts that share a tuning decision: 1, 2-4, 5-8, 9-16 (each tuned at its upper limit).
BUCKETS = (1, 4, 8, 16)


def bucket(rows: int) -> int:
    """The bucket of ``rows`` (its upper limit); 0 above ``SKINNY_ROWS``."""
    for limit in BUCKETS:
        if rows <= limit:
            return limit
    return 0


def warm_rows(max_rows: int) -> list[int]:
    """Row counts that reach every kernel variant ``choose`` can pick (Triton specializes on the
    count's value, so every count of the buckets), the first count beyond them and a full fp8 row
    tile; those up to ``max_rows``. Running a product at each loads it before any request needs it."""
    return sorted(r for r in {*range(1, SKINNY_ROWS + 2), 2 * SKINNY_ROWS, ROW_TILE} if r <= max_rows)


def choose(rows: int, weight: Tensor) -> Tile | None:
    """The tile that computes a ``rows``-row product with ``weight``, or None for ``F.linear``.

    fp8 weights need the kernel at any size (torch has no plain fp8 x bf16 product). bf16/fp16
    weights use it only where tuning measured it faster than cuBLAS on this GPU; float32 never
    (its results must not depend on the batch's size). Off the GPU, without Triton, or for a
    reduction length the tiles do not divide, torch computes it.
    """
    n, k = weight.shape
    if triton is None or weight.device.type != "cuda" or k % 64:
        return None
    b = bucket(rows)
    if weight.dtype == FP8:
        default = DEFAULT_MANY if b == 0 else DEFAULT_ONE if b == 1 else DEFAULT_FEW
        return _choices.get((n, k, str(weight.dtype), b), default)
    if weight.dtype not in (torch.bfloat16, torch.float16) or b == 0:
        return None
    return _choices.get((n, k, str(weight.dtype), b))


def choices() -> dict[tuple[int, int, str, int], Tile | None]:
    """What tuning decided so far (for the tuning cache)."""
    return dict(_choices)


def remember(n: int, k: int, weight_dtype: str, rows: int, tile: Tile | None) -> None:
    """Installs a decision read back from the tuning cache (None: cuBLAS)."""
    _choices[(n, k, weight_dtype, rows)] = tile


#: Every timing tuning took: (n, k, weight dtype, rows, candidate, microseconds), for benchmarks.
measurements: list[tuple[int, int, str, int, str, float]] = []


#: Smaller weights are not tuned (cuBLAS for bf16): they are launch-bound, and copies enough to
#: leave L2 would be thousands.
MIN_TUNED_BYTES = 2**20


def tune(weight: Tensor, scale: Tensor | None, dtype: torch.dtype) -> dict[int, str]:
    """Times cuBLAS (bf16/fp16 weights) and every candidate tile on ``weight`` for each row bucket,
    keeps the fastest; returns bucket -> what won. Runs at warm-up, before anything is captured.

    Each candidate is timed as a CUDA graph of back-to-back launches, the way a captured step
    runs it (Python's launch cost, high for Triton, is not part of a replayed step), over enough
    copies of the weight that they do not fit in the L2 cache: a step reads each weight once, from
    device memory, and a product timed on one weight that stays in L2 would look faster than it is.
    """
    n, k = weight.shape
    nbytes = weight.numel() * weight.element_size()
    if triton is None or weight.device.type != "cuda" or k % 64 or nbytes < MIN_TUNED_BYTES:
        return {}
    copies = weight_copies(weight)
    by_rows = {rows: _candidates(rows, weight, scale, dtype) for rows in BUCKETS}
    with compile_ahead.compiling("skinny-product candidate"):
        for candidates in by_rows.values():
            for _, tile, fn in candidates:
                if tile is not None:
                    fn(weight)
    won = {}
    for rows, candidates in by_rows.items():
        best: tuple[float, str, Tile | None] = (float("inf"), "cublas", None)
        for name, tile, fn in candidates:
            seconds = graph_time(fn, copies)
            measurements.append((n, k, str(weight.dtype), rows, name, seconds * 1e6))
            if seconds < best[0]:
                best = (seconds, name, tile)
        _choices[(n, k, str(weight.dtype), rows)] = best[2]
        won[rows] = best[1]
    del copies
    torch.cuda.empty_cache()
    return won


def compile_chosen(weight: Tensor, scale: Tensor | None, dtype: torch.dtype) -> None:
    """Launches the tile installed for each of ``weight``'s row buckets once, as ``tune`` launches
    its candidates (inside ``compile_ahead.compiling`` the launches compile and run nothing): a
    start that installed decisions it did not measure (``model/shipped_tuning.py``) compiles only
    the tiles chosen."""
    n, k = weight.shape
    if triton is None or weight.device.type != "cuda" or k % 64:
        return
    for rows in BUCKETS:
        tile = _choices.get((n, k, str(weight.dtype), rows))
        if tile is None:  # cuBLAS, or nothing installed: nothing of ours to compile
            continue
        for _, _, fn in _candidates(rows, weight, scale, dtype, only=tile):
            fn(weight)


def _candidates(rows: int, weight: Tensor, scale: Tensor | None, dtype: torch.dtype,
                only: Tile | None = None) -> list[tuple[str, Tile | None, Callable[[Tensor], object]]]:
    """What ``tune`` times for ``rows`` rows: cuBLAS (not for fp8) and every tile that divides the
    reduction, each as (name, tile or None, a product of a fresh random input with a weight);
    with ``only``, that tile alone."""
    k = weight.shape[1]
    x = torch.randn(rows, k, device=weight.device, dtype=dtype)
    candidates: list[tuple[str, Tile | None, Callable[[Tensor], object]]] = []
    if weight.dtype != FP8 and only is None:
        candidates.append(("cublas", None, lambda w: torch.nn.functional.linear(x, w)))
    for tile in ONE_ROW if rows == 1 else FEW_ROWS:
        if k % tile.block_k == 0 and only in (None, tile):
            candidates.append((f"triton {tile.block_n}x{tile.block_k}/{tile.warps}w{tile.stages}s", tile,
                               lambda w, tile=tile: skinny_linear(x, w, scale, tile)))
    return candidates


def reference(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    """The plain PyTorch meaning of every path: dequantize, then ``F.linear`` (fp32 accumulation)."""
    if scale is None:
        return torch.nn.functional.linear(x, weight.to(x.dtype))
    w = weight.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)
    return torch.nn.functional.linear(x.float(), w).to(x.dtype)


if triton is not None:

    @triton.jit
    def _skinny_kernel(
        x_ptr, w_ptr, s_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_om, K: tl.constexpr,
        HAS_SCALE: tl.constexpr, SCALE_PER_CHANNEL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        col_ok = cols < N
        row_ok = rows < M
        ks = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + cols[:, None] * stride_wn + ks[None, :]
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
        if BLOCK_M == 1:  # noqa: SIM108 - constexpr branch, resolved at compile time
            acc = tl.zeros([BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for _ in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            if BLOCK_M == 1:
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if BLOCK_M == 1:  # noqa: SIM108 - constexpr branch, resolved at compile time
            out = acc[None, :]
        else:
            out = acc
        if HAS_SCALE:
            if SCALE_PER_CHANNEL:
                out = out * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
            else:
                out = out * tl.load(s_ptr)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    _skinny = LaunchMemo(_skinny_kernel)


def skinny_linear(x: Tensor, weight: Tensor, scale: Tensor | None = None, tile: Tile | None = None) -> Tensor:
    """``x [M, K] @ weight[N, K]^T`` (times ``scale`` per output channel or per tensor) in one launch."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tile = tile or (DEFAULT_ONE if m == 1 else DEFAULT_FEW if m <= SKINNY_ROWS else DEFAULT_MANY)
    block_m = 1 if m == 1 else 16 if m <= SKINNY_ROWS else ROW_TILE
    block_n, block_k = tile.block_n, min(tile.block_k, k)
    if block_m > 1:
        block_n = max(16, block_n)  # tl.dot needs 16 columns
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _skinny.launch(
        grid,
        x, weight, scale if scale is not None else weight, out, m, n, x.stride(0), weight.stride(0),
        out.stride(0), K=k, HAS_SCALE=scale is not None, SCALE_PER_CHANNEL=scale is not None and scale.numel() > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=tile.warps, num_stages=tile.stages,
    )
    return out


def linear(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    """The product a model layer asks for, by ``choose``; ``x`` may have leading dimensions."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    tile = choose(flat.shape[0], weight)
    if tile is not None:
        out = skinny_linear(flat.contiguous(), weight, scale, tile)
    elif scale is None and weight.dtype == x.dtype:
        out = torch.nn.functional.linear(flat, weight)
    else:
        out = reference(flat, weight, scale)
    return out.reshape(*lead, weight.shape[0])
