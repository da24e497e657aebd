"""Generation through a running worker: greedy tokens equal transformers' greedy generation on the same
weights, continuous batching and chunked prefill change nothing, seeded sampling reproduces, stopping
criteria, bad input, model info, health, reflection and the CLI; on the CPU every step is eager with
reason backend_unsupported."""

from __future__ import annotations

import json
import math
import random
import subprocess

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from hf_reference import hf_greedy, tiny_hf_model
from worker_harness import (
    CONTROL_SERVICE,
    GRAPHKEEPER,
    INFERENCE_SERVICE,
    eager_reasons,
    generate,
    generate_concurrently,
    make_request,
)

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc

transformers = pytest.importorskip("transformers")

MAX_NEW = 24
_rng = random.Random(1234)
# Different lengths, so that batched steps mix prefill and decode rows of different sizes.
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (1, 3, 7, 12, 20, 33)]
LONG_PROMPT = [_rng.randrange(3, 512) for _ in range(60)]
BACKEND = pb.FALLBACK_REASON_BACKEND_UNSUPPORTED


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Random tiny weights saved as an HF directory, transformers' greedy outputs on them, and an
    EOS id chosen so that one prompt's greedy output hits it (written into config.json)."""
    path = tmp_path_factory.mktemp("hf-tiny")
    hf = tiny_hf_model(path)
    refs = {tuple(p): hf_greedy(hf, p, MAX_NEW) for p in [*PROMPTS, LONG_PROMPT]}
    ref = refs[tuple(PROMPTS[2])]
    eos_at = next(i for i in range(3, MAX_NEW) if ref[i] not in ref[:i])
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = ref[eos_at]
    (path / "config.json").write_text(json.dumps(config))
    return {"path": path, "refs": refs, "eos_at": eos_at, "eos": ref[eos_at],
            "parameters": hf.num_parameters()}


@pytest.fixture(scope="module")
def worker(module_workers, model):
    return module_workers(model=str(model["path"]))


@pytest.fixture(scope="module")
def alone(worker):
    """Each prompt's greedy tokens, sent alone."""
    results = {}
    for prompt in [*PROMPTS, LONG_PROMPT]:
        tokens, completion = generate(worker, make_request(prompt, MAX_NEW))
        assert completion.finish_reason == pb.FINISH_REASON_LENGTH
        results[tuple(prompt)] = tokens
    return results


def test_greedy_equals_transformers(model, alone):
    for prompt in [*PROMPTS, LONG_PROMPT]:
        assert len(alone[tuple(prompt)]) == MAX_NEW
        assert alone[tuple(prompt)] == model["refs"][tuple(prompt)], f"prompt of {len(prompt)} tokens"


def test_concurrent_greedy_requests_equal_each_alone(worker, alone):
    # Six requests against max-num-seqs 4: some queue, all share steps with others.
    requests = [make_request(p, MAX_NEW, request_id=f"batch-{i}") for i, p in enumerate(PROMPTS)]
    results = generate_concurrently(worker, requests)
    for prompt, request, (tokens, completion) in zip(PROMPTS, requests, results, strict=True):
        assert tokens == alone[tuple(prompt)], f"prompt of {len(prompt)} tokens"
        assert completion.request_id == request.request_id
        assert completion.finish_reason == pb.FINISH_REASON_LENGTH
        assert completion.prompt_tokens == len(prompt)
        assert completion.generated_tokens == MAX_NEW
        assert completion.total_seconds >= completion.time_to_first_token_seconds > 0
        # On the CPU every step that served the request ran eager, backend_unsupported.
        assert not completion.execution.graph_steps
        assert set(eager_reasons(completion)) == {BACKEND}
        assert eager_reasons(completion)[BACKEND] >= MAX_NEW


SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(worker, alone):
    prompt = PROMPTS[3]
    first, _ = generate(worker, make_request(prompt, 16, seed=1234, **SAMPLED))
    again, _ = generate(worker, make_request(prompt, 16, seed=1234, **SAMPLED))
    assert first == again
    assert first != alone[tuple(prompt)][:16], "sampling at temperature 0.8 returned greedy tokens"
    requests = [make_request(p, MAX_NEW) for p in PROMPTS[:4]]
    requests.insert(2, make_request(prompt, 16, seed=1234, **SAMPLED))
    requests.append(make_request(prompt, 16, seed=999, **SAMPLED))
    results = generate_concurrently(worker, requests)
    assert results[2][0] == first
    assert results[5][0] != first, "two different seeds gave the same tokens"
    for prompt_, (tokens, _) in zip(PROMPTS[:2], results[:2], strict=True):
        assert tokens == alone[tuple(prompt_)]


def test_stop_token_ids_finish_with_stop(worker, alone):
    ref = alone[tuple(PROMPTS[4])]
    k = next(i for i in range(4, MAX_NEW) if ref[i] not in ref[:i])
    tokens, completion = generate(worker, make_request(PROMPTS[4], MAX_NEW, stop=[ref[k], 511]))
    assert tokens == ref[:k + 1]  # the stop id is included
    assert completion.finish_reason == pb.FINISH_REASON_STOP
    assert completion.generated_tokens == k + 1


def test_max_new_tokens_finish_with_length(worker, alone):
    tokens, completion = generate(worker, make_request(PROMPTS[1], 7))
    assert tokens == alone[tuple(PROMPTS[1])][:7]
    assert completion.finish_reason == pb.FINISH_REASON_LENGTH
    assert (completion.prompt_tokens, completion.generated_tokens) == (len(PROMPTS[1]), 7)
    tokens, completion = generate(worker, make_request(PROMPTS[1], 1))
    assert tokens == alone[tuple(PROMPTS[1])][:1]
    assert completion.finish_reason == pb.FINISH_REASON_LENGTH


def test_eos_finishes_unless_ignored(worker, model, alone):
    prompt, k = PROMPTS[2], model["eos_at"]
    tokens, completion = generate(worker, make_request(prompt, MAX_NEW, ignore_eos=False))
    assert tokens == alone[tuple(prompt)][:k + 1]
    assert tokens[-1] == model["eos"]
    assert completion.finish_reason == pb.FINISH_REASON_EOS
    tokens, completion = generate(worker, make_request(prompt, MAX_NEW, ignore_eos=True))
    assert len(tokens) == MAX_NEW
    assert completion.finish_reason == pb.FINISH_REASON_LENGTH


def test_chunked_prefill_equals_unchunked(module_workers, model, alone):
    chunked = module_workers("--prefill-chunk", "8", model=str(model["path"]))
    tokens, completion = generate(chunked, make_request(LONG_PROMPT, MAX_NEW))
    assert tokens == alone[tuple(LONG_PROMPT)] == model["refs"][tuple(LONG_PROMPT)]
    # 60 prompt tokens in chunks of 8 take 8 steps, the last of which samples the first token.
    assert eager_reasons(completion)[BACKEND] == math.ceil(60 / 8) + MAX_NEW - 1
    # Chunks of two long prompts interleave with decode rows of short ones.
    prompts = [LONG_PROMPT, PROMPTS[0], LONG_PROMPT[::-1][:50], PROMPTS[5]]
    results = generate_concurrently(chunked, [make_request(p, MAX_NEW) for p in prompts])
    assert results[0][0] == alone[tuple(LONG_PROMPT)]
    assert results[1][0] == alone[tuple(PROMPTS[0])]
    assert results[3][0] == alone[tuple(PROMPTS[5])]
    reversed_alone, _ = generate(chunked, make_request(prompts[2], MAX_NEW))
    assert results[2][0] == reversed_alone


# --- bad input ----------------------------------------------------------------------------------

BAD_REQUESTS = {
    "empty-prompt": (make_request([], 4), "prompt_token_ids"),
    "token-above-vocab": (make_request([5, 512], 4), "prompt_token_ids[1]"),
    "negative-token": (make_request([-1, 5], 4), "prompt_token_ids[0]"),
    "max-new-zero": (make_request([5], 0), "stopping.max_new_tokens"),
    "max-new-negative": (make_request([5], -3), "stopping.max_new_tokens"),
    "beyond-context": (make_request([5] * 100, 29), "stopping.max_new_tokens"),
    "temperature-negative": (make_request([5], 4, temperature=-0.5), "sampling.temperature"),
    "temperature-huge": (make_request([5], 4, temperature=101.0), "sampling.temperature"),
    "temperature-nan": (make_request([5], 4, temperature=math.nan), "sampling.temperature"),
    "top-p-above-one": (make_request([5], 4, temperature=1.0, top_p=1.5), "sampling.top_p"),
    "top-p-negative": (make_request([5], 4, temperature=1.0, top_p=-0.1), "sampling.top_p"),
    "top-k-negative": (make_request([5], 4, temperature=1.0, top_k=-1), "sampling.top_k"),
    "stop-id-outside-vocab": (make_request([5], 4, stop=[600]), "stopping.stop_token_ids[0]"),
    "tenant-uppercase": (make_request([5], 4, tenant="Team_A"), "tenant"),
    "tenant-too-long": (make_request([5], 4, tenant="a" * 64), "tenant"),
    "tenant-leading-dash": (make_request([5], 4, tenant="-team"), "tenant"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field(worker, alone, case):
    request, field = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
    # The worker keeps serving: the next valid request succeeds.
    tokens, completion = generate(worker, make_request(PROMPTS[1], 3, tenant="team-a"))
    assert tokens == alone[tuple(PROMPTS[1])][:3]
    assert completion.finish_reason == pb.FINISH_REASON_LENGTH


def test_edges_of_the_valid_ranges_are_accepted(worker):
    for request in (make_request([5] * 100, 28), make_request([511], 2, temperature=100.0, top_p=1.0),
                    make_request([0], 2, tenant="a" * 63)):
        tokens, completion = generate(worker, request)
        assert len(tokens) == request.stopping.max_new_tokens


def test_rejections_are_counted(worker):
    before = worker.metric("graphkeeper_requests_total", outcome="invalid")
    with pytest.raises(grpc.RpcError):
        generate(worker, make_request([], 4))
    assert worker.metric("graphkeeper_requests_total", outcome="invalid") == before + 1


# --- model info, health, reflection, metrics ----------------------------------------------------


def test_get_model_info(worker, model):
    info = worker.model_info()
    assert info.source == model["path"].name  # the directory's name: the unauthenticated port hides where it lies
    assert "/" not in info.source
    assert info.revision.startswith("sha256:") and len(info.revision) > len("sha256:")
    assert info.architecture == "LlamaForCausalLM"
    assert info.dtype == "float32"
    assert info.device == "cpu"
    assert (info.vocab_size, info.hidden_size, info.num_layers) == (512, 64, 2)
    assert (info.num_attention_heads, info.num_key_value_heads) == (4, 2)
    assert (info.max_seq_len, info.max_num_seqs) == (128, 4)
    assert info.eos_token_id == model["eos"]
    assert info.parameter_count == model["parameters"]
    assert worker.status().model_revision == info.revision


def test_health_and_probes(worker):
    stub = health_pb2_grpc.HealthStub(worker.channel)
    for service in ("", INFERENCE_SERVICE, CONTROL_SERVICE):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert worker.http_get("/healthz")[0] == 200
    assert worker.http_get("/readyz") == (200, "READY\n")
    assert worker.http_get("/nothing")[0] == 404
    assert worker.status().state == pb.LIFECYCLE_STATE_READY


def test_reflection_lists_the_services(worker):
    db = ProtoReflectionDescriptorDatabase(worker.channel)
    services = set(db.get_services())
    assert {INFERENCE_SERVICE, "grpc.health.v1.Health"} <= services
    assert CONTROL_SERVICE not in services  # the control plane has its own port
    pool = DescriptorPool(db)
    methods = {m.name for m in pool.FindServiceByName(INFERENCE_SERVICE).methods}
    assert methods == {"Generate", "GetModelInfo"}
    control = {m.name for m in pool.FindFileContainingSymbol(CONTROL_SERVICE).services_by_name["GraphControl"].methods}
    assert control == {"ApplyGraphPolicy", "GetGraphStatus", "LoadModelRevision", "WatchGraphStatus", "Sleep", "Wake"}
    reason = pool.FindEnumTypeByName("graphkeeper.worker.v1.FallbackReason")
    assert "FALLBACK_REASON_BACKEND_UNSUPPORTED" in reason.values_by_name


def test_cpu_steps_are_eager_backend_unsupported_in_metrics_and_status(worker, alone):
    generate(worker, make_request(PROMPTS[0], 4))
    metrics = worker.metrics()
    eager = {dict(labels)["fallback_reason"]: v for (name, labels), v in metrics.items()
             if name == "graphkeeper_eager_steps_total"}
    assert eager["backend_unsupported"] > 0
    assert all(v == 0 for reason, v in eager.items() if reason != "backend_unsupported")
    assert not [k for k in metrics if k[0] == "graphkeeper_graph_replays_total"]
    assert worker.metric("graphkeeper_graph_mode", kind="effective", mode="none") == 1
    assert worker.metric("graphkeeper_graph_mode", kind="requested", mode="full_and_piecewise") == 1
    assert worker.metric("graphkeeper_lifecycle_state", state="ready") == 1
    assert worker.metric("graphkeeper_running_sequences") == 0
    status = worker.status()
    assert status.requested_mode == pb.GRAPH_MODE_FULL_AND_PIECEWISE
    assert status.effective_mode == pb.GRAPH_MODE_NONE
    assert "CUDA" in status.mode_downgrade_reason
    assert [f.reason for f in status.fallbacks] == [BACKEND]
    assert status.fallbacks[0].steps == status.eager_steps == eager["backend_unsupported"]
    assert status.graph_steps == 0 and not status.captured
    assert {e.stage for e in status.ledger} >= {pb.LEDGER_STAGE_WEIGHTS, pb.LEDGER_STAGE_KV_CACHE,
                                                pb.LEDGER_STAGE_CAPTURE}


# --- the CLI ------------------------------------------------------------------------------------


def _control_args(worker) -> tuple[str, ...]:
    token = worker.log_path.parent / f"token-{worker.target.rsplit(':', 1)[1]}"
    return ("--control-target", worker.control_target, "--token-file", str(token))


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(GRAPHKEEPER), *args], capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_generate_json(worker):
    prompt = PROMPTS[2]
    expected, completion = generate(worker, make_request(prompt, 6, ignore_eos=False))
    proc = _cli("generate", "--target", worker.target, "--prompt-ids", ",".join(map(str, prompt)),
                "--max-new-tokens", "6", "--json")
    doc = json.loads(proc.stdout)
    assert doc["token_ids"] == expected
    assert doc["finish_reason"] == pb.FinishReason.Name(completion.finish_reason).removeprefix(
        "FINISH_REASON_").lower()
    assert doc["generated_tokens"] == len(expected)
    assert doc["execution"] == {"graph_steps": [],
                                "eager_steps": [{"reason": "backend_unsupported", "steps": len(expected)}]}


def test_cli_generate_sampled_and_plain(worker):
    args = ("generate", "--target", worker.target, "--prompt-ids", "9,8,7", "--max-new-tokens", "5",
            "--temperature", "0.9", "--top-k", "20", "--seed", "77")
    one = json.loads(_cli(*args, "--json").stdout)
    two = json.loads(_cli(*args, "--json").stdout)
    assert one["token_ids"] == two["token_ids"]
    plain = _cli(*args).stdout
    assert " ".join(map(str, one["token_ids"])) in plain
    assert "backend_unsupported" in plain


def test_cli_generate_reports_bad_input(worker):
    proc = _cli("generate", "--target", worker.target, "--prompt-ids", "1,2,9999", "--json", check=False)
    assert proc.returncode == 2
    assert "INVALID_ARGUMENT" in proc.stderr and "prompt_token_ids[2]" in proc.stderr


def test_cli_status(worker):
    generate(worker, make_request(PROMPTS[0], 2))
    doc = json.loads(_cli("status", "--target", worker.target, *_control_args(worker), "--json").stdout)
    assert doc["model"]["revision"] == worker.model_info().revision
    assert doc["model"]["vocab_size"] == 512
    graphs = doc["graphs"]
    assert graphs["state"] == "LIFECYCLE_STATE_READY"
    assert graphs["requested_mode"] == "GRAPH_MODE_FULL_AND_PIECEWISE"
    assert graphs["effective_mode"] == "GRAPH_MODE_NONE"
    assert [f["reason"] for f in graphs["fallbacks"]] == ["FALLBACK_REASON_BACKEND_UNSUPPORTED"]
    assert int(graphs["fallbacks"][0]["steps"]) > 0
    plain = _cli("status", "--target", worker.target, *_control_args(worker)).stdout
    assert "state     READY" in plain
    assert "effective none" in plain
    assert "backend_unsupported=" in plain
    assert "step      -O2, not compiled (preset -O2 asks for compilation, but it runs only on CUDA)" in plain
    assert graphs["compile"]["optimization_level"] == 2 and graphs["compile"]["kernels"] == "torch"
    assert worker.model_info().revision in plain
    kv = graphs["kv_cache"]
    assert kv["block_size"] == 16 and int(kv["blocks_total"]) == 4 * 128 // 16 and kv["prefix_caching"]
    assert f"0/{kv['blocks_total']} blocks of 16 tokens used (0%)" in plain and "prefix cache " in plain
    assert graphs["sleep"]["unavailable_reason"] == "sleep needs a CUDA device: this worker runs on cpu"
    assert "sleep     unavailable: sleep needs a CUDA device: this worker runs on cpu" in plain


def test_graph_control_is_only_on_its_port_and_only_with_the_token(worker):
    request = pb.GetGraphStatusRequest()
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.GraphControlStub(worker.channel).GetGraphStatus(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(worker.control_target) as channel:
        stub = pb_grpc.GraphControlStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", worker.token),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.ApplyGraphPolicy(pb.ApplyGraphPolicyRequest(), timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = stub.GetGraphStatus(request, timeout=10, metadata=(("authorization", f"Bearer {worker.token}"),))
        assert status.state == pb.LIFECYCLE_STATE_READY
        health = health_pb2_grpc.HealthStub(channel)  # probes need no token
        assert health.Check(health_pb2.HealthCheckRequest(service=CONTROL_SERVICE), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_a_second_worker_on_a_port_in_use_exits_with_one_line(worker, tmp_path):
    port = worker.target.rsplit(":", 1)[1]
    proc = subprocess.run([str(GRAPHKEEPER), "worker", "--port", port, "--metrics-port", "0", "--control-port", "0",
                           "--http-port", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr.strip().splitlines()[-1]
