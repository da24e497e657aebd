"""Which worker pods a policy selects, where to reach them, and who owns a contested pod.

Everything here is pure: the kopf indices hold ``WorkerPod`` and ``PolicyRef`` values built by
these functions from watch events, and the reconciler resolves selectors against them in memory
instead of listing pods per event.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from graphkeeper.operator import naming
from graphkeeper.proto import ports


@dataclass(frozen=True)
class WorkerPod:
    """The little the operator needs to know about one pod."""

    namespace: str
    name: str
    uid: str
    labels: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    address: str = ""
    port: int = ports.GRPC_PORT
    phase: str = ""
    ready: bool = False
    restarts: int = 0
    deleting: bool = False
    model_source: str = ""
    model_revision: str = ""
    #: The GraphControl port: the container port named ``control``, else the gRPC port (old
    #: workers served GraphControl beside inference).
    control_port: int = 0

    @property
    def key(self) -> str:
        """``namespace/name``, the name people see in status and Events."""
        return f"{self.namespace}/{self.name}"

    @property
    def target(self) -> str:
        """The inference address (``grpc`` port)."""
        return f"{self.address}:{self.port}"

    @property
    def control_target(self) -> str:
        """Where GraphControl answers; two pods with the same one are the same worker."""
        return f"{self.address}:{self.control_port or self.port}"

    @property
    def running(self) -> bool:
        """Whether there is a process to talk to (a Running pod with an IP)."""
        return self.phase == "Running" and bool(self.address) and not self.deleting

    def fingerprint(self) -> tuple:
        """What, when it changes, may need the policy pushed again or a model reloaded."""
        return (self.address, self.port, self.control_port, self.phase, self.ready, self.restarts, self.deleting,
                self.model_source, self.model_revision, tuple(sorted(self.labels.items())))


def grpc_port(pod: Mapping[str, Any]) -> int:
    """The container port named ``grpc``, else the ``graphkeeper.io/grpc-port`` annotation,
    else the worker's default (``proto/ports.py``)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == naming.GRPC_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    value = str(annotations.get(naming.GRPC_PORT_ANNOTATION, "")).strip()
    if value.isdigit() and 0 < int(value) < 65536:
        return int(value)
    return ports.GRPC_PORT


def control_port(pod: Mapping[str, Any]) -> int:
    """The container port named ``control``; 0 when none is declared (an old worker)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == naming.CONTROL_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return 0


def worker_from_pod(pod: Mapping[str, Any]) -> WorkerPod:
    """Builds a ``WorkerPod`` from a Pod object (a dict, or kopf's body)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [])
    return WorkerPod(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        labels=dict(meta.get("labels") or {}),
        address=status.get("podIP") or "",
        port=grpc_port(pod),
        phase=status.get("phase") or "",
        ready=ready,
        restarts=restarts,
        deleting=bool(meta.get("deletionTimestamp")),
        model_source=str(annotations.get(naming.MODEL_SOURCE_ANNOTATION, "")),
        model_revision=str(annotations.get(naming.MODEL_REVISION_ANNOTATION, "")),
        control_port=control_port(pod),
    )


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics, except that an empty selector matches nothing.

    Kubernetes reads an empty selector as "everything"; for a policy that pushes graph settings
    into processes, selecting every pod by accident is worse than selecting none (the CRD
    refuses empty selectors too).
    """
    if not selector:
        return False
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not match_labels and not expressions:
        return False
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for expr in expressions:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False
    return True


@dataclass(frozen=True)
class PolicyRef:
    """A GraphPolicy as the operator's index keeps it."""

    namespace: str
    name: str
    uid: str
    created: str = ""
    generation: int = 1
    spec: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    status: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    deleting: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def seniority(self) -> tuple[str, str, str, str]:
        """Older policies own contested workers (``ownership``). ``creationTimestamp`` has
        one-second resolution, so the name breaks ties (then the namespace and the uid): the
        same answer for both rivals, every time, and one a person can predict."""
        return (self.created, self.name, self.namespace, self.uid)

    def selects(self, pod: WorkerPod) -> bool:
        return pod.namespace == self.namespace and selector_matches(
            self.spec.get("selector"), pod.labels
        )

    def body(self) -> dict[str, Any]:
        """Just enough of the object for kopf to post Events about it."""
        return {
            "apiVersion": naming.API_VERSION,
            "kind": naming.KIND,
            "metadata": {"namespace": self.namespace, "name": self.name, "uid": self.uid},
        }


def plain(value: Any) -> Any:
    """A deep copy made of dicts and lists (kopf hands out read-only views)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def policy_ref_from_body(body: Mapping[str, Any]) -> PolicyRef:
    meta = body.get("metadata") or {}
    return PolicyRef(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        created=str(meta.get("creationTimestamp") or ""),
        generation=int(meta.get("generation") or 1),
        spec=plain(body.get("spec") or {}),
        status=plain(body.get("status") or {}),
        deleting=bool(meta.get("deletionTimestamp")),
    )


def selected_workers(policy: PolicyRef, pods: Iterable[WorkerPod]) -> list[WorkerPod]:
    """The pods ``policy`` selects, by name."""
    return sorted((p for p in pods if policy.selects(p)), key=lambda p: p.name)


def pods_by_target(pods: Mapping[str, Iterable[WorkerPod]]) -> dict[str, list[WorkerPod]]:
    """Every live pod with an address, by GraphControl address (``pods``: the index, by namespace)."""
    out: dict[str, list[WorkerPod]] = {}
    for namespace in pods.values():
        for p in namespace:
            if p.address and not p.deleting:
                out.setdefault(p.control_target, []).append(p)
    return out


def live_targets(pods: Mapping[str, Iterable[WorkerPod]]) -> set[str]:
    """The addresses some running pod answers at (both ports)."""
    return {t for namespace in pods.values() for p in namespace if p.running
            for t in (p.control_target, p.target)}


def claims(
    pod: WorkerPod,
    policies: Iterable[PolicyRef],
    pods_at_target: Iterable[WorkerPod] = (),
) -> list[tuple[PolicyRef, WorkerPod]]:
    """Every live policy that claims the worker behind ``pod``, with the pod it claims it through.

    A worker is claimed through any pod that points at its GraphControl address, in any
    namespace: two policies whose pods share an address push to one process, so only one may.
    ``pods_at_target`` are the other pods known at ``pod``'s control address.
    """
    same = [pod] + [p for p in pods_at_target if p.uid != pod.uid and not p.deleting]
    found: dict[str, tuple[PolicyRef, WorkerPod]] = {}
    for policy in policies:
        if policy.deleting or policy.uid in found:
            continue
        via = next((q for q in same if policy.selects(q)), None)
        if via is not None:
            found[policy.uid] = (policy, via)
    return list(found.values())


# --- selector validation ----------------------------------------------------------------------

_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def label_key_error(key: Any) -> str | None:
    """Why ``key`` is not a valid label key (``[prefix/]name``), or None."""
    if not isinstance(key, str) or not key:
        return "a label key must be a non-empty string"
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.match(prefix)):
        return f"label key {key!r}: the prefix must be a DNS subdomain of at most 253 characters"
    if len(name) > 63 or not _NAME_RE.match(name):
        return (f"label key {key!r}: the name must be at most 63 characters of [A-Za-z0-9-_.], "
                "starting and ending with a letter or digit")
    return None


def label_value_error(value: Any) -> str | None:
    """Why ``value`` is not a valid label value (empty is valid), or None."""
    if not isinstance(value, str):
        return f"label value {value!r} must be a string"
    if value and (len(value) > 63 or not _NAME_RE.match(value)):
        return (f"label value {value!r} must be at most 63 characters of [A-Za-z0-9-_.], "
                "starting and ending with a letter or digit")
    return None


def selector_error(selector: Mapping[str, Any] | None) -> str | None:
    """Why a policy's selector can never select anything (a message naming the field), or None.

    The API server checks a selector's shape; label syntax it leaves to us, and a selector with
    an invalid key would otherwise select nothing, silently.
    """
    if not selector:
        return "spec.selector: must not be empty"
    for key, value in (selector.get("matchLabels") or {}).items():
        why = label_key_error(key) or label_value_error(value)
        if why:
            return f"spec.selector.matchLabels: {why}"
    for i, expr in enumerate(selector.get("matchExpressions") or []):
        field = f"spec.selector.matchExpressions[{i}]"
        why = label_key_error(expr.get("key"))
        if why:
            return f"{field}.key: {why}"
        op = expr.get("operator")
        if op not in _OPERATORS:
            return f"{field}.operator: {op!r} is not one of {', '.join(_OPERATORS)}"
        values = expr.get("values") or []
        if op in ("In", "NotIn") and not values:
            return f"{field}.values: operator {op} needs at least one value"
        if op in ("Exists", "DoesNotExist") and values:
            return f"{field}.values: operator {op} takes no values"
        for j, value in enumerate(values):
            why = label_value_error(value)
            if why:
                return f"{field}.values[{j}]: {why}"
    return None
