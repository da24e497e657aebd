"""Graph memory as the caching allocator holds it: the bytes of a graph pool's own segments.

A graph set records into one private pool; the allocator knows every segment it holds and to which
pool each belongs (``torch.cuda.memory_snapshot()``'s ``segment_pool_id``). Summing a pool's
segments gives what its graphs hold, whatever else the device holds at the same time: a second
model loaded beside the first during a reload, or the old model's memory freed after the baseline
was read, cannot make it zero or negative, as a difference of device-wide readings could.

What the pool does not hold is reported apart, by name: the piece buffers (tensors of the regular
pool) and what sits outside the allocator (graph executables, library workspaces), which only a
device-wide reading sees.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

#: The regular (non-graph) pool's id in the allocator's snapshot.
REGULAR_POOL = (0, 0)


def bytes_by_pool(segments: Iterable[Mapping[str, Any]]) -> dict[tuple[int, int], int]:
    """Segment bytes by pool id (pure: tests give it a snapshot's segments)."""
    out: dict[tuple[int, int], int] = {}
    for seg in segments:
        pool = tuple(seg.get("segment_pool_id") or REGULAR_POOL)
        out[pool] = out.get(pool, 0) + int(seg["total_size"])
    return out


def snapshot_by_pool() -> dict[tuple[int, int], int]:
    """What the allocator holds now, by pool (its unused cache included: callers settle first)."""
    return bytes_by_pool(torch.cuda.memory_snapshot())


def pool_bytes(pool: tuple[int, int]) -> int:
    """Bytes the allocator holds in ``pool``'s segments."""
    return snapshot_by_pool().get(tuple(pool), 0)

