"""Rollout decisions, pure: maxUnavailable, who gets a change now, and the status counts."""

from __future__ import annotations

import pytest

from graphkeeper.operator.rollout import (
    RolloutWorker,
    plan_rollout,
    push_recaptures,
    resolve_max_unavailable,
    rollout_settings,
    rollout_status,
)
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import policy_from_spec, recapture_key


@pytest.mark.parametrize(("value", "total", "expected"), [
    (None, 10, 2), ("25%", 10, 2), ("25%", 200, 50), ("25%", 3, 1), ("100%", 7, 7),
    (2, 10, 2), ("1%", 10, 1), ("3", 10, 3), ("50%", 5, 2),
])
def test_max_unavailable_is_a_count_or_a_percentage_rounded_down_and_at_least_one(
        value, total, expected):
    assert resolve_max_unavailable(value, total) == expected


@pytest.mark.parametrize("value", ["lots", "25.5%", "101%", -1, True, 0, "0", "0%"])
def test_a_max_unavailable_that_is_neither_is_refused(value):
    with pytest.raises(ValueError):
        resolve_max_unavailable(value, 10)


def test_rollout_settings_read_the_spec_with_defaults():
    assert rollout_settings({}, 8) == (2, 600.0)
    assert rollout_settings({"rollout": {"maxUnavailable": 3, "progressDeadlineSeconds": 30}},
                            8) == (3, 30.0)


def w(name, available=True, **kw):
    return RolloutWorker(name=name, available=available, **kw)


def test_a_recapturing_change_goes_to_the_budget_in_name_order():
    plan = plan_rollout([w(f"w{i}", needs_push=True) for i in (3, 1, 0, 2)], 2)
    assert plan.push == ("w0", "w1") and plan.waiting == ("w2", "w3") and not plan.paused


def test_unavailable_workers_use_up_the_budget_and_the_next_batch_waits_for_them():
    workers = [w("a", available=False), w("b", needs_push=True), w("c", needs_push=True)]
    assert plan_rollout(workers, 2).push == ("b",)
    assert plan_rollout(workers, 1).push == ()
    assert plan_rollout(workers, 1).unavailable == 1


def test_a_worker_already_out_of_service_is_told_at_once_without_using_the_budget():
    workers = [w("a", available=False, needs_push=True), w("b", needs_push=True)]
    plan = plan_rollout(workers, 1)
    assert plan.push == ("a",), "a is unavailable anyway; b waits for the budget"


def test_a_worker_still_settling_an_earlier_push_waits_for_the_latest_generation():
    """An edit burst: a worker busy capturing generation n is not handed n+1, n+2, ... as they
    come; it is handed the latest once it reports READY."""
    plan = plan_rollout([w("busy", available=False, needs_push=True, settling=True),
                         w("starting", available=False, needs_push=True)], 1)
    assert plan.push == ("starting",)
    assert "busy" in plan.waiting


def test_toggle_only_changes_go_everywhere_at_once():
    workers = [w(f"w{i}", needs_push=True, push_recaptures=False) for i in range(5)]
    assert len(plan_rollout(workers, 1).push) == 5


def test_reloads_share_the_budget_with_pushes():
    workers = [w("a", needs_push=True), w("b", needs_reload=True), w("c", needs_reload=True)]
    plan = plan_rollout(workers, 2)
    assert (plan.push, plan.reload, plan.waiting) == (("a",), ("b",), ("c",))


def test_a_failure_pauses_the_rollout_but_not_tenant_toggles():
    workers = [w("a", failed=True), w("b", needs_push=True), w("c", needs_reload=True),
               w("d", needs_push=True, push_recaptures=False)]
    plan = plan_rollout(workers, 3)
    assert plan.paused and plan.failed == ("a",)
    assert plan.push == ("d",) and plan.reload == ()
    assert set(plan.waiting) == {"b", "c"}


def test_blocked_workers_are_skipped():
    assert plan_rollout([w("a", needs_push=True, blocked=True)], 1).push == ()


def test_rollout_status_counts_like_a_deployment():
    plan = plan_rollout([w("a", failed=True), w("b", available=False), w("c"), w("d")], 2)
    assert rollout_status(plan, updated=2, total=4) == {
        "maxUnavailable": 2, "updatedWorkers": 2, "pendingWorkers": 1, "failedWorkers": 1,
        "unavailableWorkers": 1, "paused": True}


BASE = {"selector": {"matchLabels": {"a": "b"}}, "captureSizes": {"sizes": [1, 2]}}


def wire(generation: int = 1, **spec) -> pb.GraphPolicy:
    return policy_from_spec({**BASE, **spec}, uid="u", name="n", generation=generation)


def test_the_recapture_key_ignores_tenants_and_sleep_but_not_sizes_mode_or_budget():
    def key(**spec):
        return recapture_key(wire(**spec))
    assert key() == key(tenants=[{"name": "t", "graphs": "Disabled"}])
    assert key() == key(defaultTenantGraphs="Disabled")
    assert key() == key(sleepAfterIdleSeconds=900, sleepLevel=2)
    assert key() != key(captureSizes={"sizes": [1, 2, 4]})
    assert key() != key(mode="Full")
    assert key() != key(memoryBudget="1Gi")


@pytest.mark.parametrize(("before", "after"), [
    ({"captureSizes": {"sizes": [4, 1, 2]}}, {"captureSizes": {"sizes": [1, 2, 4]}}),
    ({"captureSizes": {"sizes": [1, 2, 4]}}, {"captureSizes": {"sizes": [1, 2], "maxCaptureSize": 4}}),
    ({}, {"mode": "FullAndPiecewise"}),
    ({"captureSizes": {}}, {"captureSizes": {"ladder": "Default"}}),
    ({}, {"sleepAfterIdleSeconds": 900, "sleepLevel": 2}),
])
def test_an_equivalent_rewrite_is_no_recapture_and_goes_everywhere_at_once(before, after):
    """Spelling the same captured set another way (sizes reordered, the maximum listed, the default
    mode or ladder written out), or changing only the sleep settings, costs no rollout slot: every
    worker gets it in one plan, as a tenant toggle does, even with a budget of one."""
    held, new = recapture_key(wire(1, **before)), wire(2, **after)
    recaptures = push_recaptures(held, new)
    assert not recaptures
    workers = [w(f"w{i}", needs_push=True, push_recaptures=recaptures) for i in range(6)]
    plan = plan_rollout(workers, 1)
    assert plan.push == tuple(f"w{i}" for i in range(6)) and plan.waiting == ()


def test_a_real_capture_change_or_an_unknown_held_generation_recaptures():
    assert push_recaptures(recapture_key(wire()), wire(2, captureSizes={"sizes": [1, 2, 8]}))
    assert push_recaptures(None, wire(2)), "a generation the operator never built: the safe answer"


def test_a_waiting_rollout_says_what_it_waits_on():
    from graphkeeper.operator.rollout import rollout_wait

    busy = RolloutWorker("ns/a", available=False, settling=True)
    gone = RolloutWorker("ns/gone", available=False, blocked=True, departed=True)
    lacking = RolloutWorker("ns/b", available=True, needs_push=True)
    plan = plan_rollout([busy, lacking], 1)
    wait = rollout_wait(plan)
    assert plan.waiting == ("ns/b",) and wait.reason == "WaitingForUnavailableWorkers"
    assert "ns/a" in wait.message and "maxUnavailable 1" in wait.message
    wait = rollout_wait(plan_rollout([gone, lacking], 1))
    assert wait.reason == "WaitingForDeletedWorker" and "ns/gone" in wait.message
    assert rollout_wait(plan_rollout([lacking], 1)) is None, "nothing waits: the push goes out"
    other = RolloutWorker("ns/c", available=True, needs_push=True)
    wait = rollout_wait(plan_rollout([lacking, other], 1))
    assert "1 unavailable (ns/b)" in wait.message, "the worker this run takes out counts"
