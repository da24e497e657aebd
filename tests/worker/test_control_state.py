"""The GraphControl state (engine/control.py) and the one recapture rule (proto/policy.py's
recapture_key), without an engine: offers, adoption, snapshots, reloads and lifecycle moves."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import PolicyError, recapture_key
from graphkeeper.worker.engine.control import Control, Reload, default_policy, starting_policy
from graphkeeper.worker.engine.errors import StalePolicy
from graphkeeper.worker.engine.lifecycle import Lifecycle

S = pb.LifecycleState
LIMITS = (16, 256)


def policy(generation: int = 1, uid: str = "uid-a", **fields) -> pb.GraphPolicy:
    return pb.GraphPolicy(policy_uid=uid, policy_name="ns/p", generation=generation, **fields)


def explicit(*sizes: int, **fields) -> pb.GraphPolicy:
    p = policy(**fields)
    p.capture_sizes.explicit.sizes.extend(sizes)
    return p


def ready_control(start: pb.GraphPolicy | None = None) -> Control:
    lifecycle = Lifecycle()
    control = Control(start or default_policy(), lifecycle, LIMITS)
    for state in (S.LIFECYCLE_STATE_MODEL_LOADED, S.LIFECYCLE_STATE_WARMED, S.LIFECYCLE_STATE_CAPTURED,
                  S.LIFECYCLE_STATE_READY):
        control.move(state)
    return control


# --- the recapture rule ------------------------------------------------------------------------


def test_equivalent_spellings_of_a_policy_have_one_recapture_key():
    unset = policy()
    spelled = policy(mode=pb.GRAPH_MODE_FULL_AND_PIECEWISE)
    spelled.capture_sizes.ladder = pb.CAPTURE_LADDER_DEFAULT
    assert recapture_key(unset) == recapture_key(spelled)
    assert recapture_key(unset, LIMITS) == recapture_key(spelled, LIMITS)
    assert recapture_key(explicit(4, 1, 2)) == recapture_key(explicit(1, 2, 4))
    with_max = explicit(1, 2)
    with_max.capture_sizes.max_capture_size = 4
    assert recapture_key(with_max) == recapture_key(explicit(1, 2, 4))


def test_tenant_toggles_are_not_part_of_the_recapture_key():
    toggled = policy(generation=2, default_tenant_graphs=pb.TENANT_GRAPHS_DISABLED,
                     tenants=[pb.TenantToggle(tenant="batch", graphs=pb.TENANT_GRAPHS_ENABLED)])
    assert recapture_key(toggled) == recapture_key(policy())


def test_mode_sizes_and_budget_each_change_the_recapture_key():
    base = recapture_key(explicit(1, 2, 4))
    assert recapture_key(explicit(1, 2, 4, mode=pb.GRAPH_MODE_PIECEWISE)) != base
    assert recapture_key(explicit(1, 2, 8)) != base
    assert recapture_key(explicit(1, 2, 4, memory_budget_bytes=1 << 20)) != base
    interactive = policy()
    interactive.capture_sizes.ladder = pb.CAPTURE_LADDER_INTERACTIVITY
    assert recapture_key(interactive) != recapture_key(policy())


def test_with_a_workers_limits_the_key_is_the_resolved_ladder():
    ladder = policy()
    same = explicit(1, 2, 4, *range(8, 257, 8))  # the default ladder up to the token budget 256
    assert recapture_key(ladder) != recapture_key(same)  # the operator cannot know the worker's budget
    assert recapture_key(ladder, LIMITS) == recapture_key(same, LIMITS)
    assert recapture_key(None) is None


# --- offers (any thread) and adoption (the engine thread) -------------------------------------


def test_an_offer_is_pending_until_the_engine_adopts_it():
    control = ready_control()
    new = explicit(1, 2)
    assert control.offer(new) == (False, True)
    snap = control.snapshot()
    assert snap.pending is new and snap.policy is not new
    control.adopt(new, recapture=True)
    snap = control.snapshot()
    assert snap.policy is new and snap.pending is None
    assert snap.state == S.LIFECYCLE_STATE_RECAPTURING
    assert control.captured("") and control.snapshot().state == S.LIFECYCLE_STATE_READY


def test_offers_are_idempotent_by_generation_and_never_go_back():
    control = ready_control()
    assert control.offer(policy(generation=3)) == (False, False)
    assert control.offer(policy(generation=3)) == (True, False)
    with pytest.raises(StalePolicy, match="generation 2 is older than generation 3"):
        control.offer(policy(generation=2))
    assert control.offer(policy(generation=1, uid="uid-b")) == (False, False)


def test_an_invalid_offer_changes_nothing():
    control = ready_control()
    with pytest.raises(PolicyError, match="capture_sizes.explicit.sizes"):
        control.offer(explicit(1, 1000))  # above the token budget 256
    assert control.snapshot().pending is None
    assert control.offer(explicit(1, 2)) == (False, True)


def test_an_offer_compares_with_the_pending_policy_not_only_the_adopted_one():
    control = ready_control()
    control.offer(explicit(1, 2, generation=1))
    assert control.offer(explicit(1, 2, generation=2, default_tenant_graphs=pb.TENANT_GRAPHS_DISABLED)) == (
        False, False)


def test_a_tenant_toggle_adopted_without_a_recapture_keeps_the_worker_ready():
    control = ready_control()
    toggled = policy(default_tenant_graphs=pb.TENANT_GRAPHS_DISABLED,
                     tenants=[pb.TenantToggle(tenant="chat", graphs=pb.TENANT_GRAPHS_ENABLED)])
    assert control.tenant_allows("batch")
    control.offer(toggled)
    control.adopt(toggled, recapture=False)
    assert control.snapshot().state == S.LIFECYCLE_STATE_READY
    assert not control.tenant_allows("batch") and control.tenant_allows("chat")


def test_a_snapshot_never_shows_an_adoption_half_done():
    """Adoption changes (state, policy, pending) under the lock snapshots read under: a reader
    never sees a policy both adopted and still pending, nor a pending one older than the adopted."""
    control = ready_control()
    stop, seen = threading.Event(), []

    def reader() -> None:
        while not stop.is_set():
            snap = control.snapshot()
            seen.append((snap.policy.generation, snap.pending.generation if snap.pending else None))

    thread = threading.Thread(target=reader)
    thread.start()
    # Write until the reader has read across many adoptions: on a loaded 2-core machine the
    # reader thread may not be scheduled at all during a fixed count of writes.
    deadline, generation = time.monotonic() + 30, 0
    while time.monotonic() < deadline and (generation < 300 or not any(a > 0 for a, _ in seen[-50:])):
        generation += 1
        p = explicit(1, 2 + generation % 2, generation=generation)
        control.offer(p)
        control.adopt(p, recapture=True)
        control.captured("")
    stop.set()
    thread.join()
    assert any(adopted > 0 for adopted, _ in seen), "the reader saw no adoption at all"
    torn = [(adopted, pending) for adopted, pending in seen if pending is not None and pending <= adopted]
    assert not torn, f"pending not newer than adopted: {torn[:5]}"


# --- reloads, errors, the lifecycle -----------------------------------------------------------


def test_one_reload_at_a_time_and_its_revision_is_reported_as_pending():
    control = ready_control()
    assert control.request_reload(Reload("/models/b", "rev-b", Future()))
    assert not control.request_reload(Reload("/models/c", "", Future()))
    assert control.snapshot().pending_revision == "rev-b"
    control.reload_failed("model reload failed: no config.json")
    snap = control.snapshot()
    assert snap.pending_revision == "" and snap.last_error.startswith("model reload failed")
    assert control.request_reload(Reload("/models/c", "", Future()))
    assert control.snapshot().pending_revision == "/models/c"  # no revision given: the source


def test_a_model_swap_recaptures_and_clears_the_reload_and_the_error():
    control = ready_control()
    control.reload_failed("an old failure")
    control.request_reload(Reload("/models/b", "rev-b", Future()))
    states = []
    assert control.swap_model(True, lambda: states.append(control.lifecycle.state) or "kept") == "kept"
    assert states == [S.LIFECYCLE_STATE_RECAPTURING]
    snap = control.snapshot()
    assert snap.pending_revision == "" and snap.last_error == ""


def test_draining_is_final_and_may_be_asked_for_twice():
    control = ready_control()
    control.move(S.LIFECYCLE_STATE_DRAINING)
    control.move(S.LIFECYCLE_STATE_DRAINING)
    assert not control.captured("")  # a capture ending during shutdown does not make it READY
    assert control.snapshot().state == S.LIFECYCLE_STATE_DRAINING


def test_the_starting_policy_is_the_settings_policy_only_when_it_is_a_real_one():
    real = policy(generation=4)
    assert starting_policy(real) is real
    assert starting_policy(None).mode == pb.GRAPH_MODE_FULL_AND_PIECEWISE
    assert starting_policy(pb.GraphPolicy(mode=pb.GRAPH_MODE_NONE)).mode == pb.GRAPH_MODE_NONE
    assert starting_policy(pb.GraphPolicy(mode=pb.GRAPH_MODE_NONE)).generation == 0


def test_a_repeated_generation_with_other_content_is_refused():
    control = ready_control()
    assert control.offer(policy(3, mode=pb.GRAPH_MODE_FULL)) == (False, True)
    assert control.offer(policy(3, mode=pb.GRAPH_MODE_FULL))[0]  # the same again: unchanged
    with pytest.raises(StalePolicy, match="other content"):
        control.offer(policy(3, mode=pb.GRAPH_MODE_PIECEWISE))
    assert control.pending.mode == pb.GRAPH_MODE_FULL


def test_generations_are_never_forgotten_however_many_uids_arrive(monkeypatch):
    """The memory used to drop its oldest uid past 1024, letting that uid's old generations in
    again; now it keeps every uid and, when full, takes no new one."""
    monkeypatch.setattr("graphkeeper.worker.engine.control.GENERATION_MEMORY", 40)
    control = ready_control()
    control.offer(policy(5, uid="first"))
    for i in range(38):
        control.offer(policy(1, uid=f"u{i}"))
    with pytest.raises(StalePolicy, match="older than generation 5"):
        control.offer(policy(4, uid="first"))
    with pytest.raises(StalePolicy, match="takes no new uid"):
        control.offer(policy(1, uid="one-too-many"))
    assert control.offer(policy(6, uid="first")) == (False, False)  # a known uid still moves on
