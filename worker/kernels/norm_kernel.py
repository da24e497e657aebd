"""Residual add and RMSNorm in one kernel: ``h = residual + delta; out = rms_norm(h) * weight``.

Every layer adds its attention output and its MLP output to the residual stream and normalises
the sum for what comes next. Done with separate kernels that is three reads and two writes of the
hidden states and two launches; fused it is two reads and two writes in one launch. One program
handles one row. The sum is rounded to the model's dtype before it is normalised, exactly as the
unfused ``h = h + delta; rms_norm(h)`` does, so the two agree to the reduction order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from graphkeeper.worker.kernels import pdl
from graphkeeper.worker.kernels.triton_support import available, tl, triton


def reference(residual: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The unfused meaning: the new residual stream and its normalised form."""
    h = residual + delta
    return h, F.rms_norm(h, (h.shape[-1],), weight, eps)


if triton is not None:
    from graphkeeper.worker.kernels.pdl import await_inputs

    @triton.jit
    def _add_rms_norm_kernel(r_ptr, d_ptr, w_ptr, h_ptr, out_ptr, N, eps, stride_r, stride_d, stride_h,
                             stride_o, BLOCK: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr):
        await_inputs(USE_PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        h = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0)
        if ADD:  # the new residual stream, rounded to the model's dtype, is stored and normalised
            d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
            h = (h.to(tl.float32) + d.to(tl.float32)).to(h.dtype)
            tl.store(h_ptr + row * stride_h + cols, h, mask=ok)
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (hf * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(residual: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``[T, dim]`` residual and delta -> (new residual, normalised), one launch on CUDA."""
    if not available(residual.device) or residual.dim() != 2:
        return reference(residual, delta, weight, eps)
    rows, n = residual.shape
    h = torch.empty_like(residual)
    out = torch.empty_like(residual)
    if rows:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(rows,)](residual, delta, weight, h, out, n, eps, residual.stride(0), delta.stride(0),
                                      h.stride(0), out.stride(0), BLOCK=block, ADD=True,
                                      num_warps=min(16, max(1, block // 512)), **pdl.launch_options())
    return h, out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm(x) * weight`` for ``[T, dim]`` rows, one launch on CUDA (the same kernel, no add)."""
    if not available(x.device) or x.dim() != 2 or x.stride(-1) != 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    rows, n = x.shape
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(rows,)](x, x, weight, x, out, n, eps, x.stride(0), x.stride(0), x.stride(0),
                                      out.stride(0), BLOCK=block, ADD=False, num_warps=min(16, max(1, block // 512)),
                                      **pdl.launch_options())
    return out
