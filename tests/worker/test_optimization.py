"""The -O presets, explicit overrides and the compile cache's key: pure decisions, checked
without a GPU. The compiled step itself is checked on the GPU (tests/gpu/test_step_cuda.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.spawn import compiles
from graphkeeper.worker.engine.startup import process_age
from graphkeeper.worker.kernels import linear_kernel, row_kernel
from graphkeeper.worker.kernels.decode_kernel import decode_splits
from graphkeeper.worker.model import tuning
from graphkeeper.worker.model.cache_key import library_versions, source_digest
from graphkeeper.worker.model.config import PRESETS
from graphkeeper.worker.model.llama import row_pieces_fit
from graphkeeper.worker.model.presets import resolve
from graphkeeper.worker.model.quantization import quantize, quantize_model
from graphkeeper.worker.model.step import cache_key, compile_timers, default_stance, step_modules, timer_summary


def test_presets_set_compile_and_the_default_graph_mode():
    def preset(level: int) -> tuple[bool, int]:
        o = resolve(level, None, "cuda")
        return o.compile, o.default_graph_mode

    assert preset(0) == (False, pb.GRAPH_MODE_NONE)
    assert preset(1) == (False, pb.GRAPH_MODE_FULL_AND_PIECEWISE)
    assert preset(2) == (True, pb.GRAPH_MODE_FULL_AND_PIECEWISE)


def test_the_flags_say_before_any_check_whether_the_worker_compiles():
    """What the engine core is told at its spawn (it imports torch's compiler while it waits for its
    settings when the flags compile): the preset's decision, on the device as ``--device`` spells it."""
    assert compiles(2, None, "cuda") and compiles(2, None, "cuda:1") and compiles(1, True, "cuda")
    assert not compiles(2, None, "cpu") and not compiles(1, None, "cuda") and not compiles(2, False, "cuda")
    assert not compiles(0, None, "cuda") and not compiles(7, None, "cuda")  # a level the checks refuse


def test_explicit_flags_override_the_preset_and_say_so():
    assert resolve(1, True, "cuda").compile and resolve(1, True, "cuda").reason == "--compile"
    assert not resolve(2, False, "cuda").compile and resolve(2, False, "cuda").reason == "--no-compile"
    off = resolve(2, None, "cpu")
    assert not off.compile and "only on CUDA" in off.reason
    with pytest.raises(ValueError, match="optimization level 3"):
        resolve(3, None, "cuda")


def _key(**changes) -> str:
    args = {"config": PRESETS["tiny"], "dtype": torch.bfloat16, "quantization": "none", "kernels": "inductor",
            "capability": "9.0", "versions": library_versions(), "source": source_digest(step_modules())}
    args.update(changes)
    return cache_key(**args)


def test_the_cache_key_changes_with_everything_that_changes_generated_code():
    base = _key()
    assert base == _key()
    changed = [
        _key(config=dataclasses.replace(PRESETS["tiny"], n_layers=3)), _key(dtype=torch.float16),
        _key(quantization="fp8"), _key(kernels="torch"), _key(capability="8.0"),
        _key(versions={**library_versions(), "torch": "0.0"}), _key(source="other"),
        _key(versions={**library_versions(), "driver": "535.0.0"}), _key(device_name="NVIDIA H100 80GB HBM3"),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_float32_never_takes_batch_dependent_paths():
    w = torch.zeros(64, 128, dtype=torch.float32)
    assert linear_kernel.choose(1, w) is None  # CPU, and float32 anyway
    assert decode_splits(1, 8, 1024, torch.float32) == (1, 1024)
    splits, keys = decode_splits(1, 8, 1040, torch.bfloat16)
    assert splits > 1 and splits * keys >= 1040 and keys % 64 == 0
    assert decode_splits(64, 8, 1040, torch.bfloat16) == (1, 1040)  # enough programs already


def test_fp8_quantization_keeps_each_channels_scale():
    w = torch.randn(32, 64) * torch.logspace(-3, 1, 32)[:, None]
    q, scale = quantize(w, per_channel=True)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (32,)
    restored = q.float() * scale[:, None]
    assert ((restored - w).norm(dim=1) / w.norm(dim=1)).max() < 0.05  # every row, small or large
    assert q.float().abs().amax(dim=1).allclose(torch.full((32,), 448.0))


def test_quantize_model_leaves_embedding_and_head_alone():
    from graphkeeper.worker.model.loader import load_model

    loaded = load_model("random:tiny", device="cpu", dtype="bfloat16", max_positions=64, quantization="fp8")
    layer = loaded.model.layers[0]
    assert layer.attention.wqkv.weight.dtype == torch.float8_e4m3fn and layer.attention.wqkv.scale is not None
    assert loaded.model.output.weight.dtype == torch.bfloat16
    assert quantize_model(loaded.model, "none") == 0
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(loaded.model, "int3")


def test_a_worker_reports_its_preset_and_why_it_did_not_compile(fresh_workers):
    worker = fresh_workers("-O", "0")
    status = worker.status()
    assert status.compile.optimization_level == 0 and not status.compile.enabled
    assert status.compile.cache == "off" and status.compile.kernels == "torch"
    assert status.requested_mode == pb.GRAPH_MODE_NONE  # -O0: no graphs unless a policy says so
    info = worker.metrics()
    assert any(name == "graphkeeper_compile_info" and ("level", "0") in labels for name, labels in info)


def test_o2_on_a_cpu_worker_serves_uncompiled_and_says_so(fresh_workers):
    worker = fresh_workers("--quantization", "fp8")
    c = worker.status().compile
    assert c.optimization_level == 2 and not c.enabled and "only on CUDA" in c.reason
    assert c.quantization == "fp8"


# --- the one-token step and kernel tuning ---------------------------------------------------------


def test_row_pieces_serve_bf16_and_fp16_models_whose_reductions_fit_one_tile():
    llama = PRESETS["llama-8b"]
    assert row_pieces_fit(llama, torch.bfloat16) and row_pieces_fit(llama, torch.float16)
    assert not row_pieces_fit(llama, torch.float32)  # float32 must not depend on the batch's size
    wide = dataclasses.replace(llama, intermediate_size=28672)  # a 70B-style MLP: longer than one tile
    assert not row_pieces_fit(wide, torch.bfloat16)


def test_row_tiles_fit_their_register_budget_and_rope_halves():
    assert row_kernel.fits(row_kernel.RowTile(16, 8), row_kernel.PLAIN, 2048)
    assert not row_kernel.fits(row_kernel.RowTile(16, 8), row_kernel.GLU, 2048)  # two bands of 16 x 2048
    assert not row_kernel.fits(row_kernel.RowTile(4, 8), row_kernel.PLAIN, 14336)  # 4 x 16384 elements
    assert not row_kernel.fits(row_kernel.RowTile(8, 4), row_kernel.ROPE, 2048, half=4)
    assert row_kernel.fits(row_kernel.RowTile(4, 4), row_kernel.ROPE, 2048, half=32)
    assert not row_kernel.fits(row_kernel.RowTile(16, 4), row_kernel.PLAIN, 2048)  # 256 elements a thread


def test_tuning_decisions_survive_the_cache_round_trip():
    linear = {(3072, 2048, "torch.bfloat16", 1): linear_kernel.Tile(8, 1024, 8, 2),
              (3072, 2048, "torch.bfloat16", 4): None}
    rows = {(row_kernel.ROPE, 3072, 2048, "torch.bfloat16"): row_kernel.RowTile(2, 8)}
    data = json.loads(json.dumps(tuning.encode(linear, rows)))
    assert tuning.decode(data) == (linear, rows)
    for broken in ({}, {"linear": [[1, 2]], "row": []}, {"linear": [], "row": [["x", 1, 2, "d", 1, 1]]}):
        with pytest.raises(ValueError, match="malformed tuning cache"):
            tuning.decode(broken)


def test_the_tuning_key_changes_with_the_gpu_the_libraries_the_source_pdl_and_the_shapes():
    args = {"device_name": "NVIDIA H200", "capability": "9.0", "versions": library_versions(),
            "source": tuning.kernel_source_digest(), "pdl_on": True, "shapes": [("wo", 2048, 2048, "bf16")]}
    base = tuning.tuning_key(**args)
    assert tuning.tuning_key(**args) == base
    for name, value in (("device_name", "NVIDIA H100"), ("capability", "8.0"), ("versions", {"torch": "x"}),
                        ("source", "other"), ("pdl_on", False), ("shapes", [("wo", 4096, 4096, "bf16")])):
        assert tuning.tuning_key(**{**args, name: value}) != base, name


def test_this_process_has_an_age():
    assert 0 < process_age() < 3600


def test_a_cache_key_hashes_module_contents_not_where_the_module_lives(tmp_path):
    """Moving a step module to another folder keeps the compile and tuning keys (a warm cache
    stays warm); changing its code changes them."""
    import importlib.util

    from graphkeeper.worker.kernels import pdl

    def load_copy(folder: str, text: str):
        path = tmp_path / folder / "pdl.py"
        path.parent.mkdir()
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"moved_{folder}", path)
        module = importlib.util.module_from_spec(spec)
        module.__file__ = str(path)
        return module

    source = Path(pdl.__file__).read_text()
    assert source_digest([load_copy("elsewhere", source)]) == source_digest([pdl])
    assert source_digest([load_copy("edited", source + "\n# changed\n")]) != source_digest([pdl])


def test_timer_summary_ranks_what_a_compile_spent_since_the_first_reading():
    before = {"trace": 1.0, "lowering": 0.5}
    after = {"trace": 1.5, "lowering": 3.5, "codegen": 0.2, "guards": 0.01}
    assert timer_summary(before, after) == "lowering 3.0 s, trace 0.5 s, codegen 0.2 s"
    assert timer_summary(before, after, top=1) == "lowering 3.0 s"
    assert timer_summary(after, after) == "none over 0.05 s"


def test_compile_timers_read_what_a_real_dynamo_compile_counted():
    """A real trace (Dynamo and AOT autograd on the CPU, no code generated) moves the timers the
    worker's compile line reports."""
    before = compile_timers()
    compiled = torch.compile(lambda x: torch.relu(x) * 3 - 1, backend="aot_eager", fullgraph=True)
    with default_stance():  # whatever stance an earlier test's engine left
        assert torch.equal(compiled(torch.arange(-2.0, 3.0)), torch.relu(torch.arange(-2.0, 3.0)) * 3 - 1)
    after = compile_timers()
    assert after["_compile.compile_inner"] > before.get("_compile.compile_inner", 0.0)
    assert "_compile.compile_inner" in timer_summary(before, after, top=50)  # ~0.3 s on a 2-core CPU
