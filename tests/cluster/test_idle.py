"""An idle fleet costs nearly nothing: workers are read when their pods change, and on a slow
resync, not on every reconcile run.

The operator here runs with a 1 s status interval (a reconcile per policy per second) and the
default 60 s resync; the session operator is stopped meanwhile, so that only this one acts.
"""

from __future__ import annotations

import time

import pytest

from .conftest import Cluster, Kubelet, Operator, Policies, StandIn, wait_until

pytestmark = pytest.mark.cluster

LABELS = {"app": "idle"}
SPEC = {"selector": {"matchLabels": LABELS}, "mode": "Full", "captureSizes": {"sizes": [1, 2]}}
READS = "graphkeeper_operator_status_reads_total"


def test_an_idle_fleet_is_not_polled_and_a_pod_change_is_still_seen_at_once(
        no_operator: Operator, cluster: Cluster, kubelet: Kubelet, policies: Policies,
        control_token, tmp_path):
    op = Operator(cluster, tmp_path / "operator.log", resync_interval=60.0,
                  extra_args=["--control-token-file", str(control_token)])
    op.start()
    try:
        workers = [kubelet.create_worker(policies.namespace, f"w{i}", LABELS, standin=StandIn())
                   for i in range(5)]
        policies.create("p", SPEC)
        policies.wait_condition("p", "Ready", "True")
        time.sleep(2.0)  # the last reads after the rollout settle
        before = op.metric(READS)
        time.sleep(10.0)  # ten reconcile runs of an idle policy
        idle = op.metric(READS) - before
        # Polling every run would be 5 workers x 10 runs = 50 reads.
        assert idle <= 1, f"{idle} status reads in 10 s of an idle fleet of 5"

        # A worker dies; its readiness probe fails, the pod says so: seen without a resync.
        kubelet.stop(workers[0])
        wait_until("the stopped worker no longer counted as captured",
                   lambda: policies.get("p")["status"]["capturedWorkers"] == 4, timeout=10)
        # Its container restarts with an empty memory: the pod's restart count tells the operator.
        kubelet.restart(workers[0])
        wait_until("the restarted worker holds the policy again",
                   lambda: workers[0].graph_status().policy_uid != "", timeout=10)
        policies.wait_condition("p", "Ready", "True", timeout=15)
    finally:
        op.stop()
