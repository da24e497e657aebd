"""The pods and policies the watches reported, and who selects what: kept current event by event.

A reconcile run must cost what its own policy has, not what the cluster has. So the selection is
not resolved per run over every pod: each pod event updates the policies of its namespace that
select it (one selector match per policy there), each policy event re-resolves that policy's
selector over its namespace's pods (only when the selector changed), and a run reads its own
pods, the claims on them and the live addresses from here without walking anything else.

What it keeps mirrors kopf's indexes (``worker_pods``, ``graph_policies``); it is fed by the
same watch events, through ``Reconciler.on_pod`` and ``Reconciler.on_policy``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from graphkeeper.operator.selection import PolicyRef, WorkerPod


class SelectionIndex:
    """Pods by uid, policies by uid, and the selection in both directions."""

    def __init__(self) -> None:
        self.pods: dict[str, WorkerPod] = {}
        self.policies: dict[str, PolicyRef] = {}
        self._in_namespace: dict[str, set[str]] = {}  # namespace -> pod uids
        self._policies_in: dict[str, set[str]] = {}  # namespace -> policy uids
        self._selected: dict[str, set[str]] = {}  # policy uid -> pod uids it selects
        self._selectors_of: dict[str, set[str]] = {}  # pod uid -> policy uids that select it
        self._at_target: dict[str, set[str]] = {}  # control address -> live pod uids there
        self._running_at: dict[str, int] = {}  # address (either port) -> running pods there

    # --- updates from watch events ----------------------------------------------------------

    def put_pod(self, pod: WorkerPod) -> None:
        old = self.pods.get(pod.uid)
        if old is not None:
            self._unplace(old)
        self.pods[pod.uid] = pod
        self._in_namespace.setdefault(pod.namespace, set()).add(pod.uid)
        if pod.address and not pod.deleting:
            self._at_target.setdefault(pod.control_target, set()).add(pod.uid)
        if pod.running:
            for target in {pod.control_target, pod.target}:
                self._running_at[target] = self._running_at.get(target, 0) + 1
        if old is not None and old.labels == pod.labels:
            return  # the selection is the same
        selectors = {uid for uid in self._policies_in.get(pod.namespace, ()) if self.policies[uid].selects(pod)}
        for uid in self._selectors_of.get(pod.uid, set()) - selectors:
            self._selected[uid].discard(pod.uid)
        for uid in selectors:
            self._selected.setdefault(uid, set()).add(pod.uid)
        self._selectors_of[pod.uid] = selectors

    def drop_pod(self, uid: str) -> None:
        pod = self.pods.pop(uid, None)
        if pod is None:
            return
        self._unplace(pod)
        self._in_namespace.get(pod.namespace, set()).discard(uid)
        for policy in self._selectors_of.pop(uid, set()):
            self._selected.get(policy, set()).discard(uid)

    def put_policy(self, ref: PolicyRef) -> set[str]:
        """Adds or updates a policy; returns the pods whose claims changed (none for an edit
        that leaves the selector as it was)."""
        old = self.policies.get(ref.uid)
        self.policies[ref.uid] = ref
        self._policies_in.setdefault(ref.namespace, set()).add(ref.uid)
        before = self._selected.get(ref.uid, set())
        if old is not None and old.spec.get("selector") == ref.spec.get("selector"):
            return set(before) if old.deleting != ref.deleting else set()
        now = {uid for uid in self._in_namespace.get(ref.namespace, ()) if ref.selects(self.pods[uid])}
        for uid in before - now:
            self._selectors_of[uid].discard(ref.uid)
        for uid in now:
            self._selectors_of.setdefault(uid, set()).add(ref.uid)
        self._selected[ref.uid] = now
        return before | now

    def drop_policy(self, uid: str) -> set[str]:
        """Forgets a policy; returns the pods it selected."""
        ref = self.policies.pop(uid, None)
        if ref is None:
            return set()
        self._policies_in.get(ref.namespace, set()).discard(uid)
        pods = self._selected.pop(uid, set())
        for pod in pods:
            self._selectors_of.get(pod, set()).discard(uid)
        return pods

    def claimants(self, pod_uids: Iterable[str]) -> set[str]:
        """The policies that claim any worker behind ``pod_uids`` (through any pod at its address):
        the ones whose ownership a change to those pods' claims may move."""
        out: set[str] = set()
        for uid in pod_uids:
            pod = self.pods.get(uid)
            if pod is None:
                continue
            out.update(ref.uid for ref, _ in self.claims(pod))
        return out

    def seed(self, pods: Mapping[str, Iterable[WorkerPod]], policies: Mapping[str, Iterable[PolicyRef]]) -> None:
        """Everything in kopf-shaped indexes (namespace -> values), e.g. at start."""
        for refs in policies.values():
            for ref in refs:
                self.put_policy(ref)
        for namespace in pods.values():
            for pod in namespace:
                self.put_pod(pod)

    # --- what a run reads -------------------------------------------------------------------

    def selected(self, policy_uid: str) -> list[WorkerPod]:
        """The pods a policy selects, by name."""
        return sorted((self.pods[uid] for uid in self._selected.get(policy_uid, ())), key=lambda p: p.name)

    def selects(self, policy_uid: str, pod_uid: str) -> bool:
        return pod_uid in self._selected.get(policy_uid, ())

    def claims(self, pod: WorkerPod) -> list[tuple[PolicyRef, WorkerPod]]:
        """Every live policy that claims the worker behind ``pod``, with the pod it claims it
        through (``selection.claims``, from the index: the pod first, then the other live pods at
        its control address, in any namespace)."""
        same = [pod]
        if pod.address:
            same += [self.pods[uid] for uid in sorted(self._at_target.get(pod.control_target, ())) if uid != pod.uid]
        found: dict[str, tuple[PolicyRef, WorkerPod]] = {}
        for via in same:
            for uid in sorted(self._selectors_of.get(via.uid, ())):
                ref = self.policies[uid]
                if uid not in found and not ref.deleting:
                    found[uid] = (ref, via)
        return list(found.values())

    def live(self, target: str) -> bool:
        """Whether some running pod answers at ``target`` (either of its ports)."""
        return self._running_at.get(target, 0) > 0

    def _unplace(self, pod: WorkerPod) -> None:
        if pod.address and not pod.deleting:
            self._at_target.get(pod.control_target, set()).discard(pod.uid)
        if pod.running:
            for target in {pod.control_target, pod.target}:
                self._running_at[target] -= 1
                if not self._running_at[target]:
                    del self._running_at[target]
