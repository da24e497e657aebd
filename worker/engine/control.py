"""GraphControl state: what the engine has adopted and what it has been asked to adopt.

The adopted policy, a pushed policy not adopted yet, the highest generation seen per policy uid,
a requested model reload, the last error and the lifecycle state change together under one lock,
so that a ``GraphStatus`` read sees one consistent picture: a pushed-but-not-adopted generation is
reported as pending, never as held. The gRPC thread only offers (a policy, a reload); the engine
thread adopts between steps. Tenant rules are the engine thread's alone.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import recapture_key, tenant_allows_graphs, validate_policy
from graphkeeper.worker.engine.errors import StalePolicy
from graphkeeper.worker.engine.lifecycle import Lifecycle

S = pb.LifecycleState
T = TypeVar("T")
#: Tenants whose graph permission is remembered; beyond this the memo starts over.
TENANT_MEMO_LIMIT = 4096
#: Policy uids whose highest generation is remembered, so generations never go backwards. Never
#: forgotten (forgetting one would let its old generations in again): past this many uids a new
#: uid is refused instead. A cluster has a GraphPolicy per workload, not thousands; each entry is
#: a uid (at most 128 bytes) and a 16-byte digest, so the memory stays a few megabytes.
GENERATION_MEMORY = 16384


def default_policy(mode: int = pb.GRAPH_MODE_FULL_AND_PIECEWISE) -> pb.GraphPolicy:
    """The policy a worker holds before any is applied: generation 0, default ladder."""
    return pb.GraphPolicy(
        policy_name="(worker default)", mode=mode,
        capture_sizes=pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_DEFAULT),
    )


def starting_policy(policy: pb.GraphPolicy | None) -> pb.GraphPolicy:
    """The settings' policy when it is a real one (it has a uid), else the default with its mode."""
    if policy is not None and policy.policy_uid:
        return policy
    return default_policy((policy.mode if policy else 0) or pb.GRAPH_MODE_FULL_AND_PIECEWISE)


@dataclass(frozen=True)
class Reload:
    """A model reload the engine will run once no sequence is running."""

    source: str
    revision: str
    future: Future


@dataclass(frozen=True)
class Snapshot:
    """The GraphControl state at one instant."""

    state: int
    policy: pb.GraphPolicy
    pending: pb.GraphPolicy | None
    pending_revision: str
    last_error: str


class Control:
    def __init__(self, policy: pb.GraphPolicy, lifecycle: Lifecycle, limits: tuple[int, int]) -> None:
        self._lock = threading.Lock()
        self.lifecycle = lifecycle
        self.limits = limits  # (max_num_seqs, max_num_batched_tokens): what resolves a policy's sizes
        self.policy = policy
        self.pending: pb.GraphPolicy | None = None
        self.reload: Reload | None = None
        self.last_error = ""
        #: uid -> (highest generation seen, the digest of that generation's content)
        self._generations: dict[str, tuple[int, bytes]] = {policy.policy_uid: (policy.generation, digest(policy))}
        self._tenant_policy = policy
        self._tenant_allowed: dict[str, bool] = {}

    def recaptures(self, old: pb.GraphPolicy, new: pb.GraphPolicy) -> bool:
        """Whether moving from ``old`` to ``new`` changes the captured set (the shared rule)."""
        return recapture_key(old, self.limits) != recapture_key(new, self.limits)

    # --- any thread -----------------------------------------------------------------------

    def offer(self, policy: pb.GraphPolicy) -> tuple[bool, bool]:
        """Makes ``policy`` pending; (unchanged, recaptures). Raises PolicyError or StalePolicy.

        Idempotent by (uid, generation): the same generation again with the same content is
        unchanged, with other content it is refused (a change needs a new generation). A
        generation older than any seen for the same uid, held or pending, is refused.
        """
        with self._lock:
            held = self._generations.get(policy.policy_uid) if policy.policy_uid else None
            if held is not None and policy.generation < held[0]:
                raise StalePolicy(f"generation {policy.generation} is older than generation {held[0]} of policy "
                                  f"{policy.policy_uid[:64]!r}, which this worker already holds or was sent")
            content = digest(policy)
            if held is not None and policy.generation == held[0]:
                if content != held[1]:
                    raise StalePolicy(f"generation {policy.generation} of policy {policy.policy_uid[:64]!r} was "
                                      "already sent with other content: a change needs a new generation")
                return True, False
            validate_policy(policy, self.limits[1])
            if held is None and len(self._generations) >= GENERATION_MEMORY:
                raise StalePolicy(f"this worker remembers {GENERATION_MEMORY} policy uids, so that no generation "
                                  "goes back; it takes no new uid (restart it to start over)")
            recapture = self.recaptures(self.pending or self.policy, policy)
            self._generations[policy.policy_uid] = (policy.generation, content)
            self.pending = policy
            return False, recapture

    def request_reload(self, reload: Reload) -> bool:
        """Records a reload to run; False when one is already in progress."""
        with self._lock:
            if self.reload is not None:
                return False
            self.reload = reload
            return True

    def snapshot(self) -> Snapshot:
        with self._lock:
            reload = self.reload
            return Snapshot(self.lifecycle.state, self.policy, self.pending,
                            (reload.revision or reload.source) if reload else "", self.last_error)

    def move(self, state: int) -> None:
        with self._lock:
            self._move(state)

    def _move(self, state: int) -> None:
        """The one place the lifecycle moves (the lock held); DRAINING is final, and a second move
        to it is a no-op."""
        if not (state == S.LIFECYCLE_STATE_DRAINING == self.lifecycle.state):
            self.lifecycle.move(state)

    # --- the engine thread ----------------------------------------------------------------

    def adopt(self, policy: pb.GraphPolicy, recapture: bool) -> None:
        """The engine takes ``policy``: RECAPTURING first when its graphs change while READY."""
        with self._lock:
            if recapture and self.lifecycle.state == S.LIFECYCLE_STATE_READY:
                self._move(S.LIFECYCLE_STATE_RECAPTURING)
            self.policy = policy
            if self.pending is policy:
                self.pending = None
            self._tenant_policy = policy
            self._tenant_allowed = {}

    def captured(self, failure: str) -> bool:
        """A capture phase ended; True when that made a recapturing worker READY again."""
        with self._lock:
            self.last_error = failure
            if self.lifecycle.state != S.LIFECYCLE_STATE_RECAPTURING:
                return False
            self._move(S.LIFECYCLE_STATE_READY)
            return True

    def reload_failed(self, message: str) -> None:
        with self._lock:
            self.last_error = message
            self.reload = None

    def swap_model(self, recapture: bool, install: Callable[[], T]) -> T:
        """Runs ``install`` (stale graphs out, new weights in) as one change of the reported state."""
        with self._lock:
            if recapture and self.lifecycle.state == S.LIFECYCLE_STATE_READY:
                self._move(S.LIFECYCLE_STATE_RECAPTURING)
            result = install()
            self.last_error = ""
            self.reload = None
            return result

    def tenant_allows(self, tenant: str) -> bool:
        """The shared policy rule, memoised per tenant until the next policy is adopted."""
        allowed = self._tenant_allowed.get(tenant)
        if allowed is None:
            if len(self._tenant_allowed) >= TENANT_MEMO_LIMIT:
                self._tenant_allowed.clear()  # bounded: any number of tenant names may arrive
            allowed = self._tenant_allowed[tenant] = tenant_allows_graphs(self._tenant_policy, tenant)
        return allowed


def digest(policy: pb.GraphPolicy) -> bytes:
    """What identifies a policy's content, so that one (uid, generation) cannot carry two."""
    return hashlib.blake2b(policy.SerializeToString(deterministic=True), digest_size=16).digest()
