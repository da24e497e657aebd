"""Who owns a worker that two policies select: one rule for the whole overlap, and what the loser says.

The rule: the senior policy (the older ``creationTimestamp``; within one second, the smaller
name, then namespace, then uid) owns every worker it selects, whoever holds the worker now. It
depends only on facts that never change while both policies select the worker, so it cannot
flip back: a junior that pushed to some workers before the senior arrived (or before a selector
edit made them overlap) hands them over through the senior's normal rollout, each once, and no
later event, restart or spec change can split the overlap between them again. A worker changes
owner only when its owner lets go (deleted, or its selector moved), and then to the next senior.

The earlier rule (the worker's holder keeps it) depended on which pushes had landed, so a
rollout that had pushed some workers before the overlap kept them forever and the selection
stayed split between two policies.

Everything here is pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from graphkeeper.operator.selection import PolicyRef, WorkerPod, claims
from graphkeeper.operator.status import WorkerObservation, WorkerState


def owner(claimed: Iterable[tuple[PolicyRef, WorkerPod]]) -> tuple[PolicyRef, WorkerPod] | None:
    """The one policy that may push to a worker, from every claim on it: the most senior."""
    return min(claimed, key=lambda c: c[0].seniority, default=None)


def split_owned(
    ref: PolicyRef,
    pods: Sequence[WorkerPod],
    claims_on: Callable[[WorkerPod], Iterable[tuple[PolicyRef, WorkerPod]]],
) -> tuple[list[WorkerPod], list[WorkerObservation]]:
    """The pods ``ref`` owns among those it selects, and a CONFLICT observation for each that a
    more senior policy owns (it selects the pod, or another pod at the same worker address).

    ``claims_on(pod)``: every live policy that claims the worker behind ``pod``, with the pod it
    claims it through (``pod_index.SelectionIndex.claims``, or ``claims_from`` below).
    """
    mine: list[WorkerPod] = []
    conflicts: list[WorkerObservation] = []
    for pod in pods:
        won = owner(claims_on(pod))
        if won is None or won[0].uid == ref.uid:
            mine.append(pod)
            continue
        other, via = won
        where = "" if via.uid == pod.uid else f" through pod {via.key} at {pod.control_target}"
        conflicts.append(WorkerObservation(
            pod.key, WorkerState.CONFLICT,
            f"owned by the policy {other.key}{where}, which is older ({other.created or 'same age'}, "
            "older policies own every worker they select); not pushed", owner=other.key))
    return mine, conflicts


def claims_from(everyone: Sequence[PolicyRef], at_target: Mapping[str, Sequence[WorkerPod]]
                ) -> Callable[[WorkerPod], list[tuple[PolicyRef, WorkerPod]]]:
    """``claims_on`` for ``split_owned`` from plain lists: every policy, and pods by control address."""
    return lambda pod: claims(pod, everyone, at_target.get(pod.control_target, ()) if pod.address else ())
