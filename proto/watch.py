"""``WatchGraphStatus``: what counts as a change of a worker's status, and the stream's pacing.

Both sides share this: the worker (and its stand-in) sends a status when ``change_key`` moves or
a heartbeat is due; the operator treats a message whose key moved as a change worth a run.
Counters that move on every step (steps, traffic, serving figures) are left out of the key, so an
idle-but-serving worker sends only heartbeats.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from graphkeeper.proto import worker_pb2 as pb

#: The longest gap between two messages when the request asks for none.
DEFAULT_HEARTBEAT_SECONDS = 60
#: The longest gap a request may ask for (a day): a stream must prove now and then it is alive.
MAX_HEARTBEAT_SECONDS = 86400


def change_key(status: pb.GraphStatus) -> tuple:
    """What, when it differs between two statuses, is a change the operator acts on."""
    return (status.state, status.requested_mode, status.effective_mode, status.policy_uid,
            status.policy_generation, status.pending_policy_uid, status.pending_policy_generation,
            status.model_revision, status.pending_model_revision, status.last_error, status.sleep.pending_level,
            tuple((c.size, c.mode) for c in status.captured),
            tuple((s.size, s.reason) for s in status.skipped))


def heartbeat_seconds(request: pb.WatchGraphStatusRequest) -> float:
    """The request's heartbeat, the default for 0, at most ``MAX_HEARTBEAT_SECONDS``."""
    return float(min(request.heartbeat_seconds or DEFAULT_HEARTBEAT_SECONDS, MAX_HEARTBEAT_SECONDS))


async def watch_status(read: Callable[[], pb.GraphStatus], heartbeat: float,
                       changed: Callable[[float], Awaitable[object]]) -> AsyncIterator[pb.GraphStatus]:
    """The statuses a WatchGraphStatus stream sends: the first at once, then each whose
    ``change_key`` moved, and one at least every ``heartbeat`` seconds.

    ``read`` returns the current status; ``changed(timeout)`` returns when the status may have
    changed (the worker polls its engine a few times a second; a stand-in waits on an event) or
    after ``timeout`` seconds.
    """
    last_key: tuple | None = None
    last_sent = -math.inf
    while True:
        status = read()
        key = change_key(status)
        now = time.monotonic()
        if key != last_key or now - last_sent >= heartbeat:
            yield status
            last_key, last_sent = key, now
        await changed(max(0.0, last_sent + heartbeat - time.monotonic()))
