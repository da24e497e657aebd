"""Triton, where it is installed: the one import guard for every kernel module.

CPU-only installs (and CI) have no Triton; the kernel modules define their ``@triton.jit``
functions only when ``triton`` is not None, and callers ask ``available(device)`` before a launch,
falling back to PyTorch.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton
    triton = None
    tl = None


def available(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``."""
    return triton is not None and device.type == "cuda"
