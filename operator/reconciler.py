"""One reconcile loop per GraphPolicy: read every selected worker, push what it lacks, write status.

Why not ``@kopf.timer``: kopf adds a finalizer to every object that has a timer or daemon, so a
policy deleted while the operator is away would hang in Terminating. These loops are plain
asyncio tasks started and stopped from watch events; nothing blocks deletion, and the workers
simply keep their last policy.

A loop runs every ``interval`` seconds and at once when woken: by a spec change, by a selected
pod's event (a new, restarted or re-annotated worker), by a rival policy going away, or by a
worker call that ended. Each run is level-triggered (it compares what each worker reports with
what the policy says), so a missed event costs at most one interval, and a restarted operator
repeats no push.

A run never waits on a worker for long: it starts a status read per worker that needs one
(``sync.needs_read``: nothing known, a failed read, a changed pod, a change settling, or the
slow resync; an idle fleet is not polled), each on its own deadline, waits at most
``READ_WAIT_SECONDS`` for them, and uses the last known status of any worker that has not
answered yet (its late answer wakes the loop). Then, without awaiting anything, it settles who
owns each worker (``selection.owner`` over ``Reconciler.holders``, one entry per worker address
shared by all loops), what each lacks, and what to push: every loop decides from the same
snapshot, so two policies never both push to a worker nor both defer to each other. Pushes and model reloads run
as tasks of their own, handed out by the rollout planner (``rollout.plan_rollout``) at most
``maxUnavailable`` at a time; their end wakes the loop. Status is written on every run with what
is known.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import kopf

from graphkeeper.operator import metrics
from graphkeeper.operator.kube import Kube, api_unreachable
from graphkeeper.operator.outage import OUTAGE
from graphkeeper.operator.render import build_configmap, build_status_patch, configmap_differs
from graphkeeper.operator.rollout import (
    RolloutPlan,
    RolloutWorker,
    plan_rollout,
    push_recaptures,
    rollout_settings,
    rollout_status,
)
from graphkeeper.operator.selection import (
    PolicyRef,
    WorkerPod,
    claims,
    owner,
    selected_workers,
    selector_error,
)
from graphkeeper.operator.status import FAILURE_REASONS, WorkerObservation, WorkerState, build_status
from graphkeeper.operator.sync import (
    PUSH,
    RELOAD,
    Track,
    classify,
    finish_action,
    goal_of,
    needs_read,
    record_action,
    settle,
)
from graphkeeper.operator.traffic import (
    Applied,
    FromTraffic,
    applied_from_status,
    applied_status,
    decide_apply,
    effective_policy,
    from_traffic_settings,
    histograms,
    in_effect,
    max_capture_size,
    recommendation_status,
    sizes_in_effect,
    waiting_status,
)
from graphkeeper.operator.workerclient import GraphControlClient, WorkerError
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import (
    MODE_BY_NAME,
    PolicyError,
    RecaptureKey,
    policy_from_spec,
    recapture_key,
)
from graphkeeper.proto.traffic_sizes import CostModel, choose_sizes, evaluate_sizes, measurements_from, merge_histograms

logger = logging.getLogger("graphkeeper.operator")

#: How soon to look again while some worker is still capturing a pushed generation.
FOLLOW_UP_SECONDS = 0.5
#: Events arriving this close together are handled by one run.
COALESCE_SECONDS = 0.02
#: How long a run waits for status reads before it uses what it knows (late answers wake it).
READ_WAIT_SECONDS = 0.5
#: Retry delay while the Kubernetes API does not answer.
API_RETRY_SECONDS = 1.0
#: Recapture keys remembered per policy (generations a worker may still hold).
MAX_RECAPTURE_KEYS = 64
#: A settled worker whose pod did not change is read again after this many seconds.
RESYNC_SECONDS = 60.0
#: A recommendation from traffic is recomputed at most every this many reconcile intervals (30 s at
#: the default 5 s) while only the traffic changes: each recomputation is a status write, and a
#: large fleet's staggered reads would otherwise change the merged histogram every few seconds.
RECOMMEND_EVERY_INTERVALS = 6

_STATES = [str(s) for s in WorkerState]


@dataclass(frozen=True)
class Desired:
    """What a valid spec asks for: the wire policy and how fast it may roll out."""

    wire: pb.GraphPolicy
    max_unavailable: int
    #: Seconds a push or reload may take to settle before the worker counts as failed.
    deadline: float
    #: ``spec.captureSizes.fromTraffic``, and the wire policy as the spec alone says it.
    traffic: FromTraffic | None = None
    spec_wire: pb.GraphPolicy | None = None


@dataclass
class RunOutcome:
    """What one run observed and did; ``plan`` and ``rollout`` are None when nothing was planned."""

    observations: list[WorkerObservation]
    plan: RolloutPlan | None = None
    rollout: dict[str, Any] | None = None
    fired: dict[str, list[str]] = field(default_factory=lambda: {PUSH: [], RELOAD: []})


def desired_policy(ref: PolicyRef, total: int, applied: Applied | None = None) -> tuple[Desired | None, str | None]:
    """The policy to roll out to ``total`` selected workers, or why there is none (pure): the
    operator checks the spec again, so one that slipped past the CRD is reported, not pushed.
    ``applied``: the sizes chosen from traffic and applied (``traffic.effective_policy``)."""
    invalid = selector_error(ref.spec.get("selector"))
    if invalid is not None:
        return None, invalid
    try:
        spec_wire = policy_from_spec(ref.spec, uid=ref.uid, name=ref.key, generation=ref.generation)
        settings = from_traffic_settings(ref.spec)
        max_unavailable, deadline = rollout_settings(ref.spec, total)
    except PolicyError as err:
        return None, f"{err.field}: {err.message}"
    except ValueError as err:
        return None, f"spec.rollout: {err}"
    wire = effective_policy(spec_wire, settings, applied or Applied(), _spec_mode(ref))
    return Desired(wire, max_unavailable, deadline, settings, spec_wire), None


def _spec_mode(ref: PolicyRef) -> str:
    return str(ref.spec.get("mode") or "FullAndPiecewise")


def holding_slots(departed: dict[str, tuple[float, frozenset[str]]],
                  views: Mapping[str, tuple[WorkerPod, Track, RolloutWorker]], now: float,
                  deadline: float) -> list[str]:
    """The deleted pods that still hold a rollout slot; forgets the others (``departed`` is the
    loop's). A force-deleted pod's worker may go on recapturing for a while: its slot is free
    once a pod this policy did not select at the deletion is available (its replacement is
    READY), or once the change's progress deadline passed."""
    for key, (started, known) in list(departed.items()):
        replaced = any(view.available for pod, _, view in views.values() if pod.uid not in known)
        if replaced or now - started > deadline:
            del departed[key]
    return sorted(departed)


def mark_waiting(observations: list[WorkerObservation], waiting: set[str]) -> list[WorkerObservation]:
    """Pending workers the rollout did not reach this run say that they wait for their turn."""
    return [replace(o, message=f"waiting for its turn in the rollout ({o.message})")
            if o.name in waiting and o.state == WorkerState.PENDING else o
            for o in observations]


class PolicyLoop:
    """The loop of one policy; ``wake()`` asks for a run now."""

    def __init__(self, reconciler: Reconciler, ref: PolicyRef) -> None:
        self.uid, self.namespace, self.name = ref.uid, ref.namespace, ref.name
        self.generation = ref.generation
        self.last_status: dict[str, Any] | None = None
        self.worker_states: dict[str, WorkerState] = {}
        self.seen_pods: set[str] = set()
        self.seen_targets: set[str] = set()
        self.invalid: str | None = None
        self.paused: tuple[str, ...] = ()
        #: Pods deleted while a change of ours was under way on their worker: key -> (when that
        #: change started, the pod uids this policy selected then). Each keeps its rollout slot
        #: (the process may still be recapturing) until a replacement is READY or the progress
        #: deadline passes.
        self.departed: dict[str, tuple[float, frozenset[str]]] = {}
        #: Capture sizes from traffic: the set applied last (read back from status, so a restarted
        #: operator keeps it), the last recommendation, and what it was computed from.
        self.applied: Applied = applied_from_status(ref.status)
        self.recommendation: dict[str, Any] | None = (ref.status or {}).get("recommendation")
        self.traffic_key: tuple | None = None
        self.recommended_at = -math.inf
        #: The applied set's sequence last written into the policy's ConfigMap (-1: not checked yet).
        self.rendered_sequence = -1
        self._reconciler = reconciler
        self._woken = asyncio.Event()
        self._woken.set()
        self.task = asyncio.create_task(self._run(), name=f"graphpolicy {ref.key}")

    def wake(self) -> None:
        self._woken.set()

    async def _run(self) -> None:
        delay = 0.0
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that
            # arrives in the same step as the wake, and shutdown would then wait on this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._woken.wait()
            await asyncio.sleep(COALESCE_SECONDS)
            self._woken.clear()
            try:
                delay = await self._reconciler.reconcile(self)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a bad run must never end the loop
                if api_unreachable(err):
                    OUTAGE.failed(err)  # one line per outage, not a traceback per policy
                    delay = API_RETRY_SECONDS
                    continue
                logger.exception("reconcile of %s/%s failed", self.namespace, self.name)
                delay = self._reconciler.interval


class Reconciler:
    """Owns the loops, the worker client and the per-worker tracks shared between them."""

    def __init__(
        self,
        *,
        client: GraphControlClient,
        kube: Kube,
        pods: Mapping[str, Iterable[WorkerPod]],
        policies: Mapping[str, Iterable[PolicyRef]],
        interval: float = 5.0,
        post_event: Callable[..., None] = kopf.event,
        read_wait: float = READ_WAIT_SECONDS,
        resync: float = RESYNC_SECONDS,
    ) -> None:
        self.client, self.kube = client, kube
        self.pods, self.policies = pods, policies
        self.interval = interval
        self.read_wait = read_wait
        self.resync = resync
        #: GraphControl address -> (policy uid the worker holds or is capturing, monotonic time
        #: that became known): one entry per worker, shared by every loop, so that all of them
        #: decide ownership from the same fact. ``math.inf`` while a push of ours is under way.
        self.holders: dict[str, tuple[str, float]] = {}
        self.loops: dict[str, PolicyLoop] = {}
        self.tracks: dict[str, Track] = {}
        self._fingerprints: dict[str, tuple] = {}
        #: (policy uid, generation) -> its recapture key, for the generations this operator built.
        self._recapture_keys: dict[tuple[str, int], RecaptureKey | None] = {}
        self._post_event = post_event
        self.runs = 0

    # --- wiring from watch events ---------------------------------------------------------------

    def on_policy(self, ref: PolicyRef, deleted: bool) -> None:
        """A GraphPolicy watch event: start, wake or stop its loop."""
        OUTAGE.ok()
        loop = self.loops.get(ref.uid)
        if deleted or ref.deleting:
            if loop is not None:
                loop.task.cancel()
                del self.loops[ref.uid]
                metrics.forget_policy(ref.namespace, ref.name, _STATES)
                self.wake_all()  # a younger rival (here or at the same address) may own its pods
            return
        if loop is None:
            self.loops[ref.uid] = PolicyLoop(self, ref)
        elif loop.generation != ref.generation:
            loop.generation = ref.generation
            self.wake_all()  # its selector may have moved

    def on_pod(self, pod: WorkerPod, deleted: bool) -> None:
        """A Pod watch event: wake the loops of policies that select (or selected) it."""
        OUTAGE.ok()
        fingerprint = None if deleted else pod.fingerprint()
        if self._fingerprints.get(pod.uid) == fingerprint:
            return
        track = self.tracks.get(pod.uid)
        if track is not None:
            track.rejected = None  # a changed pod (restarted, re-annotated) is asked again
            track.stale = True  # and read again (readiness is how an idle fleet is watched)
        if deleted:
            self._fingerprints.pop(pod.uid, None)
            if track is not None and (track.busy() or not track.settled):
                for loop in self.loops.values():
                    if pod.uid in loop.seen_pods:
                        loop.departed[pod.key] = (track.action_started, frozenset(loop.seen_pods))
            track = self.tracks.pop(pod.uid, None)
            if track is not None:
                for task in (track.read, track.action):
                    if task is not None:
                        task.cancel()
        else:
            self._fingerprints[pod.uid] = fingerprint
        for loop in self.loops.values():
            if pod.uid in loop.seen_pods:
                loop.wake()
                continue
            ref = self._ref(loop)
            if ref is not None and ref.selects(pod):
                loop.wake()
            elif pod.address and pod.control_target in loop.seen_targets:
                loop.wake()  # it shares an address with a pod this policy selects

    def wake(self, uid: str) -> None:
        loop = self.loops.get(uid)
        if loop is not None:
            loop.wake()

    def wake_namespace(self, namespace: str) -> None:
        for loop in self.loops.values():
            if loop.namespace == namespace:
                loop.wake()

    def wake_all(self) -> None:
        for loop in self.loops.values():
            loop.wake()

    def _wake_pod(self, pod_uid: str) -> None:
        for loop in self.loops.values():
            if pod_uid in loop.seen_pods:
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
        tasks = [t for tr in self.tracks.values() for t in (tr.read, tr.action) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.close()

    # --- worker calls, each a task with its own deadline ----------------------------------------

    def _track(self, pod: WorkerPod) -> Track:
        track = self.tracks.get(pod.uid)
        if track is None:
            track = self.tracks[pod.uid] = Track()
        return track

    def _start_read(self, pod: WorkerPod, track: Track) -> asyncio.Task | None:
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
                self._wake_pod(pod.uid)

        track.read = asyncio.create_task(read(), name=f"read {pod.key}")
        return track.read

    def _learn_holder(self, target: str, uid: str, read_started: float) -> None:
        """A read's answer replaces what is known of the worker's holder unless something newer
        is known (a push started after the read, or a later read)."""
        known = self.holders.get(target)
        if known is None or read_started >= known[1]:
            self.holders[target] = (uid, read_started)

    def _holder(self, pod: WorkerPod) -> str:
        """The policy uid the worker behind ``pod`` holds, as far as the operator knows."""
        known = self.holders.get(pod.control_target) if pod.address else None
        return known[0] if known is not None else ""

    def _start_push(self, pod: WorkerPod, track: Track, wire: pb.GraphPolicy) -> None:
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
            self._wake_pod(pod.uid)

        track.action = asyncio.create_task(push(), name=f"push {pod.key}")

    def _start_reload(self, pod: WorkerPod, track: Track, revision: str) -> None:
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
            self._wake_pod(pod.uid)

        track.action = asyncio.create_task(reload(), name=f"reload {pod.key}")

    # --- one run -------------------------------------------------------------------------------

    def _ref(self, loop: PolicyLoop) -> PolicyRef | None:
        return next((p for p in self.policies.get(loop.namespace, ()) if p.uid == loop.uid), None)

    def _all_policies(self) -> list[PolicyRef]:
        return [p for refs in self.policies.values() for p in refs]

    def _recaptures(self, status: pb.GraphStatus | None, wire: pb.GraphPolicy) -> bool:
        """Whether moving a worker from what it reports holding to ``wire`` recaptures graphs."""
        held = None
        if status is not None and status.policy_uid:
            held = self._recapture_keys.get((status.policy_uid, status.policy_generation))
        return push_recaptures(held, wire)

    def _remember_recapture_key(self, wire: pb.GraphPolicy) -> None:
        """Keeps ``wire``'s key, so that a later generation can tell whether leaving it recaptures."""
        self._recapture_keys[(wire.policy_uid, wire.generation)] = recapture_key(wire)
        if len(self._recapture_keys) > MAX_RECAPTURE_KEYS * max(1, len(self.loops)):
            for key in list(self._recapture_keys)[: len(self._recapture_keys) // 2]:
                del self._recapture_keys[key]

    async def reconcile(self, loop: PolicyLoop) -> float:
        """Reads the selected workers, hands out what the rollout allows, writes status; returns
        the seconds until the next run."""
        ref = self._ref(loop)
        if ref is None or ref.deleting:
            return self.interval
        started = time.monotonic()
        self.runs += 1
        pods = selected_workers(ref, self.pods.get(ref.namespace, ()))
        loop.seen_pods = {p.uid for p in pods}
        loop.seen_targets = {p.control_target for p in pods if p.address}
        desired, invalid = desired_policy(ref, len(pods), loop.applied)
        if desired is None:
            outcome = RunOutcome([WorkerObservation(p.key, WorkerState.PENDING, "not pushed") for p in pods])
        else:
            outcome = await self._roll_out(loop, ref, pods, desired)
            if loop.applied.sequence and loop.rendered_sequence != loop.applied.sequence:
                await self._render(ref, desired_policy(ref, len(pods), loop.applied)[0])
                loop.rendered_sequence = loop.applied.sequence
        await self._report(loop, ref, outcome, invalid)
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        return self._next_delay(pods, outcome.observations, invalid)

    async def _roll_out(self, loop: PolicyLoop, ref: PolicyRef, pods: list[WorkerPod],
                        desired: Desired) -> RunOutcome:
        """Reads the selected workers that need it, settles who owns each, classifies the ones
        this policy owns, and starts what the plan allows."""
        self._remember_recapture_key(desired.wire)
        await self._read_statuses(pods)
        # From here to the hand-out nothing awaits: who owns each worker, what it lacks and what
        # is pushed to it come from one snapshot, the same one every other loop sees.
        mine, observations = self._claimed(ref, pods)
        if desired.traffic is not None:
            desired = self._from_traffic(loop, ref, mine, desired)
        worker_observations, views = self._classify(ref, mine, desired)
        observations += worker_observations
        departed = holding_slots(loop.departed, views, time.monotonic(), desired.deadline)
        plan = plan_rollout([view for _, _, view in views.values()]
                            + [RolloutWorker(f"{key} (deleted, may still be recapturing)",
                                             available=False, blocked=True) for key in departed],
                            desired.max_unavailable)
        fired = self._hand_out(plan, views, desired.wire)
        observations = mark_waiting(observations, set(plan.waiting))
        updated = sum(1 for o in observations if o.state == WorkerState.CAPTURED)
        rollout = rollout_status(plan, updated=updated, total=len(mine))
        return RunOutcome(observations, plan, rollout, fired)

    def _from_traffic(self, loop: PolicyLoop, ref: PolicyRef, mine: list[WorkerPod],
                      desired: Desired) -> Desired:
        """Merges the owned workers' step histograms (this run's snapshot), recommends sizes, and in
        Apply mode makes them effective when ``decide_apply`` allows; returns the policy to push.
        Recomputed only when the merged histogram or the spec changed."""
        settings, spec_wire = desired.traffic, desired.spec_wire
        assert settings is not None and spec_wire is not None
        statuses = [t.status for p in mine
                    if (t := self.tracks.get(p.uid)) is not None and t.status is not None and t.error is None]
        traffic = merge_histograms(histograms(statuses))
        key = (ref.generation, traffic.steps, traffic.workers, traffic.since, loop.applied)
        same_spec = loop.traffic_key is not None and (key[0], key[-1]) == (loop.traffic_key[0], loop.traffic_key[-1])
        if key == loop.traffic_key or (
                same_spec and time.monotonic() - loop.recommended_at < RECOMMEND_EVERY_INTERVALS * self.interval):
            return desired
        loop.traffic_key = key
        loop.recommended_at = time.monotonic()
        if traffic.steps < settings.min_steps:
            loop.recommendation = waiting_status(loop.recommendation, traffic, settings)
            return desired
        mode = MODE_BY_NAME[_spec_mode(ref)]
        model = CostModel(mode, measurements_from(c for s in statuses for c in s.captured))
        top = max_capture_size(spec_wire)
        new = choose_sizes(traffic, mode=mode, max_capture_size=top, max_graphs=settings.max_graphs,
                           memory_budget_bytes=settings.memory_budget_bytes, model=model)
        current = evaluate_sizes(traffic, sizes_in_effect(desired.wire), mode, model)
        now = time.time()
        apply, why = decide_apply(settings, loop.applied, now, current, new)
        if apply:
            loop.applied = Applied(new.sizes, loop.applied.sequence + 1, now, _spec_mode(ref))
            loop.traffic_key = (*key[:-1], loop.applied)
            wire = effective_policy(spec_wire, settings, loop.applied, _spec_mode(ref))
            desired = replace(desired, wire=wire)
            self._remember_recapture_key(wire)
            metrics.SIZE_APPLIES.inc()
            self._event(ref.body(), "Normal", "CaptureSizesApplied",
                        f"sizes {list(new.sizes)} from {traffic.steps} steps of {traffic.workers} worker(s), "
                        f"expected coverage {new.coverage:.1%}: {why}")
        loop.recommendation = recommendation_status(new, current, traffic, now, why)
        metrics.set_recommendation(ref.namespace, ref.name, recommended=new.coverage, current=current.coverage,
                                   graphs=new.graphs, memory_bytes=new.memory_bytes, steps=traffic.steps)
        return desired

    async def _render(self, ref: PolicyRef, desired: Desired | None) -> None:
        """Rewrites the ConfigMap worker pods boot from when the sizes applied from traffic changed,
        so that a pod started later captures them before it is ready (and is not pushed again)."""
        if desired is None:
            return
        body = build_configmap(ref, desired.wire)
        current = await self.kube.read_configmap(ref.namespace, body["metadata"]["name"])
        if configmap_differs(current, body):
            await self.kube.write_configmap(body, exists=current is not None)

    def _claimed(self, ref: PolicyRef, pods: list[WorkerPod]) -> tuple[list[WorkerPod], list[WorkerObservation]]:
        """The pods this policy owns, and a CONFLICT observation for each that another policy
        keeps (it selects the pod, or the worker behind it, too, and holds it or is older)."""
        everyone = self._all_policies()
        at_target = self._pods_by_target()
        mine: list[WorkerPod] = []
        conflicts: list[WorkerObservation] = []
        for pod in pods:
            holder = self._holder(pod)
            others = at_target.get(pod.control_target, ()) if pod.address else ()
            won = owner(claims(pod, everyone, others), holder)
            if won is None or won[0].uid == ref.uid:
                mine.append(pod)
                continue
            other, via = won
            where = "" if via.uid == pod.uid else f" through pod {via.key} at {pod.control_target}"
            why = "it holds the worker" if other.uid == holder else "it is older"
            conflicts.append(WorkerObservation(
                pod.key, WorkerState.CONFLICT,
                f"also claimed by the policy {other.key}{where}, which keeps it ({why}); not pushed"))
        return mine, conflicts

    def _pods_by_target(self) -> dict[str, list[WorkerPod]]:
        out: dict[str, list[WorkerPod]] = {}
        for pods in self.pods.values():
            for p in pods:
                if p.address and not p.deleting:
                    out.setdefault(p.control_target, []).append(p)
        return out

    async def _read_statuses(self, pods: list[WorkerPod]) -> None:
        """Starts a status read per running pod that needs one (``sync.needs_read``, or the
        worker's holder changed since this pod's last read) and waits at most ``read_wait``
        for them; a read still under way is marked orphaned, so that its end wakes the loops."""
        now = time.monotonic()
        reads = [t for p in pods if p.running and self._wants_read(p, now)
                 and (t := self._start_read(p, self._track(p))) is not None]
        if not reads:
            return
        _, late = await asyncio.wait(reads, timeout=self.read_wait)
        for pod in pods:
            track = self.tracks.get(pod.uid)
            if track is not None and track.read in late:
                track.read_orphaned = True

    def _wants_read(self, pod: WorkerPod, now: float) -> bool:
        track = self._track(pod)
        known = self.holders.get(pod.control_target)
        moved = (known is not None and track.status is not None and known[1] > track.read_at
                 and known[0] != (track.status.pending_policy_uid or track.status.policy_uid))
        return moved or needs_read(track, now, self.resync)

    def _classify(self, ref: PolicyRef, pods: list[WorkerPod], desired: Desired) -> tuple[
            list[WorkerObservation], dict[str, tuple[WorkerPod, Track, RolloutWorker]]]:
        """Each owned worker's observation for ``.status`` and its view for the planner, by pod key."""
        now = time.monotonic()
        reload_on_revision = ref.spec.get("onModelRevisionChange", "Recapture") == "Recapture"
        observations: list[WorkerObservation] = []
        views: dict[str, tuple[WorkerPod, Track, RolloutWorker]] = {}
        for pod in pods:
            track = self._track(pod)
            settle(track)
            obs, view = classify(
                pod, track, desired.wire, want_revision=pod.model_revision if reload_on_revision else "",
                recaptures=self._recaptures(track.status, desired.wire), now=now, deadline=desired.deadline)
            observations.append(obs)
            views[pod.key] = (pod, track, view)
        return observations, views

    def _hand_out(self, plan: RolloutPlan, views: Mapping[str, tuple[WorkerPod, Track, RolloutWorker]],
                  wire: pb.GraphPolicy) -> dict[str, list[str]]:
        """Starts the pushes and reloads the plan allows; returns what was started, for Events."""
        fired: dict[str, list[str]] = {PUSH: [], RELOAD: []}
        for name in plan.push:
            pod, track, _ = views[name]
            self._start_push(pod, track, wire)
            fired[PUSH].append(name)
        for name in plan.reload:
            pod, track, _ = views[name]
            self._start_reload(pod, track, pod.model_revision)
            fired[RELOAD].append(f"{name} ({pod.model_revision})")
        return fired

    async def _report(self, loop: PolicyLoop, ref: PolicyRef, outcome: RunOutcome, invalid: str | None) -> None:
        """Writes status, posts Events, drops connections to gone workers and sets the gauges."""
        await self._write_status(loop, ref, outcome.observations, invalid, outcome.rollout)
        self._post_events(loop, ref, outcome.observations, outcome.fired, invalid, outcome.plan)
        live = self._live_targets()
        await self.client.prune(live)
        for target in [t for t in self.holders if t not in live]:
            del self.holders[target]
        counts = Counter(str(o.state) for o in outcome.observations)
        metrics.set_worker_states(ref.namespace, ref.name, dict(counts), _STATES)

    def _next_delay(self, pods: list[WorkerPod], observations: list[WorkerObservation],
                    invalid: str | None) -> float:
        """Soon while a worker is still moving (a call under way, a change not settled, a worker
        pending or starting); otherwise the interval."""
        busy = any(not t.settled or t.busy() for p in pods if (t := self.tracks.get(p.uid)) is not None)
        pending = any(o.state in (WorkerState.PENDING, WorkerState.STARTING) for o in observations)
        if (pending or busy) and invalid is None:
            return min(self.interval, FOLLOW_UP_SECONDS)
        return self.interval

    async def _write_status(self, loop: PolicyLoop, ref: PolicyRef,
                            observations: list[WorkerObservation], invalid: str | None,
                            rollout: dict[str, Any] | None) -> None:
        previous = loop.last_status if loop.last_status is not None else dict(ref.status)
        status = build_status(generation=ref.generation, observations=observations,
                              previous=previous, now=datetime.now(UTC), invalid=invalid,
                              rollout=rollout)
        desired_traffic = from_traffic_or_none(ref)
        if loop.recommendation and desired_traffic is not None:
            status["recommendation"] = loop.recommendation
        effective = applied_status(loop.applied)
        if effective is not None:
            effective["inEffect"] = in_effect(desired_traffic, loop.applied, _spec_mode(ref))
            status["effectiveCaptureSizes"] = effective
        if status == previous:
            return
        await self.kube.patch_policy_status(ref.namespace, ref.name,
                                            build_status_patch(status, previous))
        metrics.STATUS_WRITES.inc()
        loop.last_status = status

    def _post_events(self, loop: PolicyLoop, ref: PolicyRef,
                     observations: list[WorkerObservation], fired: dict[str, list[str]],
                     invalid: str | None, plan: RolloutPlan | None) -> None:
        """Events for what a person wants to see, one per kind per run (never one per worker)."""
        body = ref.body()
        if fired[PUSH]:
            self._event(body, "Normal", "PolicyPushed",
                        f"pushed generation {ref.generation} to {_names(fired[PUSH])}")
        if fired[RELOAD]:
            self._event(body, "Normal", "ModelRevisionLoad",
                        f"asked to load a new model revision: {_names(fired[RELOAD])}")
        fresh: dict[WorkerState, list[WorkerObservation]] = {}
        states: dict[str, WorkerState] = {}
        for o in observations:
            states[o.name] = o.state
            if o.state in FAILURE_REASONS and loop.worker_states.get(o.name) != o.state:
                fresh.setdefault(o.state, []).append(o)
        for state, obs in fresh.items():
            detail = "; ".join(f"{o.name}: {o.message}" for o in obs[:3])
            more = f"; and {len(obs) - 3} more" if len(obs) > 3 else ""
            self._event(body, "Warning", FAILURE_REASONS[state], detail + more)
        paused = plan.failed if plan is not None and plan.paused else ()
        if paused and not loop.paused:
            self._event(body, "Warning", "RolloutPaused",
                        f"generation {ref.generation}: not handed to more workers until "
                        f"{_names(list(paused))} recover(s) or the spec changes")
        elif loop.paused and not paused and plan is not None:
            self._event(body, "Normal", "RolloutResumed", f"generation {ref.generation}")
        loop.paused = paused
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
        return {t for pods in self.pods.values() for p in pods if p.running
                for t in (p.control_target, p.target)}


def from_traffic_or_none(ref: PolicyRef) -> FromTraffic | None:
    try:
        return from_traffic_settings(ref.spec)
    except PolicyError:
        return None


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return f"{len(names)} worker(s): {shown}{more}"
