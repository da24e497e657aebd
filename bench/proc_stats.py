"""What a benchmark reads of a process from ``/proc``: its CPU time, alone or with its descendants.

CPU time, not wall time, is what shows a process is (or is not) the limit of a run: a process near
a whole core sets the pace, one far below it waits.
"""

from __future__ import annotations

import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system, every thread) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime, fields 14 and 15 of proc(5)


def tree_cpu_seconds(pid: int) -> dict[int, float]:
    """``cpu_seconds`` of ``pid`` and of each of its descendants, by pid; a process that is gone
    is left out."""
    try:
        out = {pid: cpu_seconds(pid)}
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    except (OSError, ValueError):
        return {}
    for child in children:
        out.update(tree_cpu_seconds(child))
    return out


def host_cpu(cpuinfo: str | None = None) -> str:
    """The host's CPU model and how many this process may use, e.g. ``"AMD EPYC 9654 96-Core
    Processor x16"``: two GPU machines of one card model can differ in their host, and a figure
    the engine thread sets the pace of moves with it. ``cpuinfo``: ``/proc/cpuinfo``'s text
    (read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), "unknown CPU")
    return f"{model} x{len(os.sched_getaffinity(0))}"
