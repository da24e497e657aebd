"""One reconcile loop per GraphPolicy: read every selected worker, push what it lacks, write status.

Why not ``@kopf.timer``: kopf adds a finalizer to every object that has a timer or daemon, so a
policy deleted while the operator is away would hang in Terminating. These loops are plain
asyncio tasks started and stopped from watch events; nothing blocks deletion, and the workers
simply keep their last policy.

A loop runs every ``interval`` seconds and at once when woken: by a spec change, by a selected
pod's event (a new, restarted or re-annotated worker), or by a rival policy going away. Each run
is level-triggered (it compares what each worker reports with what the policy says), so a missed
event costs at most one interval, and a restarted operator repeats no push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from graphkeeper.operator import metrics
from graphkeeper.operator.kube import Kube
from graphkeeper.operator.render import build_status_patch
from graphkeeper.operator.selection import (
    PolicyRef,
    WorkerPod,
    selected_workers,
    senior_claimant,
)
from graphkeeper.operator.status import WorkerObservation, WorkerState, build_status
from graphkeeper.operator.sync import SyncResult, sync_worker
from graphkeeper.operator.workerclient import GraphControlClient
from graphkeeper.proto.policy import PolicyError, policy_from_spec

logger = logging.getLogger("graphkeeper.operator")

#: How soon to look again while some worker is still capturing a pushed generation.
FOLLOW_UP_SECONDS = 0.5
#: Events arriving this close together are handled by one run.
COALESCE_SECONDS = 0.02

_STATES = [str(s) for s in WorkerState]
_EVENT_FOR_STATE = {
    WorkerState.REJECTED: "PolicyRejected",
    WorkerState.CAPTURE_FAILED: "CaptureFailed",
    WorkerState.UNREACHABLE: "WorkerUnreachable",
    WorkerState.CONFLICT: "Conflict",
}


class PolicyLoop:
    """The loop of one policy; ``wake()`` asks for a run now."""

    def __init__(self, reconciler: Reconciler, ref: PolicyRef) -> None:
        self.uid, self.namespace, self.name = ref.uid, ref.namespace, ref.name
        self.generation = ref.generation
        self.last_status: dict[str, Any] | None = None
        self.worker_states: dict[str, WorkerState] = {}
        self.seen_pods: set[str] = set()
        self.invalid: str | None = None
        self._reconciler = reconciler
        self._woken = asyncio.Event()
        self._woken.set()
        self.task = asyncio.create_task(self._run(), name=f"graphpolicy {ref.key}")

    def wake(self) -> None:
        self._woken.set()

    async def _run(self) -> None:
        delay = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), timeout=delay)
            await asyncio.sleep(COALESCE_SECONDS)
            self._woken.clear()
            try:
                delay = await self._reconciler.reconcile(self)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad run must never end the loop
                logger.exception("reconcile of %s/%s failed", self.namespace, self.name)
                delay = self._reconciler.interval


class Reconciler:
    """Owns the loops, the worker client and the bookkeeping shared between them."""

    def __init__(
        self,
        *,
        client: GraphControlClient,
        kube: Kube,
        pods: Mapping[str, Iterable[WorkerPod]],
        policies: Mapping[str, Iterable[PolicyRef]],
        interval: float = 5.0,
        concurrency: int = 64,
        post_event: Callable[..., None] = kopf.event,
    ) -> None:
        self.client, self.kube = client, kube
        self.pods, self.policies = pods, policies
        self.interval = interval
        self.loops: dict[str, PolicyLoop] = {}
        self._fingerprints: dict[str, tuple] = {}
        self._load_attempts: dict[str, tuple[str, float]] = {}
        self._rejections: dict[str, tuple[str, int, str, float]] = {}
        self._limit = asyncio.Semaphore(concurrency)
        self._post_event = post_event
        self.runs = 0

    # --- wiring from watch events ---------------------------------------------------------------

    def on_policy(self, ref: PolicyRef, deleted: bool) -> None:
        """A GraphPolicy watch event: start, wake or stop its loop."""
        loop = self.loops.get(ref.uid)
        if deleted or ref.deleting:
            if loop is not None:
                loop.task.cancel()
                del self.loops[ref.uid]
                metrics.forget_policy(ref.namespace, ref.name, _STATES)
                self.wake_namespace(ref.namespace)  # a younger rival may own its pods now
            return
        if loop is None:
            self.loops[ref.uid] = PolicyLoop(self, ref)
        elif loop.generation != ref.generation:
            loop.generation = ref.generation
            self.wake_namespace(ref.namespace)  # its selector may have moved

    def on_pod(self, pod: WorkerPod, deleted: bool) -> None:
        """A Pod watch event: wake the loops of policies that select (or selected) it."""
        fingerprint = None if deleted else pod.fingerprint()
        if self._fingerprints.get(pod.uid) == fingerprint:
            return
        self._rejections.pop(pod.uid, None)  # a changed pod (restarted, re-annotated) is asked again
        if deleted:
            self._fingerprints.pop(pod.uid, None)
            self._load_attempts.pop(pod.uid, None)
        else:
            self._fingerprints[pod.uid] = fingerprint
        for ref in self.policies.get(pod.namespace, ()):
            loop = self.loops.get(ref.uid)
            if loop is not None and (ref.selects(pod) or pod.uid in loop.seen_pods):
                loop.wake()

    def wake(self, uid: str) -> None:
        loop = self.loops.get(uid)
        if loop is not None:
            loop.wake()

    def wake_namespace(self, namespace: str) -> None:
        for loop in self.loops.values():
            if loop.namespace == namespace:
                loop.wake()

    def health(self) -> dict[str, Any]:
        dead = [f"{lp.namespace}/{lp.name}" for lp in self.loops.values() if lp.task.done()]
        return {"ok": not dead, "policies": len(self.loops), "dead_loops": dead,
                "reconciles": self.runs}

    async def shutdown(self) -> None:
        for loop in self.loops.values():
            loop.task.cancel()
        await asyncio.gather(*(lp.task for lp in self.loops.values()), return_exceptions=True)
        self.loops.clear()
        await self.client.close()

    # --- one run -------------------------------------------------------------------------------

    def _ref(self, loop: PolicyLoop) -> PolicyRef | None:
        return next((p for p in self.policies.get(loop.namespace, ()) if p.uid == loop.uid), None)

    async def reconcile(self, loop: PolicyLoop) -> float:
        """Brings every selected worker to the policy and writes status; returns the next delay."""
        ref = self._ref(loop)
        if ref is None or ref.deleting:
            return self.interval
        started = time.monotonic()
        self.runs += 1
        pods = selected_workers(ref, self.pods.get(ref.namespace, ()))
        loop.seen_pods = {p.uid for p in pods}
        try:
            wire = policy_from_spec(ref.spec, uid=ref.uid, name=ref.key, generation=ref.generation)
            invalid = None
        except PolicyError as err:
            wire, invalid = None, f"{err.field}: {err.message}"

        if wire is None:
            results = [SyncResult(WorkerObservation(p.key, WorkerState.PENDING, "not pushed"))
                       for p in pods]
        else:
            rivals = list(self.policies.get(ref.namespace, ()))
            recapture = ref.spec.get("onModelRevisionChange", "Recapture") == "Recapture"
            results = await asyncio.gather(
                *(self._sync(ref, wire, pod, rivals, recapture) for pod in pods)
            )
        observations = [r.observation for r in results]
        await self._write_status(loop, ref, observations, invalid)
        self._post_events(loop, ref, results, invalid)
        await self.client.prune(self._live_targets())

        counts = Counter(str(o.state) for o in observations)
        metrics.set_worker_states(ref.namespace, ref.name, dict(counts), _STATES)
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        pending = any(o.state == WorkerState.PENDING for o in observations)
        if pending and invalid is None:
            return min(self.interval, FOLLOW_UP_SECONDS)
        return self.interval

    async def _sync(self, ref: PolicyRef, wire: Any, pod: WorkerPod,
                    rivals: list[PolicyRef], recapture: bool) -> SyncResult:
        rival = senior_claimant(ref, pod, rivals)
        if rival is not None:
            return SyncResult(WorkerObservation(
                pod.key, WorkerState.CONFLICT,
                f"also selected by the older policy {rival.name}, which keeps it; not pushed"))
        async with self._limit:
            return await sync_worker(self.client, pod, wire, recapture_on_revision=recapture,
                                     load_attempts=self._load_attempts, rejections=self._rejections)

    async def _write_status(self, loop: PolicyLoop, ref: PolicyRef,
                            observations: list[WorkerObservation], invalid: str | None) -> None:
        previous = loop.last_status if loop.last_status is not None else dict(ref.status)
        status = build_status(generation=ref.generation, observations=observations,
                              previous=previous, now=datetime.now(UTC), invalid=invalid)
        if status == previous:
            return
        await self.kube.patch_policy_status(ref.namespace, ref.name,
                                            build_status_patch(status, previous))
        metrics.STATUS_WRITES.inc()
        loop.last_status = status

    def _post_events(self, loop: PolicyLoop, ref: PolicyRef, results: list[SyncResult],
                     invalid: str | None) -> None:
        """Events for what a person wants to see, one per kind per run (never one per worker)."""
        body = ref.body()
        pushed = [r.observation.name for r in results if r.pushed == "applied"]
        if pushed:
            self._event(body, "Normal", "PolicyPushed",
                        f"pushed generation {ref.generation} to {_names(pushed)}")
        loaded = [f"{r.observation.name} ({r.loaded})" for r in results if r.loaded]
        if loaded:
            self._event(body, "Normal", "ModelRevisionLoad",
                        f"asked to load a new model revision: {_names(loaded)}")
        fresh: dict[WorkerState, list[WorkerObservation]] = {}
        states: dict[str, WorkerState] = {}
        for r in results:
            o = r.observation
            states[o.name] = o.state
            if o.state in _EVENT_FOR_STATE and loop.worker_states.get(o.name) != o.state:
                fresh.setdefault(o.state, []).append(o)
        for state, obs in fresh.items():
            detail = "; ".join(f"{o.name}: {o.message}" for o in obs[:3])
            more = f"; and {len(obs) - 3} more" if len(obs) > 3 else ""
            self._event(body, "Warning", _EVENT_FOR_STATE[state], detail + more)
        if invalid is not None and loop.invalid != invalid:
            self._event(body, "Warning", "InvalidPolicy", invalid)
        loop.invalid = invalid
        loop.worker_states = states

    def _event(self, body: dict[str, Any], kind: str, reason: str, message: str) -> None:
        log = logger.warning if kind == "Warning" else logger.info
        log("%s/%s: %s: %s", body["metadata"]["namespace"], body["metadata"]["name"], reason,
            message)
        try:
            self._post_event(body, type=kind, reason=reason, message=message[:1024])
        except Exception:  # Events are a courtesy; never fail a reconcile for one
            logger.debug("could not post an Event", exc_info=True)

    def _live_targets(self) -> set[str]:
        return {p.target for pods in self.pods.values() for p in pods if p.running}


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return f"{len(names)} worker(s): {shown}{more}"
