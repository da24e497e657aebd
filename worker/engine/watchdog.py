"""The step-loop watchdog: a worker whose engine holds work and makes no progress is not ready.

The lifecycle says what the engine means to do (READY: serving); it cannot say that the step
loop is stuck (an engine core stopped by a signal, a step that never returns, a read that
blocks): health said SERVING for 80 s while every request hit its deadline. The watchdog sees
what clients see: the engine has work (streams not yet ended) and for ``stall_seconds`` no
stream got a token or a completion. Then gRPC health is NOT_SERVING and ``/readyz`` and the HTTP
``/health`` answer 503, so the kubelet takes the pod out of its Service and gateways send
elsewhere; the first token after it makes the worker ready again. Liveness is not tied to it: a
wedged engine is out of traffic at once, and a stall that lasts ``restart_factor`` times the
limit fails ``/healthz`` too (the kubelet restarts the pod).

Idle is never a stall: the clock starts when work appears, or at the last progress if later.
Refusals (a full queue) end streams without progress and do not count: an attacker flooding a
wedged engine cannot make it look alive.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from graphkeeper.proto import worker_pb2 as pb

#: A step (a long prefill chunk on a CPU, a recapture's eager steps) stays well under this.
DEFAULT_STALL_SECONDS = 30.0
#: /healthz fails once a stall has lasted this many times the limit.
RESTART_FACTOR = 4.0


def stalled_for(now: float, pending_since: float | None, last_progress: float) -> float:
    """Seconds the engine has held work without progress (0.0 when it holds none)."""
    if pending_since is None:
        return 0.0
    return max(0.0, now - max(pending_since, last_progress))


def progressed(updates: list[tuple[Any, list[int], Any]]) -> bool:
    """Whether a batch of stream updates is progress: a token, or a stream that completed
    (a refusal or an error ending a stream is not)."""
    return any(tokens or isinstance(end, pb.Completion) for _, tokens, end in updates)


class StepWatchdog:
    """Progress is noted from the engine's publish (any thread); ``poll`` (the API process's
    main loop, a few times a second) decides, and tells its listeners when the verdict moves."""

    DEFAULT_STALL = DEFAULT_STALL_SECONDS

    def __init__(self, pending: Callable[[], int], stall_seconds: float = DEFAULT_STALL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pending = pending
        self.stall_seconds = stall_seconds
        self.clock = clock
        self.last_progress = clock()
        self.pending_since: float | None = None
        self.stalled = False
        self._listeners: list[Callable[[bool], None]] = []
        self._lock = threading.Lock()

    def subscribe(self, listener: Callable[[bool], None]) -> None:
        self._listeners.append(listener)

    def wrap(self, publish: Callable[[list], None]) -> Callable[[list], None]:
        """``publish`` that notes progress first."""
        def noted(updates: list) -> None:
            if progressed(updates):
                self.last_progress = self.clock()
            publish(updates)
        return noted

    def stall_seconds_now(self) -> float:
        return stalled_for(self.clock(), self.pending_since, self.last_progress)

    def wedged(self) -> bool:
        """A stall long enough that the pod should be restarted (``/healthz``)."""
        return self.stall_seconds_now() > self.stall_seconds * RESTART_FACTOR

    def poll(self) -> bool:
        """Updates the verdict; returns whether the engine is stalled now."""
        with self._lock:
            now = self.clock()
            if self.pending() <= 0:
                self.pending_since = None
            elif self.pending_since is None:
                self.pending_since = now
            stalled = stalled_for(now, self.pending_since, self.last_progress) > self.stall_seconds
            changed, self.stalled = stalled != self.stalled, stalled
        if changed:
            for listener in self._listeners:
                listener(stalled)
        return stalled


def in_process_pending(engine: Any) -> int:
    """Work an in-process ``Engine`` holds: running, waiting and submitted sequences (each read
    is one ``len`` of a collection only the engine thread changes)."""
    return len(engine.scheduler.running) + len(engine.scheduler.waiting) + len(engine.mailbox)


def ready(engine: Any, watchdog: StepWatchdog | None) -> bool:
    """The one readiness rule every probe answers: the lifecycle serves, the engine has not
    failed, a model is loaded, and the step loop is not stalled."""
    return (engine.lifecycle.serving and engine.failed is None and engine.limits() is not None
            and not (watchdog is not None and watchdog.stalled))
