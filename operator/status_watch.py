"""One ``WatchGraphStatus`` stream per worker: its changes pushed to the operator, not polled.

Each running worker pod gets a task that keeps a stream open to its GraphControl address. Every
message lands in the worker's ``sync.Track`` as a read would, and one whose ``change_key`` moved
(a lost policy, a capture that ended, a new lifecycle state) wakes the loops that select it. A
stream that breaks, ends or falls silent past two heartbeats marks the worker unreachable at
once and wakes the loops; the task then opens a new stream every ``RETRY_SECONDS``, and the
first message of the new one (a restarted worker that lost its policy) is a change.

A worker whose control service lacks the call (UNIMPLEMENTED: an older worker) gets no stream
and is read as before (``sync.needs_read``). While a stream is open the worker is not read on
resync: the stream's heartbeat (the resync interval) is its resync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import grpc

from graphkeeper.operator import metrics
from graphkeeper.operator.selection import WorkerPod
from graphkeeper.operator.sync import Track
from graphkeeper.operator.workerclient import GraphControlClient, WorkerError
from graphkeeper.proto.watch import change_key

logger = logging.getLogger("graphkeeper.operator")

#: Seconds between attempts to open a stream to a worker that does not answer.
RETRY_SECONDS = 0.5


class StatusWatches:
    """The streams to every running worker, by pod uid."""

    def __init__(self, client: GraphControlClient, track: Callable[[WorkerPod], Track],
                 learned: Callable[[str, str, float], None], wake: Callable[[str], None]) -> None:
        self.client = client
        self._track, self._learned, self._wake = track, learned, wake
        self.heartbeat = 60.0
        self.tasks: dict[str, asyncio.Task] = {}
        #: The latest pod object per uid (a restarted pod may have a new address).
        self.pods: dict[str, WorkerPod] = {}
        #: Control addresses that answered UNIMPLEMENTED: polled, never streamed.
        self.unsupported: set[str] = set()

    def follow(self, pods: Iterable[WorkerPod], heartbeat: float) -> None:
        """Opens a stream to each running pod that has none (and whose worker has the call);
        ``heartbeat``: the longest silence a stream opened now asks of its worker."""
        self.heartbeat = heartbeat
        for pod in pods:
            self.pods[pod.uid] = pod
            if (pod.running and pod.uid not in self.tasks and pod.control_target not in self.unsupported):
                self.tasks[pod.uid] = asyncio.create_task(self._follow(pod.uid), name=f"watch {pod.key}")

    def forget(self, uid: str) -> None:
        self.pods.pop(uid, None)
        task = self.tasks.pop(uid, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()

    async def _follow(self, uid: str) -> None:
        try:
            while (pod := self.pods.get(uid)) is not None and pod.running:
                track = self._track(pod)
                try:
                    await self._stream(pod, track)
                except WorkerError as err:
                    if err.code == grpc.StatusCode.UNIMPLEMENTED:
                        self.unsupported.add(pod.control_target)
                        return
                    metrics.STATUS_STREAM_BREAKS.inc()
                    if track.streaming or track.error is None:
                        track.error = err  # unreachable at once, not at the next resync
                        self._wake(uid)
                except Exception:  # a stream must never end its follower: open another
                    logger.warning("status stream to %s failed", pod.key, exc_info=True)
                finally:
                    track.streaming = False
                await asyncio.sleep(RETRY_SECONDS)
        finally:
            with contextlib.suppress(KeyError):
                if self.tasks.get(uid) is asyncio.current_task():
                    del self.tasks[uid]

    async def _stream(self, pod: WorkerPod, track: Track) -> None:
        metrics.STATUS_STREAMS.inc()
        try:
            async for status in self.client.watch_status(pod.control_target, self.heartbeat):
                changed = (not track.streaming or track.status is None or track.error is not None
                           or change_key(track.status) != change_key(status))
                now = time.monotonic()
                track.status, track.error, track.read_at, track.streaming = status, None, now, True
                self._learned(pod.control_target, status.pending_policy_uid or status.policy_uid, now)
                if changed:
                    self._wake(pod.uid)
        finally:
            metrics.STATUS_STREAMS.dec()
