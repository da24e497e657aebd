"""The GraphPolicy CRD against a real kube-apiserver: schema, CEL rules, printer columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from memory_budget_cases import ACCEPTED, REFUSED  # tests/, shared with the operator's tests

from graphkeeper.proto.policy import parse_quantity, policy_from_spec

from .conftest import GROUP, PLURAL, VERSION, Cluster, Operator, Policies, kubernetes

pytestmark = pytest.mark.cluster

SELECTOR = {"matchLabels": {"app": "worker"}}

# Each invalid spec, and a fragment of the message the API server must answer with.
INVALID = {
    "unknown mode": ({"selector": SELECTOR, "mode": "Turbo"}, "Unsupported value: \"Turbo\""),
    "zero capture size": ({"selector": SELECTOR, "captureSizes": {"sizes": [0, 8]}},
                          "should be greater than or equal to 1"),
    "duplicate capture sizes": ({"selector": SELECTOR, "captureSizes": {"sizes": [8, 16, 8]}},
                                "capture sizes must be unique"),
    "size above maxCaptureSize": (
        {"selector": SELECTOR, "captureSizes": {"sizes": [16, 64], "maxCaptureSize": 32}},
        "every capture size must be at most maxCaptureSize"),
    "sizes and ladder": (
        {"selector": SELECTOR, "captureSizes": {"sizes": [8], "ladder": "Default"}},
        "set either sizes or ladder, not both"),
    "graph mode without sizes": (
        {"selector": SELECTOR, "mode": "Full", "captureSizes": {"sizes": []}},
        "mode Full captures graphs and needs at least one capture size"),
    "mode None with capture sizes": (
        {"selector": SELECTOR, "mode": "None", "captureSizes": {"sizes": []}},
        "mode None captures no graphs; leave captureSizes out"),
    "memory budget in exponent form": ({"selector": SELECTOR, "memoryBudget": "1e9"},
                                       "memoryBudget must be a non-negative number of bytes"),
    "maxCaptureSize out of range": (
        {"selector": SELECTOR, "captureSizes": {"maxCaptureSize": 100000}},
        "should be less than or equal to 8192"),
    "memory budget not a quantity": ({"selector": SELECTOR, "memoryBudget": "lots"},
                                     "memoryBudget must be a non-negative number of bytes"),
    "memory budget in millibytes": ({"selector": SELECTOR, "memoryBudget": "1000m"},
                                    "memoryBudget must be a non-negative number of bytes"),
    "memory budget not whole bytes": ({"selector": SELECTOR, "memoryBudget": "1.1Gi"},
                                      "memoryBudget must be a whole number of bytes"),
    "memory budget above int64": ({"selector": SELECTOR, "memoryBudget": "8Ei"},
                                  "memoryBudget must be at most 9223372036854775807 bytes"),
    "negative memory budget": ({"selector": SELECTOR, "memoryBudget": -1},
                               "memoryBudget must be a non-negative number of bytes"),
    "duplicate tenant": (
        {"selector": SELECTOR, "tenants": [{"name": "a", "graphs": "Enabled"},
                                           {"name": "a", "graphs": "Disabled"}]},
        "Duplicate value"),
    "tenant name not a DNS label": ({"selector": SELECTOR, "tenants": [{"name": "Bad_Name"}]},
                                    "should match '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'"),
    "tenant toggle not an enum": (
        {"selector": SELECTOR, "tenants": [{"name": "a", "graphs": "Maybe"}]},
        "Unsupported value: \"Maybe\""),
    "empty selector": ({"selector": {}}, "selector must not be empty"),
    "In without values": (
        {"selector": {"matchExpressions": [{"key": "app", "operator": "In"}]}},
        "operators In and NotIn need values"),
    "missing selector": ({"mode": "Full"}, "spec.selector: Required value"),
    "maxUnavailable above 100%": ({"selector": SELECTOR, "rollout": {"maxUnavailable": "150%"}},
                                  "maxUnavailable must be a count of at least 1 or a percentage"),
    "maxUnavailable not a percentage": (
        {"selector": SELECTOR, "rollout": {"maxUnavailable": "two"}},
        "maxUnavailable must be a count of at least 1 or a percentage"),
    "negative maxUnavailable": ({"selector": SELECTOR, "rollout": {"maxUnavailable": -1}},
                                "maxUnavailable must be a count of at least 1 or a percentage"),
    "zero maxUnavailable": ({"selector": SELECTOR, "rollout": {"maxUnavailable": 0}},
                            "spec.rollout.maxUnavailable: Invalid value"),
    "zero percent maxUnavailable": ({"selector": SELECTOR, "rollout": {"maxUnavailable": "0%"}},
                                    "maxUnavailable must be a count of at least 1 or a percentage"),
    "zero progress deadline": (
        {"selector": SELECTOR, "rollout": {"progressDeadlineSeconds": 0}},
        "should be greater than or equal to 1"),
    "fromTraffic without a bound": (
        {"selector": SELECTOR, "captureSizes": {"fromTraffic": {"mode": "Apply"}}},
        "fromTraffic needs maxGraphs or memoryBudget"),
    "fromTraffic unknown mode": (
        {"selector": SELECTOR, "captureSizes": {"fromTraffic": {"mode": "Sometimes", "maxGraphs": 8}}},
        "Unsupported value: \"Sometimes\""),
    "fromTraffic zero maxGraphs": (
        {"selector": SELECTOR, "captureSizes": {"fromTraffic": {"mode": "Apply", "maxGraphs": 0}}},
        "should be greater than or equal to 1"),
    "fromTraffic budget not whole bytes": (
        {"selector": SELECTOR, "captureSizes": {"fromTraffic": {"mode": "Apply", "memoryBudget": "1.1Gi"}}},
        "spec.captureSizes.fromTraffic.memoryBudget"),
    "fromTraffic improvement above 100": (
        {"selector": SELECTOR,
         "captureSizes": {"fromTraffic": {"mode": "Apply", "maxGraphs": 8, "minImprovementPercent": 150}}},
        "should be less than or equal to 100"),
    "negative maxGraphs": ({"selector": SELECTOR, "maxGraphs": -1}, "should be greater than or equal to 0"),
    "idleReleaseSeconds as a duration string": ({"selector": SELECTOR, "idleReleaseSeconds": "5m"},
                                                "spec.idleReleaseSeconds: Invalid value"),
    "negative sleepAfterIdleSeconds": ({"selector": SELECTOR, "sleepAfterIdleSeconds": -1},
                                       "spec.sleepAfterIdleSeconds in body should be greater than or equal to 0"),
    "sleepAfterIdleSeconds above 30 days": (
        {"selector": SELECTOR, "sleepAfterIdleSeconds": 2592001},
        "spec.sleepAfterIdleSeconds in body should be less than or equal to 2592000"),
    "sleepAfterIdleSeconds as a duration string": ({"selector": SELECTOR, "sleepAfterIdleSeconds": "15m"},
                                                   "spec.sleepAfterIdleSeconds: Invalid value"),
    "sleepLevel not 1 or 2": ({"selector": SELECTOR, "sleepLevel": 3},
                              "spec.sleepLevel: Unsupported value: 3"),
    "unknown revision policy": ({"selector": SELECTOR, "onModelRevisionChange": "Sometimes"},
                                "Unsupported value: \"Sometimes\""),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_an_invalid_graph_policy_is_rejected_with_its_message(policies: Policies, case: str):
    spec, message = INVALID[case]
    with pytest.raises(kubernetes.client.ApiException) as caught:
        policies.create("bad", spec)
    assert caught.value.status == 422
    answer = json.loads(caught.value.body)["message"]
    assert message in answer, answer


def test_a_valid_policy_gets_its_defaults(policies: Policies):
    obj = policies.create("defaults", {"selector": SELECTOR, "memoryBudget": "2Gi",
                                       "tenants": [{"name": "batch"}]})
    spec = obj["spec"]
    assert spec["mode"] == "FullAndPiecewise"
    assert spec["defaultTenantGraphs"] == "Enabled"
    assert spec["onModelRevisionChange"] == "Recapture"
    assert spec["tenants"] == [{"name": "batch", "graphs": "Enabled"}]
    assert "sleepAfterIdleSeconds" not in spec and spec["sleepLevel"] == 1  # no sleep; level 1 if set
    assert policy_from_spec(spec, uid="u", name="ns/p", generation=1).sleep_after_idle_seconds == 0
    more = [policies.create("bytes", {"selector": SELECTOR, "memoryBudget": 1048576,
                                      "mode": "None"}),
            policies.create("decimal", {"selector": SELECTOR, "memoryBudget": "1G"}),
            policies.create("count", {"selector": SELECTOR, "rollout": {"maxUnavailable": 3}}),
            policies.create("percent", {"selector": SELECTOR,
                                        "rollout": {"maxUnavailable": "100%"}}),
            policies.create("sleepy", {"selector": SELECTOR, "sleepAfterIdleSeconds": 900, "sleepLevel": 2}),
            policies.create("traffic", {"selector": SELECTOR, "maxGraphs": 16, "idleReleaseSeconds": 600,
                                        "captureSizes": {"fromTraffic": {"mode": "Recommend",
                                                                         "memoryBudget": "256Mi"}}})]
    traffic = more[-1]["spec"]["captureSizes"]["fromTraffic"]
    assert (traffic["minIntervalSeconds"], traffic["minImprovementPercent"], traffic["minSteps"]) == (600, 5, 1000)
    for accepted in [obj, *more]:  # what admission accepts, the operator accepts too
        policy_from_spec(accepted["spec"], uid="u", name="ns/p", generation=1)


def admitted(cluster: Cluster, namespace: str, budget) -> tuple[bool, str]:
    """Whether the API server admits ``memoryBudget: budget`` (a server-side dry run), and its
    message when it does not."""
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GraphPolicy",
            "metadata": {"name": "budget"}, "spec": {"selector": SELECTOR, "memoryBudget": budget}}
    try:
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body,
                                                       dry_run="All")
    except kubernetes.client.ApiException as err:
        assert err.status == 422, err.body
        return False, json.loads(err.body)["message"]
    return True, ""


def test_the_crd_and_the_operator_agree_on_every_memory_budget_example(
        cluster: Cluster, namespace: str):
    """One table (tests/memory_budget_cases.py), two judges: the CRD's CEL rules on a real API
    server, and the operator's parser. Every refusal names the field."""
    for budget, expected in ACCEPTED:
        ok, message = admitted(cluster, namespace, budget)
        assert ok, f"{budget!r} was refused: {message}"
        assert parse_quantity(budget) == expected
    for budget in REFUSED:
        ok, message = admitted(cluster, namespace, budget)
        assert not ok, f"{budget!r} was admitted"
        assert "spec.memoryBudget" in message, message


def test_status_is_a_subresource_and_keeps_only_declared_fields(
        no_operator: Operator, cluster: Cluster, policies: Policies):
    policies.create("st", {"selector": SELECTOR})
    cluster.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, policies.namespace, PLURAL, "st",
        {"status": {"observedGeneration": 1, "selectedWorkers": 3, "bogus": True}},
        _content_type="application/merge-patch+json")
    status = policies.get("st")["status"]
    assert status["selectedWorkers"] == 3
    assert "bogus" not in status, "the status schema is structural: unknown fields are pruned"


def test_kubectl_get_gp_shows_the_printer_columns(
        no_operator: Operator, cluster: Cluster, policies: Policies):
    policies.create("cols", {"selector": SELECTOR, "mode": "FullDecodeOnly"})
    cluster.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, policies.namespace, PLURAL, "cols",
        {"status": {"observedGeneration": 1, "selectedWorkers": 2, "capturedWorkers": 1,
                    "conditions": [{"type": "Ready", "status": "False",
                                    "reason": "WorkersNotCaptured", "message": "1/2",
                                    "lastTransitionTime": "2026-11-29T12:00:00Z"}]}},
        _content_type="application/merge-patch+json")
    out = cluster.kubectl("get", "gp", "-n", policies.namespace)
    header, row = out.strip().splitlines()[:2]
    assert header.split() == ["NAME", "MODE", "SELECTED", "CAPTURED", "READY", "AGE"]
    assert row.split()[:5] == ["cols", "FullDecodeOnly", "2", "1", "False"]
    wide = cluster.kubectl("get", "graphpolicies", "-o", "wide", "-n", policies.namespace)
    assert "WorkersNotCaptured" in wide and "REASON" in wide


def test_the_examples_pass_server_side_validation(no_operator: Operator, cluster: Cluster,
                                                   policies: Policies):
    examples = Path(__file__).resolve().parents[2] / "deploy" / "examples"
    out = cluster.kubectl("apply", "--dry-run=server", "-n", policies.namespace,
                          "-f", str(examples))
    assert out.count("(server dry run)") == len(list(examples.glob("*.yaml"))), out
