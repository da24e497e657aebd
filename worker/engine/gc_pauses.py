"""The engine's garbage-collector pauses: frozen out of the startup heap, timed when they happen.

Python's cyclic collector stops the thread that triggers it while it walks every object tracked
in the generations it collects. The oldest generation holds everything the process built before
serving: torch, the model's modules, the compiled step's and Triton's wrappers, a few hundred
thousand objects, so one full collection under load stalls the step that triggered it by tens of
milliseconds (60 ms for torch's import alone on a 2-core CPU). Requests come and go by the
thousand, and the objects they leave behind trigger such collections every few seconds: a step
far past its predicted time, and an inter-token gap far past the target, with no cause a step
metric shows.

Two parts, each called from one line of the engine:

- ``freeze_heap`` after every capture phase (the first READY, each recapture): collects once, then
  moves everything alive into the permanent generation (``gc.freeze``), which the collector no
  longer walks; what serving allocates afterwards is collected as before. vLLM's engine core freezes
  its startup heap the same way. A reload's old model, frozen earlier, is thawed and collected by
  the next phase's freeze (``gc.unfreeze`` first).
- ``GcPauses.install``: every collection in the engine's process is timed (``gc.callbacks``) into
  ``graphkeeper_engine_gc_pause_seconds{generation}``, so a pause that still stalls a step is seen
  and named, not guessed at.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Histogram

#: Label values of graphkeeper_engine_gc_pause_seconds{generation}: the oldest generation collected.
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

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self._started: float | None = None
        for generation in GC_GENERATIONS:
            histogram.labels(generation)

    def install(self) -> GcPauses:
        """Registers the callback (once per process would do; a second watcher times the same
        pauses into its own histogram: tests run several engines in one process)."""
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
            generation = str(min(int(info.get("generation", 2)), 2))
            self.histogram.labels(generation).observe(time.perf_counter() - self._started)
            self._started = None
