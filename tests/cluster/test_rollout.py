"""Fleet-safe rollouts against a real kube-apiserver and the operator as a process.

The workers here are LIGHT STAND-INS (``tests/fakes/fake_worker.py`` processes: the worker's
GraphControl contract, bearer token and separate control port, no model), because these tests
need ten workers whose captures take long enough to overlap, reloads that take 30 s, and
captures that fail on demand. Every claim about how many workers were recapturing or reloading
at once comes from the stand-ins' own lifecycle reports (each writes its state changes with a
timestamp), never from the operator's bookkeeping.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from .conftest import (
    CLUSTER_SH,
    Cluster,
    Kubelet,
    Operator,
    Policies,
    StandIn,
    Worker,
    wait_until,
)

pytestmark = pytest.mark.cluster

LABELS = {"app": "standin"}


def spec(sizes: list[int], max_unavailable: int | str | None = 2, **extra) -> dict:
    out = {"selector": {"matchLabels": LABELS}, "mode": "Full", "captureSizes": {"sizes": sizes},
           **extra}
    if max_unavailable is not None:
        out["rollout"] = {"maxUnavailable": max_unavailable}
    return out


def fleet(kubelet: Kubelet, ns: str, count: int, standin: StandIn) -> list[Worker]:
    workers = [kubelet.create_worker(ns, f"standin-{i:02d}", LABELS, standin=standin, wait=False)
               for i in range(count)]
    for w in workers:
        kubelet.wait_ready(w)
    return workers


def holds(worker: Worker, uid: str, generation: int) -> bool:
    s = worker.graph_status()
    return s.policy_uid == uid and s.policy_generation == generation and s.state == 5


def most_busy_at_once(workers: list[Worker], since: float) -> int:
    """From the stand-ins' own lifecycle reports: the most workers not READY at one moment."""
    changes = sorted((t, i, state) for i, w in enumerate(workers)
                     for t, state in w.transitions() if t >= since)
    busy: set[int] = set()
    most = 0
    for _, i, state in changes:
        (busy.discard if state == "READY" else busy.add)(i)
        most = max(most, len(busy))
    return most


def test_a_capture_size_change_recaptures_at_most_max_unavailable_workers_at_once(
        running_operator: Operator, kubelet: Kubelet, policies: Policies):
    workers = fleet(kubelet, policies.namespace, 10, StandIn(capture_seconds=1.0))
    policy = policies.create("p", spec([1, 2]))
    uid = policy["metadata"]["uid"]
    wait_until("generation 1 everywhere", lambda: all(holds(w, uid, 1) for w in workers),
               timeout=120)

    since = time.time()
    policies.patch_spec("p", {"captureSizes": {"sizes": [1, 2, 4]}})
    wait_until("generation 2 everywhere", lambda: all(holds(w, uid, 2) for w in workers),
               timeout=120)
    obj = policies.wait_condition("p", "Ready", "True", generation=2)
    assert most_busy_at_once(workers, since) == 2, "never more than 2, and 2 at a time"
    assert sum(1 for w in workers if w.transitions() and
               any(t >= since and s == "RECAPTURING" for t, s in w.transitions())) == 10
    assert obj["status"]["rollout"]["updatedWorkers"] == 10
    assert obj["status"]["rollout"]["maxUnavailable"] == 2


def test_a_model_revision_change_reloads_at_most_max_unavailable_workers_at_once(
        running_operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    ns = policies.namespace
    workers = fleet(kubelet, ns, 10, StandIn(capture_seconds=0.5, load_seconds=0.5))
    policy = policies.create("p", spec([1, 2]))
    uid = policy["metadata"]["uid"]
    wait_until("generation 1 everywhere", lambda: all(holds(w, uid, 1) for w in workers),
               timeout=120)

    since = time.time()
    for w in workers:  # the way a Deployment's template change would, all at once
        cluster.core.patch_namespaced_pod(w.name, ns, {"metadata": {"annotations": {
            "graphkeeper.io/model-source": "random:tiny@7",
            "graphkeeper.io/model-revision": "rev-7"}}})

    def serves() -> bool:
        return all((s := w.graph_status()).model_revision == "rev-7" and s.state == 5
                   for w in workers)

    wait_until("rev-7 everywhere", serves, timeout=120)
    assert most_busy_at_once(workers, since) == 2
    wait_until("status to list only rev-7",
               lambda: policies.get("p")["status"].get("modelRevisions") == ["rev-7"], timeout=30)


def test_a_failed_capture_pauses_the_rollout(
        running_operator: Operator, kubelet: Kubelet, policies: Policies):
    workers = fleet(kubelet, policies.namespace, 10,
                    StandIn(capture_seconds=0.3, fail_sizes=(16,)))
    policy = policies.create("p", spec([1, 2]))
    uid = policy["metadata"]["uid"]
    wait_until("generation 1 everywhere", lambda: all(holds(w, uid, 1) for w in workers),
               timeout=120)

    policies.patch_spec("p", {"captureSizes": {"sizes": [1, 16]}})  # every stand-in fails 16
    obj = policies.wait_condition("p", "Progressing", "False", "RolloutPaused", generation=2)
    time.sleep(3.0)  # several more reconciles: nothing more may be handed out
    got = [w for w in workers if w.graph_status().policy_generation == 2]
    assert len(got) == 2, f"only the first batch took generation 2: {[w.name for w in got]}"
    obj = policies.get("p")
    rollout = obj["status"]["rollout"]
    assert (rollout["paused"], rollout["failedWorkers"], rollout["pendingWorkers"]) == (
        True, 2, 8)
    assert policies.condition("p", "Degraded")["reason"] == "CaptureFailed"
    wait_until("the RolloutPaused Event",
               lambda: "RolloutPaused" in {e["reason"] for e in policies.events("p")})

    policies.patch_spec("p", {"captureSizes": {"sizes": [1, 4]}})  # a fix resumes it
    wait_until("generation 3 everywhere", lambda: all(holds(w, uid, 3) for w in workers),
               timeout=120)
    policies.wait_condition("p", "Ready", "True", generation=3)


def test_a_generation_workers_refuse_pauses_the_rollout_and_counts_as_failed_everywhere(
        running_operator: Operator, kubelet: Kubelet, policies: Policies):
    workers = fleet(kubelet, policies.namespace, 6, StandIn())
    policy = policies.create("p", spec([1, 2]))
    uid = policy["metadata"]["uid"]
    wait_until("generation 1 everywhere", lambda: all(holds(w, uid, 1) for w in workers),
               timeout=60)
    rejected = running_operator.metric("graphkeeper_operator_policy_pushes_total",
                                       outcome="rejected")

    # Every stand-in serves --max-num-batched-tokens 64, so each refuses a capture size of 128.
    policies.patch_spec("p", {"captureSizes": {"sizes": [8, 128]}})
    policies.wait_condition("p", "Progressing", "False", "RolloutPaused", generation=2)
    time.sleep(3.0)  # several more reconciles: nothing more may be handed out
    pushed = running_operator.metric("graphkeeper_operator_policy_pushes_total",
                                     outcome="rejected") - rejected
    assert pushed == 2, f"only the first batch (maxUnavailable 2) was asked, not {pushed}"
    status = policies.get("p")["status"]
    assert (status["failedWorkers"], status["rollout"]["failedWorkers"],
            status["rollout"]["paused"]) == (2, 2, True), status
    assert policies.condition("p", "Degraded")["reason"] == "PolicyRejected"
    assert all(holds(w, uid, 1) for w in workers), "every worker kept generation 1"


def test_a_30s_reload_on_one_worker_does_not_delay_a_change_to_the_others(
        running_operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    ns = policies.namespace
    workers = fleet(kubelet, ns, 5, StandIn(capture_seconds=0.2, load_seconds=30.0))
    slow, others = workers[0], workers[1:]
    policy = policies.create("p", spec([1, 2], max_unavailable=4))
    uid = policy["metadata"]["uid"]
    wait_until("generation 1 everywhere", lambda: all(holds(w, uid, 1) for w in workers),
               timeout=120)

    def change_and_time(generation: int, sizes: list[int]) -> float:
        t0 = time.monotonic()
        policies.patch_spec("p", {"captureSizes": {"sizes": sizes}})
        wait_until(f"generation {generation} on the others",
                   lambda: all(holds(w, uid, generation) for w in others), timeout=60,
                   interval=0.02)
        return time.monotonic() - t0

    baseline = change_and_time(2, [1, 2, 4])
    cluster.core.patch_namespaced_pod(slow.name, ns, {"metadata": {"annotations": {
        "graphkeeper.io/model-revision": "rev-slow"}}})
    wait_until("the 30 s reload to be under way",
               lambda: slow.graph_status().pending_model_revision == "rev-slow", timeout=30)
    during = change_and_time(3, [1, 2, 8])
    assert slow.graph_status().pending_model_revision == "rev-slow", "still reloading"
    assert during <= baseline + 1.0, f"{during:.2f}s during the reload, {baseline:.2f}s before"
    # Status is written meanwhile, with what is known: the others captured, the slow one not.
    wait_until("status for generation 3", lambda: (s := policies.get("p")["status"]).get(
        "observedGeneration") == 3 and s.get("capturedWorkers") == 4, timeout=10)


def test_a_spec_change_after_a_20s_api_outage_is_seen_within_5s_of_its_return(
        running_operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    workers = fleet(kubelet, policies.namespace, 2, StandIn())
    policy = policies.create("p", spec([1, 2]))
    uid = policy["metadata"]["uid"]
    wait_until("generation 1 everywhere", lambda: all(holds(w, uid, 1) for w in workers),
               timeout=60)
    mark = running_operator.log.stat().st_size

    pid = int((cluster.state / "run" / "kube-apiserver.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    time.sleep(20)
    up = subprocess.run([str(CLUSTER_SH), "up"], env=cluster.env, capture_output=True,
                        text=True, timeout=300)
    assert up.returncode == 0, up.stderr
    back = time.monotonic()
    policies.patch_spec("p", {"captureSizes": {"sizes": [1, 2, 4]}})
    wait_until("the workers to get generation 2",
               lambda: all(holds(w, uid, 2) for w in workers), timeout=30, interval=0.05)
    seen = time.monotonic() - back
    assert seen <= 5.0, f"the change was seen {seen:.1f}s after the API server returned"
    policies.wait_condition("p", "Ready", "True", generation=2, timeout=30)

    log = running_operator.log.read_text()[mark:]
    assert log.count("Kubernetes API unreachable") == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert running_operator.running


def test_a_pod_deleted_mid_recapture_frees_its_slot_and_the_others_get_the_change_within_10s(
        running_operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    """A scale-down mid-rollout: the pod goes and its process with it, no replacement comes. Its
    slot is free once its address stops answering, not at the progress deadline (600 s)."""
    workers = fleet(kubelet, policies.namespace, 6, StandIn(capture_seconds=0.5))
    uid = policies.create("p", spec([1, 2], max_unavailable=1))["metadata"]["uid"]
    wait_until("generation 1 everywhere", lambda: all(holds(w, uid, 1) for w in workers), timeout=120)
    policies.patch_spec("p", {"captureSizes": {"sizes": [1, 2, 4]}})
    gone = wait_until("a worker recapturing generation 2", lambda: next(
        (w for w in workers if w.graph_status().pending_policy_generation == 2), None), timeout=30,
        interval=0.02)
    cluster.core.delete_namespaced_pod(gone.name, gone.namespace, grace_period_seconds=0)
    kubelet.kill(gone)  # the kubelet stops the container; no replacement (scaled down)
    deleted = time.monotonic()
    others = [w for w in workers if w is not gone]

    def changed(w: Worker) -> bool:
        s = w.graph_status()
        return s.policy_generation == 2 or s.pending_policy_generation == 2

    wait_until("the other five pushed generation 2", lambda: all(changed(w) for w in others), timeout=30,
               interval=0.05)
    took = time.monotonic() - deleted
    print(f"the other five had generation 2 {took:.2f}s after the pod went")
    assert took < 10.0, f"the other workers got the change {took:.1f}s after the pod went"
    policies.wait_condition("p", "Ready", "True", generation=2, timeout=60)
