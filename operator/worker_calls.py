"""The operator's calls to workers: status reads, pushes and model reloads, each a task of its own.

A call never holds up a reconcile run: each runs as an asyncio task with the client's deadline,
its outcome lands in the worker's ``sync.Track`` (one per pod uid), and its end wakes the loops
that select the pod (``wake``). ``WorkerCalls`` also keeps ``holders``: what the operator knows
of the policy each worker holds or is capturing, one entry per GraphControl address, shared by
every policy's loop, so that a worker another policy just pushed to is read again before a run
decides what it lacks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping

from graphkeeper.operator import metrics
from graphkeeper.operator.rollout import RolloutPlan, RolloutWorker
from graphkeeper.operator.selection import WorkerPod
from graphkeeper.operator.status_watch import StatusWatches
from graphkeeper.operator.sync import PUSH, RELOAD, Track, finish_action, goal_of, needs_read, record_action
from graphkeeper.operator.workerclient import GraphControlClient, WorkerError
from graphkeeper.proto import worker_pb2 as pb

#: One owned worker as a run sees it, by pod key: its pod, its track, and its view for the planner.
Views = Mapping[str, tuple[WorkerPod, Track, RolloutWorker]]


class WorkerCalls:
    """The tracks of every known worker and the calls under way to them."""

    def __init__(self, client: GraphControlClient, wake: Callable[[str], None]) -> None:
        self.client = client
        #: Called with a pod uid when a call to its worker ended and a run should look.
        self._wake = wake
        self.tracks: dict[str, Track] = {}
        #: GraphControl address -> (policy uid the worker holds or is capturing, monotonic time
        #: that became known). ``math.inf`` while a push of ours is under way.
        self.holders: dict[str, tuple[str, float]] = {}
        #: Pods forgotten so far, and that count at the last prune.
        self._forgotten = self._pruned = 0
        #: The status stream of each running worker (its heartbeat: the resync interval).
        self.watches = StatusWatches(client, self.track, self._learn_holder, wake)

    def track(self, pod: WorkerPod) -> Track:
        track = self.tracks.get(pod.uid)
        if track is None:
            track = self.tracks[pod.uid] = Track()
        return track

    def statuses(self, pods: Iterable[WorkerPod]) -> list[pb.GraphStatus]:
        """The last status of each of ``pods`` whose last read answered."""
        return [t.status for p in pods
                if (t := self.tracks.get(p.uid)) is not None and t.status is not None and t.error is None]

    def busy(self, pods: Iterable[WorkerPod]) -> bool:
        """Whether a call to one of ``pods`` is under way, or a change of ours still settling."""
        return any(not t.settled or t.busy() for p in pods if (t := self.tracks.get(p.uid)) is not None)

    def pod_changed(self, pod: WorkerPod) -> None:
        """A changed pod (restarted, re-annotated) is offered a refused generation again, and read
        again (readiness is how an idle fleet is watched)."""
        self.watches.unsupported.discard(pod.control_target)  # perhaps a newer worker now
        track = self.tracks.get(pod.uid)
        if track is not None:
            track.rejected = None
            track.stale = True

    def forget(self, pod: WorkerPod) -> None:
        """A deleted pod: its track goes, and the calls to it are cancelled."""
        self.watches.forget(pod.uid)
        self._forgotten += 1
        track = self.tracks.pop(pod.uid, None)
        if track is not None:
            for task in (track.read, track.action):
                if task is not None:
                    task.cancel()

    async def read(self, pods: list[WorkerPod], *, wait: float, resync: float) -> None:
        """Keeps a status stream open to each running pod (``status_watch``), starts a status read
        per running pod that needs one (``sync.needs_read``, or the
        worker's holder changed since this pod's last read) and waits at most ``wait`` seconds
        for them; a read still under way is marked orphaned, so that its end wakes the loops."""
        self.watches.follow(pods, heartbeat=resync)
        now = time.monotonic()
        reads = [self._start_read(p) for p in pods if p.running and self._wants_read(p, now, resync)]
        if not reads:
            return
        _, late = await asyncio.wait(reads, timeout=wait)
        for pod in pods:
            track = self.tracks.get(pod.uid)
            if track is not None and track.read in late:
                track.read_orphaned = True

    def hand_out(self, plan: RolloutPlan, views: Views,
                 wire_for: Callable[[str], pb.GraphPolicy]) -> dict[str, list[str]]:
        """Starts the pushes and reloads the plan allows; returns what was started, for Events.
        ``wire_for``: the policy to push to a pod key (a canary's few get another than the rest)."""
        fired: dict[str, list[str]] = {PUSH: [], RELOAD: []}
        for name in plan.push:
            pod, track, _ = views[name]
            self._push(pod, track, wire_for(name))
            fired[PUSH].append(name)
        for name in plan.reload:
            pod, track, _ = views[name]
            self._reload(pod, track, pod.model_revision)
            fired[RELOAD].append(f"{name} ({pod.model_revision})")
        return fired

    async def prune(self, live: Callable[[str], bool]) -> None:
        """Drops the connections to, and what is known of, workers at addresses no pod runs at
        (``live``); only after a pod went or moved, so an idle run walks nothing."""
        if self._pruned == self._forgotten:
            return
        self._pruned = self._forgotten
        await self.client.prune(live)
        for target in [t for t in self.holders if not live(t)]:
            del self.holders[target]

    async def close(self) -> None:
        await self.watches.close()
        tasks = [t for tr in self.tracks.values() for t in (tr.read, tr.action) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.close()

    def _wants_read(self, pod: WorkerPod, now: float, resync: float) -> bool:
        track = self.track(pod)
        known = self.holders.get(pod.control_target)
        moved = (known is not None and track.status is not None and known[1] > track.read_at
                 and known[0] != (track.status.pending_policy_uid or track.status.policy_uid))
        return moved or needs_read(track, now, resync)

    def _start_read(self, pod: WorkerPod) -> asyncio.Task:
        track = self.track(pod)
        if track.read is not None and not track.read.done():
            return track.read
        track.read_orphaned = False
        track.stale = False

        async def read() -> None:
            started = time.monotonic()
            try:
                status = await self.client.get_status(pod.control_target)
            except WorkerError as err:
                metrics.STATUS_READS.labels(outcome=str(err.kind).lower()).inc()
                track.error = err
            else:
                metrics.STATUS_READS.labels(outcome="ok").inc()
                track.status, track.error = status, None
                self._learn_holder(pod.control_target, status.pending_policy_uid or status.policy_uid,
                                   started)
            track.read_at = started
            if track.read_orphaned:
                self._wake(pod.uid)

        track.read = asyncio.create_task(read(), name=f"read {pod.key}")
        return track.read

    def _learn_holder(self, target: str, uid: str, read_started: float) -> None:
        """A read's answer replaces what is known of the worker's holder unless something newer
        is known (a push started after the read, or a later read)."""
        known = self.holders.get(target)
        if known is None or read_started >= known[1]:
            self.holders[target] = (uid, read_started)

    def _push(self, pod: WorkerPod, track: Track, wire: pb.GraphPolicy) -> None:
        record_action(track, PUSH, goal_of(wire), time.monotonic())
        target = pod.control_target
        self.holders[target] = (wire.policy_uid, math.inf)  # no read may undo this until it ends

        async def push() -> None:
            error = None
            try:
                reply = await self.client.apply_policy(pod.control_target, wire)
                outcome = "unchanged" if reply.unchanged else "applied"
            except WorkerError as err:
                error = err
            label = finish_action(track, wire, error, time.monotonic())
            if self.holders.get(target) == (wire.policy_uid, math.inf):
                self.holders[target] = (wire.policy_uid, time.monotonic())  # reads after this say
            metrics.PUSHES.labels(outcome=outcome if error is None else label).inc()
            self._wake(pod.uid)

        track.action = asyncio.create_task(push(), name=f"push {pod.key}")

    def _reload(self, pod: WorkerPod, track: Track, revision: str) -> None:
        record_action(track, RELOAD, revision, time.monotonic())

        async def reload() -> None:
            error = None
            try:
                source = pod.model_source or (await self.client.model_info(pod.target)).source
                # Blocks on the worker until the revision serves; observed through status reads.
                await self.client.load_model_revision(pod.control_target, source, revision)
            except WorkerError as err:
                error = err
            label = finish_action(track, None, error, time.monotonic())
            metrics.MODEL_LOADS.labels(outcome=label).inc()
            self._wake(pod.uid)

        track.action = asyncio.create_task(reload(), name=f"reload {pod.key}")
