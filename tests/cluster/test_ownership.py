"""Two policies claiming one worker, created in the same second: no push war, no deadlock.

GitOps applies a whole directory in one go, so rival GraphPolicies are routinely created within
one second of each other, where ``creationTimestamp`` cannot order them. These tests create such
pairs many times over (in one namespace, and in two namespaces whose pods point at one worker
address) against a real kube-apiserver and the operator as a process, and check each trial from
the stand-in worker's own reports and the operator's push counter: exactly one push, the worker
never changes hands between the two, exactly one of them is Ready and the other is
``Degraded=Conflict`` naming it, and a later spec change to the one that holds it still arrives.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from .conftest import Cluster, Kubelet, Operator, Policies, StandIn, Worker, kubernetes, wait_until

pytestmark = pytest.mark.cluster

LABELS = {"app": "contested"}
#: Trials in which both policies were created in the same second; at least this many must run.
TRIALS = 20
PUSHES = "graphkeeper_operator_policy_pushes_total"


def spec(sizes: list[int]) -> dict:
    return {"selector": {"matchLabels": LABELS}, "mode": "Full", "captureSizes": {"sizes": sizes}}


def held_by(worker: Worker) -> str:
    s = worker.graph_status()
    return s.pending_policy_uid or s.policy_uid


def watch_hands(worker: Worker, uids: set[str], seconds: float) -> list[str]:
    """The sequence of the two rivals' uids the worker reported holding, sampled every 20 ms."""
    seen: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        uid = held_by(worker)
        if uid in uids and (not seen or seen[-1] != uid):
            seen.append(uid)
        time.sleep(0.02)
    return seen


def settled_pair(a: tuple[Policies, str], b: tuple[Policies, str]) -> tuple[int, int] | None:
    """(winner, loser) indexes once one is Ready and the other Degraded=Conflict, else None."""
    state = []
    for pols, name in (a, b):
        status = pols.get(name).get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions") or []}
        ready = conds.get("Ready", {}).get("status") == "True"
        conflict = (conds.get("Degraded", {}).get("status") == "True"
                    and conds["Degraded"].get("reason") == "Conflict")
        state.append((status.get("observedGeneration") == 1, ready, conflict))
    if all(s[0] for s in state):
        if state[0][1] and state[1][2]:
            return 0, 1
        if state[1][1] and state[0][2]:
            return 1, 0
    return None


def one_trial(operator: Operator, worker: Worker, sides: tuple[Policies, Policies],
              trial: int) -> bool:
    """Creates one pair and checks it; returns whether both were created in the same second."""
    names = (f"x{trial}", f"y{trial}")
    pushes = operator.metric(PUSHES)
    objs = [sides[0].create(names[0], spec([1, 2])), sides[1].create(names[1], spec([4]))]
    uids = [o["metadata"]["uid"] for o in objs]
    pair = ((sides[0], names[0]), (sides[1], names[1]))
    hands = watch_hands(worker, set(uids), 2.0)
    winner, loser = wait_until(f"trial {trial}: one Ready, the other Degraded=Conflict",
                               lambda: settled_pair(*pair), timeout=20)
    seen = hands + watch_hands(worker, set(uids), 1.0)
    hands = [u for i, u in enumerate(seen) if i == 0 or u != seen[i - 1]]
    assert hands == [uids[winner]], f"trial {trial}: the worker changed hands: {hands}"
    assert operator.metric(PUSHES) - pushes == 1, f"trial {trial}: not exactly one push"
    message = pair[loser][0].condition(pair[loser][1], "Degraded")["message"]
    assert names[winner] in message, f"trial {trial}: {message}"
    # No deadlock: the holder's next generation still reaches the worker.
    pols, name = pair[winner]
    pols.patch_spec(name, {"captureSizes": {"sizes": [8]}})
    want = (uids[winner], 2)
    wait_until(f"trial {trial}: generation 2 of the holder on the worker",
               lambda: (worker.graph_status().policy_uid,
                        worker.graph_status().policy_generation) == want, timeout=15)
    assert pair[loser][0].condition(pair[loser][1], "Degraded")["reason"] == "Conflict"
    # The counter moves when a push's answer is back, a moment after the worker adopted it.
    wait_until(f"trial {trial}: the second push counted", lambda: operator.metric(PUSHES) - pushes == 2,
               timeout=5)
    # Clean up: the loser first. (Were the holder deleted first, the loser would rightly take
    # the worker for the moment until its own deletion reaches the operator.)
    for pols, name in (pair[loser], pair[winner]):
        pols.delete(name)
    quiet(operator)
    return len({o["metadata"]["creationTimestamp"] for o in objs}) == 1


def quiet(operator: Operator, seconds: float = 1.0) -> None:
    """Waits until the push counter stood still for ``seconds``: the next trial counts only its
    own pushes."""
    last = [operator.metric(PUSHES), time.monotonic()]

    def still() -> bool:
        now = operator.metric(PUSHES)
        if now != last[0]:
            last[:] = [now, time.monotonic()]
        return time.monotonic() - last[1] >= seconds

    wait_until("the push counter to stand still", still, timeout=15, interval=0.1)


def run_trials(operator: Operator, worker: Worker, sides: tuple[Policies, Policies]) -> None:
    """Runs trials until ``TRIALS`` pairs were created in one second (each trial is checked)."""
    same_second = trial = 0
    while same_second < TRIALS:
        assert trial < TRIALS + 10, f"only {same_second} of {trial} pairs fell in one second"
        same_second += one_trial(operator, worker, sides, trial)
        trial += 1


def test_same_second_pairs_in_one_namespace_never_alternate(
        running_operator: Operator, kubelet: Kubelet, policies: Policies):
    worker = kubelet.create_worker(policies.namespace, "w", LABELS, standin=StandIn())
    run_trials(running_operator, worker, (policies, policies))


def test_same_second_pairs_across_namespaces_never_alternate_or_deadlock(
        running_operator: Operator, kubelet: Kubelet, policies: Policies, cluster: Cluster):
    ns = policies.namespace
    worker = kubelet.create_worker(ns, "w", LABELS, standin=StandIn())
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
        run_trials(running_operator, worker, (policies, Policies(cluster, other_ns)))
    finally:
        with contextlib.suppress(kubernetes.client.ApiException):
            cluster.core.delete_namespace(other_ns)
