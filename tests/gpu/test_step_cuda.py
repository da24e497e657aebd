"""The step itself on a real GPU: each kernel against its plain PyTorch reference, the compiled
step against the uncompiled one, graph replay against eager execution with compiled pieces, fp8
weights, and the model against `transformers` on the same weights, compiled and not.
Run with ``pytest -m cuda`` on the GPU machine."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.executor.graphs.capture import CaptureJob
from graphkeeper.worker.executor.graphs.graph_set import GraphSet
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.kernels import choice as ops
from graphkeeper.worker.kernels import linear_kernel, norm_kernel, pdl, row_kernel
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.model.llama import apply_rope, make_row_pieces
from graphkeeper.worker.model.loader import load_model, save_hf_directory
from graphkeeper.worker.model.quantization import quantize
from graphkeeper.worker.model.step import compile_counters, prepare_step
from graphkeeper.worker.plan import StepPlan

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]

FULL, PIECEWISE = pb.GRAPH_MODE_FULL, pb.GRAPH_MODE_PIECEWISE
MAX_LEN = 256
SIZES = [1, 2, 3, 8, 16, 33, 64]


@pytest.fixture(autouse=True)
def _default_stance():
    yield
    torch.compiler.set_stance("default")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


# --- kernels against their references ------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (1000, 512)])
def test_skinny_linear_matches_torch(rows, n, k):
    g = torch.Generator(device="cuda").manual_seed(rows * n + k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    got = linear_kernel.skinny_linear(x, w)
    expected = torch.nn.functional.linear(x.float(), w.float())
    assert rel(got, expected) < 5e-3


@pytest.mark.parametrize("rows", [1, 4, 16, 64, 200])
@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "tensor"])
def test_fp8_linear_matches_dequantized_reference(rows, per_channel):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(3072, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    q, scale = quantize(w, per_channel)
    got = ops.linear(x, q, scale)
    expected = torch.nn.functional.linear(x.float(), q.float() * (scale[:, None] if per_channel else scale))
    assert rel(got, expected) < 5e-3
    assert rel(got, torch.nn.functional.linear(x.float(), w.float())) < 6e-2  # fp8's own error


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows,dim", [(1, 2048), (7, 4096), (64, 64)])
def test_fused_add_rms_norm_matches_reference(dtype, tol, rows, dim):
    g = torch.Generator(device="cuda").manual_seed(rows + dim)
    r = torch.randn(rows, dim, device="cuda", dtype=dtype, generator=g)
    d = torch.randn(rows, dim, device="cuda", dtype=dtype, generator=g)
    w = torch.rand(dim, device="cuda", dtype=dtype, generator=g) + 0.5
    h, out = norm_kernel.add_rms_norm(r, d, w, 1e-5)
    h_ref, out_ref = norm_kernel.reference(r, d, w, 1e-5)
    assert torch.equal(h, h_ref)  # the residual is the rounded sum, exactly as unfused
    assert rel(out, out_ref) < tol
    assert rel(norm_kernel.rms_norm(r, w, 1e-5), torch.nn.functional.rms_norm(r, (dim,), w, 1e-5)) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (7, 32000), (64, 128256), (4, 8192)])
def test_argmax_kernel_equals_torch_argmax(dtype, rows, vocab):
    """Greedy decoding's argmax in two launches gives torch.argmax's index: ties to the first, a
    maximum in the last chunk or on a chunk boundary, NaN; on a view of rows, and through sample()."""
    from graphkeeper.worker.executor import sampling
    from graphkeeper.worker.kernels import argmax_kernel

    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    x = torch.randn(rows + 1, vocab, device="cuda", generator=g).to(dtype)
    x[0, vocab - 1] = 100.0
    if rows >= 4:
        x[1, 7] = x[1, vocab // 2] = 100.0
        x[2, argmax_kernel.CHUNK - 1] = x[2, argmax_kernel.CHUNK] = 100.0
        x[3, argmax_kernel.CHUNK] = float("nan")
    rows_view = x[:rows]
    want = rows_view.argmax(-1)
    got = argmax_kernel.argmax(rows_view)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
    assert torch.equal(sampling.sample(rows_view.float(), None), want)
    if rows >= 4:
        assert want[1] == 7 and want[2] == argmax_kernel.CHUNK - 1 and want[3] == argmax_kernel.CHUNK


# --- the one-token step: fused row kernels, programmatic dependent launch ------------------------


def test_programmatic_dependent_launch_records_and_replays_on_hopper():
    assert pdl.probe(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)


def row_reference(mode: int, x, w, scale, norm, residual, cos, sin, head_dim: int):
    """The unfused ops the row kernel replaces, in the model's dtype."""
    if norm is not None:
        x = ops.rms_norm(x, norm, 1e-5)
    y = linear_kernel.reference(x, w, scale)
    if mode == row_kernel.GLU:
        gate, up = y.split(y.shape[-1] // 2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    if mode == row_kernel.ROPE:  # llama shapes: 4 query heads per key head
        heads = y.view(1, -1, head_dim)
        kv = heads.shape[1] // 6
        return torch.cat((apply_rope(heads[:, : 5 * kv], cos, sin), heads[:, 5 * kv:]), 1).view(1, -1)
    return residual + y


@torch.inference_mode()
@pytest.mark.parametrize("n,k,mode", [(3072, 2048, row_kernel.ROPE), (2048, 2048, row_kernel.PLAIN),
                                      (16384, 2048, row_kernel.GLU), (2048, 8192, row_kernel.PLAIN),
                                      (6144, 4096, row_kernel.ROPE), (4096, 14336, row_kernel.PLAIN)])
@pytest.mark.parametrize("weights", ["bf16", "fp8", "fp8-tensor"])
def test_row_linear_matches_the_unfused_ops_with_every_tile_and_pdl_on_or_off(n, k, mode, weights):
    g = torch.Generator(device="cuda").manual_seed(n + k + mode)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    scale = None
    if weights != "bf16":
        w, scale = quantize(w, weights == "fp8")
    norm = (torch.rand(k, device="cuda", generator=g) + 0.5).to(torch.bfloat16) if mode != row_kernel.PLAIN else None
    residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16, generator=g) if mode == 0 else None
    head_dim = 128 if k == 4096 else 64
    angles = 7.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    cos = torch.cat((angles, angles)).cos()[None].to(torch.bfloat16)
    sin = torch.cat((-angles.sin(), angles.sin()))[None].to(torch.bfloat16)
    rope = (cos, sin, n * 5 // 6, head_dim) if mode == row_kernel.ROPE else None
    expected = row_reference(mode, x, w, scale, norm, residual, cos, sin, head_dim)
    tiles = [t for t in row_kernel.CANDIDATES if row_kernel.fits(t, mode, k, head_dim // 2)]
    assert tiles
    results = {}
    try:
        for on in (False, True):
            pdl.set_enabled(on and pdl.probe(torch.device("cuda")))
            for tile in tiles:
                got = row_kernel.row_linear(x, w, scale, norm=norm, eps=1e-5, residual=residual,
                                            glu=mode == row_kernel.GLU, rope=rope, tile=tile)
                assert rel(got, expected) < 1e-2, (tile, on, rel(got, expected))
                assert torch.equal(results.setdefault(tile, got), got), tile  # PDL changes no bit
    finally:
        pdl.probe(torch.device("cuda"))


@torch.inference_mode()
@pytest.mark.parametrize("step", ["fused-row", "compiled-row"])
def test_one_token_row_step_matches_the_general_step(cache_root, step):
    general = make_runner("plain", cache_root)
    row = make_runner(step, cache_root)
    assert row.model.row_pieces is not None
    for position in (0, 9, 200):
        plan = decode_plan(1, position, seed=position)
        expected = general.model.logits(hidden_for(general, plan, 1))
        got = row.model.logits(hidden_for(row, plan, 1))
        assert rel(got, expected) < 2e-2, (position, rel(got, expected))
        assert got.argmax(-1).item() == expected.argmax(-1).item()


@torch.inference_mode()
def test_start_up_times_the_one_token_step_and_installs_what_it_chose(cache_root):
    runner = make_runner("plain", cache_root, preset="llama-1b")
    report = prepare_step(runner.model, compile=True, cache_root=cache_root, quantization="none",
                          warm_up=lambda: runner.warm_up(16), level=2, reason="test")
    print(report.row_step)
    assert report.row_step.startswith(("fused row kernels", "the general step"))
    chosen = report.row_step.startswith("fused row kernels")
    assert (runner.model.row_pieces is not None) == chosen == runner.model.kernels.endswith("+row1")
    assert report.tuning is not None and report.tuning.cache in ("hit", "miss", "shipped")


# --- the compiled step ---------------------------------------------------------------------------


def make_runner(step: str, cache_root: str, *, preset: str = "tiny", dtype: str = "bfloat16",
                quantization: str = "none") -> ModelRunner:
    loaded = load_model(f"random:{preset}@3", device="cuda", dtype=dtype, max_positions=MAX_LEN,
                        quantization=quantization)
    cache = KVCache(loaded.config, 64, MAX_LEN, device=loaded.device, dtype=loaded.dtype, scratch_slots=2)
    runner = ModelRunner(loaded, cache, max_tokens=128)
    if step != "plain":
        prepare_step(runner.model, compile=step.startswith("compiled"), cache_root=cache_root,
                     quantization=quantization, warm_up=lambda: runner.warm_up(64), level=2, reason="test")
    model = runner.model
    if step.endswith("-row"):  # the fused one-token step, whatever the start-up timing chose
        model.use_pieces(model.pieces, model.kernels, make_row_pieces(model.config))
    elif step != "plain":
        model.use_pieces(model.pieces, model.kernels)  # the general step at every size
    return runner


def decode_plan(b: int, position: int, seed: int) -> StepPlan:
    g = np.random.default_rng(seed)
    return StepPlan(prompt_tokens=[], positions=np.full(b, position), slots=np.arange(b), num_decode=b,
                    sample_rows=np.arange(b), sample_slots=np.arange(b),
                    decode_tokens=g.integers(3, 500, b).astype(np.int64))


def hidden_for(runner: ModelRunner, plan: StepPlan, rows: int) -> torch.Tensor:
    return runner.forward_eager(runner.prepare(plan, rows), rows).clone()


@pytest.fixture(scope="module")
def cache_root():
    with tempfile.TemporaryDirectory(prefix="gk-compile-") as tmp:
        yield tmp


@torch.inference_mode()
def test_compiled_step_equals_uncompiled_at_every_size_with_one_compilation_per_piece(tmp_path):
    """A fresh cache compiles each piece once (ahead, and saves it); the next start loads the saved
    pieces and compiles nothing. Both equal the uncompiled step at every size, with no recompile."""
    plain = make_runner("plain", str(tmp_path))
    for start, compilations in (("compiled ahead", 3), ("loaded", 0)):
        torch.compiler.set_stance("default")
        before = compile_counters()
        compiled = make_runner("compiled", str(tmp_path))  # the same seed: the same weights
        torch.compiler.set_stance("fail_on_recompile")  # any recompile below raises
        for b in SIZES:
            plan = decode_plan(b, 5 + b, seed=b)
            assert rel(hidden_for(compiled, plan, b), hidden_for(plain, plan, b)) < 2e-2, (start, b)
        assert compile_counters()["graphs"] - before["graphs"] == compilations, start  # first, middle, last
    assert sorted(p.name.split("-")[0] for p in tmp_path.rglob("precompiled/*.bin")) == ["first", "last", "middle"]


@torch.inference_mode()
@pytest.mark.parametrize("step", ["compiled", "fused", "compiled-row"])
def test_graph_replay_equals_eager_with_the_optimized_step(cache_root, step):
    runner = make_runner(step, cache_root)
    keys = [(FULL, s) for s in reversed(SIZES)] + [(PIECEWISE, s) for s in reversed(SIZES)]
    graphs = GraphSet(runner)
    CaptureJob(graphs, keys, tolerance=2e-2).run_all()
    assert not graphs.skipped, graphs.skipped
    for mode, size in keys:
        plan = decode_plan(size, 9, seed=size)
        expected = hidden_for(runner, plan, size)
        got = graphs.replay(mode, size, runner.prepare(plan, size)).clone()
        assert torch.equal(got, expected), (mode, size)  # the same kernels, recorded: bit for bit


@torch.inference_mode()
@pytest.mark.parametrize("scheme", ["fp8", "fp8-tensor"])
def test_fp8_step_equals_the_step_on_its_dequantized_weights(cache_root, scheme):
    """The fp8 step computes what its own weights mean (quantization error aside): the same model
    in float32 with each fp8 weight dequantized gives the same logits within bf16 rounding."""
    fp8 = make_runner("compiled", cache_root, quantization=scheme)
    reference = make_runner("plain", cache_root, dtype="float32")
    for mine, theirs in zip(fp8.model.layers, reference.model.layers, strict=True):
        for name in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2"):
            q, r = mine.get_submodule(name), theirs.get_submodule(name)
            assert q.weight.dtype == torch.float8_e4m3fn
            scale = q.scale[:, None] if q.scale.numel() > 1 else q.scale
            r.weight.copy_((q.weight.float() * scale).to(r.weight.dtype))
    for b in (1, 4, 16, 33):
        plan = decode_plan(b, 3, seed=b)
        expected = reference.model.logits(hidden_for(reference, plan, b))
        got = fp8.model.logits(hidden_for(fp8, plan, b))
        error = rel(got, expected)
        print(f"{scheme} batch {b} vs dequantized bf16: relative error {error:.4f}")
        assert error < 3e-2, (b, error)


# --- against transformers ------------------------------------------------------------------------


def hf_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
    with torch.inference_mode():
        return hf(tokens[None]).logits[0].float()


@pytest.mark.parametrize("step,quantization,tol", [("plain", "none", 2e-2), ("fused", "none", 2e-2),
                                                   ("compiled", "none", 2e-2), ("compiled", "fp8", 0.12)])
def test_worker_step_matches_transformers_on_the_same_weights(cache_root, tmp_path, step, quantization, tol):
    """A whole prompt through our step (prefill through the varlen kernel) against HF's forward."""
    from graphkeeper.worker.plan import PrefillChunk

    with torch.inference_mode():
        runner = make_runner(step, cache_root, quantization="none")
        save_hf_directory(runner.model, tmp_path)
        if quantization != "none":
            runner = make_runner(step, cache_root, quantization=quantization)
        tokens = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(7))
        n = len(tokens)
        plan = StepPlan(prompt_tokens=tokens.tolist(), positions=np.arange(n), slots=np.zeros(n, dtype=np.int64),
                        num_decode=0, prefill=[PrefillChunk(0, n, 0, 0)], sample_rows=np.arange(n),
                        sample_slots=np.zeros(n, dtype=np.int64))
        ours = runner.model.logits(hidden_for(runner, plan, n))
    theirs = hf_logits(tmp_path, tokens.cuda())
    error = rel(ours, theirs)
    print(f"{step} {quantization} vs transformers: relative error {error:.4f}")
    assert error < tol, error
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= (0.9 if quantization == "none" else 0.6), agree


@pytest.mark.parametrize("step", ["fused-row", "compiled-row"])
def test_one_token_row_step_matches_transformers_on_the_same_weights(cache_root, tmp_path, step):
    """A prompt prefilled by the general step, then one decode token through the row kernels,
    against HF's forward over the whole sequence."""
    from graphkeeper.worker.plan import PrefillChunk

    with torch.inference_mode():
        runner = make_runner(step, cache_root)
        save_hf_directory(runner.model, tmp_path)
        tokens = torch.randint(3, 500, (25,), generator=torch.Generator().manual_seed(11))
        n = len(tokens) - 1
        prefill = StepPlan(prompt_tokens=tokens[:n].tolist(), positions=np.arange(n),
                           slots=np.zeros(n, dtype=np.int64), num_decode=0, prefill=[PrefillChunk(0, n, 0, 0)],
                           sample_rows=np.arange(n), sample_slots=np.zeros(n, dtype=np.int64))
        hidden_for(runner, prefill, n)
        decode = StepPlan(prompt_tokens=[], positions=np.array([n]), slots=np.zeros(1, dtype=np.int64),
                          num_decode=1, sample_rows=np.arange(1), sample_slots=np.zeros(1, dtype=np.int64),
                          decode_tokens=tokens[n:].numpy().astype(np.int64))
        ours = runner.model.logits(hidden_for(runner, decode, 1))[0]
    theirs = hf_logits(tmp_path, tokens.cuda())[-1]
    error = rel(ours, theirs)
    print(f"{step} one token vs transformers: relative error {error:.4f}")
    assert error < 2e-2, error
    assert ours.argmax().item() == theirs.argmax().item()


# --- the engine ----------------------------------------------------------------------------------


def test_engine_reports_preset_compilation_and_a_cache_hit_on_the_second_start(cache_root):
    root = str(Path(cache_root) / "engine")
    reports, tunings, starts = [], [], []
    for _ in range(2):
        engine = Engine(EngineSettings(model="random:tiny@5", device="cuda", max_num_seqs=8, max_seq_len=128,
                                       max_num_batched_tokens=64, compile_cache_dir=root))
        engine.start()
        assert engine.ready.wait(600) and engine.failed is None, engine.failed
        done = []
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], stopping=pb.StoppingCriteria(max_new_tokens=8,
                                                                                          ignore_eos=True))
        engine.submit(req, lambda tokens, end, done=done: done.append(end) if end is not None else None)
        for _ in range(600):
            if done:
                break
            time.sleep(0.01)
        status = engine.status()
        engine.drain_and_stop(10)
        assert done and engine.failed is None
        reports.append(status.compile)
        tunings.append(engine.slot.compile_report.tuning.cache)
        starts.append(status.startup)
        assert status.compile.enabled and status.compile.optimization_level == 2
        assert status.compile.compiled_graphs == 3
        assert status.compile.kernels.startswith("inductor")
        assert status.graph_steps > 0
    assert reports[0].cache == "miss" and reports[1].cache == "hit", reports
    assert reports[0].cache_key == reports[1].cache_key
    assert tunings == ["miss", "hit"]  # the second start read the kernel tuning back
    # The start says so too, stage by stage (an engine built alone counts from its own construction).
    assert [(s.compile_cache, s.tuning_cache, s.caches) for s in starts] == [("miss", "miss", "cold"),
                                                                           ("hit", "hit", "warm")]
    for start in starts:
        seconds = {s.stage: s.seconds for s in start.stages}
        assert list(seconds)[:2] == ["engine_setup", "device_context"]
        assert seconds["compile"] > 0 and seconds["capture_record"] > 0
        assert sum(seconds.values()) == pytest.approx(start.ready_seconds)
    record = json.loads((Path(root) / reports[0].cache_key / "key.json").read_text())
    assert record["key"] == reports[0].cache_key and record["facts"]["versions"]["driver"] != "unknown"
