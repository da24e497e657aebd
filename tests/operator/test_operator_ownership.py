"""Ownership of an overlap, over every order of events: one owner per worker, never split, never
flipping back (``operator/ownership.py``), without a cluster.

A small model of the operator: watch events (policies created, their selectors edited, pods
labelled) arrive in an order hypothesis chooses, each a versioned upsert as an informer applies
them; between events, the policies' loops run in an order hypothesis chooses and each pushes to
at most one worker it owns per run (a batched rollout, ``maxUnavailable: 1``), which is how the
operator split a selection before: a junior part-way through its rollout when the overlap began.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from graphkeeper.operator.ownership import claims_from, owner, split_owned
from graphkeeper.operator.selection import PolicyRef, WorkerPod, claims, pods_by_target
from graphkeeper.operator.status import WorkerObservation, WorkerState, build_status

PODS = 6
#: Policies: (name, creationTimestamp). b and c were created in the same second.
POLICIES = [("a", "2026-12-01T10:00:00Z"), ("b", "2026-12-01T10:00:05Z"), ("c", "2026-12-01T10:00:05Z")]
GROUPS = ["x", "y"]


def pod(i: int, group: str) -> WorkerPod:
    return WorkerPod(namespace="ns", name=f"w{i}", uid=f"pod-{i}", labels={"group": group, "all": "1"},
                     address=f"10.0.0.{i}", port=50051, phase="Running", ready=True)


def policy(name: str, created: str, selector: dict) -> PolicyRef:
    return PolicyRef(namespace="ns", name=name, uid=f"uid-{name}", created=created,
                     spec={"selector": {"matchLabels": selector}})


#: Each event is (kind, key, version, value): the latest version of each key wins, whatever the
#: order the events arrive in, as with a watch.
EVENTS = (
    [("policy", name, 1, {"group": "x"}) for name, _ in POLICIES]
    + [("policy", "a", 2, {"all": "1"})]  # the senior's selector widens over the others' pods
    + [("policy", "c", 2, {"all": "1"})]
    + [("pod", i, 1, GROUPS[i % 2]) for i in range(PODS)]
    + [("pod", 0, 2, "y")]  # a pod relabelled
)
CREATED = dict(POLICIES)


class Model:
    def __init__(self) -> None:
        self.policies: dict[str, tuple[int, PolicyRef]] = {}
        self.pods: dict[int, tuple[int, WorkerPod]] = {}
        #: worker address -> the policy uid it holds, and each worker's history of holders.
        self.held: dict[str, str] = {}
        self.history: dict[str, list[tuple[str, frozenset[str]]]] = {}

    def apply(self, event: tuple) -> None:
        kind, key, version, value = event
        table = self.policies if kind == "policy" else self.pods
        if key in table and table[key][0] >= version:
            return  # an older version arriving late changes nothing
        table[key] = (version, policy(key, CREATED[key], value) if kind == "policy" else pod(key, value))

    def refs(self) -> list[PolicyRef]:
        return [ref for _, ref in self.policies.values()]

    def run(self, name: str) -> list[WorkerObservation]:
        """One run of ``name``'s loop: what it owns, and one push to a worker that lacks it."""
        ref = self.policies[name][1]
        pods = sorted((p for _, p in self.pods.values() if ref.selects(p)), key=lambda p: p.name)
        index = {"ns": [p for _, p in self.pods.values()]}
        mine, conflicts = split_owned(ref, pods, claims_from(self.refs(), pods_by_target(index)))
        lacking = [p for p in mine if self.held.get(p.control_target) != ref.uid]
        if lacking:
            target = lacking[0].control_target
            self.held[target] = ref.uid
            claimants = frozenset(c[0].uid for c in claims(lacking[0], self.refs()))
            self.history.setdefault(target, []).append((ref.uid, claimants))
        return conflicts

    def settle(self) -> None:
        for _ in range(PODS * len(POLICIES) + 1):
            for name in sorted(self.policies):
                self.run(name)


@settings(max_examples=300, deadline=None)
@given(order=st.permutations(EVENTS), runs=st.lists(st.sampled_from([n for n, _ in POLICIES]), max_size=40),
       interleave=st.lists(st.integers(0, 3), min_size=len(EVENTS), max_size=len(EVENTS)))
def test_every_order_of_events_ends_with_one_senior_owner_per_worker_and_no_flip_back(order, runs, interleave):
    model = Model()
    queue = list(runs)
    for event, n in zip(order, interleave, strict=True):
        model.apply(event)
        for _ in range(n):  # some loops run between events, part-way through their rollouts
            if queue and queue[0] in model.policies:
                model.run(queue.pop(0))
            elif queue:
                queue.pop(0)
    model.settle()

    # The final state is the same whatever the order; so is who owns each worker: the senior.
    refs = model.refs()
    for _, p in model.pods.values():
        claimants = [c[0] for c in claims(p, refs)]
        if claimants:
            senior = min(claimants, key=lambda r: (r.created, r.name))
            assert model.held[p.control_target] == senior.uid, (p.name, model.held)
    # No split: every policy's selection is either all its own or Conflict naming the owner.
    a_selects_all = model.policies["a"][1].spec["selector"]["matchLabels"] == {"all": "1"}
    assert a_selects_all
    assert set(model.held.values()) == {"uid-a"}, "the senior selects every pod, so it holds them all"
    for name in ("b", "c"):
        conflicts = model.run(name)
        assert conflicts and all(o.owner == "ns/a" for o in conflicts)
    # Never back: while a worker's claimants stay the same, it never returns to a holder it left.
    for target, moves in model.history.items():
        since: list[str] = []
        claimed_by = None
        for uid, claimants in moves:
            if claimants != claimed_by:
                since, claimed_by = [], claimants
            assert uid not in since, f"{target} flipped back to {uid}: {moves}"
            since.append(uid)


def test_the_losers_degraded_condition_names_the_owner_and_how_many_pods():
    senior = policy("a", "2026-12-01T10:00:00Z", {"all": "1"})
    junior = policy("b", "2026-12-01T10:00:05Z", {"group": "x"})
    pods = [pod(i, GROUPS[i % 2]) for i in range(PODS)]
    selected = [p for p in pods if junior.selects(p)]
    mine, conflicts = split_owned(junior, selected, claims_from([senior, junior], pods_by_target({"ns": pods})))
    assert mine == [] and len(conflicts) == 3
    from datetime import UTC, datetime

    status = build_status(generation=1, observations=conflicts, previous={}, now=datetime.now(UTC))
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "Conflict")
    assert degraded["message"].startswith("3 selected pod(s) owned by the older policy ns/a"), degraded
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"


def test_the_senior_keeps_its_workers_when_a_junior_holds_them_first():
    senior = policy("a", "2026-12-01T10:00:00Z", {"all": "1"})
    junior = policy("b", "2026-12-01T10:00:05Z", {"all": "1"})
    p = pod(0, "x")
    assert owner(claims(p, [junior, senior]))[0] is senior
    assert owner(claims(p, [junior]))[0] is junior
    assert WorkerState.CONFLICT in {o.state for o in split_owned(junior, [p], claims_from([junior, senior], {}))[1]}
