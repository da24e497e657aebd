"""What a start imports: the API process never loads torch (only the engine core needs it), and the
engine core loads nothing for a path it does not take (Dynamo and sympy without compilation; GGUF,
structured output, tokenizers for a random model). Torch in the API process and Dynamo with sympy
in a CPU start each cost about a second before they were removed; the others were lazy already
and stay so. These tests fail if one comes back."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
from worker_harness import GRAPHKEEPER, children, collect, make_request, mapped_libraries, start_worker

from graphkeeper.worker.engine.cuda_probe import parse_device, torch_cuda_version

#: Modules only the engine core needs: torch and the Triton kernels (about 1.2 s of imports).
DEVICE_SIDE = ("torch", "triton")
#: Modules a plain start (no compilation, no GGUF file, no tokenizer, no constraint) never needs.
PATHS_NOT_TAKEN = ("torch._dynamo", "torch._inductor", "sympy", "torch.fx.experimental.symbolic_shapes", "gguf",
                   "llguidance", "transformers", "tokenizers", "jinja2")


def imported_after(code: str) -> set[str]:
    """The modules of interest a fresh interpreter holds after running ``code``."""
    wanted = DEVICE_SIDE + PATHS_NOT_TAKEN
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {wanted!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_api_process_checks_its_flags_without_importing_torch():
    loaded = imported_after(
        "from graphkeeper.cli import build_parser\n"
        "from graphkeeper.worker import main\n"
        "args = build_parser().parse_args(['worker', '--model', 'random:tiny', '--device', 'cpu'])\n"
        "settings = main.settings_from_args(args)\n"
        "client = main.make_engine(args, settings)\n"
        "assert main.device_error('cuda:1', False, 0) and main.device_error('cpu', False, 0) is None")
    assert loaded == set(), f"the API process imported {sorted(loaded)}"


def test_an_unusual_device_string_is_still_judged_by_torch():
    """Only ``cpu`` and ``cuda[:N]`` are parsed without torch; anything else reads as torch reads it."""
    from graphkeeper.worker.main import device_error, device_kind

    assert device_kind("cuda:3") == ("cuda", 3) and device_kind("cpu") == ("cpu", None)
    assert device_kind("mps") == ("mps", None)  # torch's parse
    assert "only cpu and cuda" in device_error("mps", True, 1)
    assert "is not a device" in device_error("cuda:x", True, 1)
    assert "is not a device" in device_error("cuda:-1", True, 1)


def test_the_engine_core_builds_a_cpu_engine_without_paths_it_does_not_take():
    loaded = imported_after(
        "import torch\n"
        "from graphkeeper.worker.engine import process\n"
        "from graphkeeper.worker.engine.core import Engine\n"
        "from graphkeeper.worker.settings import EngineSettings\n"
        "engine = Engine(EngineSettings(model='random:tiny', device='cpu', max_num_seqs=4, max_seq_len=128,\n"
        "                               max_num_batched_tokens=64))\n"
        "with torch.inference_mode():\n"
        "    engine._startup()\n"
        "assert engine.ready.is_set() and engine.failed is None")
    assert set(DEVICE_SIDE) <= loaded  # the probe sees the engine core's imports at all
    assert loaded.isdisjoint(PATHS_NOT_TAKEN), f"a CPU start imported {sorted(loaded & set(PATHS_NOT_TAKEN))}"


def test_a_serving_worker_holds_torch_in_the_engine_core_only(tmp_path):
    """A real worker, after READY and a request through each front end of the API process (gRPC,
    OpenAI HTTP, /metrics, GraphControl): torch's library is mapped into the engine core and not
    into the API process."""
    worker = start_worker(tmp_path)
    try:
        tokens, _ = collect(worker.inference.Generate(make_request([1, 2, 3], 4), timeout=60))
        assert len(tokens) == 4 and worker.status().startup.stages
        reply = httpx.post(worker.http_url + "/v1/completions", timeout=60,
                           json={"model": "random:tiny", "prompt": [1, 2, 3], "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, reply.text
        assert "graphkeeper_startup_stage_seconds" in worker.metrics_text()
        assert "libtorch" not in mapped_libraries(worker.proc.pid)
        assert any("libtorch" in mapped_libraries(child) for child in children(worker.proc.pid))
    finally:
        worker.stop()


def test_the_probe_reads_the_device_and_torch_builds_without_torch():
    assert parse_device("cuda:0") == ("cuda", 0) and parse_device("cuda") == ("cuda", None)
    assert parse_device("cpu") == ("cpu", None)
    assert parse_device("cuda:01") is None and parse_device("mps") is None and parse_device(" cuda") is None
    assert torch_cuda_version("from typing import Optional\ncuda: Optional[str] = '12.8'\n") == "12.8"
    assert torch_cuda_version("cuda = '13.0'\nhip = None\n") == "13.0"
    assert torch_cuda_version("cuda: Optional[str] = None\n") is None
    assert torch_cuda_version("__version__ = '2.5.1+cpu'\n") is None


def test_the_probe_counts_the_gpus_torch_counts():
    """On this machine's torch and driver: no GPU here, each GPU on a GPU machine; with none visible, 0."""
    code = ("import torch\nfrom graphkeeper.worker.engine.cuda_probe import cuda_device_count\n"
            "print(cuda_device_count(), torch.cuda.device_count())")
    for env in ({}, {"CUDA_VISIBLE_DEVICES": ""}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                             env={**os.environ, **env})
        probe, torch_count = out.stdout.split()
        assert probe == torch_count, env


def processes_with(mark: str) -> list[int]:
    """Live processes whose environment holds ``mark`` (a worker's children inherit it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def test_a_refused_flag_leaves_no_engine_core_behind(tmp_path):
    """The engine core is spawned before the flags are checked; a refusal still ends with one line
    on stderr and no process left over."""
    mark = f"GRAPHKEEPER_TEST_MARK={secrets.token_hex(8)}"
    name, value = mark.split("=")
    proc = subprocess.run([str(GRAPHKEEPER), "worker", "--model", "random:nope", "--port", "0", "--metrics-port", "0",
                           "--http-port", "0"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, name: value})
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "graphkeeper worker: --model unknown preset 'nope'; known: llama-1b, llama-8b, tiny"], proc.stderr
    assert processes_with(mark) == []
