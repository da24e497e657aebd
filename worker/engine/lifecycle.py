"""The worker's lifecycle: which state may follow which.

``LOADING -> MODEL_LOADED -> WARMED -> CAPTURED -> READY``, then ``RECAPTURING`` (back to
``READY`` when the new graphs are in), ``SLEEPING`` (after a Sleep; back to ``READY`` on a wake)
and ``DRAINING`` at shutdown. A transition the table does not allow is a bug, raised rather than
logged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import lifecycle_name

S = pb.LifecycleState
ALLOWED: dict[int, frozenset[int]] = {
    S.LIFECYCLE_STATE_LOADING: frozenset({S.LIFECYCLE_STATE_MODEL_LOADED, S.LIFECYCLE_STATE_DRAINING}),
    S.LIFECYCLE_STATE_MODEL_LOADED: frozenset({S.LIFECYCLE_STATE_WARMED, S.LIFECYCLE_STATE_DRAINING}),
    S.LIFECYCLE_STATE_WARMED: frozenset({S.LIFECYCLE_STATE_CAPTURED, S.LIFECYCLE_STATE_DRAINING}),
    S.LIFECYCLE_STATE_CAPTURED: frozenset({S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_DRAINING}),
    S.LIFECYCLE_STATE_READY: frozenset({S.LIFECYCLE_STATE_RECAPTURING, S.LIFECYCLE_STATE_SLEEPING,
                                        S.LIFECYCLE_STATE_DRAINING}),
    S.LIFECYCLE_STATE_RECAPTURING: frozenset({S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_DRAINING}),
    S.LIFECYCLE_STATE_SLEEPING: frozenset({S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_DRAINING}),
    S.LIFECYCLE_STATE_DRAINING: frozenset(),
}
#: States in which the inference service reports SERVING (Kubernetes readiness) and requests are
#: taken. SLEEPING is one: a request sent to a sleeping worker is queued and wakes it, so the
#: worker stays in its Service (as vLLM's /health answers 200 while it sleeps); whether it sleeps
#: is read from GraphStatus, /readyz's body and graphkeeper_sleeping, never from health.
SERVING_STATES = frozenset({S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_RECAPTURING, S.LIFECYCLE_STATE_SLEEPING})


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: int, new: int) -> None:
    """Raises IllegalTransition unless ``new`` may follow ``current``."""
    if new not in ALLOWED[current]:
        raise IllegalTransition(f"{lifecycle_name(current)} -> {lifecycle_name(new)} is not a lifecycle transition")


class Lifecycle:
    """The current state, with listeners (health, metrics, logs) told of every change."""

    def __init__(self) -> None:
        self.state = S.LIFECYCLE_STATE_LOADING
        self._listeners: list[Callable[[int], None]] = []
        self._lock = threading.Lock()

    def subscribe(self, listener: Callable[[int], None]) -> None:
        self._listeners.append(listener)
        listener(self.state)

    def move(self, new: int) -> None:
        """Moves to ``new``; a move out of DRAINING (shutdown began mid-capture) is ignored."""
        with self._lock:
            if self.state == S.LIFECYCLE_STATE_DRAINING and new != S.LIFECYCLE_STATE_DRAINING:
                return
            check_transition(self.state, new)
            self.state = new
        for listener in self._listeners:
            listener(new)

    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES
