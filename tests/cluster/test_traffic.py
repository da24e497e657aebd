"""Capture sizes from traffic against a real kube-apiserver and the operator as a process.

The workers are LIGHT STAND-INS (``tests/fakes/fake_worker.py`` processes) that report a
configurable step-shape histogram (steps per second since their last adoption, reset on adoption
as a worker's is) and one captured graph per explicit size: the thing under test is the operator,
which merges what they report, writes its recommendation into the policy's status and, in Apply
mode, rolls the chosen sizes out. How many recaptured at once comes from the stand-ins' own
lifecycle reports.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from graphkeeper.operator.naming import configmap_name
from graphkeeper.operator.traffic import GENERATION_STRIDE
from graphkeeper.proto.policy import policy_from_json

from .conftest import Kubelet, Operator, Policies, StandIn, wait_until
from .test_rollout import fleet, most_busy_at_once

pytestmark = pytest.mark.cluster

LABELS = {"app": "standin"}
TRAFFIC = "1:decode:2000,8:decode:2000,40:mixed:50"


def spec(mode: str, **from_traffic) -> dict:
    return {"selector": {"matchLabels": LABELS}, "mode": "Piecewise",
            "captureSizes": {"ladder": "Default", "maxCaptureSize": 64,
                             "fromTraffic": {"mode": mode, "maxGraphs": 3, "minSteps": 100, **from_traffic}},
            "rollout": {"maxUnavailable": 1}}


def recommendation(policies: Policies, name: str) -> dict:
    return (policies.get(name).get("status") or {}).get("recommendation") or {}


def test_recommend_writes_the_recommendation_into_status(running_operator: Operator, kubelet: Kubelet,
                                                         policies: Policies):
    workers = fleet(kubelet, policies.namespace, 2, StandIn(traffic=TRAFFIC))
    policies.create("rec", spec("Recommend"))
    rec = wait_until("a recommendation", lambda: recommendation(policies, "rec").get("sizes") and
                     recommendation(policies, "rec"), timeout=60)
    assert rec["sizes"] == [1, 8, 40] and rec["expectedCoverage"] == 1 and rec["graphs"] == 3
    assert rec["workers"] == 2 and rec["steps"] >= 100 and rec["since"] and rec["time"]
    assert [r["size"] for r in rec["reasons"]] == [1, 8, 40]
    assert rec["message"].startswith("mode Recommend")
    # The default ladder up to 64 (11 sizes) stays what the workers hold.
    status = workers[0].graph_status()
    assert status.policy_generation == 1 and not status.captured
    wide = policies.cluster.kubectl("get", "gp", "rec", "-o", "wide", "-n", policies.namespace)
    assert "COVERAGE" in wide and "[1,8,40]" in wide


def test_apply_rolls_out_within_max_unavailable_and_does_not_flap(running_operator: Operator, kubelet: Kubelet,
                                                                   policies: Policies, tmp_path: Path):
    traffic = tmp_path / "traffic"
    traffic.write_text(TRAFFIC)
    workers = fleet(kubelet, policies.namespace, 3,
                    StandIn(capture_seconds=1.0, traffic_file=str(traffic)))
    t0 = time.time()
    policies.create("app", spec("Apply", minIntervalSeconds=3600))
    uid = policies.get("app")["metadata"]["uid"]
    wire = GENERATION_STRIDE + 1

    def holds_chosen(w) -> bool:
        s = w.graph_status()
        return (s.policy_uid == uid and s.policy_generation == wire and s.state == 5
                and sorted(c.size for c in s.captured) == [1, 8, 40])

    wait_until("the chosen sizes on every worker", lambda: all(holds_chosen(w) for w in workers), timeout=90)
    assert most_busy_at_once(workers, t0) <= 1
    obj = policies.wait_condition("app", "Ready", "True", "AllWorkersCaptured")
    effective = obj["status"]["effectiveCaptureSizes"]
    assert effective["sizes"] == [1, 8, 40] and effective["sequence"] == 1 and effective["inEffect"]
    assert obj["spec"]["captureSizes"] == spec("Apply", minIntervalSeconds=3600, minImprovementPercent=5)[
        "captureSizes"], "the user's spec is never edited"
    assert any(e["reason"] == "CaptureSizesApplied" for e in policies.events("app"))
    # A pod that starts later boots with the applied sizes (the ConfigMap it mounts).
    cm = policies.cluster.core.read_namespaced_config_map(configmap_name("app"), policies.namespace)
    booted = policy_from_json(cm.data["policy.json"])
    assert list(booted.capture_sizes.explicit.sizes) == [1, 8, 40] and booted.generation == wire
    # No interval, but no improvement either: the same traffic asks for the set in effect.
    policies.patch_spec("app", {"captureSizes": {"fromTraffic": {"minIntervalSeconds": 0}}})
    second = 2 * GENERATION_STRIDE + 1  # the spec's generation 2, the same applied set
    wait_until("generation 2 with the same sizes", lambda: all(
        w.graph_status().policy_generation == second for w in workers), timeout=60)
    wait_until("the set in effect recommended again", lambda: (
        recommendation(policies, "app").get("message") == "the recommended sizes are in effect"
        and recommendation(policies, "app").get("steps", 0) > 1000), timeout=60)
    assert policies.get("app")["status"]["effectiveCaptureSizes"]["sequence"] == 1
    assert all(sorted(c.size for c in w.graph_status().captured) == [1, 8, 40] for w in workers)
    # Other traffic and the interval back: a better set exists and is held back; the workers keep theirs.
    policies.patch_spec("app", {"captureSizes": {"fromTraffic": {"minIntervalSeconds": 3600}}})
    traffic.write_text("2:decode:3000,16:decode:3000,48:mixed:50")
    # (Until every worker was read again the merged histogram mixes both profiles.)
    wait_until("the interval to hold a new set back",
               lambda: "minIntervalSeconds" in recommendation(policies, "app").get("message", "")
               and recommendation(policies, "app")["sizes"] == [2, 16, 48], timeout=60)
    assert policies.get("app")["status"]["effectiveCaptureSizes"]["sequence"] == 1
    assert all(sorted(c.size for c in w.graph_status().captured) == [1, 8, 40] for w in workers)
