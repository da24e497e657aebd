"""The few operations whose implementation the worker chooses: linear layers and the residual add
with RMSNorm. The model calls these and nothing else for them, so which kernel runs is decided here.

- ``linear``: a registered custom op (``graphkeeper::linear``), so a compiled step calls it as one
  opaque kernel at any batch size and ``linear_kernel.choose`` picks the implementation per call,
  without a guard or a recompile on the row count.
- ``add_rms_norm``: the fused Triton kernel when the step runs uncompiled on CUDA; plain PyTorch
  when compiled, because Inductor fuses the add and the norm itself (and with what surrounds them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from graphkeeper.worker.kernels import linear_kernel, norm_kernel
from graphkeeper.worker.kernels.triton_support import triton


@torch.library.custom_op("graphkeeper::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, scale: Tensor | None) -> Tensor:
    return linear_kernel.linear(x, weight, scale)


@_linear_op.register_fake
def _(x: Tensor, weight: Tensor, scale: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    """``x @ weight.T`` (dequantized by ``scale``); plain ``F.linear`` where nothing else applies.

    Only code being compiled goes through the custom op: called eagerly (the uncompiled step, the
    LM head after a replay) the op's dispatch would be Python overhead on the step's hot path.
    """
    if x.device.type != "cuda" and scale is None:
        return F.linear(x, weight)
    if torch.compiler.is_compiling():
        return _linear_op(x, weight, scale)
    return linear_kernel.linear(x, weight, scale)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@dataclass(frozen=True)
class Kernels:
    """What the model's pieces call; chosen once per model by ``choose_kernels``."""

    name: str
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]] = norm_kernel.reference


def choose_kernels(device_type: str, compiled: bool) -> Kernels:
    """Fused Triton add+norm for uncompiled CUDA steps; plain PyTorch for compiled steps
    (Inductor fuses them) and off the GPU."""
    if device_type == "cuda" and not compiled and triton is not None:
        return Kernels("triton-add-rmsnorm", norm_kernel.add_rms_norm)
    return Kernels("inductor" if compiled else "torch")
