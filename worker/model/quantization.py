"""fp8 weights: the decoder layers' projections stored as float8 e4m3 with float32 scales.

A small-batch decode step is bound by the bytes of weights it reads, so weights of one byte
instead of two make it up to twice as fast. Each projection's weight is scaled so that its
largest magnitude maps to e4m3's largest finite value (448): per output channel (``fp8``, the
default: one scale per row, exact to apply after the dot product) or per tensor
(``fp8-tensor``). The embedding and the LM head stay in the model's dtype (the LM head's logits
decide every token). Products run through ``ops.linear``, which reads fp8 weights on the GPU.
"""

from __future__ import annotations

from torch import Tensor, nn

from graphkeeper.worker.kernels.linear_kernel import FP8

QUANTIZATIONS = ("none", "fp8", "fp8-tensor")
FP8_MAX = 448.0


def quantize(weight: Tensor, per_channel: bool) -> tuple[Tensor, Tensor]:
    """(fp8 weight, float32 scale) with ``weight ~= fp8.float() * scale`` (per row or one value)."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    q = (w / (scale[:, None] if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_model(model: nn.Module, scheme: str) -> int:
    """Replaces every decoder projection's weight by its fp8 form; returns the bytes saved."""
    if scheme == "none":
        return 0
    if scheme not in QUANTIZATIONS:
        raise ValueError(f"quantization {scheme!r} is not one of {', '.join(QUANTIZATIONS)}")
    saved = 0
    for layer in model.layers:
        for linear in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2):
            before = linear.weight.numel() * linear.weight.element_size()
            q, scale = quantize(linear.weight.data, per_channel=scheme == "fp8")
            linear.weight = nn.Parameter(q, requires_grad=False)
            linear.scale = scale
            saved += before - q.numel() * q.element_size()
    return saved
