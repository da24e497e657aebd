"""Small per-step host arrays on their way to the device, without stalling the host.

A step's sampling and logits-processing parameters (temperatures, seeds, penalty counts, grammar
masks, row indices) are numpy arrays built on the host for each step. Copied straight from
pageable memory, a copy may make the driver wait for the work already queued on the stream
(a blocking ``.to(device)`` always does): the host would stall behind the forward pass it has
just launched, and the next step's host work would no longer overlap the device. Staged through
pinned memory (torch's caching host allocator, which keeps a block until its copy has run) the
copy is queued like any kernel and the host goes on at once.

The bytes reach the pinned block by numpy's copy, not torch's: torch copies a large CPU tensor
(a step's grammar masks are half a megabyte at a 128k vocabulary) on its pool of CPU threads,
whose OpenMP threads then spin waiting for more work, so a copy every step keeps them spinning.
On a 2-core machine the same copy every 4 ms kept 0.92 cores busy through torch and 0.04 through
numpy; with JSON-schema requests in the batch, the H200's engine-core process (a pool of 16
threads) used 13-15 cores where plain batches use one (`bench/results/sampling-h200.md`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def pinned_masks(shape: tuple[int, int]) -> tuple[np.ndarray, Tensor]:
    """An empty pinned int32 host tensor and its numpy view, for a step's grammar masks
    (``logits_state.use_mask_buffer``): llguidance writes the view, ``to_device`` copies the
    tensor as it is. The masks are half a megabyte a step at a 128k vocabulary; this skips a fresh
    array and a staging copy of it. torch's caching host allocator hands the block out again only
    once the copy that read it has run."""
    tensor = torch.empty(shape, dtype=torch.int32, pin_memory=True)
    return tensor.numpy(), tensor


def to_device(array: np.ndarray | Tensor, device: torch.device) -> Tensor:
    """``array`` as a tensor on ``device``, queued without a host stall (the same tensor, sharing
    the array's memory, on a CPU device). A pinned CPU tensor (``pinned_masks``) is copied as it is."""
    if isinstance(array, Tensor):
        if device.type != "cuda":
            return array
        if array.is_pinned():
            return array.to(device, non_blocking=True)
        array = array.numpy()
    array = np.ascontiguousarray(array)
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)  # torch's caching host allocator
    np.copyto(pinned.numpy(), array)  # one thread; torch's copy would wake its spinning pool
    return pinned.to(device, non_blocking=True)


def to_device_all(arrays: list[np.ndarray], device: torch.device) -> list[Tensor]:
    """Arrays of one dtype as tensors on ``device``, through one copy: joined on the host, copied
    once, split on the device into views of their shapes. A step's logits processing sends a
    dozen small arrays; each copy costs the host a pinned allocation and a launch."""
    if not arrays:
        return []
    joined = to_device(np.concatenate([a.reshape(-1) for a in arrays]), device)
    parts = joined.split([a.size for a in arrays])  # one dispatch for every view
    return [part if a.ndim == 1 else part.view(a.shape) for part, a in zip(parts, arrays, strict=True)]
