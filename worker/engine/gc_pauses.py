"""The garbage collector's pauses: frozen out of the heap built before serving, timed when they happen.

Python's cyclic collector stops the thread that triggers it while it walks every object tracked
in the generations it collects. The oldest generation holds everything a worker process built
before serving: torch, the model's modules, the compiled step's and Triton's wrappers, the
servers, a few hundred thousand objects, so one full collection under load stalls whatever
triggered it by tens of milliseconds (60 ms for torch's import alone on a 2-core CPU). Requests
come and go by the thousand, and what they leave behind triggers such collections every few
seconds: in the engine core, a step far past its predicted time (on an H100, long-prompt steps'
p99 was 19 ms against an 8.7 ms ceiling, and 9.6 ms once frozen); in the API process, every
stream's writes held up at once.

Two parts, each called from one line:

- ``freeze_heap``: collects once, then moves everything alive into the permanent generation
  (``gc.freeze``), which the collector no longer walks; what serving allocates afterwards is
  collected as before. The engine calls it before its first capture phase (the phase's own
  collections then walk only what it allocates) and after every capture phase (the first READY,
  each recapture), the API process once it serves (``ReadyReport``); vLLM's engine core freezes its
  startup heap the same way. What an earlier freeze kept and has died since (a reload's old
  model) is collected by the next one (``gc.unfreeze`` first).
- ``GcPauses``: every collection of the process is timed (``gc.callbacks``) into
  ``graphkeeper_gc_pause_seconds{process, generation}``, so a pause that still stalls serving is
  seen and named, not guessed at. One watcher per process: the engine's, and the API process's
  only where the engine core runs in a process of its own.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Histogram

#: Label values of graphkeeper_gc_pause_seconds{process}: the engine core's process (the whole
#: worker's when the engine runs in the API process), and the API process's.
GC_PROCESSES = ("engine", "api")
#: Label values of graphkeeper_gc_pause_seconds{generation}: the oldest generation collected.
GC_GENERATIONS = ("0", "1", "2")


def freeze_heap() -> int:
    """Collects everything (earlier frozen objects included), then freezes what is alive; returns
    how many objects are frozen now."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Times each collection of this process into a histogram by generation."""

    def __init__(self, histogram: Histogram, process: str) -> None:
        assert process in GC_PROCESSES, process
        self.process = process
        self.series = {generation: histogram.labels(process, generation) for generation in GC_GENERATIONS}
        self._started: float | None = None

    def install(self) -> GcPauses:
        """Registers the callback (tests run several engines in one process: each times the same
        pauses into its own registry)."""
        gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks`` entry: the start stamps the time, the stop observes the pause. Runs
        inside the collector, on whichever thread triggered it: nothing here allocates much."""
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            generation = GC_GENERATIONS[min(int(info.get("generation", 2)), 2)]
            self.series[generation].observe(time.perf_counter() - self._started)
            self._started = None
