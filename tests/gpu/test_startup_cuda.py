"""The worker process's boot checks on a GPU machine, without torch: the CUDA driver's count of the
GPUs is torch's, and a CUDA worker maps torch's library into its engine core only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))  # the worker tests' harness

from worker_harness import children, collect, make_request, mapped_libraries, start_worker  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]


def probe_and_torch(env: dict[str, str]) -> tuple[int, int]:
    code = ("from graphkeeper.worker.engine.cuda_probe import cuda_device_count\nimport torch\n"
            "print(cuda_device_count(), torch.cuda.device_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, **env})
    probe, counted = out.stdout.split()
    return int(probe), int(counted)


def test_the_probe_counts_the_gpus_torch_counts():
    probe, counted = probe_and_torch({})
    assert probe == counted == torch.cuda.device_count() >= 1
    assert probe_and_torch({"CUDA_VISIBLE_DEVICES": "0"}) == (1, 1)
    assert probe_and_torch({"CUDA_VISIBLE_DEVICES": ""}) == (0, 0)


def test_the_worker_checks_a_cuda_device_without_importing_torch():
    code = ("import sys\nfrom graphkeeper.cli import build_parser\nfrom graphkeeper.worker import main\n"
            "args = build_parser().parse_args(['worker', '--model', 'random:tiny', '--device', 'cuda:0'])\n"
            "assert main.settings_from_args(args).device == 'cuda:0'\n"
            "assert main.device_error(f'cuda:{main.cuda_device_count()}', True, main.cuda_device_count())\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_cuda_worker_holds_torch_in_the_engine_core_only(tmp_path):
    worker = start_worker(tmp_path, "--device", "cuda", "-O0")
    try:
        tokens, _ = collect(worker.inference.Generate(make_request([1, 2, 3], 4), timeout=120))
        assert len(tokens) == 4
        assert "libtorch" not in mapped_libraries(worker.proc.pid)
        assert any("libtorch_cuda" in mapped_libraries(child) for child in children(worker.proc.pid))
    finally:
        worker.stop()


def test_importing_the_compiler_ahead_initialises_no_cuda():
    """The engine core imports torch's compiler while it waits for its settings, before it has
    chosen its device (``model/compiler_import.py``): the import must leave CUDA uninitialised, or
    a worker on ``cuda:1`` would also hold a context on the first GPU."""
    code = ("import torch\nfrom graphkeeper.worker.model import compiler_import\n"
            "compiler_import.ahead()()\nimport sys\n"
            "print(all(m in sys.modules for m in compiler_import.MODULES), torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["True", "False"], out.stderr
