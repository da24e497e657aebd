"""Clean boot edges: every bad flag is one clear line on stderr and a non-zero exit,
never a traceback. The checks are pure functions (tested here directly); a few real
``graphkeeper worker`` processes prove the line is what an operator actually sees."""

from __future__ import annotations

import json
import os
import py_compile
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ports import free_port
from worker_harness import GRAPHKEEPER, INFERENCE_SERVICE

from graphkeeper.cli import build_parser
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.proto.policy import policy_to_json
from graphkeeper.worker.main import (
    boot_errors,
    control_token_error,
    device_error,
    drain_error,
    dtype_error,
    limit_errors,
    missing_bytecode,
    model_error,
    model_root_errors,
    port_error,
    read_policy_file,
    settings_from_args,
)


def worker_args(*flags: str):
    return build_parser().parse_args(["worker", *flags])


# --- pure checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(("limits", "needle"), [
    ((0, 512, 256, 256), "--max-num-seqs"),
    ((-3, 512, 256, 256), "--max-num-seqs"),
    ((16, 1, 256, 256), "--max-seq-len"),
    ((16, 512, 8, 256), "--max-num-batched-tokens"),
    ((16, 512, 256, 0), "--max-queue"),
])
def test_limit_errors(limits, needle):
    errors = limit_errors(*limits)
    assert len(errors) == 1 and errors[0].startswith(needle)


def test_limits_at_their_edges_pass():
    assert limit_errors(1, 2, 1, 1) == []
    assert limit_errors(16, 512, 16, 256) == []


def test_single_value_checks():
    assert port_error("port", -1) and port_error("control_port", 70000).startswith("--control-port")
    assert port_error("metrics_port", 0) is None and port_error("port", 65535) is None
    assert dtype_error("float8") and dtype_error("bfloat16") is None
    assert drain_error(-1.0) and drain_error(float("nan")) and drain_error(0.0) is None
    assert device_error("cuda", False, 0) == "--device cuda: CUDA is not available on this machine"
    assert "1 CUDA device" in device_error("cuda:1", True, 1)
    assert device_error("tpu", False, 0) and device_error("mps", False, 0)
    assert device_error("cpu", False, 0) is None and device_error("cuda:0", True, 1) is None


def test_model_errors(tmp_path):
    assert "unknown preset" in model_error("random:nope")
    assert "not an integer" in model_error("random:tiny@x")
    assert "not a directory" in model_error(str(tmp_path / "missing"))
    assert "config.json" in model_error(str(tmp_path))
    (tmp_path / "config.json").write_bytes(b"\xff\xfe not json")
    assert "not a readable JSON document" in model_error(str(tmp_path))
    (tmp_path / "config.json").write_text("[]")
    assert "not a JSON object" in model_error(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert "config.json" in model_error(str(tmp_path))
    assert model_error("random:tiny@7") is None


def test_control_token_and_model_root(tmp_path):
    assert control_token_error("") is None
    assert "not a file" in control_token_error(str(tmp_path))
    assert "not a file" in control_token_error(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    assert "empty" in control_token_error(str(empty))
    good = tmp_path / "token"
    good.write_text("s3cret\n")
    assert control_token_error(str(good)) is None
    good.write_bytes(b"\xff\xfe")
    assert "not UTF-8" in control_token_error(str(good))
    assert model_root_errors([str(tmp_path), str(good)]) == [f"--model-root {good}: not a directory"]


def test_policy_file(tmp_path):
    assert read_policy_file(str(tmp_path / "missing.json"), 64) == (None, None)
    assert "not a regular file" in read_policy_file(str(tmp_path), 64)[1]
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"policy_uid": "\xff"}')
    assert "not UTF-8" in read_policy_file(str(bad), 64)[1]
    bad.write_text("mode: Full\n")
    assert "not a GraphPolicy JSON document" in read_policy_file(str(bad), 64)[1]
    good = tmp_path / "good.json"
    good.write_text(policy_to_json(pb.GraphPolicy(policy_uid="u", generation=2)))
    policy, error = read_policy_file(str(good), 64)
    assert error is None and policy.generation == 2


def test_sleep_mode_is_off_unless_the_flag_asks_for_it():
    assert settings_from_args(worker_args("--model", "random:tiny")).sleep_mode is False
    assert settings_from_args(worker_args("--model", "random:tiny", "--enable-sleep-mode")).sleep_mode is True
    # A sleep moves the CUDA context and graph memory to the host too, unless told not to.
    assert settings_from_args(worker_args("--model", "random:tiny")).sleep_offload_context is True
    assert settings_from_args(worker_args("--model", "random:tiny", "--enable-sleep-mode",
                                          "--no-sleep-offload-context")).sleep_offload_context is False


def test_boot_errors_collects_flags_and_settings_exit_with_one_line(tmp_path):
    args = worker_args("--max-num-seqs", "0", "--port", "-5", "--dtype", "fp8", "--drain-seconds", "-1")
    errors = boot_errors(args)
    assert [e.split()[0] for e in errors] == ["--max-num-seqs", "--port", "--dtype",
                                              "--drain-seconds"]
    with pytest.raises(SystemExit) as exit_info:
        settings_from_args(args)
    message = str(exit_info.value.code)
    assert message.startswith("graphkeeper worker: --max-num-seqs") and "\n" not in message
    assert boot_errors(worker_args()) == []


# --- real processes -----------------------------------------------------------------------------


def run_worker(*flags: str, cwd: Path) -> subprocess.CompletedProcess:
    # No GPU is visible, so "--device cuda" is refused on a GPU machine too.
    return subprocess.run(
        [str(GRAPHKEEPER), "worker", "--port", str(free_port()), "--metrics-port", "0", "--http-port", "0", *flags],
        capture_output=True, text=True, timeout=120, cwd=cwd, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


def _bad_flag_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    not_utf8 = tmp / "policy-latin1.json"
    not_utf8.write_bytes('{"policy_uid": "caf\xe9"}'.encode("latin-1"))
    not_json = tmp / "policy.yaml"
    not_json.write_text("mode: Full\n")
    empty_token = tmp / "token"
    empty_token.write_text("")
    return {
        "budget-not-a-number": (["--max-num-batched-tokens", "lots"], "neither a whole number nor auto"),

        "policy-not-utf8": (["--policy-file", str(not_utf8)], "not UTF-8"),
        "policy-not-json": (["--policy-file", str(not_json)], "not a GraphPolicy JSON"),
        "policy-is-a-directory": (["--policy-file", str(tmp)], "not a regular file"),
        "model-dir-without-config": (["--model", str(tmp)], "config.json"),
        "unknown-preset": (["--model", "random:huge"], "unknown preset"),
        "seed-past-64-bits": (["--model", f"random:tiny@{2**70}"], "not in [0, 2**64)"),
        "seed-as-an-expression": (["--model", "random:tiny@2**70"], "not an integer"),
        "zero-seqs": (["--max-num-seqs", "0"], "--max-num-seqs"),
        "short-context": (["--max-seq-len", "1"], "--max-seq-len"),
        "budget-below-seqs": (["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens"),
        "zero-queue": (["--max-queue", "0"], "--max-queue"),
        "negative-port": (["--control-port", "-1"], "--control-port"),
        "cuda-without-cuda": (["--device", "cuda"], "CUDA is not available"),
        "unknown-dtype": (["--dtype", "float8"], "--dtype"),
        "negative-drain": (["--drain-seconds", "-2"], "--drain-seconds"),
        "empty-token-file": (["--control-token-file", str(empty_token)], "empty"),
        "model-root-not-a-dir": (["--model-root", str(empty_token)], "--model-root"),
        "not-a-number": (["--max-num-seqs", "lots"], "--max-num-seqs"),
        "bad-log-level": (["--log-level", "loud"], "--log-level"),
        "block-size-not-a-power-of-two": (["--kv-block-size", "12"], "--kv-block-size must be a power of two"),
        "utilization-above-one": (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be"),
        "utilization-zero": (["--gpu-memory-utilization", "0"], "in (0, 1]"),
        "utilization-on-a-cpu": (["--gpu-memory-utilization", "0.9"], "it needs --device cuda"),
        "negative-itl-target": (["--itl-target-ms", "-1"], "--itl-target-ms must be a finite number"),
        "infinite-itl-target": (["--itl-target-ms", "inf"], "--itl-target-ms must be a finite number"),
        "negative-itl-max": (["--itl-max-ms", "-1"], "--itl-max-ms must be a finite number of milliseconds"),
        "nan-itl-max": (["--itl-max-ms", "nan"], "--itl-max-ms must be a finite number of milliseconds"),
        "itl-max-below-target": (["--itl-target-ms", "5", "--itl-max-ms", "4"],
                                 "--itl-max-ms (4) must be at least --itl-target-ms (5)"),
        "negative-ttft-target": (["--ttft-target-ms", "-3"], "--ttft-target-ms must be a finite number"),
        "infinite-ttft-target": (["--ttft-target-ms", "inf"], "--ttft-target-ms must be a finite number"),
    }


CASES = list(_bad_flag_cases(Path("/tmp")))  # names only; the files are made per test


@pytest.mark.parametrize("case", CASES)
def test_bad_flag_is_one_line_and_a_nonzero_exit(tmp_path, case):
    flags, needle = _bad_flag_cases(tmp_path)[case]
    proc = run_worker(*flags, cwd=tmp_path)
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]


def test_a_policy_file_past_the_budget_sized_to_the_device_is_refused_once_the_engine_knows_it(tmp_path):
    """With the budget unset the CLI cannot judge explicit sizes against it; the engine core does,
    once it has sized the budget to the device, and the worker exits naming the size and why."""
    too_large = tmp_path / "policy.json"
    too_large.write_text(policy_to_json(pb.GraphPolicy(policy_uid="u", generation=1, capture_sizes=pb.CaptureSizes(
        explicit=pb.ExplicitSizes(sizes=[8, 1024])))))
    proc = run_worker("--model", "random:tiny", "--policy-file", str(too_large), cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("graphkeeper worker: the starting policy (--policy-file): capture_sizes.explicit.sizes[1]: 1024 "
                    "exceeds this worker's token budget per step (512) (sized to the device: cpu -> 512)")


@pytest.mark.parametrize("command", ["status", "graphs"])
@pytest.mark.parametrize(("flags", "needle"), [
    (["--token-file", "/nonexistent/token"], "error: --token-file: "),
    (["--timeout", "2"], "error: UNAVAILABLE: "),  # nothing listens on the port
], ids=["token-file", "unreachable"])
def test_client_commands_fail_with_one_line_and_exit_2(command, flags, needle):
    proc = subprocess.run([GRAPHKEEPER, command, "--target", f"127.0.0.1:{free_port()}", *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(needle), proc.stderr


def test_missing_policy_file_still_starts(tmp_path):
    """The ConfigMap may appear later: a missing file warns, and the worker still comes up READY,
    serving the default policy (the exit here is the drain)."""
    port, control_port = free_port(), free_port()
    proc = subprocess.Popen(
        [str(GRAPHKEEPER), "worker", "--port", str(port), "--control-port", str(control_port), "--metrics-port", "0",
         "--http-port", "0", "--policy-file", str(tmp_path / "later.json"), "--max-num-seqs", "2",
         "--max-seq-len", "32", "--max-num-batched-tokens", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )
    try:
        for line in proc.stdout:
            if "does not exist (yet)" in line:
                break
        else:
            pytest.fail("the worker exited without the missing-policy warning")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            wait_for_health(channel, proc)
        with grpc.insecure_channel(f"127.0.0.1:{control_port}") as channel:
            status = pb_grpc.GraphControlStub(channel).GetGraphStatus(pb.GetGraphStatusRequest(), timeout=10)
        assert status.state == pb.LIFECYCLE_STATE_READY
        assert status.policy_generation == 0  # the worker's default policy: no file was read
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_process_exits_promptly_after_stopped(tmp_path):
    """Nothing is left to do after "stopped": the process exits at once instead of spending
    seconds in interpreter teardown (a full garbage collection over torch's objects took 2-5 s)."""
    port, control_port = free_port(), free_port()
    proc = subprocess.Popen(
        [str(GRAPHKEEPER), "worker", "--port", str(port), "--control-port", str(control_port), "--metrics-port", "0",
         "--http-port", "0", "--max-num-seqs", "2", "--max-seq-len", "32", "--max-num-batched-tokens", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            wait_for_health(channel, proc)
        proc.terminate()
        for line in proc.stdout:
            if line.rstrip().endswith(": stopped"):
                break
        stopped = time.monotonic()
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - stopped < 1.5, f"{time.monotonic() - stopped:.1f} s from 'stopped' to the exit"
    finally:
        proc.kill()
        proc.wait(timeout=60)


def wait_for_health(channel: grpc.Channel, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Polls grpc.health.v1 for the inference service until SERVING (the worker is READY)."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the worker exited with {proc.returncode}"
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE), timeout=2)
        except grpc.RpcError:
            response = None
        if response is not None and response.status == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.1)
    pytest.fail(f"the worker did not report SERVING within {timeout} s")


def test_port_in_use_is_one_line_and_a_nonzero_exit(tmp_path):
    """Needs the lead's server change (binding failures become one line); fails until then."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [str(GRAPHKEEPER), "worker", "--port", str(port), "--metrics-port", "0", "--http-port", "0"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    assert str(port) in proc.stderr.strip().splitlines()[-1]


def test_missing_bytecode_names_the_file_python_would_otherwise_compile_at_every_start(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("x = 1\n")
    assert missing_bytecode(str(source)).endswith(".pyc")
    py_compile.compile(str(source))  # where the import system looks (pycache prefix included)
    assert missing_bytecode(str(source)) == ""
    assert missing_bytecode(None) == "" and missing_bytecode("built-in") == ""  # no source file
