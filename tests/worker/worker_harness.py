"""Starting real worker processes on loopback, and small clients of them, for the worker tests.

Every worker is the ``graphkeeper`` console script of the interpreter running the tests, started as
a subprocess on free ports; nothing here imports the worker's engine or server.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ports import free_port  # tests/ports.py, shared by every suite

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc

GRAPHKEEPER = Path(sys.executable).parent / "graphkeeper"
INFERENCE_SERVICE = "graphkeeper.worker.v1.InferenceWorker"
CONTROL_SERVICE = "graphkeeper.worker.v1.GraphControl"
STARTUP_TIMEOUT = 120.0
# The shape every test worker shares unless a test needs other limits.
BASE_ARGS = ("--max-num-seqs", "4", "--max-seq-len", "128", "--max-num-batched-tokens", "64")

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call, as the operator does."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {self.token}")]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready,
            details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


@dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list
    credentials: object
    wait_for_ready: bool | None
    compression: object


@dataclass
class Worker:
    """A running worker process and its addresses: inference, control (with its token), metrics."""

    proc: subprocess.Popen
    target: str
    metrics_url: str
    log_path: Path
    control_target: str = ""
    token: str = ""
    #: The OpenAI-compatible HTTP API's base URL (``http://host:port``).
    http_url: str = ""
    health_seen: list[int] = field(default_factory=list)
    _channel: grpc.Channel | None = None
    _control_channel: grpc.Channel | None = None

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.target)
        return self._channel

    @property
    def control_channel(self) -> grpc.Channel:
        """The control port's channel, carrying the bearer token on every call."""
        if self._control_channel is None:
            self._control_channel = grpc.intercept_channel(
                grpc.insecure_channel(self.control_target), BearerToken(self.token))
        return self._control_channel

    @property
    def inference(self) -> pb_grpc.InferenceWorkerStub:
        return pb_grpc.InferenceWorkerStub(self.channel)

    @property
    def control(self) -> pb_grpc.GraphControlStub:
        return pb_grpc.GraphControlStub(self.control_channel)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def status(self) -> pb.GraphStatus:
        return self.control.GetGraphStatus(pb.GetGraphStatusRequest(), timeout=10)

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.inference.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url + "/metrics", timeout=10) as resp:
            return resp.read().decode()

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        return parse_metrics(self.metrics_text())

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value; 0.0 when the series is absent."""
        return self.metrics().get((name, frozenset(labels.items())), 0.0)

    def http_get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.metrics_url + path, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        for channel in (self._channel, self._control_channel):
            if channel is not None:
                channel.close()
        self._channel = self._control_channel = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_worker(
    log_dir: Path, *extra: str, model: str = "random:tiny", env: dict[str, str] | None = None,
    wait: bool = True, base_args: bool = True,
) -> Worker:
    """Starts ``graphkeeper worker`` on free loopback ports (gRPC, control, metrics and OpenAI HTTP),
    its control port guarded by a token file, and waits for health SERVING. ``base_args`` False
    leaves the sizes to the worker's defaults (a default worker, as ``make run`` starts one)."""
    port, metrics_port, control_port = free_port(), free_port(), free_port()
    http_port = free_port() if "--http-port" not in extra else int(extra[extra.index("--http-port") + 1])
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"worker-{port}.log"
    token = secrets.token_hex(16)
    token_file = log_dir / f"token-{port}"
    token_file.write_text(token + "\n")
    args = [
        str(GRAPHKEEPER), "worker", "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(metrics_port), "--device", "cpu", "--drain-seconds", "60",
        "--control-port", str(control_port), "--control-token-file", str(token_file), *extra,
    ]
    if "--http-port" not in extra:
        args += ["--http-port", str(http_port)]
    if base_args and not any(a == "--max-num-seqs" for a in extra):
        args += BASE_ARGS
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, cwd=log_dir,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    worker = Worker(proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}", log_path,
                    control_target=f"127.0.0.1:{control_port}", token=token,
                    http_url=f"http://127.0.0.1:{http_port}" if http_port else "")
    if wait:
        try:
            wait_serving(worker)
        except BaseException:
            worker.stop(timeout=5)
            raise
    return worker


def wait_serving(worker: Worker, timeout: float = STARTUP_TIMEOUT) -> None:
    """Polls grpc.health.v1 for the inference service until SERVING, recording what it saw."""
    stub = health_pb2_grpc.HealthStub(worker.channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"worker exited with {worker.proc.returncode}:\n{worker.log()}")
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE), timeout=2)
        except grpc.RpcError:
            time.sleep(0.05)
            continue
        if not worker.health_seen or worker.health_seen[-1] != resp.status:
            worker.health_seen.append(resp.status)
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.05)
    raise TimeoutError(f"worker {worker.target} not SERVING after {timeout} s:\n{worker.log()}")


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text format -> {(name, frozenset(labels)): value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        assert match, f"unparseable metrics line: {line!r}"
        name, labels, value = match.groups()
        pairs = frozenset(_LABEL_RE.findall(labels or ""))
        out[(name, pairs)] = float(value)
    return out


# --- Generate -----------------------------------------------------------------------------------


def make_request(
    prompt: Iterable[int], max_new_tokens: int = 8, *, temperature: float = 0.0, top_k: int = 0,
    top_p: float = 0.0, seed: int | None = None, stop: Iterable[int] = (), ignore_eos: bool = True,
    tenant: str = "", request_id: str = "",
) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateRequest(
        request_id=request_id, tenant=tenant, prompt_token_ids=list(prompt), sampling=sampling,
        stopping=pb.StoppingCriteria(
            max_new_tokens=max_new_tokens, stop_token_ids=list(stop), ignore_eos=ignore_eos),
    )


def collect(stream: Iterable[pb.GenerateResponse]) -> tuple[list[int], pb.Completion]:
    """Drains a Generate stream into (token ids, completion); fails if the stream has no end."""
    tokens: list[int] = []
    completion = None
    for response in stream:
        assert completion is None, "a message arrived after the completion"
        if response.HasField("tokens"):
            tokens.extend(response.tokens.token_ids)
        else:
            completion = response.completion
    assert completion is not None, "stream ended without a completion"
    return tokens, completion


def generate(worker: Worker, request: pb.GenerateRequest, timeout: float = 120) -> tuple[
        list[int], pb.Completion]:
    return collect(worker.inference.Generate(request, timeout=timeout))


def generate_concurrently(worker: Worker, requests: list[pb.GenerateRequest]) -> list[
        tuple[list[int], pb.Completion]]:
    """Sends every request at once (one thread each, released together) and returns the results."""
    results: list = [None] * len(requests)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(requests))

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = generate(worker, requests[i])
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    if errors:
        raise errors[0]
    return results


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def eager_reasons(completion: pb.Completion) -> dict[int, int]:
    return {e.reason: e.steps for e in completion.execution.eager_steps}


def mapped_libraries(pid: int) -> str:
    """What ``pid`` has mapped (/proc/PID/maps): which shared libraries a process loaded."""
    return Path(f"/proc/{pid}/maps").read_text()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out
