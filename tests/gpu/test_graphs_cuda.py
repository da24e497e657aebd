"""CUDA graph lifecycle on a real GPU: capture, replay against eager, padding, budget, failure
isolation, weight changes and tenant toggles. Run with ``pytest -m cuda`` on the GPU machine."""

from __future__ import annotations

import threading

import pytest
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.attention import PrefillChunk
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.graphs import CaptureJob, GraphSet, StaleGraphError
from graphkeeper.worker.kv_cache import KVCache
from graphkeeper.worker.loader import load_model
from graphkeeper.worker.runner import ModelRunner, StepPlan

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]

FULL, PIECEWISE = pb.GRAPH_MODE_FULL, pb.GRAPH_MODE_PIECEWISE
SIZES = [1, 2, 4, 8, 16, 24, 32]
MAX_LEN = 256


def make_runner(dtype: str, seed: int = 0, preset: str = "tiny", slots: int = 32) -> ModelRunner:
    loaded = load_model(f"random:{preset}@{seed}", device="cuda", dtype=dtype, max_positions=MAX_LEN)
    cache = KVCache(loaded.config, slots, MAX_LEN, device=loaded.device, dtype=loaded.dtype)
    return ModelRunner(loaded, cache, max_tokens=64)


def capture(runner: ModelRunner, keys: list[tuple[int, int]], **kw) -> GraphSet:
    graphs = GraphSet(runner)
    job = CaptureJob(graphs, keys, **kw)
    job.run_all()
    return graphs


def prefill(runner: ModelRunner, prompts: list[list[int]]) -> list[int]:
    """Prefills each prompt eagerly into slot i; returns the first generated token of each."""
    first = []
    for slot, prompt in enumerate(prompts):
        n = len(prompt)
        plan = StepPlan(prompt, list(range(n)), [slot] * n, 0, [PrefillChunk(0, n, slot, 0)], [n - 1])
        hidden = runner.forward_eager(runner.prepare(plan, n), n)
        first.append(int(runner.logits(hidden, plan).argmax(-1)[0]))
    return first


def decode(runner: ModelRunner, graphs: GraphSet | None, mode: int, prompts, steps: int):
    """Greedy decode of len(prompts) sequences, one row each; graph replay when ``graphs``."""
    tokens = prefill(runner, prompts)
    lengths = [len(p) for p in prompts]
    trajectory, all_logits = [], []
    b = len(prompts)
    for _ in range(steps):
        plan = StepPlan(tokens, lengths, list(range(b)), b, [], list(range(b)))
        meta = runner.prepare(plan, b)
        hidden = graphs.replay(mode, b, meta) if graphs else runner.forward_eager(meta, b)
        logits = runner.logits(hidden, plan)
        tokens = logits.argmax(-1).tolist()
        trajectory.append(tokens)
        all_logits.append(logits.clone())
        lengths = [n + 1 for n in lengths]
    return trajectory, all_logits


def prompts_for(b: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(b)]


@pytest.fixture(scope="module")
def bf16_graphs():
    runner = make_runner("bfloat16")
    keys = [(FULL, s) for s in reversed(SIZES)] + [(PIECEWISE, s) for s in reversed(SIZES)]
    graphs = capture(runner, keys, tolerance=2e-2)
    assert not graphs.skipped, graphs.skipped
    return runner, graphs


@pytest.mark.parametrize("mode", [FULL, PIECEWISE], ids=["full", "piecewise"])
@pytest.mark.parametrize("size", SIZES)
def test_replay_equals_eager_for_32_greedy_steps(bf16_graphs, mode, size):
    runner, graphs = bf16_graphs
    prompts = prompts_for(size, seed=size)
    eager_tokens, eager_logits = decode(runner, None, mode, prompts, 32)
    graph_tokens, graph_logits = decode(runner, graphs, mode, prompts, 32)
    assert graph_tokens == eager_tokens
    for got, want in zip(graph_logits, eager_logits, strict=True):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-2, rel


def test_padding_never_changes_outputs_or_other_sequences():
    runner = make_runner("float32")
    graphs = capture(runner, [(FULL, 8), (PIECEWISE, 8)], tolerance=1e-4)
    prompts = prompts_for(5, seed=11)
    tokens = prefill(runner, prompts)
    bystander = 20  # a slot outside the batch, holding another sequence's keys
    runner.cache.k[:, bystander].normal_()
    before = runner.cache.k[:, bystander].clone(), runner.cache.v[:, bystander].clone()
    plan = StepPlan(tokens, [len(p) for p in prompts], list(range(5)), 5, [], list(range(5)))
    eager = runner.logits(runner.forward_eager(runner.prepare(plan, 5), 5), plan)
    eager_kv = runner.cache.k[:, :5].clone()
    for mode in (FULL, PIECEWISE):
        outs = []
        for junk in (0, 499):  # different padded-row contents must not matter
            meta = runner.prepare(plan, 8)
            runner.inputs[runner.TOKENS, 5:8] = junk
            outs.append(runner.logits(graphs.replay(mode, 8, meta), plan).clone())
            assert torch.allclose(runner.cache.k[:, :5], eager_kv, rtol=1e-4, atol=1e-5)
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(outs[0].argmax(-1), eager.argmax(-1))
        assert ((outs[0] - eager).norm() / eager.norm()).item() < 1e-4
    assert torch.equal(runner.cache.k[:, bystander], before[0])
    assert torch.equal(runner.cache.v[:, bystander], before[1])


def test_piecewise_mixed_step_matches_eager():
    runner = make_runner("float32")
    graphs = capture(runner, [(PIECEWISE, 16)], tolerance=1e-4)
    prompts = prompts_for(2, seed=3)
    tokens = prefill(runner, prompts)
    new_prompt = list(range(10, 17))  # 7 tokens into slot 5, alongside 2 decode rows
    plan = StepPlan(tokens + new_prompt, [len(p) for p in prompts] + list(range(7)), [0, 1] + [5] * 7, 2,
                    [PrefillChunk(2, 7, 5, 0)], [0, 1, 8])
    kv = runner.cache.k.clone(), runner.cache.v.clone()
    eager = runner.logits(runner.forward_eager(runner.prepare(plan, 9), 9), plan)
    runner.cache.k.copy_(kv[0])
    runner.cache.v.copy_(kv[1])
    got = runner.logits(graphs.replay(PIECEWISE, 16, runner.prepare(plan, 16)), plan)
    assert torch.equal(got.argmax(-1), eager.argmax(-1))
    assert ((got - eager).norm() / eager.norm()).item() < 1e-4


def test_stale_graphs_are_never_replayed():
    runner = make_runner("bfloat16")
    graphs = capture(runner, [(FULL, 4)])
    runner.model.tok_embeddings.weight = torch.nn.Parameter(runner.model.tok_embeddings.weight.clone())
    with pytest.raises(StaleGraphError):
        graphs.check_fresh()


# --- the engine: lifecycle, budget, failures, revisions, tenants ----------------------------


def engine_for(policy: pb.GraphPolicy | None = None, model: str = "random:tiny",
               max_num_batched_tokens_override: int = 64, **kw) -> Engine:
    settings = EngineSettings(model=model, device="cuda", dtype="bfloat16", max_num_seqs=16, max_seq_len=MAX_LEN,
                              max_num_batched_tokens=max_num_batched_tokens_override,
                              policy=policy or pb.GraphPolicy(), **kw)
    engine = Engine(settings)
    engine.start()
    assert engine.ready.wait(300) and engine.failed is None, engine.failed
    return engine


def generate(engine: Engine, prompt: list[int], n: int = 16, tenant: str = "") -> tuple[list[int], pb.Completion]:
    done, out, result = threading.Event(), [], {}

    def emit(kind, payload):
        if kind == "tokens":
            out.extend(payload)
        else:
            result["completion"] = payload
            done.set()

    req = pb.GenerateRequest(prompt_token_ids=prompt, tenant=tenant,
                             stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))
    engine.submit(req, emit)
    assert done.wait(120)
    return out, result["completion"]


def policy(uid="p", generation=1, **kw) -> pb.GraphPolicy:
    p = pb.GraphPolicy(policy_uid=uid, generation=generation, mode=kw.pop("mode", pb.GRAPH_MODE_FULL_AND_PIECEWISE))
    p.capture_sizes.ladder = pb.CAPTURE_LADDER_DEFAULT
    for key, value in kw.items():
        if key == "tenants":
            p.tenants.extend(value)
        else:
            setattr(p, key, value)
    return p


def test_engine_captures_before_ready_and_serves_from_graphs():
    engine = engine_for()
    try:
        status = engine.status()
        assert status.state == pb.LIFECYCLE_STATE_READY
        assert status.effective_mode == pb.GRAPH_MODE_FULL_AND_PIECEWISE
        assert {(c.mode, c.size) for c in status.captured} >= {(FULL, 1), (PIECEWISE, 32)}
        assert all(c.capture_seconds > 0 for c in status.captured)
        assert status.graph_memory_bytes > 0
        stages = {e.stage for e in status.ledger}
        assert {pb.LEDGER_STAGE_WEIGHTS, pb.LEDGER_STAGE_KV_CACHE, pb.LEDGER_STAGE_CAPTURE} <= stages
        _, completion = generate(engine, [5, 6, 7, 8], 16)
        graph_modes = {g.mode for g in completion.execution.graph_steps}
        assert FULL in graph_modes  # the decode steps replayed the FULL graph of size 1
    finally:
        engine.drain_and_stop(5)


def test_budget_that_fits_part_of_the_ladder_captures_what_fits():
    def pieces(budget: int) -> pb.GraphPolicy:
        p = policy(mode=pb.GRAPH_MODE_PIECEWISE, memory_budget_bytes=budget)
        p.capture_sizes.explicit.sizes.extend([1, 2, 512])
        return p

    unlimited = engine_for(pieces(0), model="random:llama-1b", max_num_batched_tokens_override=512)
    cost = {c.size: c.device_bytes for c in unlimited.status().captured}
    unlimited.drain_and_stop(5)
    del unlimited
    # Just under what the largest size alone costs: it cannot fit, the small ones can.
    budget = cost[512] - 1
    engine = engine_for(pieces(budget), model="random:llama-1b", max_num_batched_tokens_override=512)
    try:
        status = engine.status()
        captured = {c.size for c in status.captured}
        over = {s.size for s in status.skipped if s.reason == pb.FALLBACK_REASON_SIZE_OVER_BUDGET}
        assert captured == {1, 2} and over == {512}, (cost, captured, [s.message for s in status.skipped])
        assert 0 < status.graph_memory_bytes <= budget
        assert status.state == pb.LIFECYCLE_STATE_READY
        _, completion = generate(engine, list(range(3, 103)), 4)  # a 100-token prefill pads to 512
        reasons = {e.reason for e in completion.execution.eager_steps}
        assert pb.FALLBACK_REASON_SIZE_OVER_BUDGET in reasons
        assert completion.execution.graph_steps  # its decode steps replay the size-1 pieces
    finally:
        engine.drain_and_stop(5)


def test_injected_capture_failure_leaves_worker_ready_with_that_size_eager():
    engine = engine_for(policy(mode=pb.GRAPH_MODE_FULL_DECODE_ONLY), inject_capture_failures=frozenset({1}))
    try:
        status = engine.status()
        assert status.state == pb.LIFECYCLE_STATE_READY
        failed = {(s.mode, s.size): s for s in status.skipped}
        assert failed[(FULL, 1)].reason == pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED
        assert "injected" in failed[(FULL, 1)].message
        assert (FULL, 2) in {(c.mode, c.size) for c in status.captured}
        _, completion = generate(engine, [9, 10, 11], 8)  # batch of 1 decodes: the failed size
        reasons = {e.reason for e in completion.execution.eager_steps}
        assert pb.FALLBACK_REASON_SIZE_CAPTURE_FAILED in reasons
    finally:
        engine.drain_and_stop(5)


def test_after_a_weight_change_outputs_are_the_new_models():
    prompt = [11, 12, 13, 14, 15]
    reference = engine_for(policy(mode=pb.GRAPH_MODE_NONE), model="random:tiny@2")
    want_new, _ = generate(reference, prompt, 24)
    reference.drain_and_stop(5)
    engine = engine_for(model="random:tiny@1")
    try:
        old, _ = generate(engine, prompt, 24)
        revision = engine.load_revision("random:tiny@2", "").result(120)
        assert revision == engine.status().model_revision
        assert engine.ready.wait(60)
        for _ in range(200):  # wait for the recapture to finish
            if engine.status().state == pb.LIFECYCLE_STATE_READY:
                break
            threading.Event().wait(0.05)
        new, completion = generate(engine, prompt, 24)
        assert new == want_new and new != old
        assert completion.execution.graph_steps, "the new graphs serve after the recapture"
    finally:
        engine.drain_and_stop(5)


def test_disabled_tenant_runs_eager_while_others_replay():
    toggles = [pb.TenantToggle(tenant="blocked", graphs=pb.TENANT_GRAPHS_DISABLED)]
    engine = engine_for(policy(tenants=toggles))
    try:
        _, blocked = generate(engine, [3, 4, 5], 8, tenant="blocked")
        _, other = generate(engine, [3, 4, 5], 8, tenant="team-a")
        assert {e.reason for e in blocked.execution.eager_steps} == {pb.FALLBACK_REASON_TENANT_DISABLED}
        assert not blocked.execution.graph_steps
        assert other.execution.graph_steps
    finally:
        engine.drain_and_stop(5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_decode_kernel_matches_sdpa_reference(dtype, tol):
    from graphkeeper.worker import decode_kernel

    torch.manual_seed(0)
    slots_total, kv_heads, length_max, d, heads, rows = 9, 2, 200, 64, 8, 7
    k = torch.randn(slots_total, length_max, kv_heads, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(rows, heads, d, device="cuda", dtype=dtype)
    slots = torch.tensor([3, 0, 8, 5, 5, 1, 2], device="cuda")
    lengths = torch.tensor([1, 17, 64, 65, 200, 129, 3], device="cuda")
    got = decode_kernel.decode_attention(q, k, v, slots, lengths).view(rows, heads, d).float()
    group = heads // kv_heads
    for r in range(rows):
        n = int(lengths[r])
        keys = k[slots[r], :n].float().transpose(0, 1).repeat_interleave(group, 0)
        values = v[slots[r], :n].float().transpose(0, 1).repeat_interleave(group, 0)
        want = torch.softmax(q[r].float()[:, None, :] @ keys.transpose(1, 2) / d**0.5, -1) @ values
        rel = ((got[r] - want[:, 0]).norm() / want.norm()).item()
        assert rel < tol, (r, rel)
