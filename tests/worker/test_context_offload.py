"""The checkpoint helper's plumbing (engine/context_offload.py) without a GPU: the helper runs as a
real process by its file path with only the standard library, answers one JSON line, says clearly
why it cannot checkpoint where there is no driver, and leaves the process it was pointed at
running; the engine side reads every answer, including none. The checkpoint itself (memory given
back, the same graphs replayed after the restore) is tests/gpu/test_sleep_cuda.py's."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from graphkeeper.worker.engine import context_offload
from graphkeeper.worker.engine.context_offload import HelperResult, call_helper, nvml_uuid, parse_result

HELPER = Path(context_offload.__file__)
NO_DRIVER = not Path("/dev/nvidiactl").exists()


def test_the_helper_imports_only_the_standard_library():
    """It runs by path under ``python -I``: no torch to import (seconds), no package on the path."""
    tree = ast.parse(HELPER.read_text())
    imported = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in tree.body
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_a_process_the_helper_cannot_checkpoint_is_left_running_and_the_answer_says_why():
    """A process with no CUDA state, on any machine: without a driver (this CI's machine) the
    helper refuses, says it found none, and that it left the process as it was; with one, a
    refusal names the driver's call. Either way the process runs on."""
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for op in ("offload", "restore"):
            result = call_helper(op, "GPU-00000000-0000-0000-0000-000000000000", pid=target.pid)
            if NO_DRIVER:
                assert not result.ok and result.left_running and "libcuda.so.1" in result.error, (op, result)
            else:
                assert result.ok or "cuCheckpointProcess" in result.error, (op, result)
            assert target.poll() is None  # the process it was pointed at was not touched
    finally:
        target.kill()
        target.wait()


def test_a_bad_command_line_is_refused_with_its_usage_and_exit_2():
    done = subprocess.run([sys.executable, "-I", str(HELPER), "sleep", "12x", "GPU-1"], capture_output=True,
                          text=True, timeout=60, check=False)
    out = json.loads(done.stdout)
    assert done.returncode == 2 and not out["ok"] and "offload|restore" in out["error"]


def test_the_engine_side_refuses_an_unknown_op():
    with pytest.raises(ValueError, match="op must be one of"):
        call_helper("checkpoint", "GPU-1")


def test_a_helper_answer_is_read_from_its_last_line():
    ok = parse_result('noise\n{"ok": true, "moved_bytes": 2147483648, "seconds": 0.4, "found": null}\n', "", 0)
    assert ok == HelperResult(True, "", 2 << 30, 0.4, None) and not ok.left_running
    no_nvml = parse_result('{"ok": true, "moved_bytes": null, "seconds": 0.1}', "", 0)
    assert no_nvml.ok and no_nvml.moved_bytes is None
    refused = parse_result('{"ok": false, "error": "cuCheckpointProcessLock failed: CUDA_ERROR_TIMEOUT (909)", '
                           '"state": "running"}', "", 1)
    assert not refused.ok and refused.left_running and "CUDA_ERROR_TIMEOUT" in refused.error


def test_a_helper_without_an_answer_leaves_the_state_unknown():
    """A helper that died says nothing of where it left the process: only a restore can settle it."""
    died = parse_result("", "Traceback (most recent call last):\nSegmentation fault\n", -11)
    assert not died.ok and died.state is None and not died.left_running
    assert "exited -11" in died.error and "Segmentation fault" in died.error
    garbled = parse_result("{not json", "", 1)
    assert not garbled.ok and garbled.state is None and "no output" in garbled.error
    locked = parse_result('{"ok": false, "error": "cuCheckpointProcessUnlock failed", "state": "locked"}', "", 1)
    assert not locked.left_running


def test_a_gpu_uuid_is_spelt_as_nvml_spells_it():
    assert nvml_uuid("5d1f2a3c-0000-1111-2222-333344445555") == "GPU-5d1f2a3c-0000-1111-2222-333344445555"
    assert nvml_uuid("GPU-5d1f2a3c-0000-1111-2222-333344445555") == "GPU-5d1f2a3c-0000-1111-2222-333344445555"
    assert nvml_uuid("MIG-5d1f2a3c-0000-1111-2222-333344445555").startswith("MIG-")

