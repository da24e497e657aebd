"""CUDA graph lifecycle on a real GPU: capture, replay against eager, padding, budget, failure
isolation, weight changes and tenant toggles. Run with ``pytest -m cuda`` on the GPU machine."""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.executor.graphs.capture import CaptureJob
from graphkeeper.worker.executor.graphs.graph_set import GraphSet, StaleGraphError
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.model.loader import load_model
from graphkeeper.worker.plan import PrefillChunk, StepPlan

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]

FULL, PIECEWISE = pb.GRAPH_MODE_FULL, pb.GRAPH_MODE_PIECEWISE
SIZES = [1, 2, 4, 8, 16, 24, 32]
MAX_LEN = 256


def sample_logits(runner: ModelRunner, hidden, plan: StepPlan):
    """Float32 logits of the plan's sample rows."""
    return runner.model.logits(runner.sample_rows(hidden, plan))


def make_runner(dtype: str, seed: int = 0, preset: str = "tiny", slots: int = 32,
                record_mixed: bool = True) -> ModelRunner:
    loaded = load_model(f"random:{preset}@{seed}", device="cuda", dtype=dtype, max_positions=MAX_LEN)
    cache = KVCache(loaded.config, slots, MAX_LEN, device=loaded.device, dtype=loaded.dtype)
    return ModelRunner(loaded, cache, max_tokens=64, record_mixed=record_mixed)


def mkplan(tokens, positions, slots, num_decode, prefill, sample_rows) -> StepPlan:
    """A step plan from flat lists; decode rows carry their tokens (no sampling history here)."""
    slots, rows = np.asarray(slots, dtype=np.int64), np.asarray(sample_rows, dtype=np.int64)
    return StepPlan(prompt_tokens=list(tokens[num_decode:]), positions=np.asarray(positions, dtype=np.int64),
                    slots=slots, num_decode=num_decode, prefill=prefill, sample_rows=rows,
                    sample_slots=slots[rows], decode_tokens=np.asarray(tokens[:num_decode], dtype=np.int64))


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
        plan = mkplan(prompt, list(range(n)), [slot] * n, 0, [PrefillChunk(0, n, slot, 0)], [n - 1])
        hidden = runner.forward_eager(runner.prepare(plan, n), n)
        first.append(int(sample_logits(runner, hidden, plan).argmax(-1)[0]))
    return first


def decode(runner: ModelRunner, graphs: GraphSet | None, mode: int, prompts, steps: int,
           forced: list[list[int]] | None = None):
    """Greedy decode of len(prompts) sequences, one row each; graph replay when ``graphs``. With
    ``forced`` (another run's trajectory) each step is fed those tokens instead of its own."""
    tokens = prefill(runner, prompts)
    lengths = [len(p) for p in prompts]
    trajectory, all_logits = [], []
    b = len(prompts)
    for i in range(steps):
        plan = mkplan(tokens, lengths, list(range(b)), b, [], list(range(b)))
        meta = runner.prepare(plan, b)
        hidden = graphs.replay(mode, b, meta) if graphs else runner.forward_eager(meta, b)
        logits = sample_logits(runner, hidden, plan)
        tokens = logits.argmax(-1).tolist() if forced is None else forced[i]
        trajectory.append(tokens)
        all_logits.append(logits.clone())
        lengths = [n + 1 for n in lengths]
    return trajectory, all_logits


def own_blocks(cache: KVCache, slots: int) -> None:
    """Slots ``0 .. slots - 1`` each on blocks of their own, as the scheduler would give them. A
    paged cache (a ModelSlot's) starts every slot on block 0: without this, rows of one step would
    write the same cache rows, and which write lands would vary from run to run."""
    per = cache.max_blocks_per_seq
    assert slots * per <= cache.num_blocks
    cache.table_host[:slots] = np.arange(slots)[:, None] * per + np.arange(per)
    cache.block_table.copy_(torch.from_numpy(cache.table_host))


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
    """A FULL graph runs the eager decode step's kernels: the same greedy tokens. A PIECEWISE key
    records the mixed step's attention (the varlen kernel, where eager decode runs the decode
    kernel), so in bfloat16 it is fed the eager tokens and its logits compared within tolerance,
    its greedy choice equal wherever eager's is not a near tie."""
    runner, graphs = bf16_graphs
    prompts = prompts_for(size, seed=size)
    eager_tokens, eager_logits = decode(runner, None, mode, prompts, 32)
    forced = eager_tokens if mode == PIECEWISE else None
    graph_tokens, graph_logits = decode(runner, graphs, mode, prompts, 32, forced=forced)
    for got, want in zip(graph_logits, eager_logits, strict=True):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-2, rel
        top = want.topk(2, dim=-1).values
        clear = (top[:, 0] - top[:, 1]) > 0.05
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    if mode == FULL:
        assert graph_tokens == eager_tokens


def slot_blocks(cache, slots) -> torch.Tensor:
    """The blocks that hold ``slots``' keys (a static cache: each slot's own run of blocks)."""
    return torch.as_tensor(cache.table_host[slots].ravel(), device=cache.k.device)


def test_padding_never_changes_outputs_or_other_sequences():
    runner = make_runner("float32")
    graphs = capture(runner, [(FULL, 8), (PIECEWISE, 8)], tolerance=1e-4)
    prompts = prompts_for(5, seed=11)
    tokens = prefill(runner, prompts)
    cache = runner.cache
    bystander = slot_blocks(cache, [20])  # a slot outside the batch, holding another sequence's keys
    batch = slot_blocks(cache, list(range(5)))
    cache.k[:, bystander] = torch.randn_like(cache.k[:, bystander])
    before = cache.k[:, bystander].clone(), cache.v[:, bystander].clone()
    plan = mkplan(tokens, [len(p) for p in prompts], list(range(5)), 5, [], list(range(5)))
    eager = sample_logits(runner, runner.forward_eager(runner.prepare(plan, 5), 5), plan)
    eager_kv = cache.k[:, batch].clone()
    for mode in (FULL, PIECEWISE):
        outs = []
        for junk in (0, 499):  # different padded-row contents must not matter
            meta = runner.prepare(plan, 8)
            runner.inputs[runner.TOKENS, 5:8] = junk
            outs.append(sample_logits(runner, graphs.replay(mode, 8, meta), plan).clone())
            assert torch.allclose(cache.k[:, batch], eager_kv, rtol=1e-4, atol=1e-5)
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(outs[0].argmax(-1), eager.argmax(-1))
        assert ((outs[0] - eager).norm() / eager.norm()).item() < 1e-4
    assert torch.equal(cache.k[:, bystander], before[0])
    assert torch.equal(cache.v[:, bystander], before[1])


@pytest.mark.parametrize("record_mixed", [True, False], ids=["whole", "pieces"])
def test_piecewise_mixed_step_matches_eager(record_mixed):
    """A PIECEWISE key is one graph with the attention recorded (the varlen kernel over a program
    per row), or a graph per piece with the attention eager between them; either replays a mixed
    step padded to its size as the eager step computes it."""
    runner = make_runner("float32", record_mixed=record_mixed)
    graphs = capture(runner, [(PIECEWISE, 16)], tolerance=1e-4)
    pieces = len(graphs.captured[(PIECEWISE, 16)].graphs)
    assert pieces == (1 if record_mixed else runner.loaded.config.n_layers + 1)
    prompts = prompts_for(2, seed=3)
    tokens = prefill(runner, prompts)
    new_prompt = list(range(10, 17))  # 7 tokens into slot 5, alongside 2 decode rows
    plan = mkplan(tokens + new_prompt, [len(p) for p in prompts] + list(range(7)), [0, 1] + [5] * 7, 2,
                  [PrefillChunk(2, 7, 5, 0)], [0, 1, 8])
    kv = runner.cache.k.clone(), runner.cache.v.clone()
    eager = sample_logits(runner, runner.forward_eager(runner.prepare(plan, 9), 9), plan)
    runner.cache.k.copy_(kv[0])
    runner.cache.v.copy_(kv[1])
    got = sample_logits(runner, graphs.replay(PIECEWISE, 16, runner.prepare(plan, 16)), plan)
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

    def emit(tokens, end):
        out.extend(tokens)
        if end is not None:
            result["completion"] = end
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

    # The premise is that a size costs the same in two engines of one process. The process's first
    # engine also pays one-time costs in its first graph (Triton modules loaded, library
    # workspaces), so the cost is read from a second one.
    for _ in range(2):
        unlimited = engine_for(pieces(0), model="random:llama-1b", max_num_batched_tokens_override=512,
                               optimization_level=1)
        cost = {c.size: c.device_bytes for c in unlimited.status().captured}
        unlimited.drain_and_stop(5)
        del unlimited
    # Just under what the largest size alone costs: it cannot fit, the small ones can.
    budget = cost[512] - 1
    engine = engine_for(pieces(budget), model="random:llama-1b", max_num_batched_tokens_override=512,
                        optimization_level=1)
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


def test_a_graph_that_fails_validation_first_leaves_the_rest_capturable(monkeypatch):
    """Dropping the only graphs in the pool frees the pool; the next capture gets a fresh one."""
    from graphkeeper.worker.executor.graphs import capture as graphs_module

    real, calls = graphs_module.validate, []

    def first_fails(graphs, mode, size, probe, tolerance, expected):
        calls.append((mode, size))
        if len(calls) == 1:
            return "forced by the test", 0.0
        return real(graphs, mode, size, probe, tolerance, expected)

    monkeypatch.setattr(graphs_module, "validate", first_fails)
    runner = make_runner("float32")
    graphs = capture(runner, [(FULL, 8), (FULL, 4), (PIECEWISE, 8)], tolerance=1e-4)
    assert set(graphs.skipped) == {(FULL, 8)} and "forced by the test" in graphs.skipped[(FULL, 8)].message
    assert set(graphs.captured) == {(FULL, 4), (PIECEWISE, 8)}


def test_every_key_is_validated_against_the_eager_step_it_serves(monkeypatch):
    """A FULL key compares with an eager uniform decode step of its size, a PIECEWISE key with an
    eager mixed step (decode rows and prefill chunks), each probe's prime kept in host memory and
    given back after its last key. It is the eager step itself and its key reports its time; a
    probe runs eager on the serving stream once (the prime, its timing too), twice where a coarse
    verdict reads the size's eager time (here 8 as a coarse size and 4 below it, not 2), and a
    size's eager time is its mixed step's."""
    from graphkeeper.worker.executor.graphs import capture as graphs_module

    real, seen = graphs_module.validate, {}

    def recording(graphs, mode, size, probe, tolerance, expected):
        seen[(mode, size)] = expected.clone()
        return real(graphs, mode, size, probe, tolerance, expected)

    monkeypatch.setattr(graphs_module, "validate", recording)
    runner = make_runner("float32")
    graphs = GraphSet(runner)
    eager_runs, forward = collections.Counter(), runner.forward_eager

    def counted(meta, rows):
        if torch.cuda.current_stream() != graphs.stream:  # not the capture stream's warm-up or recording
            eager_runs[rows] += 1
        return forward(meta, rows)

    monkeypatch.setattr(runner, "forward_eager", counted)
    keys = [(FULL, 8), (FULL, 4), (FULL, 2), (PIECEWISE, 8), (PIECEWISE, 4), (PIECEWISE, 2)]
    job = CaptureJob(graphs, keys, tolerance=1e-4, coarse=(8,), ladder=(2, 4, 8))
    job.run_all()
    monkeypatch.setattr(runner, "forward_eager", forward)
    assert set(graphs.captured) == set(seen) == set(keys)
    runs = 2 * graphs_module.EAGER_TIMING_REPEATS  # two probes a size
    assert eager_runs == {8: runs, 4: runs, 2: 2}
    assert seen[(FULL, 8)].shape[0] == 8 and seen[(FULL, 4)].shape[0] == 4 and job.references == {}
    for size in (8, 4):
        for mode, mixed in ((FULL, False), (PIECEWISE, True)):
            probe = graphs_module.probe_plan(runner, size, mixed=mixed)
            assert probe.num_decode == (size // 2 if mixed else size) and bool(probe.prefill) == mixed
            eager = runner.forward_eager(runner.prepare(probe, size), size)
            torch.testing.assert_close(seen[(mode, size)], eager)
        full, piecewise = graphs.captured[(FULL, size)], graphs.captured[(PIECEWISE, size)]
        assert full.eager_seconds > 0 and piecewise.eager_seconds > 0
        assert graphs.eager_seconds[size] == piecewise.eager_seconds
        assert full.replay_seconds > 0 and piecewise.replay_seconds > 0


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


def paged(slots_total: int, length_max: int, kv_heads: int, d: int, dtype, block_size: int = 16):
    """A paged cache whose slots' blocks are scattered in a shuffled order, and a gather of a slot's
    first ``n`` keys (or values) through its table, for references."""
    per_slot = -(-length_max // block_size)
    k = torch.randn(slots_total * per_slot + 3, block_size, kv_heads, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    order = torch.randperm(k.shape[0], generator=torch.Generator().manual_seed(5))[: slots_total * per_slot]
    table = order.view(slots_total, per_slot).to("cuda")

    def gather(cache, slot: int, n: int) -> torch.Tensor:
        pos = torch.arange(n, device="cuda")
        return cache.flatten(0, 1)[table[slot, pos // block_size] * block_size + pos % block_size]

    return k, v, table, gather


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_triton_decode_kernel_matches_sdpa_reference(dtype, tol, block_size):
    from graphkeeper.worker.kernels import decode_kernel

    torch.manual_seed(0)
    slots_total, kv_heads, length_max, d, heads, rows = 9, 2, 200, 64, 8, 7
    k, v, table, gather = paged(slots_total, length_max, kv_heads, d, dtype, block_size)
    q = torch.randn(rows, heads, d, device="cuda", dtype=dtype)
    slots = torch.tensor([3, 0, 8, 5, 5, 1, 2], device="cuda")
    lengths = torch.tensor([1, 17, 64, 65, 200, 129, 3], device="cuda")
    got = decode_kernel.decode_attention(q, k, v, slots, lengths, table).view(rows, heads, d).float()
    group = heads // kv_heads
    for r in range(rows):
        n = int(lengths[r])
        keys = gather(k, int(slots[r]), n).float().transpose(0, 1).repeat_interleave(group, 0)
        values = gather(v, int(slots[r]), n).float().transpose(0, 1).repeat_interleave(group, 0)
        want = torch.softmax(q[r].float()[:, None, :] @ keys.transpose(1, 2) / d**0.5, -1) @ values
        rel = ((got[r] - want[:, 0]).norm() / want.norm()).item()
        assert rel < tol, (r, rel)


# --- the varlen kernel and mixed steps (Worker III) ------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (32, 8)])
def test_varlen_kernel_matches_a_float64_reference(dtype, tol, heads, kv_heads):
    """Decode rows and prefill chunks of several lengths (within, across and beyond BLOCK_Q), one launch."""
    from graphkeeper.worker.kernels.varlen_kernel import BLOCK_Q, varlen_attention

    torch.manual_seed(heads)
    d, slots_total, length_max = 64, 6, 300
    k, v, block_table, gather = paged(slots_total, length_max, kv_heads, d, dtype)
    # (slot, first position, tokens): two decode rows, then chunks of 1, 16, 17 and 40 tokens.
    entries = [(0, 50, 1), (1, 0, 1), (2, 0, 1), (3, 7, BLOCK_Q), (4, 100, BLOCK_Q + 1), (5, 200, 40)]
    rows = sum(n for _, _, n in entries)
    q = torch.randn(rows, heads, d, device="cuda", dtype=dtype)
    blocks, row, want_rows = [], 0, []
    for slot, start, n in entries:
        for b in range(0, n, BLOCK_Q):
            blocks.append((row + b, min(BLOCK_Q, n - b), slot, start + b))
        for i in range(n):
            want_rows.append((row + i, slot, start + i))
        row += n
    table = torch.tensor(blocks, device="cuda", dtype=torch.long).T.contiguous()
    out = torch.full((rows, heads * d), float("nan"), device="cuda", dtype=dtype)
    got = varlen_attention(q, k, v, table[0], table[1], table[2], table[3], len(blocks), block_table, out=out)
    assert torch.isfinite(got).all(), "every row is written"
    group = heads // kv_heads
    got = got.view(rows, heads, d).double()
    for r, slot, pos in want_rows:
        keys = gather(k, slot, pos + 1).double().transpose(0, 1).repeat_interleave(group, 0)
        values = gather(v, slot, pos + 1).double().transpose(0, 1).repeat_interleave(group, 0)
        want = torch.softmax(q[r].double()[:, None, :] @ keys.transpose(1, 2) / d**0.5, -1) @ values
        rel = ((got[r] - want[:, 0]).norm() / want.norm()).item()
        assert rel < tol, (r, rel)


def mixed_plan(runner: ModelRunner, prompts: list[list[int]], new_prompts: list[list[int]]):
    """Decode rows for ``prompts`` (prefilled into slots 0..) beside prefill chunks of ``new_prompts``."""
    tokens = prefill(runner, prompts)
    nd = len(prompts)
    flat, positions, slots, chunks, sample_rows = list(tokens), [len(p) for p in prompts], list(range(nd)), [], []
    sample_rows = list(range(nd))
    for i, p in enumerate(new_prompts):
        slot = nd + i
        chunks.append(PrefillChunk(len(flat), len(p), slot, 0))
        flat += p
        positions += list(range(len(p)))
        slots += [slot] * len(p)
        sample_rows.append(len(flat) - 1)
    return mkplan(flat, positions, slots, nd, chunks, sample_rows)


@pytest.mark.parametrize("record_mixed", [True, False], ids=["whole", "pieces"])
def test_mixed_steps_through_the_varlen_kernel_and_piecewise_graphs_equal_the_sdpa_reference(record_mixed):
    runner = make_runner("float32", slots=32, record_mixed=record_mixed)
    graphs = capture(runner, [(PIECEWISE, 64)], tolerance=1e-4)
    plan = mixed_plan(runner, prompts_for(5, seed=21), [list(range(3, 40)), list(range(50, 53)), [7]])
    n = plan.num_tokens
    kv = runner.cache.k.clone(), runner.cache.v.clone()

    def run(fn):
        runner.cache.k.copy_(kv[0])
        runner.cache.v.copy_(kv[1])
        return sample_logits(runner, fn(), plan).clone()

    runner.attention.triton_varlen = False  # SDPA per decode batch and per chunk: the reference
    reference = run(lambda: runner.forward_eager(runner.prepare(plan, n), n))
    runner.attention.triton_varlen = True
    eager = run(lambda: runner.forward_eager(runner.prepare(plan, n), n))
    piecewise = run(lambda: graphs.replay(PIECEWISE, 64, runner.prepare(plan, 64)))
    for got in (eager, piecewise):
        assert torch.equal(got.argmax(-1), reference.argmax(-1))
        assert ((got - reference).norm() / reference.norm()).item() < 1e-4


def test_mixed_traffic_replays_piecewise_graphs_up_to_the_token_budget():
    engine = engine_for(max_num_batched_tokens_override=64)
    try:
        _, long_prompt = generate(engine, list(range(3, 203)), 4)  # 200 tokens: chunks of 64 and a rest
        assert not long_prompt.execution.eager_steps, long_prompt.execution
        assert {g.mode for g in long_prompt.execution.graph_steps} == {FULL, PIECEWISE}
    finally:
        engine.drain_and_stop(5)


def test_token_streams_under_64_way_concurrency_equal_each_request_alone():
    """Greedy float32: every stream's tokens are exactly what the request gives alone."""
    settings = EngineSettings(model="random:tiny", device="cuda", dtype="float32", max_num_seqs=64,
                              max_seq_len=MAX_LEN, max_num_batched_tokens=128, max_queue=256,
                              policy=pb.GraphPolicy())
    engine = Engine(settings)
    engine.start()
    assert engine.ready.wait(300) and engine.failed is None, engine.failed
    try:
        g = torch.Generator().manual_seed(64)
        requests = [(torch.randint(3, 500, (int(torch.randint(1, 120, (1,), generator=g)),), generator=g).tolist(),
                     int(torch.randint(1, 60, (1,), generator=g))) for _ in range(64)]
        alone = [generate(engine, prompt, n)[0] for prompt, n in requests]
        together: list = [None] * len(requests)
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, generate(engine, *requests[i])[0]))
                   for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert together == alone
        status = engine.status()
        assert status.graph_steps > 0
    finally:
        engine.drain_and_stop(5)


@pytest.mark.parametrize("level", [1, 2])
def test_graphs_replay_the_same_tokens_after_sleep_and_wake(level):
    """Sleep mode: the weights and the KV cache give their memory back and take it again at the same
    addresses, so the graphs captured before sleep replay after wake, with no recapture, and greedy
    decoding gives exactly the tokens it gave before (level 2 reloads the weights from the source)."""
    from graphkeeper.worker.engine.ledger import Ledger
    from graphkeeper.worker.engine.model_slot import ModelSlot
    from graphkeeper.worker.engine.sleep import sleep_model, wake_model
    from graphkeeper.worker.metrics import WorkerMetrics

    # The regions alone: the process checkpoint would lock this test process, whose other threads
    # may call CUDA (test_sleep_cuda.py checks it on a worker process).
    settings = EngineSettings(model="random:llama-1b@3", device="cuda", dtype="float32", max_num_seqs=8,
                              max_seq_len=MAX_LEN, max_num_batched_tokens=64, sleep_mode=True,
                              sleep_offload_context=False)
    slot = ModelSlot(settings, torch.device("cuda"), Ledger(), WorkerMetrics())
    slot.install(slot.load(settings.model, ""))
    runner = slot.runner
    weights = runner.loaded.weights_region
    assert weights is not None and runner.cache.region is not None
    assert all(weights.ptr <= p.data_ptr() < weights.ptr + weights.size for p in runner.model.parameters())
    graphs = capture(runner, [(FULL, 4)], tolerance=1e-3)
    prompts = prompts_for(4, seed=level)
    own_blocks(runner.cache, len(prompts))
    before, _ = decode(runner, graphs, FULL, prompts, 12)
    assert decode(runner, graphs, FULL, prompts, 12)[0] == before  # the comparison below can only fail by sleep

    asleep = sleep_model(slot, level)
    held = weights.size + runner.cache.region.size
    assert asleep.released_bytes >= 0.9 * held, (asleep, held)
    assert not weights.mapped and not runner.cache.region.mapped
    woke = wake_model(slot)
    assert woke.level == level and weights.mapped and runner.cache.region.mapped

    after, _ = decode(runner, graphs, FULL, prompts, 12)
    assert after == before
    assert not graphs.skipped
