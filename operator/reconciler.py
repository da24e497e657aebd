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

One run (``Reconciler.reconcile``) takes its own pods from the selection index
(``pod_index``, kept by the watch events), parses the spec once (``desired.desired_policy``) and
hands the parsed value down. It never waits on a worker for long: each worker's status stream
(``status_watch``) keeps its status current and wakes the loop on a change; a run starts a status
read only for a worker that needs one (``sync.needs_read``: nothing known, a changed pod, a change
of ours that ended after its last message, and for a worker without the stream a failed read, a
change settling or the slow resync), each on its own deadline, waits at most
``READ_WAIT_SECONDS`` for them, and uses the last known status of any worker that has not
answered yet (its late answer wakes the loop). Then, without awaiting anything, it settles who
owns each worker (``ownership.split_owned``: the senior policy owns every worker it selects),
looks at the traffic (``traffic.recommend``), what each worker lacks, and
what to push: every loop decides from the same snapshot, so two policies never both push to a
worker nor both defer to each other. Pushes and model reloads run as tasks of their own
(``worker_calls``), handed out by the rollout planner (``rollout.plan_rollout``) at most
``maxUnavailable`` at a time (a departed worker's slot: ``departures``); their end wakes the loop.
The run writes the ConfigMap when the policy to push changed, and the status when it changed,
each at most once a second (``pacing``); both have no other writer.
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
from graphkeeper.operator.canary import PHASES
from graphkeeper.operator.canary_rollout import CanaryRollout, canary_status
from graphkeeper.operator.departures import Departures
from graphkeeper.operator.desired import Desired, desired_policy
from graphkeeper.operator.events import Told, run_events
from graphkeeper.operator.kube import Kube, api_unreachable
from graphkeeper.operator.outage import OUTAGE
from graphkeeper.operator.ownership import split_owned
from graphkeeper.operator.pacing import RENDER_EVERY_SECONDS, STATUS_EVERY_SECONDS, Pacer
from graphkeeper.operator.pod_index import SelectionIndex
from graphkeeper.operator.render import build_configmap, build_status_patch, configmap_differs
from graphkeeper.operator.rollout import (
    RecaptureKeys,
    RolloutPlan,
    RolloutWorker,
    Wait,
    plan_rollout,
    rollout_status,
    rollout_wait,
)
from graphkeeper.operator.selection import PolicyRef, WorkerPod
from graphkeeper.operator.status import WorkerObservation, WorkerState, build_status
from graphkeeper.operator.sync import PUSH, RELOAD, Track, classify, settle
from graphkeeper.operator.traffic import (
    Applied,
    applied_from_status,
    merged_traffic,
    recommend,
    recommend_due,
    sizes_status,
    traffic_key,
)
from graphkeeper.operator.worker_calls import Views, WorkerCalls
from graphkeeper.operator.workerclient import GraphControlClient
from graphkeeper.proto import worker_pb2 as pb

logger = logging.getLogger("graphkeeper.operator")

#: How soon to look again while some worker is still capturing a pushed generation.
FOLLOW_UP_SECONDS = 0.5
#: Events arriving this close together are handled by one run.
COALESCE_SECONDS = 0.02
#: How long a run waits for status reads before it uses what it knows (late answers wake it).
READ_WAIT_SECONDS = 0.5
#: Retry delay while the Kubernetes API does not answer.
API_RETRY_SECONDS = 1.0
#: A settled worker whose pod did not change is read again after this many seconds.
RESYNC_SECONDS = 60.0
#: A recommendation from traffic is recomputed at most every this many reconcile intervals (30 s at
#: the default 5 s) while only the traffic changes: each recomputation is a status write, and a
#: large fleet's staggered reads would otherwise change the merged histogram every few seconds.
RECOMMEND_EVERY_INTERVALS = 6
#: The status keys of the sizes from traffic (``traffic.sizes_status``) and of their canary.
SIZES_KEYS = ("recommendation", "effectiveCaptureSizes", "canary")

_STATES = [str(s) for s in WorkerState]


@dataclass
class RunOutcome:
    """What one run observed and did; ``desired`` is None for an invalid spec, ``plan`` and
    ``rollout`` when nothing was planned."""

    observations: list[WorkerObservation]
    desired: Desired | None = None
    plan: RolloutPlan | None = None
    rollout: dict[str, Any] | None = None
    #: What the rollout waits on, if anything (``rollout.rollout_wait``).
    wait: Wait | None = None
    fired: dict[str, list[str]] = field(default_factory=lambda: {PUSH: [], RELOAD: []})


def mark_waiting(observations: list[WorkerObservation], waiting: set[str]) -> list[WorkerObservation]:
    """Pending workers the rollout did not reach this run say that they wait for their turn."""
    return [replace(o, message=f"waiting for its turn in the rollout ({o.message})")
            if o.name in waiting and o.state == WorkerState.PENDING else o
            for o in observations]


def policy_status(generation: int, outcome: RunOutcome, previous: Mapping[str, Any], invalid: str | None,
                  applied: Applied, recommendation: Mapping[str, Any] | None, now: datetime,
                  canary: CanaryRollout | None = None) -> dict[str, Any]:
    """The whole ``.status`` after one run (pure): the workers' part (``status.build_status``), the
    sizes from traffic (``traffic.sizes_status``) and their canary (``canary_rollout``). An invalid
    spec keeps the sizes as the last status showed them: the workers keep their last policy."""
    running = canary.progressing() if canary is not None else None
    wait = (outcome.wait.reason, outcome.wait.message) if outcome.wait is not None else None
    status = build_status(generation=generation, observations=outcome.observations, previous=previous,
                          now=now, invalid=invalid, rollout=outcome.rollout, canary=running, wait=wait)
    if outcome.desired is None:
        status.update({key: previous[key] for key in SIZES_KEYS if key in previous})
    else:
        status.update(sizes_status(outcome.desired.traffic, outcome.desired.mode, applied, recommendation))
        shown = canary_status(canary.state) if canary is not None else None
        if shown is not None:
            status["canary"] = shown
    return status


def next_delay(busy: bool, observations: list[WorkerObservation], invalid: str | None, interval: float) -> float:
    """Soon while a worker is still moving (``busy``: a call under way or a change not settled; a
    worker pending or starting); otherwise the interval."""
    pending = any(o.state in (WorkerState.PENDING, WorkerState.STARTING) for o in observations)
    if (pending or busy) and invalid is None:
        return min(interval, FOLLOW_UP_SECONDS)
    return interval


class PolicyLoop:
    """The loop of one policy and what it remembers between runs; ``wake()`` asks for a run now."""

    def __init__(self, reconciler: Reconciler, ref: PolicyRef) -> None:
        self.uid, self.namespace, self.name = ref.uid, ref.namespace, ref.name
        self.generation = ref.generation
        self.last_status: dict[str, Any] | None = None
        #: The pods the last run selected, and their GraphControl addresses.
        self.seen_pods: set[str] = set()
        self.seen_targets: set[str] = set()
        #: Capture sizes from traffic: the set applied last (read back from status, so a restarted
        #: operator keeps it), the last recommendation, and what and when it was computed from.
        #: The canary of a new set (``fromTraffic.canary``); one left running by a restarted
        #: operator is reverted.
        self.canary = CanaryRollout()
        self.applied: Applied = self.canary.resume(ref.status, applied_from_status(ref.status), time.time())
        self.recommendation: dict[str, Any] | None = (ref.status or {}).get("recommendation")
        self.traffic_key: tuple | None = None
        self.recommended_at = -math.inf
        #: The wire policy the ConfigMap was last found or written with (None: not checked yet).
        self.rendered: pb.GraphPolicy | None = None
        #: What this policy's Events told so far.
        self.told = Told()
        #: Status patches and ConfigMap writes, each at most once per interval (``pacing``).
        self.status_pace = Pacer(STATUS_EVERY_SECONDS)
        self.render_pace = Pacer(RENDER_EVERY_SECONDS)
        self._reconciler = reconciler
        self._woken = asyncio.Event()
        self._woken.set()
        self.task = asyncio.create_task(self._run(), name=f"graphpolicy {ref.key}")

    def wake(self) -> None:
        self._woken.set()

    def watches(self, pod: WorkerPod) -> bool:
        """Whether the last run selected ``pod``, or a pod at the same address."""
        return pod.uid in self.seen_pods or bool(pod.address and pod.control_target in self.seen_targets)

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
    """Owns the policies' loops, the calls to workers they share, and one reconcile run."""

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
        self.kube = kube
        self.pods, self.policies = pods, policies
        self.interval = interval
        self.read_wait = read_wait
        self.resync = resync
        self.calls = WorkerCalls(client, self._wake_pod)
        self.departures = Departures(client, self.wake_all)
        self.keys = RecaptureKeys()
        self.loops: dict[str, PolicyLoop] = {}
        #: Who selects what, kept current by the watch events (a run touches only its own pods).
        self.index = SelectionIndex()
        self.index.seed(pods, policies)
        self._fingerprints: dict[str, tuple] = {}
        self._post_event = post_event
        self.runs = 0

    # --- wiring from watch events ---------------------------------------------------------------

    def on_policy(self, ref: PolicyRef, deleted: bool) -> None:
        """A GraphPolicy watch event: start, wake or stop its loop."""
        OUTAGE.ok()
        loop = self.loops.get(ref.uid)
        moved = self.index.drop_policy(ref.uid) if deleted else self.index.put_policy(ref)
        # Rivals whose ownership may have moved (a selector edit, a new senior, one letting go);
        # a change that leaves the selection as it was wakes no one else.
        for uid in self.index.claimants(moved) - {ref.uid}:
            self.wake(uid)
        if deleted or ref.deleting:
            if loop is not None:
                loop.task.cancel()
                del self.loops[ref.uid]
                metrics.forget_policy(ref.namespace, ref.name, _STATES)
            return
        if loop is None:
            self.loops[ref.uid] = PolicyLoop(self, ref)
        elif loop.generation != ref.generation:
            loop.generation = ref.generation
            loop.wake()

    def on_pod(self, pod: WorkerPod, deleted: bool) -> None:
        """A Pod watch event: wake the loops of policies that select (or selected) it."""
        OUTAGE.ok()
        fingerprint = None if deleted else pod.fingerprint()
        if self._fingerprints.get(pod.uid) == fingerprint and (not deleted or pod.uid not in self.index.pods):
            return
        if deleted:
            self._fingerprints.pop(pod.uid, None)
            track = self.calls.tracks.get(pod.uid)
            if track is not None and (track.busy() or not track.settled):
                selecting = [lp for lp in self.loops.values() if pod.uid in lp.seen_pods]
                self.departures.add(pod, track.action_started, frozenset().union(*(lp.seen_pods for lp in selecting)),
                                    frozenset(lp.uid for lp in selecting))
            self.calls.forget(pod)
            self.index.drop_pod(pod.uid)
        else:
            self._fingerprints[pod.uid] = fingerprint
            self.calls.pod_changed(pod)
            self.index.put_pod(pod)
        for loop in self.loops.values():
            if loop.watches(pod) or self.index.selects(loop.uid, pod.uid):
                loop.wake()

    def wake(self, uid: str) -> None:
        loop = self.loops.get(uid)
        if loop is not None:
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
        await self.departures.close()
        await self.calls.close()

    # --- one run -------------------------------------------------------------------------------

    async def reconcile(self, loop: PolicyLoop) -> float:
        """One run: parses the spec once, reads the selected workers, hands out what the rollout
        allows, writes the ConfigMap (when the policy to push changed) and the status; returns the
        seconds until the next run."""
        ref = self._ref(loop)
        if ref is None or ref.deleting:
            return self.interval
        started = time.monotonic()
        self.runs += 1
        pods = self.index.selected(ref.uid)
        loop.seen_pods = {p.uid for p in pods}
        loop.seen_targets = {p.control_target for p in pods if p.address}
        desired, invalid = desired_policy(ref, len(pods), loop.applied)
        put_off = math.inf  # seconds until a write this run put off is due
        if desired is None:
            outcome = RunOutcome([WorkerObservation(p.key, WorkerState.PENDING, "not pushed") for p in pods])
        else:
            outcome = await self._roll_out(loop, ref, pods, desired)
            put_off = await self._render(loop, ref, outcome.desired or desired)  # with the sizes it applied
        put_off = min(put_off, await self._report(loop, ref, outcome, invalid))
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        return min(put_off, next_delay(self.calls.busy(pods), outcome.observations, invalid, self.interval))

    def _ref(self, loop: PolicyLoop) -> PolicyRef | None:
        return self.index.policies.get(loop.uid)

    async def _roll_out(self, loop: PolicyLoop, ref: PolicyRef, pods: list[WorkerPod],
                        desired: Desired) -> RunOutcome:
        """Reads the selected workers that need it, settles who owns each, looks at their traffic,
        classifies the ones this policy owns, and starts what the plan allows."""
        self.keys.remember(desired.wire, len(self.loops))
        await self.calls.read(pods, wait=self.read_wait, resync=self.resync)
        # From here to the hand-out nothing awaits: who owns each worker, what it lacks and what
        # is pushed to it come from one snapshot, the same one every other loop sees.
        mine, observations = split_owned(ref, pods, self.index.claims)
        if desired.traffic is not None and not loop.canary.busy:
            desired = self._from_traffic(loop, ref, mine, desired)
        desired = self._canary(loop, ref, mine, desired)
        worker_observations, views = self._classify(mine, desired)
        observations += worker_observations
        departed = self.departures.holding(loop.uid, views, time.monotonic(), desired.deadline)
        plan = plan_rollout([view for _, _, view in views.values()]
                            + [RolloutWorker(key, available=False, blocked=True, departed=True) for key in departed],
                            desired.max_unavailable)
        fired = self.calls.hand_out(plan, views, desired.wire_for)
        observations = mark_waiting(observations, set(plan.waiting))
        updated = sum(1 for o in observations if o.state == WorkerState.CAPTURED)
        rollout = rollout_status(plan, updated=updated, total=len(mine))
        return RunOutcome(observations, desired, plan, rollout, rollout_wait(plan), fired)

    def _from_traffic(self, loop: PolicyLoop, ref: PolicyRef, mine: list[WorkerPod], desired: Desired) -> Desired:
        """Looks at the owned workers' traffic (this run's snapshot) when it is due, and carries out
        what ``traffic.recommend`` decided: the recommendation for status and, when it applied a
        new set, the policy to push; returns that policy."""
        assert desired.traffic is not None
        statuses = self.calls.statuses(mine)
        traffic = merged_traffic(statuses)
        key = traffic_key(ref.generation, traffic, loop.applied)
        if not recommend_due(key, loop.traffic_key, time.monotonic() - loop.recommended_at,
                             RECOMMEND_EVERY_INTERVALS * self.interval):
            return desired
        loop.traffic_key, loop.recommended_at = key, time.monotonic()
        look = recommend(desired.traffic, desired.spec_wire, loop.applied, statuses, traffic, loop.recommendation,
                         time.time())
        loop.recommendation = look.status
        if look.new is None or look.current is None:
            return desired  # too few steps yet
        # With fromTraffic.canary the new set is offered to the canary instead (``_canary``).
        if look.applied != loop.applied and not loop.canary.offer(desired.traffic, look.applied):
            loop.applied = look.applied
            loop.traffic_key = traffic_key(ref.generation, traffic, look.applied)
            desired = desired.applying(look.applied)
            self.keys.remember(desired.wire, len(self.loops))
            metrics.SIZE_APPLIES.inc()
            self._event(ref.body(), "Normal", "CaptureSizesApplied", look.applied_message)
        metrics.set_recommendation(ref.namespace, ref.name, recommended=look.new.coverage,
                                   current=look.current.coverage, graphs=look.new.graphs,
                                   memory_bytes=look.new.memory_bytes, steps=traffic.steps)
        return desired

    def _canary(self, loop: PolicyLoop, ref: PolicyRef, mine: list[WorkerPod], desired: Desired) -> Desired:
        """Carries out the canary's step (``canary_rollout``): the policy each worker is to hold,
        the set in effect after a verdict, and the Events; returns that policy."""
        statuses = {p.key: t.status if (t := self.calls.tracks.get(p.uid)) is not None and t.error is None else None
                    for p in mine}
        step = loop.canary.run(desired, loop.applied, statuses, time.time())
        if step.applied != loop.applied:
            loop.applied = step.applied
            metrics.SIZE_APPLIES.inc()
        for wire in (step.desired.wire, step.desired.canary_wire):
            if wire is not None:
                self.keys.remember(wire, len(self.loops))
        for event in step.events:
            self._event(ref.body(), event.kind, event.reason, event.message)
        metrics.CANARY_PHASE.labels(namespace=ref.namespace, policy=ref.name).set(PHASES.index(loop.canary.state.phase))
        return step.desired

    def _classify(self, pods: list[WorkerPod], desired: Desired) -> tuple[list[WorkerObservation], Views]:
        """Each owned worker's observation for ``.status`` and its view for the planner, by pod key."""
        now = time.monotonic()
        observations: list[WorkerObservation] = []
        views: dict[str, tuple[WorkerPod, Track, RolloutWorker]] = {}
        for pod in pods:
            track = self.calls.track(pod)
            settle(track)
            obs, view = classify(
                pod, track, desired.wire_for(pod.key),
                want_revision=pod.model_revision if desired.reload_on_revision else "",
                recaptures=self.keys.recaptures(track.status, desired.wire_for(pod.key)), now=now,
                deadline=desired.deadline)
            observations.append(obs)
            views[pod.key] = (pod, track, view)
        return observations, views

    async def _render(self, loop: PolicyLoop, ref: PolicyRef, desired: Desired) -> float:
        """Writes the ConfigMap worker pods boot from (nothing else writes it) when the policy to
        push changed since the last run found or wrote it (a spec edit, sizes applied from
        traffic), so that a pod started later captures it before it is ready and is not pushed
        again; at most once a second under an edit burst (returns how long it put a write off).
        It is read only the first time (after that it holds what this loop wrote). An invalid
        spec is never rendered: the last good ConfigMap stays."""
        wire = desired.wire
        if loop.rendered is not None and loop.rendered == wire:
            return math.inf
        if wait := loop.render_pace.wait(time.monotonic()):
            return wait
        body = build_configmap(ref, wire)
        name = body["metadata"]["name"]
        current = None if loop.rendered is None else build_configmap(ref, loop.rendered)
        if loop.rendered is None:
            current = await self.kube.read_configmap(ref.namespace, name)
        if configmap_differs(current, body):
            await self.kube.write_configmap(body, exists=current is not None)
            loop.render_pace.wrote(time.monotonic())
            logger.info("%s: wrote ConfigMap %s for generation %d", ref.key, name, ref.generation)
        loop.rendered = wire
        return math.inf

    async def _report(self, loop: PolicyLoop, ref: PolicyRef, outcome: RunOutcome, invalid: str | None) -> float:
        """Writes status (nothing else writes it; at most once a second, returning how long it put
        a write off), posts the run's Events, drops connections to gone workers and sets the gauges."""
        previous = loop.last_status if loop.last_status is not None else dict(ref.status)
        status = policy_status(ref.generation, outcome, previous, invalid, loop.applied, loop.recommendation,
                               datetime.now(UTC), loop.canary)
        put_off = loop.status_pace.wait(time.monotonic()) if status != previous else math.inf
        if not put_off:
            await self.kube.patch_policy_status(ref.namespace, ref.name, build_status_patch(status, previous))
            loop.status_pace.wrote(time.monotonic())
            metrics.STATUS_WRITES.inc()
            loop.last_status = status
            put_off = math.inf
        events, loop.told = run_events(loop.told, generation=ref.generation, observations=outcome.observations,
                                       fired=outcome.fired, invalid=invalid, plan=outcome.plan, wait=outcome.wait,
                                       now=time.monotonic())
        for event in events:
            self._event(ref.body(), event.kind, event.reason, event.message)
        await self.calls.prune(lambda target: self.index.live(target) or self.departures.probing(target))
        counts = Counter(str(o.state) for o in outcome.observations)
        metrics.set_worker_states(ref.namespace, ref.name, dict(counts), _STATES)
        return put_off

    def _event(self, body: dict[str, Any], kind: str, reason: str, message: str) -> None:
        log = logger.warning if kind == "Warning" else logger.info
        log("%s/%s: %s: %s", body["metadata"]["namespace"], body["metadata"]["name"], reason,
            message)
        try:
            self._post_event(body, type=kind, reason=reason, message=message[:1024])
        except Exception:  # Events are a courtesy; never fail a reconcile for one
            logger.debug("could not post an Event", exc_info=True)
