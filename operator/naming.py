"""The names the operator shares with the CRD, the chart and worker pods.

One module so that a rename happens in one place: the API group, the annotation keys people put
on worker pods, the prefix under which kopf keeps its bookkeeping, and the finalizer name.
"""

from __future__ import annotations

GROUP = "graphkeeper.io"
VERSION = "v1alpha1"
PLURAL = "graphpolicies"
KIND = "GraphPolicy"
API_VERSION = f"{GROUP}/{VERSION}"

#: kopf keeps handler progress and the last-handled spec in annotations under this prefix, so
#: ``.status`` holds only fields our schema declares.
ANNOTATION_PREFIX = GROUP
#: The finalizer kopf would add; no handler of ours requires one, so deletion never waits.
FINALIZER = f"{GROUP}/finalizer"

#: Pod annotations that say which model a worker should serve.
MODEL_SOURCE_ANNOTATION = f"{GROUP}/model-source"
MODEL_REVISION_ANNOTATION = f"{GROUP}/model-revision"
#: Pod annotation for the gRPC port when no container port is named ``grpc``.
GRPC_PORT_ANNOTATION = f"{GROUP}/grpc-port"
GRPC_PORT_NAME = "grpc"
#: The container port on which a worker serves GraphControl (never the inference port).
CONTROL_PORT_NAME = "control"

#: The ConfigMap key worker pods read at boot (``--policy-file``).
POLICY_FILE_KEY = "policy.json"
FIELD_MANAGER = "graphkeeper-operator"


def configmap_name(policy_name: str) -> str:
    """The ConfigMap that carries a policy's rendered JSON: ``<policy-name>-graphpolicy``."""
    return f"{policy_name}-graphpolicy"
