"""The operator against a real kube-apiserver, with real worker processes playing the pods.

Each test reads as the behaviour it proves; the ``kubelet`` fixture starts a worker process for
each Pod and writes the Pod's status, and ``operator`` is ``graphkeeper operator`` running as a
subprocess with a one-second status interval.
"""

from __future__ import annotations

import contextlib
import json
import time

import grpc
import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.proto.policy import policy_from_spec

from .conftest import Cluster, Kubelet, Operator, Policies, kubernetes, wait_until

pytestmark = pytest.mark.cluster

LABELS = {"app": "worker"}
SPEC = {"selector": {"matchLabels": LABELS}, "mode": "FullAndPiecewise",
        "captureSizes": {"sizes": [1, 2, 4, 8]}}


def holds(worker, policy: dict, generation: int | None = None) -> bool:
    """Whether the worker process itself reports holding the policy's generation."""
    status = worker.graph_status()
    want = generation or policy["metadata"]["generation"]
    return (status.policy_uid == policy["metadata"]["uid"]
            and status.policy_generation == want
            and status.state == 5)  # LIFECYCLE_STATE_READY


def test_applied_policy_reaches_every_selected_worker_and_is_ready(
        running_operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    ns = policies.namespace
    a = kubelet.create_worker(ns, "w-a", LABELS)
    b = kubelet.create_worker(ns, "w-b", LABELS)
    other = kubelet.create_worker(ns, "other", {"app": "something-else"})
    policy = policies.create("decode", SPEC)

    obj = policies.wait_condition("decode", "Ready", "True", "AllWorkersCaptured")
    status = obj["status"]
    assert (status["selectedWorkers"], status["capturedWorkers"], status["failedWorkers"]) == (
        2, 2, 0)
    assert holds(a, policy) and holds(b, policy)
    assert other.graph_status().policy_uid != policy["metadata"]["uid"], "not selected, not pushed"
    assert {w["name"] for w in status["workers"]} == {f"{ns}/w-a", f"{ns}/w-b"}
    assert policies.condition("decode", "Degraded")["status"] == "False"

    cm = cluster.core.read_namespaced_config_map("decode-graphpolicy", ns)
    rendered = json.loads(cm.data["policy.json"])
    assert rendered["policy_uid"] == policy["metadata"]["uid"]
    assert rendered["capture_sizes"]["explicit"]["sizes"] == [1, 2, 4, 8]
    assert cm.metadata.owner_references[0].uid == policy["metadata"]["uid"]
    assert "PolicyPushed" in {e["reason"] for e in policies.events("decode")}

    out = cluster.kubectl("get", "gp", "decode", "-n", ns)
    assert out.splitlines()[1].split()[:5] == ["decode", "FullAndPiecewise", "2", "2", "True"]


def test_changed_sizes_are_recaptured_and_status_follows(
        running_operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    ns = policies.namespace
    worker = kubelet.create_worker(ns, "w", LABELS)
    policies.create("p", SPEC)
    policies.wait_condition("p", "Ready", "True")

    updated = policies.patch_spec("p", {"captureSizes": {"sizes": [1, 16, 32]}})
    assert updated["metadata"]["generation"] == 2
    obj = policies.wait_condition("p", "Ready", "True", generation=2)
    assert obj["status"]["observedGeneration"] == 2
    assert obj["status"]["workers"][0]["policyGeneration"] == 2
    assert holds(worker, updated, 2)
    cm = cluster.core.read_namespaced_config_map("p-graphpolicy", ns)
    rendered = json.loads(cm.data["policy.json"])
    assert (rendered["generation"], rendered["capture_sizes"]["explicit"]["sizes"]) == (
        "2", [1, 16, 32]), "the ConfigMap follows the spec for workers that boot later"


def _apply_as_the_operator(worker, policy: pb.GraphPolicy) -> pb.ApplyGraphPolicyResponse:
    with grpc.insecure_channel(worker.control_target) as channel:
        return pb_grpc.GraphControlStub(channel).ApplyGraphPolicy(
            pb.ApplyGraphPolicyRequest(policy=policy), timeout=10,
            metadata=(("authorization", f"Bearer {worker.token}"),))


def held_exactly(worker, policy: pb.GraphPolicy) -> bool:
    """Whether the worker holds ``policy``'s generation with exactly this content: it answers the
    same generation again as unchanged, and refuses it with any other content."""
    try:
        return _apply_as_the_operator(worker, policy).unchanged
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
        assert "other content" in err.details()
        return False


def test_the_sleep_setting_reaches_the_worker_and_follows_the_spec(
        running_operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    ns = policies.namespace
    worker = kubelet.create_worker(ns, "w", LABELS)
    policy = policies.create("p", {**SPEC, "sleepAfterIdleSeconds": 300})
    policies.wait_condition("p", "Ready", "True")
    assert holds(worker, policy)
    uid = policy["metadata"]["uid"]

    def wire(generation: int, **sleep) -> pb.GraphPolicy:
        return policy_from_spec({**SPEC, **sleep}, uid=uid, name=f"{ns}/p", generation=generation)

    assert held_exactly(worker, wire(1, sleepAfterIdleSeconds=300))
    assert not held_exactly(worker, wire(1))  # what the worker would hold had the field been lost
    rendered = json.loads(cluster.core.read_namespaced_config_map("p-graphpolicy", ns).data["policy.json"])
    assert rendered["sleep_after_idle_seconds"] == "300", "workers that boot later read it too"

    updated = policies.patch_spec("p", {"sleepAfterIdleSeconds": 60, "sleepLevel": 2})
    assert updated["metadata"]["generation"] == 2
    policies.wait_condition("p", "Ready", "True", generation=2)
    assert holds(worker, updated, 2)
    assert held_exactly(worker, wire(2, sleepAfterIdleSeconds=60, sleepLevel=2))


def test_a_worker_added_later_gets_the_policy(
        running_operator: Operator, kubelet: Kubelet, policies: Policies):
    ns = policies.namespace
    kubelet.create_worker(ns, "first", LABELS)
    policy = policies.create("p", SPEC)
    policies.wait_condition("p", "Ready", "True")

    late = kubelet.create_worker(ns, "late", LABELS)
    wait_until("the late worker to hold the policy", lambda: holds(late, policy), timeout=20)
    obj = policies.wait_condition("p", "Ready", "True")
    assert obj["status"]["capturedWorkers"] == 2


def test_a_pod_whose_model_revision_changed_recaptures(
        running_operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    ns = policies.namespace
    worker = kubelet.create_worker(ns, "w", LABELS)
    policies.create("p", SPEC)
    policies.wait_condition("p", "Ready", "True")
    before = worker.graph_status().model_revision

    cluster.core.patch_namespaced_pod("w", ns, {"metadata": {"annotations": {
        "graphkeeper.io/model-source": "random:tiny@7",
        "graphkeeper.io/model-revision": "rev-7"}}})
    wait_until("the worker to serve rev-7",
               lambda: worker.graph_status().model_revision == "rev-7", timeout=60)
    assert before != "rev-7"
    obj = wait_until("status to list rev-7", lambda: (
        o := policies.get("p"))["status"].get("modelRevisions") == ["rev-7"] and o, timeout=30)
    assert obj["status"]["capturedWorkers"] == 1
    assert "ModelRevisionLoad" in {e["reason"] for e in policies.events("p")}


def test_the_operator_restarted_midway_resumes_without_duplicate_pushes(
        running_operator: Operator, kubelet: Kubelet, policies: Policies):
    ns = policies.namespace
    workers = [kubelet.create_worker(ns, f"w{i}", LABELS) for i in range(2)]
    policies.create("p", SPEC)
    policies.wait_condition("p", "Ready", "True")

    running_operator.stop()
    updated = policies.patch_spec("p", {"captureSizes": {"sizes": [2, 4]}})
    running_operator.start()
    policies.wait_condition("p", "Ready", "True", generation=2)
    assert all(holds(w, updated, 2) for w in workers)
    # Let a few more reconcile runs look (the workers' status streams keep them current): none
    # of them may push again.
    runs = "graphkeeper_operator_reconcile_duration_seconds_count"
    before = running_operator.metric(runs)
    wait_until("more reconcile runs", lambda: running_operator.metric(runs) >= before + 4, timeout=15)
    pushes = running_operator.metric("graphkeeper_operator_policy_pushes_total")
    applied = running_operator.metric("graphkeeper_operator_policy_pushes_total",
                                      outcome="applied")
    assert applied == 2, f"one push per worker for generation 2, got {applied}"
    assert pushes == applied, "no repeated (unchanged) or failed pushes"


def test_a_killed_worker_degrades_the_policy_by_name_and_recovers_when_restarted(
        running_operator: Operator, kubelet: Kubelet, policies: Policies):
    ns = policies.namespace
    kubelet.create_worker(ns, "healthy", LABELS)
    victim = kubelet.create_worker(ns, "victim", LABELS)
    policy = policies.create("p", SPEC)
    policies.wait_condition("p", "Ready", "True")

    kubelet.kill(victim)
    obj = policies.wait_condition("p", "Degraded", "True", "WorkerUnreachable")
    degraded = policies.condition("p", "Degraded")
    assert f"{ns}/victim" in degraded["message"]
    assert obj["status"]["lastFailure"]["worker"] == f"{ns}/victim"
    assert obj["status"]["failedWorkers"] == 1
    assert policies.condition("p", "Ready")["status"] == "False"
    assert "WorkerUnreachable" in {e["reason"] for e in policies.events("p")}
    assert running_operator.running, "an unreachable worker never crashes the operator"

    kubelet.restart(victim)  # a fresh process: it lost the policy with its memory
    policies.wait_condition("p", "Ready", "True")
    assert holds(victim, policy)
    assert policies.condition("p", "Degraded")["status"] == "False"


def test_a_conflicting_second_policy_is_degraded_and_not_pushed(
        running_operator: Operator, kubelet: Kubelet, policies: Policies):
    ns = policies.namespace
    worker = kubelet.create_worker(ns, "w", LABELS)
    first = policies.create("first", SPEC)
    policies.wait_condition("first", "Ready", "True")

    policies.create("second", {**SPEC, "captureSizes": {"sizes": [16]}})
    obj = policies.wait_condition("second", "Degraded", "True", "Conflict")
    assert "first" in policies.condition("second", "Degraded")["message"]
    assert obj["status"]["failedWorkers"] == 1
    assert holds(worker, first), "the older policy keeps the pod"
    assert policies.condition("first", "Ready")["status"] == "True"

    policies.delete("first")  # the pod is free again: the second policy takes it
    wait_until("the first policy to be gone", lambda: not policies.exists("first"), timeout=10)
    second = policies.get("second")
    policies.wait_condition("second", "Ready", "True")
    assert holds(worker, second)


def test_a_policy_a_worker_refuses_is_degraded_policy_rejected(
        running_operator: Operator, kubelet: Kubelet, policies: Policies):
    ns = policies.namespace
    kubelet.create_worker(ns, "w", LABELS)  # --max-num-batched-tokens 64
    policies.create("big", {**SPEC, "captureSizes": {"sizes": [8, 128]}})
    policies.wait_condition("big", "Degraded", "True", "PolicyRejected")
    assert "128" in policies.condition("big", "Degraded")["message"]
    assert "PolicyRejected" in {e["reason"] for e in policies.events("big")}


def test_deleting_a_policy_completes_while_the_operator_is_stopped(
        operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    operator.start()
    ns = policies.namespace
    worker = kubelet.create_worker(ns, "w", LABELS)
    policy = policies.create("p", SPEC)
    policies.wait_condition("p", "Ready", "True")
    assert not policies.get("p")["metadata"].get("finalizers"), "nothing blocks deletion"

    operator.stop()
    try:
        policies.delete("p")
        wait_until("the policy to be gone", lambda: not policies.exists("p"), timeout=15)

        def configmap_gone() -> bool:
            try:
                cluster.core.read_namespaced_config_map("p-graphpolicy", ns)
                return False
            except kubernetes.client.ApiException as err:
                return err.status == 404

        wait_until("the ConfigMap to be garbage-collected", configmap_gone, timeout=60)
        assert holds(worker, policy), "the worker keeps its last policy"
    finally:
        operator.start()


def test_a_worker_that_starts_while_the_operator_is_away_boots_with_its_policy(
        operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster,
        tmp_path):
    operator.start()
    ns = policies.namespace
    kubelet.create_worker(ns, "first", LABELS)
    policy = policies.create("p", SPEC)
    policies.wait_condition("p", "Ready", "True")

    operator.stop()
    try:
        # What the kubelet would mount from the ConfigMap the operator rendered.
        cm = cluster.core.read_namespaced_config_map("p-graphpolicy", ns)
        policy_file = tmp_path / "policy.json"
        policy_file.write_text(cm.data["policy.json"])
        late = kubelet.create_worker(ns, "late", LABELS, policy_file=str(policy_file))
        assert holds(late, policy), "it captured the policy before it reported ready"
    finally:
        operator.start()
    wait_until("both workers counted as captured",
               lambda: policies.get("p")["status"]["capturedWorkers"] == 2, timeout=30)
    assert policies.condition("p", "Ready")["status"] == "True"
    assert operator.metric("graphkeeper_operator_policy_pushes_total") == 0, (
        "the restarted operator pushed nothing: both workers already held the generation")


def test_an_invalid_selector_is_invalid_policy_with_an_event(
        running_operator: Operator, kubelet: Kubelet, policies: Policies):
    policies.create("bad", {**SPEC, "selector": {"matchLabels": {"not a key!": "worker"}}})
    policies.wait_condition("bad", "Degraded", "True", "InvalidPolicy")
    assert "not a key!" in policies.condition("bad", "Degraded")["message"]
    wait_until("the InvalidPolicy Event",
               lambda: "InvalidPolicy" in {e["reason"] for e in policies.events("bad")})


def test_pods_in_two_namespaces_pointing_at_one_worker_are_a_conflict_for_the_younger_policy(
        running_operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    ns = policies.namespace
    worker = kubelet.create_worker(ns, "w", LABELS)
    first = policies.create("first", SPEC)
    policies.wait_condition("first", "Ready", "True")

    other_ns = f"{ns}-b"
    cluster.core.create_namespace({"metadata": {"name": other_ns}})
    try:
        wait_until("the default ServiceAccount", lambda: any(
            sa.metadata.name == "default"
            for sa in cluster.core.list_namespaced_service_account(other_ns).items), timeout=30)
        pod = cluster.core.read_namespaced_pod("w", ns)
        ports = [{"name": p.name, "containerPort": p.container_port}
                 for p in pod.spec.containers[0].ports]
        cluster.core.create_namespaced_pod(other_ns, {
            "metadata": {"name": "alias", "labels": LABELS},
            "spec": {"containers": [{"name": "worker", "image": "graphkeeper:dev",
                                     "ports": ports}]}})
        cluster.core.patch_namespaced_pod_status("alias", other_ns, {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
            "conditions": [{"type": "Ready", "status": "True",
                            "lastTransitionTime": "2026-11-30T00:00:00Z"}]}},
            _content_type="application/merge-patch+json")
        rival = Policies(cluster, other_ns)
        rival.create("second", {**SPEC, "captureSizes": {"sizes": [16]}})
        rival.wait_condition("second", "Degraded", "True", "Conflict")
        message = rival.condition("second", "Degraded")["message"]
        assert f"{ns}/first" in message and "127.0.0.1" in message, message
        time.sleep(2.0)  # more runs of both: still no tug of war
        assert holds(worker, first), "the older policy keeps the worker"
        assert policies.condition("first", "Ready")["status"] == "True"
    finally:
        with contextlib.suppress(kubernetes.client.ApiException):
            cluster.core.delete_namespace(other_ns)
