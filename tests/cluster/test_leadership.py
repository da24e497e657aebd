"""Two operator replicas on a real API server: one acts (it holds the Lease), the other stands by
and takes over within 15 s of the first's ``kill -9``, pushing each worker once per generation."""

from __future__ import annotations

import os
import signal
import time

import pytest

from .conftest import Cluster, Kubelet, Operator, Policies, StandIn, kubernetes, wait_until

pytestmark = pytest.mark.cluster

LABELS = {"app": "lease"}
SPEC = {"selector": {"matchLabels": LABELS}, "mode": "Full", "captureSizes": {"sizes": [1, 2]}}
PUSHES = "graphkeeper_operator_policy_pushes_total"
LEASE = "graphkeeper-operator"


def holder(cluster: Cluster, namespace: str) -> str:
    try:
        lease = kubernetes.client.CoordinationV1Api(cluster.api).read_namespaced_lease(LEASE, namespace)
    except kubernetes.client.ApiException:
        return ""
    return lease.spec.holder_identity or ""


def test_the_standby_takes_over_within_15s_of_a_kill_9_with_one_push_per_worker(
        no_operator: Operator, cluster: Cluster, kubelet: Kubelet, policies: Policies, control_token, tmp_path):
    ns = policies.namespace

    def replica(name: str) -> Operator:
        return Operator(cluster, tmp_path / f"{name}.log", resync_interval=60.0, extra_args=[
            "--control-token-file", str(control_token), "--leader-election-namespace", ns, "--identity", name])

    first, second = replica("first"), replica("second")
    first.start()
    try:
        wait_until("the first replica to hold the Lease", lambda: holder(cluster, ns) == "first", timeout=30)
        second.start()  # answers /healthz as the standby
        workers = [kubelet.create_worker(ns, f"w{i}", LABELS, standin=StandIn()) for i in range(3)]
        uid = policies.create("p", SPEC)["metadata"]["uid"]
        policies.wait_condition("p", "Ready", "True", timeout=60)
        time.sleep(3.0)  # the standby keeps standing by while the Lease is renewed
        assert holder(cluster, ns) == "first"
        assert second.metric(PUSHES) == 0, "the standby pushes nothing"
        assert "standby" in second.log_tail()

        os.killpg(first.process.pid, signal.SIGKILL)
        first.process.wait(timeout=10)
        killed = time.monotonic()
        policies.patch_spec("p", {"captureSizes": {"sizes": [1, 2, 4]}})
        policies.wait_condition("p", "Ready", "True", generation=2, timeout=60)
        took = time.monotonic() - killed
        print(f"generation 2 Ready {took:.2f}s after the active replica's kill -9")
        assert took < 15.0, f"generation 2 Ready {took:.1f}s after the active replica was killed"
        assert holder(cluster, ns) == "second"
        for w in workers:
            status = w.graph_status()
            assert (status.policy_uid, status.policy_generation) == (uid, 2)
        # One push per worker for generation 2, and generation 1 was not pushed again.
        assert second.metric(PUSHES, outcome="applied") == 3
        assert second.metric(PUSHES) == 3, "no repeated (unchanged) or failed pushes"
    finally:
        first.stop()
        second.stop()
