"""Selecting worker pods and settling contested ones, without a cluster."""

from __future__ import annotations

import pytest

from graphkeeper.operator.selection import (
    PolicyRef,
    WorkerPod,
    grpc_port,
    policy_ref_from_body,
    selected_workers,
    selector_matches,
    senior_claimant,
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


def policy(name, created, labels, uid=None):
    return PolicyRef(namespace="ns", name=name, uid=uid or f"uid-{name}", created=created,
                     spec={"selector": {"matchLabels": labels}})


def test_the_older_policy_keeps_a_contested_pod():
    pod = worker_from_pod(pod_body())
    old = policy("old", "2026-11-29T10:00:00Z", {"app": "worker"})
    new = policy("new", "2026-11-29T11:00:00Z", {"app": "worker"})
    unrelated = policy("gpu", "2026-11-29T09:00:00Z", {"app": "other"})
    everyone = [old, new, unrelated]
    assert senior_claimant(new, pod, everyone) == old
    assert senior_claimant(old, pod, everyone) is None
    same_second = policy("aaa", "2026-11-29T11:00:00Z", {"app": "worker"})
    assert senior_claimant(new, pod, [same_second, new]) == same_second, "name breaks the tie"


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
