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


def test_usable_cpus_never_exceed_torch_s_threads():
    import torch

    assert 1 <= compile_ahead.usable_cpus() <= max(1, torch.get_num_threads())


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
