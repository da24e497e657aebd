"""The reconciler against light GraphControl stand-ins (``tests/fakes/fake_worker.py``, no model): the
rollout, independent workers and the status it writes, without a cluster.

The Kubernetes side is a recorder of the status patches and Events the reconciler makes; the
workers are real gRPC servers that keep the worker's contract, and every claim about how many
were recapturing at once comes from their own lifecycle transitions.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from fakes.fake_worker import FakeWorkerServer, FakeWorkerState  # tests/fakes, not shipped

from graphkeeper.operator.desired import desired_policy
from graphkeeper.operator.reconciler import Reconciler, mark_waiting
from graphkeeper.operator.selection import PolicyRef, WorkerPod
from graphkeeper.operator.status import WorkerObservation, WorkerState
from graphkeeper.operator.workerclient import GraphControlClient

LABELS = {"app": "w"}


class Recorder:
    """Stands in for the Kubernetes API: keeps the last status and every Event."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {}
        self.events: list[tuple[str, str, str]] = []
        self.configmaps: dict[tuple[str, str], dict[str, Any]] = {}

    async def patch_policy_status(self, namespace, name, patch):
        for key, value in patch["status"].items():
            if value is None:
                self.status.pop(key, None)
            else:
                self.status[key] = value

    async def read_configmap(self, namespace, name):
        return self.configmaps.get((namespace, name))

    async def write_configmap(self, body, exists):
        self.configmaps[(body["metadata"]["namespace"], body["metadata"]["name"])] = body

    def post_event(self, body, type, reason, message):  # noqa: A002 (kopf's keyword)
        self.events.append((type, reason, message))


class Fleet:
    def __init__(self, count: int, token: str = "", **state: Any) -> None:
        self.count, self.token, self.state = count, token, state
        self.servers: list[FakeWorkerServer] = []
        self.pods: dict[str, list[WorkerPod]] = {"ns": []}
        self.policies: dict[str, list[PolicyRef]] = {"ns": []}
        self.kube = Recorder()
        self.reconciler: Reconciler | None = None

    async def start(self, token_file: str = "") -> Fleet:
        for i in range(self.count):
            server = await FakeWorkerServer(FakeWorkerState(token=self.token, **self.state),
                                            separate_control=True).start()
            self.servers.append(server)
            self.pods["ns"].append(self.pod(i))
        self.reconciler = Reconciler(
            client=GraphControlClient(timeout=2.0, load_timeout=60.0, token_file=token_file),
            kube=self.kube, pods=self.pods, policies=self.policies, interval=0.5,
            post_event=self.kube.post_event)
        return self

    def pod(self, i: int, **kw: Any) -> WorkerPod:
        server = self.servers[i]
        base = dict(namespace="ns", name=f"w{i:02d}", uid=f"pod-{i}", labels=LABELS,
                    address="127.0.0.1", port=server.port, control_port=server.control_port,
                    phase="Running", ready=True)
        return WorkerPod(**{**base, **kw})

    def annotate(self, i: int, revision: str) -> None:
        self.pods["ns"][i] = self.pod(i, model_revision=revision, model_source="random:tiny@1")
        self.reconciler.on_pod(self.pods["ns"][i], deleted=False)

    def apply(self, spec: dict, generation: int, uid: str = "policy-uid") -> PolicyRef:
        ref = PolicyRef(namespace="ns", name="p", uid=uid, created="2026-11-30T00:00:00Z",
                        generation=generation, spec=spec)
        self.policies["ns"] = [p for p in self.policies["ns"] if p.uid != uid] + [ref]
        self.reconciler.on_policy(ref, deleted=False)
        self.reconciler.wake(uid)
        return ref

    def holding(self, generation: int, uid: str = "policy-uid") -> int:
        return sum(1 for s in self.servers if s.state.policy is not None
                   and s.state.policy.policy_uid == uid and s.state.policy.generation == generation
                   and s.state.state == 5)

    async def until(self, what: str, check, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.kube.status}"
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await self.reconciler.shutdown()
        for server in self.servers:
            await server.stop()


def max_concurrently_busy(servers: list[FakeWorkerServer], since: float) -> int:
    """From the workers' own lifecycle transitions: the most that were not READY at once."""
    changes = sorted((t, i, name) for i, s in enumerate(servers)
                     for t, name in s.state.transitions if t >= since)
    busy: set[int] = set()
    most = 0
    for _, i, name in changes:
        if name == "READY":
            busy.discard(i)
        else:
            busy.add(i)
        most = max(most, len(busy))
    return most


def spec(sizes: list[int], **extra: Any) -> dict:
    return {"selector": {"matchLabels": LABELS}, "mode": "Full",
            "captureSizes": {"sizes": sizes}, **extra}


def run(scenario, count: int, **state: Any):
    async def main():
        fleet = await Fleet(count, **state).start()
        try:
            return await scenario(fleet)
        finally:
            await fleet.stop()
    return asyncio.run(main())


def test_a_capture_change_goes_to_at_most_max_unavailable_workers_at_a_time():
    async def scenario(fleet: Fleet):
        rollout = {"rollout": {"maxUnavailable": 2}}
        fleet.apply(spec([1, 2], **rollout), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 10)
        t0 = time.time()
        fleet.apply(spec([1, 2, 4], **rollout), 2)
        await fleet.until("generation 2 everywhere", lambda: fleet.holding(2) == 10)
        await fleet.until("status Ready", lambda: fleet.kube.status.get("capturedWorkers") == 10
                          and fleet.kube.status.get("observedGeneration") == 2)
        return max_concurrently_busy(fleet.servers, t0), fleet.kube.status
    most, status = run(scenario, 10, capture_seconds=0.3)
    assert most == 2, f"at most 2 recapturing at once, and the budget was used: {most}"
    assert status["rollout"]["updatedWorkers"] == 10
    assert status["rollout"]["maxUnavailable"] == 2


def test_a_force_deleted_pod_keeps_its_slot_while_its_worker_may_still_recapture():
    """The pod goes at once, the process may not: its slot stays taken until a replacement is
    READY, so no third worker recaptures under a limit of 2."""
    async def scenario(fleet: Fleet):
        spare = fleet.pods["ns"].pop()  # server 4 becomes the replacement later
        fleet.reconciler.on_pod(spare, deleted=True)  # as the pod watch would have
        rollout = {"rollout": {"maxUnavailable": 2}}
        fleet.apply(spec([1, 2], **rollout), 1)
        await fleet.until("generation 1 on the four", lambda: fleet.holding(1) == 4)
        t0 = time.time()
        fleet.apply(spec([1, 2, 4], **rollout), 2)
        await fleet.until("the first batch recapturing",
                          lambda: fleet.servers[0].state.state != 5)
        gone = fleet.pods["ns"].pop(0)
        fleet.reconciler.on_pod(gone, deleted=True)  # kubectl delete --force: the pod is gone
        await asyncio.sleep(2.0)
        replacement = replace(spare, name="w00-new", uid="pod-new")
        fleet.pods["ns"].append(replacement)
        fleet.reconciler.on_pod(replacement, deleted=False)
        await fleet.until("generation 2 on every worker", lambda: fleet.holding(2) == 5)
        return max_concurrently_busy(fleet.servers, t0), fleet.kube.events
    most, events = run(scenario, 5, capture_seconds=1.5)
    assert most == 2, f"at most 2 recapturing at once, the deleted pod's worker counted: {most}"
    waits = [e for e in events if e[1] == "WaitingForDeletedWorker"]
    assert len(waits) == 1 and "ns/w00" in waits[0][2], events


def test_a_deleted_pod_whose_worker_is_gone_frees_its_slot_at_once():
    """Scaled down mid-rollout: the pod and its process are gone, no replacement comes. Its slot
    is free as soon as its address stops answering, not at the progress deadline (600 s)."""
    async def scenario(fleet: Fleet):
        rollout = {"rollout": {"maxUnavailable": 1}}
        fleet.apply(spec([1, 2], **rollout), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 4)
        fleet.apply(spec([1, 2, 4], **rollout), 2)
        await fleet.until("the first worker recapturing", lambda: fleet.servers[0].state.state != 5)
        await fleet.servers[0].stop()
        gone = fleet.pods["ns"].pop(0)
        fleet.reconciler.on_pod(gone, deleted=True)
        started = time.monotonic()
        others = fleet.servers[1:]
        await fleet.until("generation 2 on the other three", lambda: sum(
            1 for s in others if s.state.policy.generation == 2 and s.state.state == 5) == 3, timeout=20)
        await fleet.until("status Ready", lambda: fleet.kube.status.get("capturedWorkers") == 3
                          and fleet.kube.status.get("observedGeneration") == 2)
        return time.monotonic() - started
    # Three recaptures of 1 s, one at a time: about 3 s; a slot held to the deadline never ends.
    assert run(scenario, 4, capture_seconds=1.0) < 10


def test_without_a_rollout_section_a_quarter_of_the_fleet_recaptures_at_once():
    async def scenario(fleet: Fleet):
        fleet.apply(spec([1, 2]), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 8)
        t0 = time.time()
        fleet.apply(spec([4]), 2)
        await fleet.until("generation 2 everywhere", lambda: fleet.holding(2) == 8)
        return max_concurrently_busy(fleet.servers, t0)
    assert run(scenario, 8, capture_seconds=0.3) == 2  # 25% of 8


def test_a_model_revision_change_reloads_in_batches_too():
    async def scenario(fleet: Fleet):
        fleet.apply(spec([1, 2], rollout={"maxUnavailable": "20%"}), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 10)
        t0 = time.time()
        for i in range(10):
            fleet.annotate(i, "rev-9")
        await fleet.until("rev-9 everywhere", lambda: all(
            s.state.model_revision == "rev-9" and s.state.state == 5 for s in fleet.servers))
        return max_concurrently_busy(fleet.servers, t0), sum(
            s.state.calls["LoadModelRevision"] for s in fleet.servers)
    most, loads = run(scenario, 10, capture_seconds=0.2, load_seconds=0.2)
    assert most == 2, most
    assert loads == 10, "one reload per worker"


def test_tenant_toggles_go_to_every_worker_at_once():
    async def scenario(fleet: Fleet):
        fleet.apply(spec([1, 2], rollout={"maxUnavailable": 1}), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 6)
        t0 = time.time()
        fleet.apply(spec([1, 2], rollout={"maxUnavailable": 1},
                         tenants=[{"name": "batch", "graphs": "Disabled"}]), 2)
        await fleet.until("generation 2 everywhere", lambda: fleet.holding(2) == 6, timeout=3)
        return max_concurrently_busy(fleet.servers, t0)
    assert run(scenario, 6, capture_seconds=1.0) == 0, "nothing recaptured"


def test_an_equivalent_rewrite_goes_to_every_worker_at_once_and_recaptures_nothing():
    """Sizes reordered and the maximum listed again capture the same graphs: the operator hands
    the new generation to everyone in one run (a budget of one would take six captures of a
    second each), and no stand-in recaptures."""
    async def scenario(fleet: Fleet):
        fleet.apply(spec([4, 1, 2], rollout={"maxUnavailable": 1}), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 6)
        t0 = time.time()
        rewrite = spec([1, 2, 4], rollout={"maxUnavailable": 1})
        rewrite["captureSizes"]["maxCaptureSize"] = 4
        fleet.apply(rewrite, 2)
        await fleet.until("generation 2 everywhere", lambda: fleet.holding(2) == 6, timeout=3)
        return max_concurrently_busy(fleet.servers, t0), fleet.kube.events
    most, events = run(scenario, 6, capture_seconds=1.0)
    assert most == 0, "nothing recaptured"
    pushed = [message for _, reason, message in events if reason == "PolicyPushed"]
    assert any(m.startswith("pushed generation 2 to 6 worker(s)") for m in pushed), pushed


def test_a_failed_capture_pauses_the_rollout_with_a_condition_and_an_event():
    async def scenario(fleet: Fleet):
        rollout = {"rollout": {"maxUnavailable": 2}}
        fleet.apply(spec([1, 2], **rollout), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 10)
        fleet.apply(spec([1, 16], **rollout), 2)  # every stand-in fails size 16
        await fleet.until("the rollout paused", lambda: (fleet.kube.status.get("rollout") or {})
                          .get("paused"))
        await asyncio.sleep(1.5)  # several more runs: nothing more is handed out
        return fleet.kube.status, fleet.kube.events, [
            s.state.calls["ApplyGraphPolicy"] for s in fleet.servers]
    status, events, pushes = run(scenario, 10, capture_seconds=0.2, fail_sizes=frozenset({16}))
    assert sum(p - 1 for p in pushes) == 2, f"only the first batch got generation 2: {pushes}"
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "RolloutPaused")
    assert status["rollout"]["failedWorkers"] == 2
    assert status["rollout"]["pendingWorkers"] == 8
    assert "RolloutPaused" in {reason for _, reason, _ in events}


def test_a_slow_reload_on_one_worker_does_not_hold_back_the_others():
    async def scenario(fleet: Fleet):
        fleet.apply(spec([1, 2], rollout={"maxUnavailable": 4}), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 5)
        fleet.servers[0].state.load_seconds = 30.0
        fleet.annotate(0, "rev-slow")
        await fleet.until("the slow reload to start",
                          lambda: fleet.servers[0].state.pending_revision == "rev-slow")
        t0 = time.monotonic()
        fleet.apply(spec([1, 2, 4], rollout={"maxUnavailable": 4}), 2)
        await fleet.until("generation 2 on the four others",
                          lambda: fleet.holding(2) == 4, timeout=10)
        took = time.monotonic() - t0
        await fleet.until("status to say so", lambda: fleet.kube.status.get(
            "observedGeneration") == 2 and fleet.kube.status.get("capturedWorkers") == 4,
            timeout=5)
        return took, fleet.servers[0].state.pending_revision
    took, still_loading = run(scenario, 5, capture_seconds=0.1)
    assert still_loading == "rev-slow", "the slow reload was still under way"
    assert took < 2.0, f"the others waited {took:.1f}s"


def test_every_control_call_carries_the_bearer_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")

    async def scenario(fleet: Fleet):
        await fleet.reconciler.shutdown()
        fleet.reconciler = Reconciler(
            client=GraphControlClient(timeout=2.0, token_file=str(token)), kube=fleet.kube,
            pods=fleet.pods, policies=fleet.policies, interval=0.5,
            post_event=fleet.kube.post_event)
        fleet.apply(spec([1, 2]), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 2)
        await fleet.until("status", lambda: fleet.kube.status.get("capturedWorkers") == 2)
        return fleet.kube.status

    status = run(scenario, 2, token="s3cret")
    assert status["capturedWorkers"] == 2

    async def wrong(fleet: Fleet):
        fleet.apply(spec([1, 2]), 1)  # the fleet's reconciler has no token
        await fleet.until("a failure", lambda: fleet.kube.status.get("failedWorkers") == 2)
        return fleet.kube.status
    status = run(wrong, 2, token="s3cret")
    assert "UNAUTHENTICATED" in status["workers"][0]["message"]


def test_a_worker_that_joins_mid_rollout_with_the_new_generation_is_not_pushed_again():
    async def scenario(fleet: Fleet):
        rollout = {"rollout": {"maxUnavailable": 1}}
        fleet.apply(spec([1, 2], **rollout), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 4)
        ref = fleet.apply(spec([1, 2, 4], **rollout), 2)
        await fleet.until("the first batch", lambda: fleet.holding(2) >= 1)
        # A new pod boots from the ConfigMap, which already carries generation 2.
        from graphkeeper.proto.policy import policy_from_spec
        booted = policy_from_spec(ref.spec, uid=ref.uid, name=ref.key, generation=2)
        late = await FakeWorkerServer(FakeWorkerState(policy=booted, capture_seconds=1.0),
                                      separate_control=True).start()
        fleet.servers.append(late)
        fleet.pods["ns"].append(fleet.pod(4))
        fleet.reconciler.on_pod(fleet.pods["ns"][4], deleted=False)
        await fleet.until("generation 2 everywhere", lambda: fleet.holding(2) == 5)
        return late.state.calls["ApplyGraphPolicy"]
    assert run(scenario, 4, capture_seconds=0.5) == 0


def test_a_policy_loop_stops_when_cancelled_in_the_same_moment_it_is_woken():
    """Shutdown cancels each policy loop; a wake at that moment (a worker call finishing) must not
    swallow the cancellation, or shutdown waits on the loop forever (Python 3.11's
    ``asyncio.wait_for`` returns the inner result when both happen in one step)."""
    from graphkeeper.operator.reconciler import PolicyLoop

    class Idle:
        interval, runs = 0.5, 0

        async def reconcile(self, loop) -> float:
            self.runs += 1
            return 30.0  # then the loop waits for a wake, up to 30 s

    async def main() -> bool:
        reconciler = Idle()
        ref = PolicyRef(namespace="ns", name="p", uid="u", created="2026-11-30T00:00:00Z", generation=1, spec={})
        loop = PolicyLoop(reconciler, ref)
        while reconciler.runs == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # now inside the timed wait for a wake
        loop.wake()
        loop.task.cancel()
        done, _ = await asyncio.wait({loop.task}, timeout=2.0)
        loop.task.cancel()  # lets the loop end if the first cancellation was lost
        return bool(done) and loop.task.cancelled()

    assert asyncio.run(main()), "the loop kept running after it was cancelled"


def ref_with(spec_: dict) -> PolicyRef:
    return PolicyRef(namespace="ns", name="p", uid="u", created="2026-11-30T00:00:00Z", generation=3, spec=spec_)


def test_a_valid_spec_is_desired_with_its_rollout_settings():
    desired, invalid = desired_policy(ref_with(spec([1, 2], rollout={"maxUnavailable": 3,
                                                                       "progressDeadlineSeconds": 9})), 10)
    assert invalid is None
    assert (desired.wire.generation, desired.wire.policy_name) == (3, "ns/p")
    assert (desired.max_unavailable, desired.deadline) == (3, 9.0)


def test_an_invalid_selector_sizes_or_rollout_is_reported_by_field_and_not_desired():
    for bad, field in [({"selector": {"matchLabels": {"": "x"}}}, "selector"),
                       ({"captureSizes": {"sizes": [0]}}, "spec.captureSizes.sizes[0]"),
                       ({"rollout": {"maxUnavailable": "lots"}}, "spec.rollout")]:
        desired, invalid = desired_policy(ref_with({**spec([1, 2]), **bad}), 4)
        assert desired is None and invalid is not None and field in invalid, (bad, invalid)


def test_only_pending_workers_the_plan_left_out_say_they_wait_for_their_turn():
    observations = [WorkerObservation("ns/a", WorkerState.PENDING, "READY, holds generation 1"),
                    WorkerObservation("ns/b", WorkerState.PENDING, "READY, holds generation 1"),
                    WorkerObservation("ns/c", WorkerState.CAPTURE_FAILED, "boom")]
    marked = mark_waiting(observations, {"ns/a", "ns/c"})
    assert marked[0].message == "waiting for its turn in the rollout (READY, holds generation 1)"
    assert marked[0].state == WorkerState.PENDING
    assert marked[1:] == observations[1:]


def test_a_streamed_worker_that_loses_its_policy_or_stops_is_seen_at_once_not_at_the_resync():
    """With the resync at its default (60 s), only the workers' WatchGraphStatus streams can tell
    the operator within seconds; an older worker without the call is still read as before."""
    async def scenario(fleet: Fleet):
        fleet.servers[2].state.watch = False  # an older worker: UNIMPLEMENTED, polled
        fleet.apply(spec([1, 2]), 1)
        await fleet.until("generation 1 everywhere", lambda: fleet.holding(1) == 3)
        await fleet.until("Ready", lambda: fleet.kube.status.get("capturedWorkers") == 3)
        assert fleet.servers[0].state.calls["WatchGraphStatus"] == 1
        assert fleet.servers[2].state.calls["WatchGraphStatus"] == 0
        reads = fleet.servers[0].state.calls["GetGraphStatus"]
        await asyncio.sleep(2.0)
        assert fleet.servers[0].state.calls["GetGraphStatus"] == reads, "an idle streamed worker is not read"
        lost = fleet.servers[0].state
        lost.policy = None  # as a worker restarted behind the same pod would
        lost.notify()
        started = time.monotonic()
        await fleet.until("the lost policy pushed again", lambda: fleet.holding(1) == 3, timeout=10)
        repushed = time.monotonic() - started
        await fleet.servers[1].stop()
        started = time.monotonic()
        await fleet.until("unreachable", lambda: any(
            c["reason"] == "WorkerUnreachable" for c in fleet.kube.status.get("conditions", [])), timeout=10)
        return repushed, time.monotonic() - started
    repushed, unreachable = run(scenario, 3)
    assert repushed < 2.0, f"re-pushed {repushed:.2f}s after losing its policy"
    assert unreachable < 5.0, f"reported unreachable {unreachable:.2f}s after it stopped"
