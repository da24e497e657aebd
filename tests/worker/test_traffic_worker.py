"""The worker observes its traffic, end to end on real worker processes (CPU, the engine core in a
process of its own): the step-shape histogram in GraphStatus and in /metrics, reset and stamped at
a policy adoption; the new policy fields (graph economics, sleep after idle) over gRPC;
``graphkeeper graphs`` against the worker; one coherent memory ledger after a model reload.
(Graphs themselves need a GPU: tests/gpu.)"""

from __future__ import annotations

import json
import subprocess

import grpc
import pytest
from worker_harness import GRAPHKEEPER, generate, generate_concurrently, make_request, wait_until

from graphkeeper.proto import worker_pb2 as pb

PROMPTS = [[5, 6, 7], [9] * 11, [3, 4], [100, 101, 102, 103, 104, 105, 106]]


def _apply(worker, **fields) -> pb.ApplyGraphPolicyResponse:
    policy = pb.GraphPolicy(policy_uid="traffic-policy", policy_name="default/traffic", **fields)
    return worker.control.ApplyGraphPolicy(pb.ApplyGraphPolicyRequest(policy=policy), timeout=30)


def _graphs_cli(worker, *extra: str) -> subprocess.CompletedProcess:
    token = worker.log_path.parent / f"token-{worker.target.rsplit(':', 1)[1]}"
    proc = subprocess.run([str(GRAPHKEEPER), "graphs", "--control-target", worker.control_target,
                           "--token-file", str(token), *extra], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _stages(status: pb.GraphStatus) -> set[str]:
    return {pb.LedgerStage.Name(e.stage).removeprefix("LEDGER_STAGE_").lower() for e in status.ledger}


@pytest.fixture(scope="module")
def traffic_worker(module_workers):
    return module_workers()


def test_every_step_is_counted_in_the_histogram_and_the_metrics(traffic_worker):
    worker = traffic_worker
    generate_concurrently(worker, [make_request(p, 6) for p in PROMPTS])
    status = worker.status()
    traffic = status.traffic
    assert (traffic.policy_uid, traffic.policy_generation) == ("", 0)  # the startup policy
    assert traffic.steps == status.graph_steps + status.eager_steps > 0
    assert traffic.overflow_steps == 0
    assert sum(s.steps for s in traffic.shapes) == traffic.steps
    decode = [s for s in traffic.shapes if s.uniform_decode]
    mixed = [s for s in traffic.shapes if not s.uniform_decode]
    assert decode and mixed  # prompts prefill (mixed), then the sequences decode
    assert all(s.num_tokens == s.num_seqs for s in decode)
    assert all(s.num_tokens >= s.num_seqs >= 1 for s in mixed)
    assert max(s.num_tokens for s in mixed) >= 11  # the 11-token prompt's prefill step
    metric = worker.metric
    counted = metric("graphkeeper_step_tokens_count", kind="decode") + metric("graphkeeper_step_tokens_count",
                                                                               kind="mixed")
    assert counted == traffic.steps
    assert metric("graphkeeper_step_tokens_sum", kind="decode") == sum(s.num_tokens * s.steps for s in decode)
    assert metric("graphkeeper_step_sequences_count", kind="mixed") == sum(s.steps for s in mixed)
    # The CPU runs PyTorch attention, eagerly (no graphs): the step metric says which ran.
    assert metric("graphkeeper_step_duration_seconds_count", execution_mode="eager",
                  attention_backend="sdpa") == traffic.steps


def test_adopting_a_policy_resets_the_histogram_and_takes_the_new_fields(traffic_worker):
    worker = traffic_worker
    generate(worker, make_request(PROMPTS[0], 3))
    assert worker.status().traffic.steps > 0
    response = _apply(worker, generation=1, max_graphs=2, idle_release_seconds=5)
    assert not response.unchanged
    wait_until(lambda: worker.status().traffic.policy_generation == 1, what="the histogram reset at adoption")
    traffic = worker.status().traffic
    assert (traffic.policy_uid, traffic.steps, len(traffic.shapes)) == ("traffic-policy", 0, 0)
    generate(worker, make_request(PROMPTS[2], 4))
    traffic = worker.status().traffic
    assert traffic.steps == 4  # one prefill step of 2 tokens, then 3 decode steps
    assert {(s.num_tokens, s.num_seqs, s.uniform_decode, s.steps) for s in traffic.shapes} == {
        (2, 1, False, 1), (1, 1, True, 3)}
    for fields, name in (({"max_graphs": -1}, "max_graphs"), ({"idle_release_seconds": -1}, "idle_release_seconds"),
                         ({"sleep_after_idle_seconds": -1}, "sleep_after_idle_seconds"),
                         ({"sleep_level": 3}, "sleep_level")):
        with pytest.raises(grpc.RpcError) as err:
            _apply(worker, generation=2, **fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert name in err.value.details()
    assert generate(worker, make_request(PROMPTS[0], 2))[1].generated_tokens == 2  # still serving


def test_the_worker_holds_a_sleep_setting_pushed_over_grpc(traffic_worker):
    worker = traffic_worker
    sleepy = {"generation": 5, "sleep_after_idle_seconds": 300, "sleep_level": 2}
    response = _apply(worker, **sleepy)
    assert not response.unchanged and not response.recapture_started
    wait_until(lambda: worker.status().policy_generation == 5, what="the sleep setting adopted")
    # The worker keeps what each generation held: the same content again is unchanged, other
    # content under the same generation is refused. So it holds exactly 300 s at level 2.
    assert _apply(worker, **sleepy).unchanged
    for other in ({"sleep_after_idle_seconds": 0}, {"sleep_level": 1}):
        with pytest.raises(grpc.RpcError) as err:
            _apply(worker, **(sleepy | other))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "other content" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _apply(worker, generation=6, sleep_after_idle_seconds=-300)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("policy.sleep_after_idle_seconds: must be in [0, 2592000]")
    assert worker.status().policy_generation == 5
    assert generate(worker, make_request(PROMPTS[0], 2))[1].generated_tokens == 2  # still serving


def test_graphkeeper_graphs_against_the_worker(traffic_worker):
    worker = traffic_worker
    generate(worker, make_request(PROMPTS[1], 5))
    doc = json.loads(_graphs_cli(worker, "--json"))
    assert doc["graphs"] == [{"mode": "total", "size": 0, "memory_mib": 0.0, "capture_s": 0.0, "replay_ms": 0.0,
                              "eager_ms": 0.0, "gain_ms": 0.0, "gain_ms_per_mib": None, "replays": 0,
                              "padded_tokens": 0, "saved_s": 0.0, "released": 0}]
    status = worker.status()
    assert int(doc["traffic"]["steps"]) == status.traffic.steps > 0
    assert len(doc["traffic"]["shapes"]) == len(status.traffic.shapes)
    plain = _graphs_cli(worker).splitlines()
    assert plain[0].split()[:2] == ["MODE", "SIZE"]
    assert plain[1].startswith("(no graphs captured: effective mode none")
    assert plain[2].split()[0] == "total"
    policy = f"policy {status.traffic.policy_uid or '(worker default)'} generation {status.traffic.policy_generation}"
    assert any(line.startswith(f"traffic: {status.traffic.steps} steps") and policy in line for line in plain)
    assert any(line.split()[-1] == "mixed" for line in plain[3:])


def test_the_ledger_is_one_model_s_after_a_reload(fresh_workers):
    worker = fresh_workers(model="random:tiny")
    for _ in range(3):
        generate(worker, make_request(PROMPTS[1], 8))
    wait_until(lambda: "steady" in _stages(worker.status()), what="the steady stage")
    assert _stages(worker.status()) == {"context", "weights", "kv_cache", "warmup", "capture", "steady"}
    worker.control.LoadModelRevision(pb.LoadModelRevisionRequest(source="random:tiny@5"), timeout=300)
    # The old model's steady stage is gone; each stage is the new model's, recorded as it got there.
    assert _stages(worker.status()) == {"context", "weights", "kv_cache", "warmup", "capture"}
    assert "steady" not in {labels.get("stage") for (name, labels) in
                            ((n, dict(ls)) for n, ls in worker.metrics()) if name == "graphkeeper_memory_ledger_bytes"}
    for _ in range(3):
        generate(worker, make_request(PROMPTS[1], 8))
    wait_until(lambda: "steady" in _stages(worker.status()), what="the new model's steady stage")


def test_a_policy_file_s_new_fields_are_read_and_stamp_the_histogram(fresh_workers, tmp_path):
    from graphkeeper.worker.main import read_policy_file

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"policyUid": "file-policy", "generation": 3, "maxGraphs": -2}))
    assert "max_graphs" in read_policy_file(str(bad), 64)[1]
    good = tmp_path / "policy.json"
    good.write_text(json.dumps({"policyUid": "file-policy", "generation": 3, "maxGraphs": 4,
                                "idleReleaseSeconds": 600}))
    policy, error = read_policy_file(str(good), 64)
    assert error is None and (policy.max_graphs, policy.idle_release_seconds) == (4, 600)
    worker = fresh_workers("--policy-file", str(good))
    generate(worker, make_request(PROMPTS[0], 3))
    traffic = worker.status().traffic
    assert (traffic.policy_uid, traffic.policy_generation, traffic.steps) == ("file-policy", 3, 3)
