"""Selecting worker pods and settling contested ones, without a cluster."""

from __future__ import annotations

import pytest

from graphkeeper.operator.ownership import owner
from graphkeeper.operator.selection import (
    PolicyRef,
    WorkerPod,
    claims,
    grpc_port,
    policy_ref_from_body,
    selected_workers,
    selector_error,
    selector_matches,
    worker_from_pod,
)


def pod_body(name="w0", labels=None, annotations=None, ports=None, ip="10.0.0.5", ready=True,
             phase="Running", restarts=0):
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                     "labels": labels or {"app": "worker"}, "annotations": annotations or {}},
        "spec": {"containers": [{"name": "worker", "ports": ports or []}]},
        "status": {"phase": phase, "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                   "containerStatuses": [{"name": "worker", "restartCount": restarts}]},
    }


def test_grpc_port_prefers_the_named_container_port_then_the_annotation_then_50051():
    named = pod_body(ports=[{"name": "metrics", "containerPort": 9400},
                            {"name": "grpc", "containerPort": 7000}],
                     annotations={"graphkeeper.io/grpc-port": "8000"})
    assert grpc_port(named) == 7000
    assert grpc_port(pod_body(annotations={"graphkeeper.io/grpc-port": "8000"})) == 8000
    assert grpc_port(pod_body(annotations={"graphkeeper.io/grpc-port": "nope"})) == 50051
    assert grpc_port(pod_body()) == 50051


def test_worker_from_pod_reads_address_readiness_restarts_and_model_annotations():
    pod = worker_from_pod(pod_body(
        ports=[{"name": "grpc", "containerPort": 7000}], restarts=2,
        annotations={"graphkeeper.io/model-source": "random:tiny@1",
                     "graphkeeper.io/model-revision": "r2"}))
    assert pod.key == "ns/w0" and pod.target == "10.0.0.5:7000"
    assert pod.ready and pod.running and pod.restarts == 2
    assert (pod.model_source, pod.model_revision) == ("random:tiny@1", "r2")
    assert not worker_from_pod(pod_body(phase="Pending", ip="")).running


@pytest.mark.parametrize(("selector", "labels", "expected"), [
    ({"matchLabels": {"app": "worker"}}, {"app": "worker", "x": "y"}, True),
    ({"matchLabels": {"app": "worker"}}, {"app": "other"}, False),
    ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]},
     {"tier": "b"}, True),
    ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]}, {}, False),
    ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]}, {}, True),
    ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]},
     {"tier": "a"}, False),
    ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"gpu": ""}, True),
    ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {"gpu": "h200"}, False),
    ({"matchLabels": {"app": "worker"},
      "matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"app": "worker"}, False),
    ({}, {"app": "worker"}, False),
    (None, {"app": "worker"}, False),
])
def test_label_selector_semantics(selector, labels, expected):
    assert selector_matches(selector, labels) is expected


def policy(name, created, labels, uid=None, namespace="ns"):
    return PolicyRef(namespace=namespace, name=name, uid=uid or f"uid-{name}", created=created,
                     spec={"selector": {"matchLabels": labels}})


def winner(pod, everyone, pods=()):
    won = owner(claims(pod, everyone, pods))
    return None if won is None else (won[0].name, won[1].name)


def test_the_older_policy_keeps_a_contested_pod():
    pod = worker_from_pod(pod_body())
    old = policy("old", "2026-11-29T10:00:00Z", {"app": "worker"})
    new = policy("new", "2026-11-29T11:00:00Z", {"app": "worker"})
    unrelated = policy("gpu", "2026-11-29T09:00:00Z", {"app": "other"})
    assert winner(pod, [new, old, unrelated]) == ("old", pod.name)
    assert winner(pod, [unrelated]) is None


def test_within_one_second_the_name_breaks_the_tie_the_same_way_for_both_rivals():
    pod = worker_from_pod(pod_body())
    first = policy("aaa", "2026-11-29T11:00:00Z", {"app": "worker"}, uid="9f")
    second = policy("zzz", "2026-11-29T11:00:00Z", {"app": "worker"}, uid="0a")
    assert winner(pod, [first, second]) == winner(pod, [second, first]) == ("aaa", pod.name)


def test_the_senior_owns_a_worker_whoever_holds_it_until_it_lets_go():
    pod = worker_from_pod(pod_body())
    younger = policy("young", "2026-11-29T11:00:00Z", {"app": "worker"}, uid="9f")
    older = policy("old", "2026-11-29T10:59:59Z", {"app": "worker"}, uid="ff")
    assert winner(pod, [older, younger]) == winner(pod, [younger, older]) == ("old", pod.name)
    gone = PolicyRef(**{**older.__dict__, "deleting": True})
    assert winner(pod, [gone, younger]) == ("young", pod.name), "let go: deleted"
    moved = policy("old", "2026-11-29T10:59:59Z", {"app": "elsewhere"}, uid="ff")
    assert winner(pod, [moved, younger]) == ("young", pod.name), "let go: selector moved"


def test_pods_in_two_namespaces_that_point_at_one_worker_address_conflict():
    ours = worker_from_pod(pod_body(name="a", ports=[{"name": "control", "containerPort": 9}]))
    body = pod_body(name="b", ports=[{"name": "control", "containerPort": 9}])
    body["metadata"]["namespace"] = "team-b"
    theirs = worker_from_pod(body)
    assert ours.control_target == theirs.control_target == "10.0.0.5:9"
    mine = policy("mine", "2026-11-29T11:00:00Z", {"app": "worker"})
    older = policy("older", "2026-11-29T10:00:00Z", {"app": "worker"}, namespace="team-b")
    # Seen from either pod, the answer is the same worker owner.
    assert winner(ours, [mine, older], pods=[theirs]) == ("older", "b")
    assert winner(theirs, [mine, older], pods=[ours]) == ("older", "b")
    assert winner(ours, [mine, older]) == ("mine", "a"), "without the alias only mine claims it"


def test_the_control_port_is_the_port_named_control_else_the_grpc_port():
    both = worker_from_pod(pod_body(ports=[{"name": "grpc", "containerPort": 7000},
                                           {"name": "control", "containerPort": 7001}]))
    assert (both.target, both.control_target) == ("10.0.0.5:7000", "10.0.0.5:7001")
    old = worker_from_pod(pod_body(ports=[{"name": "grpc", "containerPort": 7000}]))
    assert old.control_target == "10.0.0.5:7000", "an old worker serves GraphControl on grpc"


@pytest.mark.parametrize(("selector", "fragment"), [
    ({"matchLabels": {"bad key!": "x"}}, "label key 'bad key!'"),
    ({"matchLabels": {"-app": "x"}}, "label key '-app'"),
    ({"matchLabels": {"Example.COM/app": "x"}}, "prefix must be a DNS subdomain"),
    ({"matchLabels": {"app": "not ok"}}, "label value 'not ok'"),
    ({"matchLabels": {"app": "x" * 64}}, "at most 63"),
    ({"matchExpressions": [{"key": "", "operator": "Exists"}]}, "non-empty"),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["ok", "no/pe"]}]},
     "values[1]"),
    ({"matchExpressions": [{"key": "a", "operator": "Near"}]}, "'Near' is not one of"),
])
def test_an_invalid_selector_is_named_with_its_field(selector, fragment):
    assert fragment in (selector_error(selector) or "")


@pytest.mark.parametrize("selector", [
    {"matchLabels": {"app": "worker", "example.com/tier": "a-b.c_d", "empty": ""}},
    {"matchExpressions": [{"key": "k8s.io/x", "operator": "In", "values": ["a"]},
                          {"key": "gpu", "operator": "Exists"}]},
])
def test_a_valid_selector_has_no_error(selector):
    assert selector_error(selector) is None


def test_a_policy_selects_only_pods_of_its_own_namespace():
    ref = policy("p", "t", {"app": "worker"})
    here = worker_from_pod(pod_body(name="a"))
    there = WorkerPod(namespace="other", name="b", uid="u", labels={"app": "worker"})
    assert selected_workers(ref, [there, here]) == [here]


def test_policy_ref_copies_the_body_into_plain_data():
    body = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "generation": 3,
                         "creationTimestamp": "2026-11-29T10:00:00Z"},
            "spec": {"selector": {"matchLabels": {"app": "w"}}, "mode": "Full"},
            "status": {"observedGeneration": 2}}
    ref = policy_ref_from_body(body)
    body["spec"]["mode"] = "None"
    assert ref.spec["mode"] == "Full" and ref.generation == 3 and ref.status["observedGeneration"] == 2
    assert ref.body()["metadata"] == {"namespace": "ns", "name": "p", "uid": "u"}
