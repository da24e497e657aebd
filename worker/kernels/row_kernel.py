"""One-row decode products with what surrounds them fused in: the batch-1 step's projections.

A batch-1 decode step reads every weight once and does almost nothing else, so its time is the
weights' bytes over the memory bandwidth plus whatever separates one weight stream from the next:
kernel launches, the small norm, RoPE, activation and residual kernels between the projections,
and each kernel's ramp up to full bandwidth. This kernel computes one row ``x @ W^T`` with those
neighbours folded in, so a decoder layer is four weight streams and the attention:

- ``norm``: ``x`` is RMS-normalised (times the norm weight) in the prologue; every program
  normalises the row itself (a few KiB, from L1/L2), so no kernel writes the normalised row;
- ``residual``: the output is ``residual + x @ W^T`` (the residual stream's add);
- ``glu``: ``W`` holds gate and up rows (``w13``); each program computes a band of both and writes
  ``silu(gate) * up``;
- ``rope``: ``W`` is the fused QKV projection; each program computes a band of a head's first
  half and the partner band of its second half and rotates query and key heads.

Each program holds its whole band of ``W`` (every column of the reduction) in registers, loaded
before anything else. Under programmatic dependent launch (``pdl``) those loads are issued while
the previous kernel finishes; the program then waits for it (``griddepcontrol.wait``) before it
reads the activations, and lets the next kernel launch. Rounding follows the unfused ops: the
product is rounded to the model's dtype before the residual add, the activation and RoPE.

``tune`` times the tiles that fit on this GPU for each projection shape; ``row_linear`` uses the
winner (or ``DEFAULT`` until tuned).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from graphkeeper.worker.kernels import compile_ahead, pdl
from graphkeeper.worker.kernels.timing import graph_time, weight_copies
from graphkeeper.worker.kernels.triton_support import tl, triton

#: What a program may hold in registers: band rows times the padded reduction length, and at most
#: this many weight elements per thread (more spills).
MAX_TILE_ELEMENTS = 32768
MAX_THREAD_ELEMENTS = 128
#: Longest reduction the kernel takes (its whole band is one tile).
MAX_K = 16384
PLAIN, GLU, ROPE = 0, 1, 2


@dataclass(frozen=True)
class RowTile:
    """Rows of ``W`` per band (a program computes one band, two in GLU/RoPE) and warps."""

    block_n: int
    warps: int


DEFAULT = RowTile(2, 8)
CANDIDATES = tuple(RowTile(n, w) for n in (1, 2, 4, 8, 16) for w in (2, 4, 8))

#: What tuning measured: (mode, n, k, weight dtype) -> the fastest tile.
_choices: dict[tuple[int, int, int, str], RowTile] = {}


#: Activation dtypes the kernel serves. Not float32: a float32 step must give the same result at
#: every batch size, and larger batches run the other kernels.
DTYPES = (torch.bfloat16, torch.float16)


def supports(k: int, dtype: torch.dtype) -> bool:
    """Whether a one-row product of reduction length ``k`` in ``dtype`` runs here (pure)."""
    return 0 < k <= MAX_K and dtype in DTYPES


def fits(tile: RowTile, mode: int, k: int, half: int = 0) -> bool:
    """Whether ``tile`` holds its bands for a reduction of ``k`` (and divides a RoPE half-head)."""
    bands = 1 if mode == PLAIN else 2
    if mode == ROPE and half % tile.block_n:
        return False
    return bands * tile.block_n * _pow2(k) <= min(MAX_TILE_ELEMENTS, MAX_THREAD_ELEMENTS * 32 * tile.warps)


def _pow2(k: int) -> int:
    return 1 << max(0, k - 1).bit_length()


def tile_for(mode: int, weight: Tensor, half: int = 0) -> RowTile:
    """The tuned tile for this product, else the largest default-like tile that fits."""
    n, k = weight.shape
    tile = _choices.get((mode, n, k, str(weight.dtype)))
    if tile is not None:
        return tile
    for block_n in (DEFAULT.block_n, 1):
        tile = RowTile(block_n, DEFAULT.warps)
        if fits(tile, mode, k, half):
            return tile
    raise ValueError(f"no row tile fits a reduction of {k}")


if triton is not None:
    from graphkeeper.worker.kernels.pdl import await_inputs

    @triton.jit
    def _band_product(w, x, s_ptr, cols, ok, HAS_SCALE: tl.constexpr, PER_CHANNEL: tl.constexpr, dtype):
        """One band's outputs: the dot products, dequantized, rounded to the model's dtype."""
        y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_SCALE and PER_CHANNEL:
            y = y * tl.load(s_ptr + cols, mask=ok, other=0.0)
        elif HAS_SCALE:
            y = y * tl.load(s_ptr)
        return y.to(dtype).to(tl.float32)

    @triton.jit
    def _row_kernel(
        x_ptr, norm_ptr, w_ptr, s_ptr, res_ptr, cos_ptr, sin_ptr, out_ptr, N, eps,
        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
        HALF: tl.constexpr, ROPE_COLS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
        HAS_SCALE: tl.constexpr, PER_CHANNEL: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < K
        band = tl.arange(0, BLOCK_N)
        if MODE == 2:  # RoPE: a band of a head's first half; its partner band is HALF columns on
            per_head = HALF // BLOCK_N
            cols_a = (pid // per_head) * 2 * HALF + (pid % per_head) * BLOCK_N + band
            cols_b = cols_a + HALF
        else:  # plain: one band; GLU: gate rows [0, N) and up rows [N, 2N)
            cols_a = pid * BLOCK_N + band
            cols_b = cols_a + N
        a_ok = cols_a < N
        # The weights first: they do not depend on the previous kernel.
        w_a = tl.load(w_ptr + cols_a[:, None] * K + ks[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        if MODE != 0:
            b_ok = cols_b < (2 * N if MODE == 1 else N)
            w_b = tl.load(w_ptr + cols_b[:, None] * K + ks[None, :], mask=b_ok[:, None] & k_ok[None, :],
                          other=0.0)
        await_inputs(USE_PDL)
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:  # rms_norm: normalised and rounded, then times the weight and rounded
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
            g = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = ((x * rstd).to(dtype).to(tl.float32) * g).to(dtype).to(tl.float32)
        y_a = _band_product(w_a, x, s_ptr, cols_a, a_ok, HAS_SCALE, PER_CHANNEL, dtype)
        if MODE == 0:
            if RESIDUAL:
                y_a = y_a + tl.load(res_ptr + cols_a, mask=a_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + cols_a, y_a.to(dtype), mask=a_ok)
        else:
            y_b = _band_product(w_b, x, s_ptr, cols_b, b_ok, HAS_SCALE, PER_CHANNEL, dtype)
            if MODE == 1:  # silu(gate) rounded, times up
                act = (y_a / (1.0 + tl.exp(-y_a))).to(dtype).to(tl.float32)
                tl.store(out_ptr + cols_a, (act * y_b).to(dtype), mask=a_ok)
            else:
                if (pid // (HALF // BLOCK_N)) * 2 * HALF < ROPE_COLS:  # a query or key head
                    d = cols_a % (2 * HALF)
                    cos_a = tl.load(cos_ptr + d).to(tl.float32)
                    cos_b = tl.load(cos_ptr + d + HALF).to(tl.float32)
                    sin_a = tl.load(sin_ptr + d).to(tl.float32)  # signed: -sin in the first half
                    sin_b = tl.load(sin_ptr + d + HALF).to(tl.float32)
                    rot_a = y_a * cos_a + y_b * sin_a
                    rot_b = y_b * cos_b + y_a * sin_b
                    y_a, y_b = rot_a, rot_b
                tl.store(out_ptr + cols_a, y_a.to(dtype), mask=a_ok)
                tl.store(out_ptr + cols_b, y_b.to(dtype), mask=b_ok)


def row_linear(
    x: Tensor, weight: Tensor, scale: Tensor | None = None, *, norm: Tensor | None = None, eps: float = 0.0,
    residual: Tensor | None = None, glu: bool = False, rope: tuple[Tensor, Tensor, int, int] | None = None,
    tile: RowTile | None = None,
) -> Tensor:
    """One row ``[1, K]`` through ``weight [N, K]`` with the fused prologue and epilogue above.

    ``rope`` is ``(cos, sin_signed, rotated columns, head_dim)``: cos/sin ``[1, head_dim]`` for
    the row's position, and the first ``rotated columns`` outputs (query and key heads) rotated.
    Returns ``[1, N]`` (``[1, N / 2]`` with ``glu``).
    """
    n_w, k = weight.shape
    mode = GLU if glu else ROPE if rope is not None else PLAIN
    n = n_w // 2 if glu else n_w
    half = rope[3] // 2 if rope is not None else 0
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    tile = tile or tile_for(mode, weight, half)
    if mode == ROPE:
        grid = (n // (2 * tile.block_n),)
        cos, sin = rope[0], rope[1]
    else:
        grid = (triton.cdiv(n, tile.block_n),)
        cos = sin = x
    compile_ahead.launcher(_row_kernel, grid)(
        x, norm if norm is not None else x, weight, scale if scale is not None else x,
        residual if residual is not None else x, cos, sin, out, n, eps,
        K=k, BLOCK_K=_pow2(k), BLOCK_N=tile.block_n, MODE=mode, HALF=max(half, 1),
        ROPE_COLS=rope[2] if rope is not None else 0, NORM=norm is not None, RESIDUAL=residual is not None,
        HAS_SCALE=scale is not None, PER_CHANNEL=scale is not None and scale.numel() > 1,
        num_warps=tile.warps, **pdl.launch_options(),
    )
    return out


#: Every timing tuning took: (mode, n, k, weight dtype, candidate, microseconds), for benchmarks.
measurements: list[tuple[int, int, int, str, str, float]] = []


def tune(mode: int, weight: Tensor, scale: Tensor | None, dtype: torch.dtype, half: int = 0) -> RowTile:
    """Times every tile that fits on ``weight`` for ``mode`` and keeps the fastest, as CUDA graphs
    of back-to-back launches over weight copies that leave L2 (``timing.graph_time``)."""
    n_w, k = weight.shape
    key = (mode, n_w, k, str(weight.dtype))
    copies = weight_copies(weight)
    best: tuple[float, RowTile | None] = (float("inf"), None)
    runs = _runs(mode, weight, scale, dtype, half, CANDIDATES)
    with compile_ahead.compiling("row-product candidate"):
        for run in runs.values():
            run(weight)
    for tile, run in runs.items():
        seconds = graph_time(run, copies)
        measurements.append((mode, n_w, k, str(weight.dtype), f"{tile.block_n}n/{tile.warps}w", seconds * 1e6))
        if seconds < best[0]:
            best = (seconds, tile)
    del copies
    torch.cuda.empty_cache()
    if best[1] is None:
        raise ValueError(f"no row tile fits a reduction of {k}")
    _choices[key] = best[1]
    return best[1]


def _runs(mode: int, weight: Tensor, scale: Tensor | None, dtype: torch.dtype, half: int,
          tiles: tuple[RowTile, ...]) -> dict[RowTile, functools.partial]:
    """A product of one fresh random row with a weight for each of ``tiles`` that fits ``mode``."""
    n_w, k = weight.shape
    x = torch.randn(1, k, device=weight.device, dtype=dtype)
    norm = torch.ones(k, device=weight.device, dtype=dtype) if mode != PLAIN else None
    residual = torch.randn(1, n_w, device=weight.device, dtype=dtype) if mode == PLAIN else None
    rope = None
    if mode == ROPE:
        cs = torch.ones(1, 2 * half, device=weight.device, dtype=dtype)
        rope = (cs, cs, n_w // 2, 2 * half)
    return {tile: functools.partial(row_linear, x, scale=scale, norm=norm, eps=1e-5, residual=residual,
                                    glu=mode == GLU, rope=rope, tile=tile)
            for tile in tiles if fits(tile, mode, k, half)}


def compile_chosen(mode: int, weight: Tensor, scale: Tensor | None, dtype: torch.dtype, half: int = 0) -> None:
    """Launches the tile installed for ``weight`` in ``mode`` once, as ``tune`` launches its
    candidates (inside ``compile_ahead.compiling`` it only compiles): a start that installed
    decisions it did not measure (``model/shipped_tuning.py``) compiles only the tiles chosen."""
    tile = _choices.get((mode, *weight.shape, str(weight.dtype)))
    if tile is not None:
        for run in _runs(mode, weight, scale, dtype, half, (tile,)).values():
            run(weight)


def remember(mode: int, n: int, k: int, weight_dtype: str, tile: RowTile) -> None:
    """Installs a tuning result read back from the tuning cache."""
    _choices[(mode, n, k, weight_dtype)] = tile


def choices() -> dict[tuple[int, int, int, str], RowTile]:
    return dict(_choices)
