"""GraphControl over gRPC on the CPU: ApplyGraphPolicy (idempotent, stale, invalid, tenant toggles), a
policy read from a file before ready, and LoadModelRevision serving the new weights."""

from __future__ import annotations

import grpc
import pytest
from worker_harness import eager_reasons, generate, make_request, wait_until

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.proto.policy import policy_to_json
from graphkeeper.worker.model.loader import load_model, save_hf_directory

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79], [323, 84, 62, 64, 33, 83, 27]]


def policy(uid: str, generation: int, *, sizes=(1, 2, 4), mode=pb.GRAPH_MODE_FULL, tenants=(),
           budget: int = 0) -> pb.GraphPolicy:
    return pb.GraphPolicy(
        policy_uid=uid, policy_name="default/graphs", generation=generation, mode=mode,
        capture_sizes=pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=list(sizes))),
        memory_budget_bytes=budget,
        tenants=[pb.TenantToggle(tenant=t, graphs=g) for t, g in tenants],
    )


def apply(worker, p: pb.GraphPolicy) -> pb.ApplyGraphPolicyResponse:
    return worker.control.ApplyGraphPolicy(pb.ApplyGraphPolicyRequest(policy=p), timeout=30)


def refused(worker, p: pb.GraphPolicy) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        apply(worker, p)
    return err.value


def adopted(worker, uid: str, generation: int) -> pb.GraphStatus:
    """The status once the engine thread has adopted an accepted policy.

    Right after ApplyGraphPolicy answers, the policy is pending or already adopted, never
    neither; adoption happens on the engine thread, so a test waits for it.
    """
    now = worker.status()
    assert (uid, generation) in {(now.pending_policy_uid, now.pending_policy_generation),
                                 (now.policy_uid, now.policy_generation)}, now
    wait_until(lambda: (worker.status().policy_uid, worker.status().policy_generation) == (uid, generation),
               what=f"{uid} generation {generation} adopted")
    status = worker.status()
    assert (status.pending_policy_uid, status.pending_policy_generation) == ("", 0)
    return status


def greedy(worker) -> list[list[int]]:
    return [generate(worker, make_request(p, 12))[0] for p in PROMPTS]


def test_apply_policy_is_idempotent_and_never_goes_back(worker):
    assert worker.status().policy_generation == 0
    first = apply(worker, policy("uid-a", 1))
    assert (first.applied_generation, first.unchanged, first.recapture_started) == (1, False, False)
    status = adopted(worker, "uid-a", 1)
    assert status.requested_mode == pb.GRAPH_MODE_FULL
    assert status.effective_mode == pb.GRAPH_MODE_NONE
    again = apply(worker, policy("uid-a", 1))
    assert (again.applied_generation, again.unchanged) == (1, True)
    newer = apply(worker, policy("uid-a", 2, sizes=(1, 8), mode=pb.GRAPH_MODE_PIECEWISE))
    assert (newer.applied_generation, newer.unchanged) == (2, False)
    stale = refused(worker, policy("uid-a", 1))
    assert stale.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "older" in stale.details() and "uid-a" in stale.details()
    status = adopted(worker, "uid-a", 2)
    assert status.requested_mode == pb.GRAPH_MODE_PIECEWISE
    assert status.effective_mode == pb.GRAPH_MODE_NONE
    wait_until(lambda: worker.metric("graphkeeper_policy_generation") == 2, what="policy generation 2")
    wait_until(lambda: worker.status().state == pb.LIFECYCLE_STATE_READY, what="READY after recapture")
    assert worker.metric("graphkeeper_graph_mode", kind="requested", mode="piecewise") == 1
    assert worker.metric("graphkeeper_graph_mode", kind="effective", mode="none") == 1
    # Still serving, still eager with the backend's reason.
    _, completion = generate(worker, make_request(PROMPTS[0], 4))
    assert eager_reasons(completion) == {pb.FALLBACK_REASON_BACKEND_UNSUPPORTED: 4}


INVALID = [
    (policy("", 5), "policy.policy_uid"),
    (policy("uid-a", 5, sizes=(1, 128)), "policy.capture_sizes.explicit.sizes[1]"),  # > token budget
    (policy("uid-a", 5, sizes=(0,)), "policy.capture_sizes.explicit.sizes[0]"),
    (policy("uid-a", 5, sizes=()), "policy.capture_sizes.explicit.sizes"),
    (policy("uid-a", 5, mode=77), "policy.mode"),
    (policy("uid-a", 5, budget=-1), "policy.memory_budget_bytes"),
    (policy("uid-a", 5, tenants=[("Team A", pb.TENANT_GRAPHS_DISABLED)]), "policy.tenants[0].tenant"),
    (policy("uid-a", 5, tenants=[("a", pb.TENANT_GRAPHS_UNSPECIFIED)]), "policy.tenants[0].graphs"),
]


@pytest.mark.parametrize(("bad", "field"), INVALID, ids=[f for _, f in INVALID])
def test_invalid_policy_is_invalid_argument_naming_the_field(worker, bad, field):
    held = worker.status()
    err = refused(worker, bad)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field + ":"), err.details()
    after = worker.status()
    assert (after.policy_uid, after.policy_generation) == (held.policy_uid, held.policy_generation)


def test_tenant_toggles_apply_without_recapture(worker):
    held = worker.status().policy_generation
    uid = worker.status().policy_uid or "uid-t"
    sizes_changed = policy(uid, held + 1, sizes=(1, 2, 4, 16))
    before = worker.metric("graphkeeper_recaptures_total", cause="policy")
    apply(worker, sizes_changed)
    wait_until(lambda: worker.metric("graphkeeper_recaptures_total", cause="policy") == before + 1,
               what="a size change recaptures")
    toggled = policy(uid, held + 2, sizes=(1, 2, 4, 16),
                     tenants=[("batch", pb.TENANT_GRAPHS_DISABLED), ("chat", pb.TENANT_GRAPHS_ENABLED)])
    response = apply(worker, toggled)
    assert (response.applied_generation, response.unchanged, response.recapture_started) == (
        held + 2, False, False)
    wait_until(lambda: worker.metric("graphkeeper_policy_generation") == held + 2, what="toggle adopted")
    assert worker.metric("graphkeeper_recaptures_total", cause="policy") == before + 1
    assert worker.status().policy_generation == held + 2
    # On the CPU the backend reason comes first, for disabled and enabled tenants alike.
    for tenant in ("batch", "chat", ""):
        tokens, completion = generate(worker, make_request(PROMPTS[1], 3, tenant=tenant))
        assert len(tokens) == 3
        assert eager_reasons(completion) == {pb.FALLBACK_REASON_BACKEND_UNSUPPORTED: 3}
    # Tenant-labelled series exist only for the tenants the policy lists (bounded labels).
    for listed in ("batch", "chat"):
        assert worker.metric("graphkeeper_tenant_steps_total", tenant=listed, execution="eager") >= 3
    assert not any(name == "graphkeeper_tenant_steps_total" and dict(labels).get("tenant") == ""
                   for name, labels in worker.metrics())


def test_another_policy_uid_is_told_apart(worker):
    response = apply(worker, policy("uid-other", 1))
    assert (response.applied_generation, response.unchanged) == (1, False)
    adopted(worker, "uid-other", 1)


def test_worker_starts_with_the_policy_file(fresh_workers, tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(policy_to_json(policy("file-uid", 7, sizes=(1, 4, 32), mode=pb.GRAPH_MODE_PIECEWISE)))
    worker = fresh_workers("--policy-file", str(path))
    status = worker.status()
    assert (status.policy_uid, status.policy_generation) == ("file-uid", 7)
    assert status.requested_mode == pb.GRAPH_MODE_PIECEWISE
    assert status.effective_mode == pb.GRAPH_MODE_NONE
    assert worker.metric("graphkeeper_policy_generation") == 7
    assert worker.metric("graphkeeper_graph_mode", kind="requested", mode="piecewise") == 1
    assert apply(worker, policy("file-uid", 7, sizes=(1, 4, 32), mode=pb.GRAPH_MODE_PIECEWISE)).unchanged
    assert refused(worker, policy("file-uid", 6)).code() == grpc.StatusCode.FAILED_PRECONDITION


def test_worker_refuses_an_invalid_policy_file(fresh_workers, tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(policy_to_json(policy("file-uid", 3, sizes=(1, 128))))  # beyond 64 tokens a step
    worker = fresh_workers("--policy-file", str(path), wait=False)
    assert worker.proc.wait(timeout=120) != 0
    log = worker.log()
    assert "--policy-file" in log and "capture_sizes.explicit.sizes[1]" in log


def test_missing_policy_file_starts_with_the_default_policy(fresh_workers, tmp_path):
    worker = fresh_workers("--policy-file", str(tmp_path / "not-yet.json"))
    status = worker.status()
    assert (status.policy_uid, status.policy_generation) == ("", 0)
    assert status.requested_mode == pb.GRAPH_MODE_FULL_AND_PIECEWISE
    assert "does not exist" in worker.log()


def test_load_model_revision_serves_the_new_weights(fresh_workers):
    old = fresh_workers(model="random:tiny")
    reference = fresh_workers(model="random:tiny@5")
    old_revision, old_tokens = old.model_info().revision, greedy(old)
    new_tokens = greedy(reference)
    assert new_tokens != old_tokens
    response = old.control.LoadModelRevision(pb.LoadModelRevisionRequest(source="random:tiny@5"), timeout=300)
    assert response.revision != old_revision
    assert response.revision == reference.model_info().revision
    info = old.model_info()
    assert (info.revision, info.source) == (response.revision, "random:tiny@5")
    assert old.status().model_revision == response.revision
    assert old.status().state == pb.LIFECYCLE_STATE_READY
    assert greedy(old) == new_tokens
    assert old.metric("graphkeeper_recaptures_total", cause="model_revision") == 1
    info_series = [labels for (name, labels) in old.metrics() if name == "graphkeeper_model_info"]
    assert [dict(labels)["revision"] for labels in info_series] == [response.revision]
    # An explicit revision is reported as given; the seed-0 weights serve again.
    back = old.control.LoadModelRevision(
        pb.LoadModelRevisionRequest(source="random:tiny@0", revision="v2024-01"), timeout=300)
    assert back.revision == "v2024-01" == old.model_info().revision
    assert greedy(old) == old_tokens


def test_load_model_revision_refuses_bad_sources_and_keeps_serving(worker):
    before = greedy(worker)
    revision = worker.model_info().revision
    refusals = (("", "source", grpc.StatusCode.INVALID_ARGUMENT),
                ("random:nope", "preset", grpc.StatusCode.PERMISSION_DENIED),
                ("random:llama-1b", "preset", grpc.StatusCode.PERMISSION_DENIED),  # no 1B model into a tiny worker
                ("random:tiny@x", "x", grpc.StatusCode.INVALID_ARGUMENT),
                # A random-model worker has no model roots: no directory may be loaded into it.
                ("/no/such/dir", "model-root", grpc.StatusCode.PERMISSION_DENIED),
                ("/etc", "model-root", grpc.StatusCode.PERMISSION_DENIED))
    for source, needle, code in refusals:
        with pytest.raises(grpc.RpcError) as err:
            worker.control.LoadModelRevision(pb.LoadModelRevisionRequest(source=source), timeout=60)
        assert err.value.code() == code
        assert err.value.details().startswith("source:") and needle in err.value.details()
    status = worker.status()
    assert worker.model_info().revision == revision
    assert status.state == pb.LIFECYCLE_STATE_READY
    assert status.last_error.startswith("model reload failed")  # the failed load is reported
    assert greedy(worker) == before


def test_a_failed_reload_changes_nothing_and_the_next_success_clears_the_error(fresh_workers, tmp_path):
    root = tmp_path / "models"
    (root / "broken").mkdir(parents=True)
    (root / "broken" / "config.json").write_text("{not json")
    good = root / "good"
    save_hf_directory(load_model("random:tiny@3", device="cpu", max_positions=128).model, good)
    worker = fresh_workers("--model-root", str(root), model=str(good))
    before, revision = greedy(worker), worker.model_info().revision
    for source in (root / "broken", root / "missing"):
        with pytest.raises(grpc.RpcError) as err:
            worker.control.LoadModelRevision(pb.LoadModelRevisionRequest(source=str(source)), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert worker.status().last_error.startswith("model reload failed")
    assert (worker.model_info().revision, greedy(worker)) == (revision, before)
    outside = tmp_path / "elsewhere"
    save_hf_directory(load_model("random:tiny@4", device="cpu", max_positions=128).model, outside)
    with pytest.raises(grpc.RpcError) as err:
        worker.control.LoadModelRevision(pb.LoadModelRevisionRequest(source=str(outside)), timeout=60)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    worker.control.LoadModelRevision(pb.LoadModelRevisionRequest(source=str(good), revision="again"), timeout=120)
    status = worker.status()
    assert (status.model_revision, status.last_error) == ("again", "")


def test_a_worker_without_a_model_root_loads_no_path(fresh_workers, tmp_path):
    """No --model-root means reloads from paths are refused, even of the served directory itself
    (the old default, the model's parent, was / for --model /model)."""
    model = tmp_path / "m"
    save_hf_directory(load_model("random:tiny@3", device="cpu", max_positions=128).model, model)
    worker = fresh_workers(model=str(model))
    with pytest.raises(grpc.RpcError) as err:
        worker.control.LoadModelRevision(pb.LoadModelRevisionRequest(source=str(model)), timeout=60)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "no --model-root" in err.value.details()


def test_a_reload_that_cannot_load_is_refused_without_pausing_admission(fresh_workers, tmp_path):
    """A source with no config.json is refused before admission pauses: while a long stream runs
    (a pending reload would wait for it, admitting nothing), the refusal comes back at once and a
    new request is served beside the stream."""
    root = tmp_path / "models"
    good, empty = root / "good", root / "empty"
    save_hf_directory(load_model("random:tiny@3", device="cpu", max_positions=4096).model, good)
    empty.mkdir()
    worker = fresh_workers("--model-root", str(root), "--max-num-seqs", "4", "--max-seq-len", "4096",
                           "--max-num-batched-tokens", "64",
                           model=str(good))
    long_call = worker.inference.Generate(make_request([3, 4], 4000), timeout=300)
    next(long_call)
    with pytest.raises(grpc.RpcError) as err:
        worker.control.LoadModelRevision(pb.LoadModelRevisionRequest(source=str(empty)), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "config.json" in err.value.details()
    assert worker.status().running_sequences == 1, "the refusal waited for the running stream"
    tokens, _ = generate(worker, make_request([5, 6], 1), timeout=30)
    assert len(tokens) == 1 and worker.status().running_sequences == 1
    assert worker.status().last_error.startswith("model reload failed")
    long_call.cancel()


def test_a_second_reload_while_one_is_pending_is_told_to_retry(fresh_workers):
    """A reload waits for running sequences; another one meanwhile gets UNAVAILABLE (retryable),
    not INVALID_ARGUMENT, and the first still completes."""
    worker = fresh_workers("--max-num-seqs", "4", "--max-seq-len", "4096", "--max-num-batched-tokens", "64")
    long_call = worker.inference.Generate(make_request([3, 4], 4000), timeout=300)
    next(long_call)
    first = worker.control.LoadModelRevision.future(pb.LoadModelRevisionRequest(source="random:tiny@5"), timeout=300)
    wait_until(lambda: worker.status().pending_model_revision != "", what="the first reload pending")
    with pytest.raises(grpc.RpcError) as err:
        worker.control.LoadModelRevision(pb.LoadModelRevisionRequest(source="random:tiny@6"), timeout=60)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "already in progress" in err.value.details()
    long_call.cancel()
    assert first.result(timeout=300).revision
    assert worker.status().state == pb.LIFECYCLE_STATE_READY


def test_watch_graph_status_sends_the_status_at_once_then_each_change_and_nothing_else(worker):
    """The operator's stream: the first message at once, the next only when what the worker
    holds changes (a day's heartbeat, so any other message would be a change sent by mistake, and a
    change not sent would end the call at its deadline instead)."""
    stream = worker.control.WatchGraphStatus(pb.WatchGraphStatusRequest(heartbeat_seconds=86400), timeout=60)
    try:
        first = next(stream)
        held = (first.policy_uid, first.policy_generation)
        generation = worker.status().policy_generation + 1 if first.policy_uid == "uid-watch" else 1
        apply(worker, policy("uid-watch", generation, sizes=(1, 2)))
        seen = [held]
        while seen[-1] != ("uid-watch", generation):
            status = next(stream)
            seen.append((status.pending_policy_uid or status.policy_uid,
                         status.pending_policy_generation or status.policy_generation))
        assert len(seen) <= 4, f"one message per change: {seen}"
    finally:
        stream.cancel()


def test_watch_graph_status_needs_the_bearer_token(worker):
    with grpc.insecure_channel(worker.control_target) as channel:
        stream = pb_grpc.GraphControlStub(channel).WatchGraphStatus(pb.WatchGraphStatusRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            next(stream)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
