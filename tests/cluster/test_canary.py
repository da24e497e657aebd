"""Proof before rollout against a real kube-apiserver and the operator as a process: a set chosen
from traffic serves on one canary worker, is compared with the rest over a window, and is promoted
or reverted.

The workers are LIGHT STAND-INS (``tests/fakes/fake_worker.py`` processes) reporting simulated
traffic and serving counters at a configurable speed, which can depend on the sizes they hold:
that is how a test makes the canary slower. The thing under test is the operator.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from graphkeeper.operator.traffic import GENERATION_STRIDE

from .conftest import Kubelet, Operator, Policies, StandIn, wait_until
from .test_rollout import fleet

pytestmark = pytest.mark.cluster

LABELS = {"app": "standin"}
TRAFFIC = "1:decode:2000,8:decode:2000,40:mixed:50"
CHOSEN = [1, 8, 40]


def spec(**canary) -> dict:
    return {"selector": {"matchLabels": LABELS}, "mode": "Piecewise",
            "captureSizes": {"ladder": "Default", "maxCaptureSize": 64,
                             "fromTraffic": {"mode": "Apply", "maxGraphs": 3, "minSteps": 100,
                                             "minIntervalSeconds": 3600,
                                             "canary": {"windowSeconds": 10, **canary}}},
            "rollout": {"maxUnavailable": 1}}


def sizes(worker) -> list[int]:
    return sorted(c.size for c in worker.graph_status().captured)


def canary(policies: Policies, name: str) -> dict:
    return (policies.get(name).get("status") or {}).get("canary") or {}


def test_a_canary_as_fast_as_the_rest_is_promoted_to_every_worker(running_operator: Operator, kubelet: Kubelet,
                                                                  policies: Policies):
    workers = fleet(kubelet, policies.namespace, 3, StandIn(traffic=TRAFFIC, speed_with_sizes="1,8,40=1.05"))
    policies.create("fast", spec())
    first = f"{policies.namespace}/standin-00"
    running = wait_until("the canary to start", lambda: canary(policies, "fast").get("phase") == "Canary"
                         and canary(policies, "fast"), timeout=60)
    assert running["workers"] == [first] and running["proposedSizes"] == CHOSEN
    # While it runs, only the canary holds the new set, and Progressing says why.
    wait_until("the canary to hold the set", lambda: sizes(workers[0]) == CHOSEN, timeout=30)
    assert sizes(workers[1]) == sizes(workers[2]) == []
    progressing = policies.wait_condition("fast", "Progressing", "True", "CanaryRunning")
    assert "canary of sizes [1, 8, 40]" in next(c for c in progressing["status"]["conditions"]
                                               if c["type"] == "Progressing")["message"]
    done = wait_until("the verdict", lambda: canary(policies, "fast").get("phase") in ("Promoted", "Reverted")
                      and canary(policies, "fast"), timeout=90)
    assert done["phase"] == "Promoted" and done["verdict"] == "Promote", done
    assert "faster per sequence than the rest" in done["reason"]
    figures = done["figures"]
    assert figures["canary"]["workers"] == 1 and figures["rest"]["workers"] == 2
    assert figures["canary"]["tokensPerSecondPerSequence"] > figures["rest"]["tokensPerSecondPerSequence"]
    assert figures["canary"]["coverage"] == 1 and figures["rest"]["coverage"] == 0
    assert done["windowStart"] and done["windowEnd"]
    wait_until("the set on every worker", lambda: all(sizes(w) == CHOSEN for w in workers), timeout=60)
    obj = policies.wait_condition("fast", "Ready", "True", "AllWorkersCaptured")
    effective = obj["status"]["effectiveCaptureSizes"]
    assert effective["sizes"] == CHOSEN and effective["sequence"] == 1 and effective["inEffect"]
    assert all(w.graph_status().policy_generation == GENERATION_STRIDE + 1 for w in workers)
    reasons = [e["reason"] for e in policies.events("fast")]
    assert "CanaryStarted" in reasons and "CanaryPromoted" in reasons and "CanaryReverted" not in reasons


def test_a_slower_canary_is_reverted_says_why_and_is_not_retried(running_operator: Operator, kubelet: Kubelet,
                                                                 policies: Policies):
    workers = fleet(kubelet, policies.namespace, 3,
                    StandIn(traffic=TRAFFIC, speed_with_sizes="1,8,40=0.9", capture_seconds=0.5))
    policies.create("slow", spec(maxSlowdownPercent=2))
    wait_until("the canary to start", lambda: canary(policies, "slow").get("phase") == "Canary", timeout=60)
    done = wait_until("the verdict", lambda: canary(policies, "slow").get("phase") in ("Promoted", "Reverted")
                      and canary(policies, "slow"), timeout=120)
    assert done["phase"] == "Reverted" and done["verdict"] == "Revert", done
    # The slowdown figure and the limit: 1 - 0.9 = 10% slower, limit 2%.
    assert done["reason"].startswith("canary 10.0% slower per sequence than the rest (limit 2%)"), done["reason"]
    figures = done["figures"]
    ratio = figures["canary"]["tokensPerSecondPerSequence"] / figures["rest"]["tokensPerSecondPerSequence"]
    assert ratio == pytest.approx(0.9, abs=0.01)
    # The canary is pushed the previous sizes back (the spec's ladder: the stand-in captures none),
    # under a generation past the proposal's; the rest never recaptured.
    reverted = GENERATION_STRIDE + 2
    wait_until("the canary back on the previous sizes", lambda: all(
        w.graph_status().policy_generation == reverted and sizes(w) == [] for w in workers), timeout=60)
    # (Past the window's first half: with maxUnavailable 1 the rest may still have been capturing the
    # spec's first generation when the canary started.)
    opened = datetime.strptime(done["windowStart"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    assert not [s for w in workers[1:] for t, s in w.transitions() if t >= opened + 5 and s == "RECAPTURING"]
    assert [s for t, s in workers[0].transitions() if t >= opened + 5] == ["RECAPTURING", "READY"]  # back
    events = {e["reason"]: e for e in policies.events("slow")}
    assert "CanaryReverted" in events and "10.0% slower" in events["CanaryReverted"]["message"]
    assert "CanaryPromoted" not in events
    status = policies.get("slow")["status"]
    assert status["effectiveCaptureSizes"]["sequence"] == 2 and status["effectiveCaptureSizes"]["sizes"] == []
    # The same proposal is not retried within minIntervalSeconds: the look holds it back.
    wait_until("the interval to hold the proposal back", lambda: "minIntervalSeconds" in (
        policies.get("slow")["status"].get("recommendation") or {}).get("message", ""), timeout=60)
    status = policies.get("slow")["status"]
    assert status["recommendation"]["sizes"] == CHOSEN
    assert status["canary"]["phase"] == "Reverted" and status["effectiveCaptureSizes"]["sequence"] == 2
    assert all(sizes(w) == [] for w in workers)
