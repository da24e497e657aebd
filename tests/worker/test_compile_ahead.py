"""Compiling kernels ahead, without a GPU: the thread count, and which launch a call makes inside
and outside ``compiling`` (a dry one compiles only). The compilation itself, on Triton's
asynchronous mode and real kernels, is tests/gpu/test_compile_ahead_cuda.py."""

from __future__ import annotations

import pytest

from graphkeeper.worker.kernels import compile_ahead
from graphkeeper.worker.kernels.launch_memo import LaunchMemo


class Recorder:
    """Stands in for a Triton kernel: records launches (``kernel[grid](...)``) and dry launches."""

    def __init__(self) -> None:
        self.launched: list[tuple] = []
        self.warmed: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.warmed.append((grid, args, kwargs))


@pytest.mark.parametrize(("cpus", "threads"), [(0, 1), (1, 1), (2, 2), (8, 8), (64, compile_ahead.MAX_THREADS)])
def test_compiler_threads_follow_the_usable_cpus_up_to_the_limit(cpus, threads):
    assert compile_ahead.thread_count(cpus) == threads


def test_usable_cpus_follow_torch_s_thread_count(monkeypatch):
    """The engine core sets torch's thread count from the CPU quota and affinity; the compiler's
    threads follow it (at least one)."""
    import torch

    for threads, usable in ((3, 3), (1, 1), (0, 1)):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        assert compile_ahead.usable_cpus() == usable


def test_a_launch_inside_the_block_is_dry_and_one_outside_runs():
    kernel = Recorder()
    compile_ahead.launcher(kernel, (4,))(1, 2, BLOCK=16)
    with compile_ahead.compiling("test", threads=1):
        assert compile_ahead.dry()
        compile_ahead.launcher(kernel, (8,))(3, BLOCK=32)
    assert not compile_ahead.dry()
    compile_ahead.launcher(kernel, (2,))(5)
    assert kernel.launched == [((4,), (1, 2), {"BLOCK": 16}), ((2,), (5,), {})]
    assert kernel.warmed == [((8,), (3,), {"BLOCK": 32})]


def test_the_launch_memo_launches_dry_inside_the_block():
    kernel = Recorder()
    memo = LaunchMemo(kernel)  # not a JITFunction: every launch goes through the kernel
    with compile_ahead.compiling("test", threads=1):
        memo.launch((1,), 7, X=1)
    memo.launch((1,), 7, X=1)
    assert kernel.warmed == [((1,), (7,), {"X": 1})]
    assert kernel.launched == [((1,), (7,), {"X": 1})]


def test_the_block_ends_dry_mode_when_its_body_raises():
    with pytest.raises(RuntimeError), compile_ahead.compiling("test", threads=1):
        raise RuntimeError("a candidate failed")
    assert not compile_ahead.dry()


def test_decode_variants_are_one_row_count_per_split_count():
    import torch

    from graphkeeper.worker.kernels import decode_kernel as dk

    rows = list(range(1, 65))
    chosen = dk.variant_rows(rows, 8, 1024, torch.bfloat16)
    splits = {n: dk.decode_splits(n, 8, 1024, torch.bfloat16) for n in rows}
    assert len({splits[n] for n in chosen}) == len(chosen) == len(set(splits.values())) > 1
    assert all(n in rows for n in chosen)
    assert dk.variant_rows(rows, 8, 1024, torch.float32) == [1]  # float32 never splits: one variant


def test_decode_attention_launches_dry_inside_the_block(monkeypatch):
    """Its kernels go through ``compile_ahead.launcher``: compiled, not run, inside the block."""
    import torch

    from graphkeeper.worker.kernels import decode_kernel as dk

    decode, combine = Recorder(), Recorder()
    monkeypatch.setattr(dk, "_decode_kernel", decode)
    monkeypatch.setattr(dk, "_combine_kernel", combine)
    k = torch.zeros(8, 16, 2, 64, dtype=torch.float16)
    q, table = torch.zeros(2, 8, 64, dtype=torch.float16), torch.zeros(2, 16, dtype=torch.long)  # 256 keys
    slots, lengths = torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with compile_ahead.compiling("test", threads=1):
        dk.decode_attention(q, k, k, slots, lengths, table)
    splits, _ = dk.decode_splits(2, 2, 256, torch.float16)
    assert splits > 1 and [w[0] for w in decode.warmed] == [(2, 2, splits)] and len(combine.warmed) == 1
    assert not decode.launched and not combine.launched


def test_launches_started_ahead_are_dry_and_the_caller_s_launches_after_run(caplog):
    """``started`` makes its launches now, dry, and returns: the caller's launches meanwhile run
    as before, and the caller may open a ``compiling`` block of its own (kernel tuning's); the
    wait closes the compile mode and logs how long it waited."""
    pytest.importorskip("triton.runtime._async_compile")  # Triton's compile mode (3.5+), as on a GPU
    kernel = Recorder()
    wait = compile_ahead.started("test", lambda: compile_ahead.launcher(kernel, (2,))("ahead"), threads=2)
    assert kernel.warmed == [((2,), ("ahead",), {})] and not compile_ahead.dry()
    compile_ahead.launcher(kernel, (1,))("the caller's")
    with compile_ahead.compiling("another", threads=2):
        compile_ahead.launcher(kernel, (3,))("another block's")
    with caplog.at_level("INFO"):
        wait()
    assert kernel.launched == [((1,), ("the caller's",), {})]
    assert kernel.warmed[1:] == [((3,), ("another block's",), {})]
    assert "test kernels ahead on 2 threads" in caplog.text and "waited for" in caplog.text


def test_a_failure_in_launches_started_ahead_is_logged_not_raised(caplog):
    def launches() -> None:
        raise RuntimeError("no compiler here")

    wait = compile_ahead.started("test", launches, threads=2)
    assert not compile_ahead.dry()
    wait()
    assert "compiling the test kernels ahead failed" in caplog.text and "no compiler here" in caplog.text


def test_a_start_compiles_its_launches_ahead_after_the_pdl_probe_so_they_are_the_warm_up_s(monkeypatch):
    """A launch passes PDL's switch to its kernel: launches compiled ahead before the probe turned
    PDL on compiled kernels the warm-up never launched (measured on an H100: 11 of 12 compiled
    again in the warm-up). The launches made ahead see the switch as the warm-up will."""
    from types import SimpleNamespace

    from graphkeeper.worker.kernels import pdl
    from graphkeeper.worker.model import step

    monkeypatch.setattr(pdl, "_enabled", False)
    monkeypatch.setattr(pdl, "probe", lambda device: pdl.set_enabled(True))  # a Hopper's probe: PDL on
    order: list[str] = []

    def started(what, launches, threads=None):
        order.append("started")
        launches()
        return lambda: order.append("waited")

    monkeypatch.setattr(step.compile_ahead, "started", started)
    monkeypatch.setattr(step.tuning, "tune_model", lambda model, root, rows: order.append("tuned"))
    monkeypatch.setattr(step.tuning, "adopt_first_ranks", lambda tp: None)
    seen: list[dict] = []
    model = SimpleNamespace(tok_embeddings=SimpleNamespace(weight=SimpleNamespace(device="cuda:0")), tp=None)
    wait = step._tune_kernels(model, step.CompileReport(), "", False, lambda: seen.append(pdl.launch_options()))
    wait()
    assert seen == [pdl.launch_options()] and seen[0]["USE_PDL"]
    assert order == ["started", "tuned", "waited"]  # compiling while the kernels are tuned
