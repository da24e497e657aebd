"""Torch's CPU threads from the CPUs this process may really use: the cgroup's CPU quota.

Torch sizes its pool from the CPUs it sees (``os.cpu_count``), not from the container's quota: a
pod limited to 2 CPUs on a 64-core node ran 64 threads that the kernel throttled in turn (on a
loaded 2-core machine: 1.0 tokens/s with torch's default, 6.4 with one thread). The engine core
sets ``torch.set_num_threads`` from the quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``),
the CPU affinity and ``OMP_NUM_THREADS`` when a user set it, whichever is lowest.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)
CGROUP = Path("/sys/fs/cgroup")


def quota_cpus(cpu_max: str | None, cfs_quota: str | None = None, cfs_period: str | None = None) -> float | None:
    """CPUs a cgroup's quota allows (None: no quota), from the files' text (pure)."""
    if cpu_max:
        quota, _, period = cpu_max.strip().partition(" ")
        if quota != "max" and quota.isdigit() and period.strip().isdigit() and int(period) > 0:
            return int(quota) / int(period)
        return None
    if cfs_quota and cfs_period:
        q, p = int(cfs_quota.strip()), int(cfs_period.strip())
        return q / p if q > 0 and p > 0 else None
    return None


def thread_count(quota: float | None, affinity: int, omp: str | None) -> int:
    """Threads torch should run: the quota rounded up, within the affinity, and never more
    than ``OMP_NUM_THREADS`` (pure)."""
    threads = affinity
    if quota is not None:
        threads = min(threads, max(1, math.ceil(quota)))
    if omp and omp.strip().isdigit() and int(omp) > 0:
        threads = min(threads, int(omp))
    return max(1, threads)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def size_torch_threads() -> int:
    """Sets torch's intra-op threads for this process; returns the count."""
    import torch

    quota = quota_cpus(_read(CGROUP / "cpu.max"), _read(CGROUP / "cpu" / "cpu.cfs_quota_us"),
                       _read(CGROUP / "cpu" / "cpu.cfs_period_us"))
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = thread_count(quota, affinity, os.environ.get("OMP_NUM_THREADS"))
    if threads != torch.get_num_threads():
        log.info("torch CPU threads: %d (CPU quota %s, %d CPUs in affinity)", threads,
                 "none" if quota is None else f"{quota:g}", affinity)
        torch.set_num_threads(threads)
    return threads
