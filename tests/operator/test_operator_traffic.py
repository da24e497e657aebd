"""Capture sizes from traffic in the operator: the spec, the no-flapping rule, the effective policy
(pure), and the reconciler recommending and applying against light GraphControl stand-ins."""

from __future__ import annotations

import time

import pytest
from test_operator_reconciler import LABELS, Fleet, max_concurrently_busy  # tests/operator

from graphkeeper.operator.desired import desired_policy
from graphkeeper.operator.selection import PolicyRef
from graphkeeper.operator.traffic import (
    GENERATION_STRIDE,
    Applied,
    FromTraffic,
    applied_from_status,
    applied_status,
    decide_apply,
    effective_policy,
    from_traffic_settings,
    recommend,
    recommend_due,
    traffic_key,
)
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import PolicyError, policy_from_json, policy_from_spec, recapture_key
from graphkeeper.proto.traffic_sizes import Traffic, evaluate_sizes

SELECTOR = {"matchLabels": LABELS}


def spec_with(from_traffic: dict | None = None, **extra) -> dict:
    sizes = {"ladder": "Default", "maxCaptureSize": 64}
    if from_traffic is not None:
        sizes["fromTraffic"] = from_traffic
    return {"selector": SELECTOR, "mode": "Piecewise", "captureSizes": sizes, **extra}


# --- the spec ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "field"), [
    ({"maxGraphs": 4}, "spec.captureSizes.fromTraffic.mode"),
    ({"mode": "Sometimes", "maxGraphs": 4}, "spec.captureSizes.fromTraffic.mode"),
    ({"mode": "Apply"}, "spec.captureSizes.fromTraffic"),
    ({"mode": "Apply", "memoryBudget": "1.1Gi"}, "spec.captureSizes.fromTraffic.memoryBudget"),
    ({"mode": "Apply", "maxGraphs": -1}, "spec.captureSizes.fromTraffic.maxGraphs"),
    ({"mode": "Apply", "maxGraphs": 0}, "spec.captureSizes.fromTraffic.maxGraphs"),
    ({"mode": "Apply", "maxGraphs": 4, "minImprovementPercent": 101},
     "spec.captureSizes.fromTraffic.minImprovementPercent"),
    ({"mode": "Apply", "maxGraphs": 4, "minSteps": 0}, "spec.captureSizes.fromTraffic.minSteps"),
])
def test_a_bad_from_traffic_is_refused_naming_the_field(raw, field):
    with pytest.raises(PolicyError) as caught:
        from_traffic_settings(spec_with(raw))
    assert caught.value.field == field
    ref = PolicyRef(namespace="ns", name="p", uid="u", created="", generation=1, spec=spec_with(raw))
    desired, invalid = desired_policy(ref, 1)
    assert desired is None and invalid.startswith(field)


def test_from_traffic_defaults():
    settings = from_traffic_settings(spec_with({"mode": "Recommend", "memoryBudget": "64Mi"}))
    assert settings == FromTraffic(mode="Recommend", memory_budget_bytes=64 * 2**20,
                                   min_interval_seconds=600, min_improvement=0.05, min_steps=1000)


def test_max_graphs_and_idle_release_reach_the_wire_and_max_graphs_recaptures():
    wire = policy_from_spec(spec_with(maxGraphs=12, idleReleaseSeconds=300), uid="u", name="n", generation=1)
    assert (wire.max_graphs, wire.idle_release_seconds) == (12, 300)
    other = policy_from_spec(spec_with(maxGraphs=13), uid="u", name="n", generation=1)
    assert recapture_key(wire) != recapture_key(other)
    with pytest.raises(PolicyError) as caught:
        policy_from_spec(spec_with(maxGraphs=-1), uid="u", name="n", generation=1)
    assert caught.value.field == "spec.maxGraphs"
    with pytest.raises(PolicyError) as caught:
        policy_from_spec(spec_with(idleReleaseSeconds="5m"), uid="u", name="n", generation=1)
    assert caught.value.field == "spec.idleReleaseSeconds"


# --- the effective policy and the decision -------------------------------------------------------


def test_applied_sizes_replace_the_spec_sizes_with_a_growing_generation():
    spec = spec_with({"mode": "Apply", "maxGraphs": 4})
    settings = from_traffic_settings(spec)
    wire = policy_from_spec(spec, uid="u", name="n", generation=3)
    applied = Applied((8, 32), 2, 1000.0, "Piecewise")
    out = effective_policy(wire, settings, applied, "Piecewise")
    assert list(out.capture_sizes.explicit.sizes) == [8, 32] and out.capture_sizes.max_capture_size == 0
    earlier = effective_policy(wire, settings, Applied((8,), 1, 0, "Piecewise"), "Piecewise")
    assert out.generation == 3 * GENERATION_STRIDE + 2 > earlier.generation
    # Chosen for another mode, or back to Recommend: the spec's sizes; the generation still grows.
    for other in (effective_policy(wire, settings, applied, "Full"),
                  effective_policy(wire, from_traffic_settings(spec_with({"mode": "Recommend", "maxGraphs": 4})),
                                   applied, "Piecewise")):
        assert other.capture_sizes.WhichOneof("sizes") == "ladder" and other.generation == out.generation
    assert effective_policy(wire, settings, Applied(), "Piecewise").generation == 3
    assert applied_from_status({"effectiveCaptureSizes": applied_status(applied)}) == applied


def _choices():
    traffic = Traffic(decode={1: 500, 8: 500, 40: 10})
    current = evaluate_sizes(traffic, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64], pb.GRAPH_MODE_PIECEWISE)
    better = evaluate_sizes(traffic, [1, 8, 40], pb.GRAPH_MODE_PIECEWISE)
    return traffic, current, better


def test_decide_apply_no_flapping():
    traffic, ladder, chosen = _choices()
    apply = FromTraffic(mode="Apply", max_graphs=4, min_interval_seconds=600, min_improvement=0.05)
    # The ladder breaks maxGraphs: applied at once, though its step time is no worse.
    ok, why = decide_apply(apply, Applied(), 10_000.0, ladder, chosen)
    assert ok and "over maxGraphs 4" in why
    assert decide_apply(FromTraffic(mode="Recommend", max_graphs=4), Applied(), 0, ladder, chosen) == (
        False, "mode Recommend: not applied")
    # A set applied 100 s ago: nothing new before the interval ends.
    recent = Applied((1, 8, 48), 1, 9_900.0, "Piecewise")
    current = evaluate_sizes(traffic, [1, 8, 48], pb.GRAPH_MODE_PIECEWISE)
    ok, why = decide_apply(apply, recent, 10_000.0, current, chosen)
    assert not ok and "minIntervalSeconds is 600 (500s left)" in why
    # After the interval: only an improvement of at least 5%.
    gain = (current.cost - chosen.cost) / current.cost
    assert 0 < gain < 0.05
    ok, why = decide_apply(apply, recent, 20_000.0, current, chosen)
    assert not ok and "minImprovementPercent is 5%" in why
    ok, _ = decide_apply(FromTraffic(mode="Apply", max_graphs=4, min_improvement=0.0), recent, 20_000.0, current,
                         chosen)
    assert ok
    assert decide_apply(apply, recent, 20_000.0, chosen, chosen) == (False, "the recommended sizes are in effect")
    empty = evaluate_sizes(traffic, [], pb.GRAPH_MODE_PIECEWISE, note="memory budget 1 bytes fits no graph")
    assert decide_apply(apply, Applied(), 0, ladder, empty) == (
        False, "nothing to apply: memory budget 1 bytes fits no graph")


# --- one look at the traffic (pure) -----------------------------------------------------------------


def _look(from_traffic: dict, applied: Applied | None = None, now: float = 10_000.0):
    """One look at ``_choices``' traffic (1010 steps) for a Piecewise policy with a ladder to 64."""
    spec = spec_with(from_traffic)
    wire = policy_from_spec(spec, uid="u", name="n", generation=1)
    previous = {"sizes": [2], "message": "earlier"}
    return recommend(from_traffic_settings(spec), wire, applied or Applied(), [], _choices()[0], previous, now)


def test_recommend_waits_for_min_steps_and_keeps_the_last_recommendation():
    look = _look({"mode": "Apply", "maxGraphs": 3, "minSteps": 5000})
    assert look.new is None and look.applied == Applied() and not look.applied_message
    assert look.status["sizes"] == [2] and look.status["steps"] == 1010
    assert look.status["message"] == "waiting for traffic: 1010 of minSteps 5000 steps observed"


def test_recommend_mode_recommends_the_cheapest_sizes_and_applies_nothing():
    look = _look({"mode": "Recommend", "maxGraphs": 3, "minSteps": 100})
    assert list(look.new.sizes) == [1, 8, 40] and look.status["sizes"] == [1, 8, 40]
    assert look.applied == Applied() and not look.applied_message
    assert look.status["message"].startswith("mode Recommend")


def test_apply_mode_applies_a_new_set_for_the_spec_mode_with_the_next_sequence():
    apply = {"mode": "Apply", "maxGraphs": 3, "minSteps": 100}
    look = _look(apply)  # the spec's ladder to 64 is 11 graphs, over maxGraphs
    assert look.applied == Applied((1, 8, 40), 1, 10_000.0, "Piecewise")
    assert look.applied_message.startswith("sizes [1, 8, 40] from 1010 steps of 0 worker(s)")
    assert "over maxGraphs 3" in look.applied_message
    # Within minIntervalSeconds of the last set: recommended, not applied.
    recent = Applied((1, 2, 4, 8), 1, 9_900.0, "Piecewise")
    held = _look(apply, applied=recent)
    assert held.applied == recent and list(held.new.sizes) == [1, 8, 40] and not held.applied_message
    assert "minIntervalSeconds" in held.status["message"]
    # After it, a set that is barely better stays (minImprovementPercent).
    kept = _look(apply, applied=Applied((1, 8, 48), 1, 0.0, "Piecewise"))
    assert kept.applied.sequence == 1 and "minImprovementPercent is 5%" in kept.status["message"]


def test_a_look_at_the_traffic_is_due_when_the_spec_or_the_set_changed_and_at_most_every_gap_for_traffic():
    traffic, _, _ = _choices()
    key = traffic_key(1, traffic, Applied())
    assert recommend_due(key, None, float("inf"), 30.0)
    assert not recommend_due(key, key, 3600.0, 30.0), "nothing changed"
    more = traffic_key(1, Traffic(decode={1: 600}), Applied())
    assert not recommend_due(more, key, 10.0, 30.0) and recommend_due(more, key, 30.0, 30.0)
    assert recommend_due(traffic_key(2, traffic, Applied()), key, 0.0, 30.0), "a spec edit"
    assert recommend_due(traffic_key(1, traffic, Applied((8,), 1)), key, 0.0, 30.0), "a set applied"


# --- the reconciler against stand-ins with traffic ------------------------------------------------


TRAFFIC = [(1, True, 2000.0), (8, True, 2000.0), (40, False, 50.0)]


def run_fleet(scenario, count: int, **state):
    import asyncio

    async def main():
        fleet = await Fleet(count, traffic=TRAFFIC, **state).start()
        try:
            return await scenario(fleet)
        finally:
            await fleet.stop()
    return asyncio.run(main())


def test_recommend_writes_the_recommendation_and_pushes_the_spec_sizes():
    async def scenario(fleet: Fleet):
        fleet.apply(spec_with({"mode": "Recommend", "maxGraphs": 3, "minSteps": 100}), 1)
        await fleet.until("a recommendation", lambda: (fleet.kube.status.get("recommendation") or {}).get("sizes"))
        rec = fleet.kube.status["recommendation"]
        assert rec["sizes"] == [1, 8, 40] and rec["expectedCoverage"] == 1.0 and rec["graphs"] == 3
        assert rec["workers"] == 2 and rec["steps"] >= 100 and rec["memoryBytes"] == 3 * 4 * 2**20
        assert [r["size"] for r in rec["reasons"]] == [1, 8, 40] and rec["reasons"][1]["fromTokens"] == 2
        assert rec["message"].startswith("mode Recommend")
        await fleet.until("generation 1", lambda: fleet.holding(1) == 2)
        assert all(s.state.policy.capture_sizes.WhichOneof("sizes") == "ladder" for s in fleet.servers)
        assert "effectiveCaptureSizes" not in fleet.kube.status
    run_fleet(scenario, 2)


def test_apply_rolls_the_chosen_sizes_out_within_max_unavailable_and_does_not_flap():
    async def scenario(fleet: Fleet):
        spec = spec_with({"mode": "Apply", "maxGraphs": 3, "minSteps": 100, "minIntervalSeconds": 3600},
                         rollout={"maxUnavailable": 1})
        fleet.reconciler.resync = 0.5  # settled workers are read again soon (their traffic grows)
        fleet.apply(spec, 1)
        t0 = time.time()
        wire_gen = GENERATION_STRIDE + 1
        await fleet.until("the chosen sizes everywhere", lambda: fleet.holding(wire_gen) == 4, timeout=60)
        assert all(list(s.state.policy.capture_sizes.explicit.sizes) == [1, 8, 40] for s in fleet.servers)
        assert max_concurrently_busy(fleet.servers, t0) <= 1
        await fleet.until("status", lambda: fleet.kube.status.get("capturedWorkers") == 4
                          and (fleet.kube.status.get("effectiveCaptureSizes") or {}).get("inEffect"))
        effective = fleet.kube.status["effectiveCaptureSizes"]
        assert effective["sizes"] == [1, 8, 40] and effective["sequence"] == 1
        assert {w["policyGeneration"] for w in fleet.kube.status["workers"]} == {1}  # the spec's, not the wire's
        assert any(reason == "CaptureSizesApplied" for _, reason, _ in fleet.kube.events)
        # Pods that start later boot with the applied sizes (the ConfigMap), at the same generation.
        (configmap,) = fleet.kube.configmaps.values()
        booted = policy_from_json(configmap["data"]["policy.json"])
        assert list(booted.capture_sizes.explicit.sizes) == [1, 8, 40] and booted.generation == wire_gen
        # New traffic after the adoption: the same set is recommended, nothing is applied again.
        await fleet.until("a fresh recommendation", lambda: "in effect" in
                          (fleet.kube.status.get("recommendation") or {}).get("message", ""), timeout=30)
        # Different traffic: a better set exists, but minIntervalSeconds holds it back.
        for s in fleet.servers:
            s.state.traffic = [(2, True, 3000.0), (16, True, 3000.0), (48, False, 50.0)]
        await fleet.until("held back by the interval", lambda: "minIntervalSeconds" in
                          (fleet.kube.status.get("recommendation") or {}).get("message", ""), timeout=30)
        assert fleet.kube.status["recommendation"]["sizes"] == [2, 16, 48]
        assert fleet.holding(wire_gen) == 4 and fleet.kube.status["effectiveCaptureSizes"]["sequence"] == 1
    run_fleet(scenario, 4, capture_seconds=0.2)


def test_the_crd_checks_from_traffic_memory_budget_by_the_same_rules_as_memory_budget():
    """One quantity rule (tests/memory_budget_cases.py holds spec.memoryBudget's to it on an API server)."""
    from pathlib import Path

    import yaml

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "crds" / "graphpolicy.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    top = spec["memoryBudget"]["x-kubernetes-validations"]
    nested = spec["captureSizes"]["properties"]["fromTraffic"]["properties"]["memoryBudget"]["x-kubernetes-validations"]
    assert [r["rule"] for r in nested] == [r["rule"] for r in top]
    assert [" ".join(r["message"].split()) for r in nested] == [" ".join(r["message"].split()) for r in top]
