"""What a GraphPolicy asks for: its spec parsed once per reconcile run, for the pushes and the ConfigMap.

The operator checks the spec again although the CRD's rules checked it at admission, so one that
slipped past them is reported (Degraded/InvalidPolicy), never pushed nor rendered. ``desired_policy``
is that one parse: the reconciler runs it once per run and hands the parsed value down; the sizes a
run applies from traffic change only which wire policy it stands for (``Desired.applying``), and a
canary only which wire policy its few workers are given (``Desired.canary_on``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from graphkeeper.operator.rollout import rollout_settings
from graphkeeper.operator.selection import PolicyRef, selector_error
from graphkeeper.operator.traffic import Applied, FromTraffic, effective_policy, from_traffic_settings, mode_of
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import PolicyError, policy_from_spec


@dataclass(frozen=True)
class Desired:
    """A valid spec, parsed: the wire policy to push and render, and how fast it may roll out."""

    #: The policy pushed to workers and written into the ConfigMap: the spec's, with the sizes
    #: applied from traffic and their wire generation (``traffic.effective_policy``).
    wire: pb.GraphPolicy
    max_unavailable: int
    #: Seconds a push or reload may take to settle before the worker counts as failed.
    deadline: float
    #: ``spec.captureSizes.fromTraffic``, and the wire policy as the spec alone says it.
    traffic: FromTraffic | None
    spec_wire: pb.GraphPolicy
    #: ``spec.onModelRevisionChange`` is Recapture: a pod asking for another revision is reloaded.
    reload_on_revision: bool
    #: While a canary runs: its workers (pod keys) and the wire policy with the proposed sizes.
    canary_workers: frozenset[str] = frozenset()
    canary_wire: pb.GraphPolicy | None = None

    @property
    def mode(self) -> str:
        """The spec's graph mode by its CRD name (what an applied set is chosen for)."""
        return mode_of(self.spec_wire)

    def applying(self, applied: Applied) -> Desired:
        """The same spec with ``applied`` (a set chosen from traffic) in effect."""
        return replace(self, wire=effective_policy(self.spec_wire, self.traffic, applied, self.mode),
                       canary_workers=frozenset(), canary_wire=None)

    def canary_on(self, workers: Iterable[str], proposed: Applied) -> Desired:
        """The same, with ``proposed`` given to ``workers`` only."""
        wire = effective_policy(self.spec_wire, self.traffic, proposed, self.mode)
        return replace(self, canary_workers=frozenset(workers), canary_wire=wire)

    def wire_for(self, worker: str) -> pb.GraphPolicy:
        """The wire policy the worker with pod key ``worker`` is to hold."""
        if self.canary_wire is not None and worker in self.canary_workers:
            return self.canary_wire
        return self.wire


def desired_policy(ref: PolicyRef, total: int, applied: Applied | None = None) -> tuple[Desired | None, str | None]:
    """The policy to roll out to ``total`` selected workers, or why there is none (pure).
    ``applied``: the sizes chosen from traffic and applied last."""
    invalid = selector_error(ref.spec.get("selector"))
    if invalid is not None:
        return None, invalid
    try:
        spec_wire = policy_from_spec(ref.spec, uid=ref.uid, name=ref.key, generation=ref.generation)
        settings = from_traffic_settings(ref.spec)
        max_unavailable, deadline = rollout_settings(ref.spec, total)
    except PolicyError as err:
        return None, f"{err.field}: {err.message}"
    except ValueError as err:
        return None, f"spec.rollout: {err}"
    reload_on_revision = ref.spec.get("onModelRevisionChange", "Recapture") == "Recapture"
    desired = Desired(spec_wire, max_unavailable, deadline, settings, spec_wire, reload_on_revision)
    return desired.applying(applied or Applied()), None
