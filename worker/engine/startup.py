"""What a worker's start spends its time on, for the one startup log line."""

from __future__ import annotations

import os
import time
from pathlib import Path

from graphkeeper.worker.model.step import CompileReport


class Laps:
    """Named phases of the start, each timed from the end of the one before."""

    def __init__(self) -> None:
        self.laps = [("before the engine", process_age())]
        self._began = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.append((name, now - self._began))
        self._began = now

    def line(self) -> str:
        """``startup: device context 0.1 s, ...; READY 13.0 s after the process started``."""
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.laps)
        return f"startup: {phases}; READY {process_age():.1f} s after the process started"


def process_age() -> float:
    """Seconds since this process started (Linux's /proc; 0 where it cannot be read)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def step_phases(report: CompileReport) -> str:
    """What building the step spent its time on, for the startup log line (pure)."""
    parts = []
    if report.tuning is not None:
        parts.append(f"tuning {report.tuning.seconds:.1f} s, cache {report.tuning.cache}")
    if report.enabled:
        parts.append(f"compile {report.seconds:.1f} s, cache {report.cache}")
    return "; ".join(parts) or "no tuning or compilation"
