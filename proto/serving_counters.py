"""The inter-token-latency buckets of ``ServingCounters``: one table, shared by the worker that
counts, the stand-in that simulates, and the operator that compares a canary with the rest.

Fixed buckets (not a sketch) so that two readings subtract bucket by bucket: a canary's window is
the difference of two cumulative readings, and a p99 comes from that difference.
"""

from __future__ import annotations

import bisect

#: Upper bounds in seconds, from 0.5 ms to 2 s, about 25% apart at the scale decode steps run.
ITL_BOUNDS_SECONDS: tuple[float, ...] = (
    0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.005, 0.006, 0.0075, 0.01,
    0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0,
)


def itl_bucket(seconds: float) -> int:
    """The bucket that counts a latency of ``seconds`` (the last one past every bound)."""
    return bisect.bisect_left(ITL_BOUNDS_SECONDS, seconds)
