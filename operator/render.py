"""The Kubernetes objects the operator writes, built by pure functions.

Worker pods mount the ConfigMap built here and start with ``--policy-file``, so a worker that
starts while the operator is away still captures the policy's graphs before it reports ready.
The ConfigMap is owned by its GraphPolicy: deleting the policy lets the garbage collector remove
it, with no finalizer involved.
"""

from __future__ import annotations

from typing import Any

from graphkeeper.operator import naming
from graphkeeper.operator.selection import PolicyRef
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import policy_to_json


def owner_reference(policy: PolicyRef) -> dict[str, Any]:
    return {
        "apiVersion": naming.API_VERSION,
        "kind": naming.KIND,
        "name": policy.name,
        "uid": policy.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def build_configmap(policy: PolicyRef, wire: pb.GraphPolicy) -> dict[str, Any]:
    """The ConfigMap ``<policy>-graphpolicy`` holding ``policy.json`` for worker pods."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": naming.configmap_name(policy.name),
            "namespace": policy.namespace,
            "labels": {
                "app.kubernetes.io/managed-by": "graphkeeper-operator",
                "app.kubernetes.io/part-of": "graphkeeper",
                f"{naming.GROUP}/policy": policy.name,
            },
            "annotations": {f"{naming.GROUP}/policy-generation": str(wire.generation)},
            "ownerReferences": [owner_reference(policy)],
        },
        "data": {naming.POLICY_FILE_KEY: policy_to_json(wire)},
    }


def configmap_differs(current: dict[str, Any] | None, desired: dict[str, Any]) -> bool:
    """Whether ``current`` (as read from the API) needs rewriting to match ``desired``."""
    if current is None:
        return True
    meta, want = current.get("metadata") or {}, desired["metadata"]
    owners = [(o.get("uid"), o.get("controller")) for o in meta.get("ownerReferences") or []]
    return (
        (current.get("data") or {}) != desired["data"]
        or any((meta.get("labels") or {}).get(k) != v for k, v in want["labels"].items())
        or any((meta.get("annotations") or {}).get(k) != v for k, v in want["annotations"].items())
        or (want["ownerReferences"][0]["uid"], True) not in owners
    )


def build_status_patch(status: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """A JSON merge patch that turns ``previous`` into ``status``.

    Merge patches keep keys they do not mention, so a key that disappeared (a cleared
    lastFailure never does, but ``workers`` entries and optional fields may) is set to null.
    """
    patch: dict[str, Any] = dict(status)
    for key in (previous or {}):
        if key not in status:
            patch[key] = None
    return {"status": patch}
