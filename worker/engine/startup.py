"""What a worker's start spends its time on: the stages of the startup line, status and metric.

The stages are counted from the worker (API) process's start, not the engine core's: the API
process passes its start time to the engine core, which marks its stages on the same wall clock,
and the API process adds the last one (READY reaching it) when it sees READY. So the line reads
what a client polling readiness waits for, and the stages add up to it exactly.

Stages, in order (a stage that does not happen on this worker reads 0 s):

- ``before_engine``: the worker process's interpreter and command line, until it spawns the
  engine core (``engine.spawn``; with ``--no-engine-process``: its imports and flag checks too,
  until the engine is built);
- ``engine_process``: the engine core's interpreter and imports, while the worker process checks
  its flags and imports its servers, until the settings reach it;
- ``engine_setup``: deciding the sizes (with ``--no-engine-process``, binding the servers too);
- ``device_context``, ``weights``, ``kv_cache``, ``tokenizer``;
- ``kernel_tuning`` (or reading it from the cache), ``compile`` (tracing and compiling, or
  loading the compiled code, with the first warm-up step it happens in), ``warm_up`` (the rest
  of building the step);
- ``capture_setup``, ``capture_prime``, ``capture_warm_up``, ``capture_record``,
  ``capture_validate``, ``capture_measure``, ``capture_finish`` (the capture job's parts, as
  ``GraphStatus.capture_parts``) and ``capture_other`` (planning and whatever the parts leave);
  ``after_capture`` (track B's KV cache sized after capture, the step budget from the measured
  steps, the ledger);
- ``ready``: until the API process serves: the engine's READY has reached it and its servers
  listen (they bind while the engine core loads; on a quick start they may finish last).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.gc_pauses import freeze_heap

#: The capture job's parts, in order (worker/executor/graphs/capture.py's CAPTURE_PARTS; a test
#: keeps the two the same, so this module need not import the device side).
CAPTURE_PARTS = ("setup", "prime", "warm_up", "record", "validate", "measure", "finish")

if TYPE_CHECKING:  # the API process imports this module; the step (and Triton) is the engine core's
    from graphkeeper.worker.model.step import CompileReport

log = logging.getLogger(__name__)


def process_age() -> float:
    """Seconds since this process started (Linux's /proc; 0 where it cannot be read)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def process_started_at() -> float:
    """When this process started, in seconds since the epoch (the wall clock both processes share)."""
    return time.time() - process_age()


class StartupClock:
    """The start's stages, each timed from the end of the one before on the wall clock."""

    def __init__(self, process_started: float = 0.0, engine_spawned: float = 0.0) -> None:
        """``process_started``: the worker process's start (0: count from now); ``engine_spawned``:
        when the API process spawned this engine core (0: the engine runs in the worker process)."""
        now = time.time()
        self.started = process_started or engine_spawned or now
        self.stages: list[tuple[str, float]] = []
        self._last = self.started
        if process_started:
            self._mark("before_engine", engine_spawned or now)
        if engine_spawned:
            self._mark("engine_process", now)

    def _mark(self, name: str, at: float) -> None:
        self.stages.append((name, max(0.0, at - self._last)))
        self._last = max(self._last, at)

    def lap(self, name: str) -> None:
        """Ends stage ``name`` now."""
        self._mark(name, time.time())

    def split(self, rest: str, parts: dict[str, float]) -> None:
        """Ends several stages now: the time since the last mark is ``parts`` (measured inside it,
        in order, each at most what is left) and ``rest``, whatever they leave."""
        now = time.time()
        left = max(0.0, now - self._last)
        for name, seconds in parts.items():
            taken = min(max(0.0, seconds), left)
            self.stages.append((name, taken))
            left -= taken
        self.stages.append((rest, left))
        self._last = max(self._last, now)

    def finish(self, report: CompileReport) -> pb.StartupStatus:
        """Ends the engine's last stage and returns the stages with ``report``'s cache outcomes."""
        self.lap("after_capture")
        return self.status(report.cache, report.tuning.cache if report.tuning else "off")

    def status(self, compile_cache: str, tuning_cache: str) -> pb.StartupStatus:
        """The stages so far (the engine's READY), for the API process to finish."""
        return pb.StartupStatus(
            stages=[pb.StartupStage(stage=name, seconds=seconds) for name, seconds in self.stages],
            ready_seconds=self._last - self.started, started_unix_seconds=self.started,
            compile_cache=compile_cache, tuning_cache=tuning_cache, caches=caches(compile_cache, tuning_cache))


def step_parts(report: CompileReport) -> dict[str, float]:
    """Kernel tuning and compile seconds measured inside building the step (pure)."""
    return {"kernel_tuning": report.tuning.seconds if report.tuning is not None else 0.0,
            "compile": report.seconds if report.enabled else 0.0}


def capture_parts(parts: dict[str, float]) -> dict[str, float]:
    """The capture stage by part (``capture_setup`` ... ``capture_finish``; 0 for a part that did
    not run, as on a CPU), in the capture job's order (pure)."""
    return {f"capture_{part}": parts.get(part, 0.0) for part in CAPTURE_PARTS}


def caches(compile_cache: str, tuning_cache: str) -> str:
    """"warm" when every cache used hit, "cold" when one missed or hit in part, "none" when none
    was used (pure). Tuning the worker ships for the GPU counts as a hit: nothing was measured."""
    used = [c for c in (compile_cache, tuning_cache) if c and c != "off"]
    if not used:
        return "none"
    return "warm" if all(c in ("hit", "shipped") for c in used) else "cold"


def finish(engine_ready: pb.StartupStatus, seen_at: float) -> pb.StartupStatus:
    """The engine's stages plus ``ready``: until the API process saw READY at ``seen_at`` (pure)."""
    done = pb.StartupStatus()
    done.CopyFrom(engine_ready)
    end = done.started_unix_seconds + done.ready_seconds
    done.stages.add(stage="ready", seconds=max(0.0, seen_at - end))
    done.ready_seconds = max(done.ready_seconds, seen_at - done.started_unix_seconds)
    return done


def line(status: pb.StartupStatus) -> str:
    """``startup: before_engine 2.1 s, ...; READY 13.0 s after the worker process started (caches warm: ...)``."""
    stages = ", ".join(f"{s.stage} {s.seconds:.1f} s" for s in status.stages)
    return (f"startup: {stages}; READY {status.ready_seconds:.1f} s after the worker process started (caches "
            f"{status.caches}: compile {status.compile_cache}, kernel tuning {status.tuning_cache})")


class ReadyReport:
    """Finishes the start's record once the API process serves: it has seen the engine's first
    READY and its servers listen, whichever comes last (the servers bind while the engine core
    loads). Then ``engine.startup`` gets its ``ready`` stage, the line is logged and the metrics set,
    once (a recapture's READY is not a start)."""

    def __init__(self, engine, metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._lock = threading.Lock()
        self._ready = self._listening = self._done = False
        engine.lifecycle.subscribe(self._on_state)

    def _on_state(self, state: int) -> None:
        if state == pb.LIFECYCLE_STATE_READY and self.engine.startup.stages:
            self._finish_when(ready=True)

    def listening(self) -> None:
        """The worker's servers are bound and answer (called once, by the worker's main)."""
        self._finish_when(listening=True)

    def _finish_when(self, ready: bool = False, listening: bool = False) -> None:
        with self._lock:
            self._ready |= ready
            self._listening |= listening
            if self._done or not (self._ready and self._listening):
                return
            self._done = True
            self.engine.startup = finish(self.engine.startup, time.time())
        self.metrics.set_startup(self.engine.startup)
        log.info(line(self.engine.startup))
        freeze_heap()  # this process serves from here: what it built before is never walked again
