"""Kernels compiled ahead on several threads, on a real GPU: inside the block nothing runs and every
variant is compiled; after it the real launches find them compiled and compute the right result;
kernel tuning compiles its candidates this way and still decides every row bucket.
Run with ``pytest -m cuda`` on the GPU machine."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from graphkeeper.worker.kernels import compile_ahead, linear_kernel
from graphkeeper.worker.kernels.launch_memo import LaunchMemo
from graphkeeper.worker.kernels.triton_support import tl, triton

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]

if triton is not None:
    @triton.jit
    def _scale_kernel(x_ptr, out_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=ok) * FACTOR, mask=ok)


def _compiled(kernel) -> int:
    device = torch.cuda.current_device()
    return len(kernel.device_caches[device][0])


def test_variants_compile_ahead_on_threads_and_nothing_runs_until_after(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # nothing found on disk: each one compiles
    memo = LaunchMemo(_scale_kernel)
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    factors = range(2, 8)
    outs = {f: torch.zeros_like(x) for f in factors}
    before = _compiled(_scale_kernel)
    with compile_ahead.compiling("test", threads=4):
        for f, out in outs.items():
            memo.launch((triton.cdiv(1000, 128),), x, out, 1000, FACTOR=f, BLOCK=128)
    torch.cuda.synchronize()
    assert all(not out.any() for out in outs.values())  # dry: compiled, not run
    assert _compiled(_scale_kernel) == before + len(outs)
    for f, out in outs.items():
        memo.launch((triton.cdiv(1000, 128),), x, out, 1000, FACTOR=f, BLOCK=128)
    torch.cuda.synchronize()
    for f, out in outs.items():
        torch.testing.assert_close(out, x * f)
    assert _compiled(_scale_kernel) == before + len(outs)  # the real launches compiled nothing more


def test_tuning_compiles_its_candidates_ahead_and_decides_every_bucket(caplog):
    caplog.set_level(logging.INFO, logger=compile_ahead.__name__)
    weight = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)  # a reduction length of its own
    before = _compiled(linear_kernel._skinny_kernel)
    won = linear_kernel.tune(weight, None, torch.bfloat16)
    assert sorted(won) == list(linear_kernel.BUCKETS)
    for rows in linear_kernel.BUCKETS:
        assert (4096, 3072, str(weight.dtype), rows) in linear_kernel.choices()
    queued = [int(m.group(1)) for r in caplog.records
              if (m := re.match(r"compiled (\d+) skinny-product", r.getMessage()))]
    # Every variant the timing launched was one the dry launches had compiled: the timed launches
    # (real arguments, same specialization) compiled nothing more.
    assert len(queued) == 1 and queued[0] > 0
    assert _compiled(linear_kernel._skinny_kernel) - before == queued[0]
    for rows in (1, 4, 16):
        x = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16)
        tile = linear_kernel.choose(rows, weight)
        if tile is not None:
            torch.testing.assert_close(linear_kernel.skinny_linear(x, weight, None, tile),
                                       linear_kernel.reference(x, weight), rtol=2e-2, atol=2e-2)


def test_the_warm_up_compiles_every_decode_variant_ahead():
    """A runner's warm-up compiles the decode attention kernels its decode steps launch inside the
    compile-ahead block (one variant per split count); its real launches compile nothing more. The
    cache holds 1,008 keys a slot, a table no other test uses: the decode kernel's keys per split
    are variants of their own, so the block has something to compile (the combining kernel
    specializes on the split count alone, which other tests may have compiled already)."""
    from graphkeeper.worker.executor.runner import ModelRunner
    from graphkeeper.worker.kernels import decode_kernel
    from graphkeeper.worker.kernels.linear_kernel import warm_rows
    from graphkeeper.worker.model.kv_cache import KVCache
    from graphkeeper.worker.model.loader import load_model

    loaded = load_model("random:tiny", device="cuda", dtype="bfloat16", max_positions=1008)
    cache = KVCache(loaded.config, 16, 1008, device=loaded.device, dtype=loaded.dtype)
    runner = ModelRunner(loaded, cache, max_tokens=64)
    before = _compiled(decode_kernel._decode_kernel), _compiled(decode_kernel._combine_kernel)
    runner.compile_attention_ahead([16, *warm_rows(64)])
    ahead = _compiled(decode_kernel._decode_kernel), _compiled(decode_kernel._combine_kernel)
    assert ahead[0] > before[0]
    runner.warm_up(16)
    assert (_compiled(decode_kernel._decode_kernel), _compiled(decode_kernel._combine_kernel)) == ahead


def test_a_start_s_warm_up_finds_every_attention_kernel_compiled_ahead(tmp_path, caplog, monkeypatch):
    """Through ``prepare_step`` as a start runs it: the attention launches compiled ahead while the
    kernels are tuned are the ones the warm-up makes, so the warm-up's own compile-ahead block
    queues nothing (on an H100 it queued 11 of 12 again when the launches were made before the
    PDL probe, which turns PDL on, 2026-12-07). A table of 1,040 keys a slot, which no other test
    uses, so the start has decode variants of its own to compile; PDL starts off, as in a new
    worker process."""
    from graphkeeper.worker.executor.runner import ModelRunner
    from graphkeeper.worker.kernels import pdl
    from graphkeeper.worker.model.kv_cache import KVCache
    from graphkeeper.worker.model.loader import load_model
    from graphkeeper.worker.model.step import prepare_step

    caplog.set_level(logging.INFO, logger=compile_ahead.__name__)
    monkeypatch.setattr(pdl, "_enabled", False)
    loaded = load_model("random:tiny", device="cuda", dtype="bfloat16", max_positions=1040)
    cache = KVCache(loaded.config, 16, 1040, device=loaded.device, dtype=loaded.dtype)
    runner = ModelRunner(loaded, cache, max_tokens=64)
    prepare_step(runner.model, compile=False, cache_root=str(tmp_path), quantization="", level=1, reason="test",
                 warm_up=lambda: runner.warm_up(16), ahead=lambda: runner.launches_ahead(16))
    lines = [r.getMessage() for r in caplog.records]
    ahead = [int(m.group(1)) for line in lines if (m := re.match(r"compiled (\d+) warm-up kernels", line))]
    again = [int(m.group(1)) for line in lines if (m := re.match(r"compiled (\d+) attention kernels", line))]
    assert len(ahead) == 1 and ahead[0] > 0, lines
    assert again == [0], lines


def test_the_warm_up_s_sampling_kernels_compile_ahead_and_its_launches_compile_nothing_more(monkeypatch):
    """``launches_ahead`` made dry compiles the kernels the warm-up's sampling launches (argmax,
    grammar mask, penalties and counts, log probabilities), every variant of them: afterwards the
    warm-up's real sampling compiles none. Every kernel's variants are forgotten first (Triton's
    in-memory table and the launch memo; the disk cache may still hold them), so what the block
    compiles is this test's, whatever ran before it in the process."""
    from graphkeeper.worker.executor.runner import ModelRunner
    from graphkeeper.worker.kernels import argmax_kernel, logprob_kernel, mask_kernel, penalty_kernel
    from graphkeeper.worker.model.kv_cache import KVCache
    from graphkeeper.worker.model.loader import load_model

    memos = [argmax_kernel._chunks, argmax_kernel._rows, mask_kernel._mask, penalty_kernel._apply,
             penalty_kernel._count, logprob_kernel._chunks, logprob_kernel._rows]
    for memo in memos:
        monkeypatch.setattr(memo, "_compiled", {})
        memo.kernel.device_caches.clear()
    # Llama's vocabulary: the argmax and log-probability kernels take rows of 8,192 tokens or more
    # (random:tiny's 512 go to torch), and every kernel here must have something to compile.
    loaded = load_model("random:llama-1b", device="cuda", dtype="bfloat16", max_positions=256)
    cache = KVCache(loaded.config, 16, 256, device=loaded.device, dtype=loaded.dtype)
    runner = ModelRunner(loaded, cache, max_tokens=64)
    with compile_ahead.compiling("test", threads=4):
        runner.warm_up_sampling()
    ahead = [_compiled(memo.kernel) for memo in memos]
    assert all(ahead), ahead  # every sampling kernel has its variants compiled
    runner.warm_up_sampling()
    torch.cuda.synchronize()
    assert [_compiled(memo.kernel) for memo in memos] == ahead


@torch.inference_mode()
def test_a_start_without_a_tuning_cache_installs_the_shipped_table_and_times_nothing(tmp_path, monkeypatch):
    """A model's tuning, measured once and shipped as a table entry (``bench/ship_tuning.py``'s
    ``add``), is what a later start with an empty tuning cache installs: the same decisions for
    every projection and row bucket, its tiles compiled ahead, no candidate timed, and the start
    says ``shipped``. The start after it finds its own cache empty again (a shipped table is not
    copied into the node's cache)."""
    import json

    from graphkeeper.worker.kernels import row_kernel
    from graphkeeper.worker.model import shipped_tuning, tuning
    from graphkeeper.worker.model.loader import load_model

    model = load_model("random:llama-1b@3", device="cuda", dtype="bfloat16", max_positions=256).model
    measured = tuning.tune_model(model, str(tmp_path / "measured"), True)
    assert measured.cache in ("miss", "shipped")
    if measured.cache == "shipped":  # this GPU has a table already: measure anyway, without it
        monkeypatch.setattr(shipped_tuning, "TABLE_DIR", tmp_path / "none")
        measured = tuning.tune_model(model, str(tmp_path / "measured-again"), True)
        assert measured.cache == "miss"
    decided = linear_kernel.choices(), row_kernel.choices()
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "gpu.json").write_text(json.dumps(shipped_tuning.add({}, json.loads(Path(measured.path).read_text()))))
    monkeypatch.setattr(shipped_tuning, "TABLE_DIR", tables)
    linear_kernel._choices.clear()
    row_kernel._choices.clear()
    timed = len(linear_kernel.measurements), len(row_kernel.measurements)
    for root in ("fresh", "fresh-again"):
        report = tuning.tune_model(model, str(tmp_path / root), True)
        assert report.cache == "shipped"
        assert (linear_kernel.choices(), row_kernel.choices()) == decided
        assert (len(linear_kernel.measurements), len(row_kernel.measurements)) == timed
        assert not Path(report.path).exists()
