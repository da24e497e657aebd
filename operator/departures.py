"""Pods deleted while a change of ours was under way on their worker: how long each holds its slot.

A deleted pod's process may go on recapturing for a while (a force delete removes the object at
once; the container is stopped later), so it keeps its rollout slot: no further worker is taken
out of service in its place. It holds the slot only while it can still be recapturing: until
its address stops answering (the process is gone) or answers READY with nothing pending (it
finished), until a replacement pod is READY, or until the change's progress deadline passes.

Each departed worker is probed at its GraphControl address every ``PROBE_SECONDS`` from its
deletion until one of those holds; the probe's end wakes the loops, so the slot is handed to the
next worker within a probe interval of the process going away, not at the progress deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from graphkeeper.operator.selection import WorkerPod
from graphkeeper.operator.worker_calls import Views
from graphkeeper.operator.workerclient import ErrorKind, GraphControlClient, WorkerError
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import serves_graphs

logger = logging.getLogger("graphkeeper.operator")

#: How often a departed worker's address is asked whether it still runs.
PROBE_SECONDS = 0.5


@dataclass
class Departure:
    """One deleted pod whose worker may still be recapturing."""

    pod: WorkerPod
    #: Monotonic time the change under way on it started.
    started: float
    #: The pod uids the policies selected at the deletion (a pod not among them is a replacement).
    known: frozenset[str]
    #: The uids of the policies whose rollout it counts in (they selected it at the deletion).
    policies: frozenset[str]
    #: Why it no longer holds a slot ("" while it may still be recapturing).
    freed: str = ""
    probe: asyncio.Task | None = None


def still_recapturing(status: pb.GraphStatus) -> bool:
    """Whether a worker that answers may still be busy with a change (pure)."""
    return (not serves_graphs(status.state) or bool(status.pending_policy_uid)
            or bool(status.pending_model_revision))


def process_gone(err: WorkerError) -> bool:
    """Whether a failed probe shows the departed worker's process gone (pure): only a refused
    connection (UNAVAILABLE) does. A call that timed out (a loaded or stalled process may still
    be recapturing) or whose channel the operator closed under it (pruning the departed pod's
    connection) says nothing of the process: the next probe asks again on a fresh channel."""
    return err.kind is ErrorKind.UNREACHABLE and err.code == grpc.StatusCode.UNAVAILABLE


class Departures:
    """Every departed worker, by pod key, with the probe that frees its slot."""

    def __init__(self, client: GraphControlClient, wake: Callable[[], None]) -> None:
        self.client = client
        self._wake = wake
        self.entries: dict[str, Departure] = {}

    def add(self, pod: WorkerPod, started: float, known: frozenset[str], policies: frozenset[str]) -> None:
        """A pod deleted while a change of ours was under way on it: it holds its slot for now."""
        if not policies:
            return
        old = self.entries.pop(pod.key, None)
        if old is not None and old.probe is not None:
            old.probe.cancel()
        departure = Departure(pod, started, known, policies)
        if pod.address:
            departure.probe = asyncio.create_task(self._probe(departure), name=f"departed {pod.key}")
        self.entries[pod.key] = departure

    def probing(self, target: str) -> bool:
        """Whether a departed worker at ``target`` is still probed (its channel must stay open)."""
        return any(not d.freed and d.pod.control_target == target for d in self.entries.values())

    def holding(self, policy: str, views: Views, now: float, deadline: float) -> list[str]:
        """The departed pods that still hold a slot in the rollout of ``policy`` (a uid; ``views``:
        its owned workers this run); forgets the ones freed."""
        out = []
        for key, d in list(self.entries.items()):
            if not d.freed:
                if any(view.available for pod, _, view in views.values() if pod.uid not in d.known):
                    d.freed = "a replacement is READY"
                elif now - d.started > deadline:
                    d.freed = "the progress deadline passed"
            if d.freed:
                self._drop(key)
            elif policy in d.policies:
                out.append(key)
        return sorted(out)

    async def close(self) -> None:
        tasks = [d.probe for d in self.entries.values() if d.probe is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.entries.clear()

    def _drop(self, key: str) -> None:
        d = self.entries.pop(key)
        if d.probe is not None:
            d.probe.cancel()

    async def _probe(self, d: Departure) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while not d.freed:
                try:
                    status = await self.client.get_status(d.pod.control_target)
                except WorkerError as err:
                    if process_gone(err):
                        d.freed = "its address no longer answers"
                except Exception:  # anything else: ask again; a probe that died would hold the slot
                    logger.debug("probing departed %s failed", d.pod.key, exc_info=True)
                else:
                    if not still_recapturing(status):
                        d.freed = "its worker finished"
                if d.freed:
                    self._wake()
                    return
                await asyncio.sleep(PROBE_SECONDS)
