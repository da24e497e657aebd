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


def test_a_dead_worker_behind_a_ready_pod_and_a_lost_policy_are_seen_in_seconds_without_polling(
        no_operator: Operator, cluster: Cluster, kubelet: Kubelet, policies: Policies,
        control_token, tmp_path):
    """With the 60 s resync, only the workers' WatchGraphStatus streams can tell the operator in
    time: nothing about either pod changes."""
    op = Operator(cluster, tmp_path / "operator.log", resync_interval=60.0,
                  extra_args=["--control-token-file", str(control_token)])
    op.start()
    try:
        workers = [kubelet.create_worker(policies.namespace, f"w{i}", LABELS, standin=StandIn())
                   for i in range(3)]
        uid = policies.create("p", SPEC)["metadata"]["uid"]
        policies.wait_condition("p", "Ready", "True")
        wait_until("a stream per worker", lambda: op.metric("graphkeeper_operator_status_streams") == 3,
                   timeout=10)

        # The process behind w0 restarts with an empty memory; its pod does not change (same
        # restart count, still Ready): it has lost its policy, and only its stream says so.
        lost = workers[0]
        kubelet.kill(lost)
        kubelet._start(lost, wait=False)
        wait_until("the restarted stand-in to serve", lost.serving, timeout=30, interval=0.02)
        back = time.monotonic()
        wait_until("the lost policy pushed again", lambda: lost.graph_status().policy_uid == uid,
                   timeout=10, interval=0.05)
        repushed = time.monotonic() - back
        print(f"lost policy re-pushed {repushed:.2f}s after the worker served again")
        assert repushed < 2.0, f"re-pushed {repushed:.2f}s after the worker lost its policy"
        policies.wait_condition("p", "Ready", "True", timeout=15)

        # w1's process dies; its pod still says Ready (the kubelet has not noticed).
        kubelet.kill(workers[1])
        died = time.monotonic()
        wait_until("Degraded=WorkerUnreachable", lambda: policies.condition("p", "Degraded").get("reason")
                   == "WorkerUnreachable", timeout=15, interval=0.05)
        seen = time.monotonic() - died
        print(f"WorkerUnreachable {seen:.2f}s after the worker died")
        assert seen < 5.0, f"reported WorkerUnreachable {seen:.2f}s after the worker died"
        assert "w1" in policies.condition("p", "Degraded")["message"]
    finally:
        op.stop()
