"""``graphkeeper worker``: starts the engine, the gRPC server and the metrics port; drains on
SIGTERM. The gRPC server starts before the model loads, so health (NOT_SERVING until READY) and
graph status are answered during startup.

This process is the API process: servers, tokenization, validation, streaming. The engine core
(device, scheduler, graphs) runs in a child process (``EngineClient``) unless
``--no-engine-process`` keeps it on a thread here."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import ipaddress
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import lifecycle_name
from graphkeeper.proto.policy import MODE_BY_NAME, PolicyError, policy_from_json, validate_policy
from graphkeeper.worker.engine import spawn as engine_spawn
from graphkeeper.worker.engine.client import EngineClient
from graphkeeper.worker.engine.cpu_quota import size_torch_threads
from graphkeeper.worker.engine.cuda_probe import cuda_device_count, parse_device
from graphkeeper.worker.engine.gc_pauses import GcPauses
from graphkeeper.worker.engine.sizing import SizingError, parse_bytes, utilization_error
from graphkeeper.worker.engine.startup import ReadyReport, process_started_at
from graphkeeper.worker.engine.watchdog import StepWatchdog, in_process_pending
from graphkeeper.worker.log_limits import limit_logging
from graphkeeper.worker.model.presets import resolve as resolve_optimization
from graphkeeper.worker.model.source import ModelSourceError, check_source
from graphkeeper.worker.serving.grpc_server import build_servers, track_health
from graphkeeper.worker.serving.limits import apply_fd_limit, limits_errors, limits_from_args
from graphkeeper.worker.serving.metrics_server import serve_http
from graphkeeper.worker.serving.streams import StreamHub
from graphkeeper.worker.serving.vllm_metrics import exported_registry
from graphkeeper.worker.settings import DTYPES, EngineSettings, check_block_size

if TYPE_CHECKING:
    from graphkeeper.worker.engine.core import Engine

log = logging.getLogger("graphkeeper.worker")
INJECT_ENV = "GRAPHKEEPER_INJECT_CAPTURE_FAILURE"
#: ``<token>`` or ``<token>:fatal``: a step holding that prompt token fails (tests only).
INJECT_STEP_ENV = "GRAPHKEEPER_INJECT_STEP_FAILURE"
STOP_GRACE_SECONDS = 2.0


#: A GraphPolicy JSON is a ConfigMap value, and ConfigMaps hold at most 1 MiB.
MAX_POLICY_FILE_BYTES = 1 << 20
MAX_TOKEN_FILE_BYTES = 64 << 10
PORT_FLAGS = ("port", "control_port", "metrics_port", "http_port")


# --- boot checks: pure functions that return one line per problem (empty when all is well) ---


def limit_errors(max_num_seqs: int | None, max_seq_len: int | None, max_num_batched_tokens: int | None,
                 max_queue: int, prefill_chunk: int = 0) -> list[str]:
    """The engine's size limits: each must leave the worker able to serve at least one request.
    An unset budget (None: sized to the device by the engine) is never below ``max_num_seqs``."""
    errors = []
    if max_num_seqs is not None and max_num_seqs < 1:
        errors.append(f"--max-num-seqs must be at least 1, got {max_num_seqs}")
    if max_seq_len is not None and max_seq_len < 2:
        errors.append(f"--max-seq-len must be at least 2 (one prompt token and one new token), got {max_seq_len}")
    if max_num_batched_tokens is not None and max_num_batched_tokens < max(1, max_num_seqs or 1):
        errors.append(f"--max-num-batched-tokens ({max_num_batched_tokens}) must be at least "
                      f"--max-num-seqs ({max_num_seqs}): every running sequence needs a token per step")
    if max_queue < 1:
        errors.append(f"--max-queue must be at least 1 (0 would report ready and refuse everything), got {max_queue}")
    if prefill_chunk < 0:
        errors.append(f"--prefill-chunk must not be negative, got {prefill_chunk}")
    return errors


def ms_flag_error(flag: str, value: float, zero: str) -> str | None:
    """A milliseconds flag that must be finite and 0 or more; ``zero`` says what 0 stands for."""
    if not math.isfinite(value) or value < 0:
        return f"{flag} must be a finite number of milliseconds, 0 or more (0: {zero}), got {value}"
    return None


def itl_target_error(itl_target_ms: float) -> str | None:
    return ms_flag_error("--itl-target-ms", itl_target_ms, "derived")


def ttft_guard_errors(itl_target_ms: float, itl_max_ms: float, ttft_target_ms: float) -> list[str]:
    """The TTFT guard's flags: finite milliseconds, 0 or more (0: a multiple of the target), and a
    stretch ceiling no tighter than an explicit inter-token target (a stretch never shortens a step)."""
    errors = [e for e in (ms_flag_error("--itl-max-ms", itl_max_ms, "2.5 x the inter-token target"),
                          ms_flag_error("--ttft-target-ms", ttft_target_ms, "10 x the inter-token target")) if e]
    if not errors and itl_max_ms > 0 and itl_target_ms > 0 and itl_max_ms < itl_target_ms:
        errors.append(f"--itl-max-ms ({itl_max_ms:g}) must be at least --itl-target-ms ({itl_target_ms:g}): "
                      "it is the ceiling a step may stretch to past the target")
    return errors


def block_size_error(block_size: int) -> str | None:
    try:
        check_block_size(block_size)
    except ValueError as err:
        return str(err)
    return None


def port_error(flag: str, port: int) -> str | None:
    """0 is allowed (ephemeral, or disabled for --metrics-port and --http-port); otherwise a TCP port."""
    if not 0 <= port <= 65535:
        return f"--{flag.replace('_', '-')} must be in [0, 65535], got {port}"
    return None


def dtype_error(dtype: str) -> str | None:
    if dtype not in DTYPES:
        return f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}"
    return None


def device_kind(device: str) -> tuple[str, int | None]:
    """``--device``'s type and index, as ``torch.device`` reads it (ValueError when it reads
    none). ``cpu`` and ``cuda[:N]`` are parsed without torch, which the API process never
    imports for them; anything else is torch's to judge (the refusal's path only)."""
    parsed = parse_device(device)
    if parsed is not None:
        return parsed
    import torch

    try:
        other = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise ValueError(str(err)) from None
    return other.type, other.index


def device_error(device: str, cuda_available: bool, cuda_devices: int) -> str | None:
    """Only ``cpu`` and ``cuda[:N]`` serve; a CUDA device must exist on this machine."""
    try:
        kind, index = device_kind(device)
    except ValueError:
        return f"--device {device!r} is not a device (cpu, cuda or cuda:N)"
    if kind == "cpu":
        return None
    if kind != "cuda":
        return f"--device {device!r}: only cpu and cuda are supported"
    if not cuda_available:
        return f"--device {device}: CUDA is not available on this machine"
    if index is not None and index >= cuda_devices:
        return f"--device {device}: this machine has {cuda_devices} CUDA device(s)"
    return None


#: The most ranks one worker shards a model across: the GPUs of one node.
MAX_TENSOR_PARALLEL = 8


def tensor_parallel_error(size: int, device: str, cuda_devices: int, sleep_mode: bool = False) -> str | None:
    """``--tensor-parallel-size`` against the device flags: 1..8 ranks; on CUDA, rank r runs on
    cuda:r, so the ranks start at cuda:0 and need that many visible GPUs (the model's own
    shapes are judged by ``tensor_parallel_model_error`` once the model is known to load)."""
    if not 1 <= size <= MAX_TENSOR_PARALLEL:
        return f"--tensor-parallel-size must be in 1..{MAX_TENSOR_PARALLEL} (the GPUs of one node), got {size}"
    if size == 1:
        return None
    kind, index = device_kind(device)
    if kind == "cuda" and (index or 0) != 0:
        return f"--tensor-parallel-size {size}: rank r runs on cuda:r, so --device must be cuda or cuda:0, got {device}"
    if kind == "cuda" and size > cuda_devices:
        return f"--tensor-parallel-size {size}: this machine shows {cuda_devices} CUDA device(s)"
    if sleep_mode:
        return f"--enable-sleep-mode is not supported with --tensor-parallel-size {size}"
    return None


def tensor_parallel_model_error(model: str, size: int) -> str | None:
    """Whether ``model``'s heads, KV heads and MLP divide across ``size`` ranks (its config only)."""
    if size == 1:
        return None
    from graphkeeper.worker.model.source import read_model_config
    from graphkeeper.worker.model.tensor_parallel import tp_config_error

    try:
        error = tp_config_error(read_model_config(model), size)
    except (ModelSourceError, OSError, ValueError) as err:
        return f"--model {err}"
    return f"--tensor-parallel-size {size}: {error}" if error else None


def drain_error(seconds: float) -> str | None:
    if not math.isfinite(seconds) or seconds < 0:
        return f"--drain-seconds must be a non-negative number, got {seconds}"
    return None


def model_error(model: str) -> str | None:
    """A --model that cannot load (missing directory, no config.json, unknown preset), weights unread."""
    try:
        check_source(model)
    except ModelSourceError as err:
        return f"--model {err}"
    return None


def control_token_error(path: str) -> str | None:
    """``--control-token-file``, when given, must be a readable, non-empty UTF-8 file."""
    if not path:
        return None
    file = Path(path)
    try:
        if not file.is_file():
            return f"--control-token-file {path}: not a file"
        if file.stat().st_size > MAX_TOKEN_FILE_BYTES:
            return f"--control-token-file {path}: larger than {MAX_TOKEN_FILE_BYTES} bytes"
        token = file.read_bytes().decode("utf-8").strip()
    except OSError as err:
        return f"--control-token-file {path}: cannot read it ({err.strerror or err})"
    except UnicodeDecodeError:
        return f"--control-token-file {path}: not UTF-8 text"
    if not token:
        return f"--control-token-file {path}: empty (an empty token would let anyone in)"
    return None


def model_root_errors(roots: list[str]) -> list[str]:
    return [f"--model-root {root}: not a directory" for root in roots if not _is_dir(root)]


def _is_dir(path: str) -> bool:
    """``Path.is_dir`` that says no, rather than raising, for a name the OS refuses outright."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def read_policy_file(path: str, max_num_batched_tokens: int | None) -> tuple[pb.GraphPolicy | None, str | None]:
    """(policy, None), or (None, error), or (None, None) when the file does not exist yet.

    A missing file is not an error (the ConfigMap may appear later); a directory, unreadable
    bytes, text that is not UTF-8 JSON or an invalid policy is. With the budget unset (sized to
    the device) the engine judges the sizes against it once it is known (``token_budget.py``).
    """
    file = Path(path)
    try:
        if not file.exists():
            return None, None
        if not file.is_file():
            return None, f"--policy-file {path}: not a regular file"
        if file.stat().st_size > MAX_POLICY_FILE_BYTES:
            return None, f"--policy-file {path}: larger than {MAX_POLICY_FILE_BYTES} bytes"
        text = file.read_bytes().decode("utf-8")
    except OSError as err:
        return None, f"--policy-file {path}: cannot read it ({err.strerror or err})"
    except UnicodeDecodeError as err:
        return None, f"--policy-file {path}: not UTF-8 ({err.reason} at byte {err.start})"
    try:
        policy = policy_from_json(text)
        validate_policy(policy, max_num_batched_tokens)
    except PolicyError as err:
        return None, f"--policy-file {path}: {err}"
    return policy, None


def boot_errors(args: argparse.Namespace) -> list[str]:
    """Every problem with the worker's flags, cheapest first, each one line."""
    errors = limit_errors(args.max_num_seqs, args.max_seq_len, args.max_num_batched_tokens, args.max_queue,
                          getattr(args, "prefill_chunk", 0))
    errors += [e for flag in PORT_FLAGS if hasattr(args, flag) and (e := port_error(flag, getattr(args, flag)))]
    errors += [e for e in (dtype_error(args.dtype), drain_error(args.drain_seconds),
                           control_token_error(getattr(args, "control_token_file", ""))) if e]
    errors += model_root_errors(getattr(args, "model_root", None) or [])
    errors += limits_errors(limits_from_args(args))
    stall = getattr(args, "stall_seconds", 1.0)
    if not (math.isfinite(stall) and stall > 0):
        errors.append(f"--stall-seconds must be a positive number of seconds, got {stall}")
    errors += [e for e in (block_size_error(getattr(args, "kv_block_size", 16)),
                           itl_target_error(getattr(args, "itl_target_ms", 0.0)),
                           utilization_error(getattr(args, "gpu_memory_utilization", None), args.device,
                                             getattr(args, "kv_cache_memory", ""))) if e]
    errors += ttft_guard_errors(getattr(args, "itl_target_ms", 0.0), getattr(args, "itl_max_ms", 0.0),
                                getattr(args, "ttft_target_ms", 0.0))
    if not errors:  # the costlier checks only once the flags themselves make sense
        gpus = cuda_device_count() if device_kind(args.device)[0] == "cuda" else 0
        cuda = gpus > 0
        tp = getattr(args, "tensor_parallel_size", 1)
        errors += [e for e in (device_error(args.device, cuda, gpus), model_error(args.model),
                               tensor_parallel_error(tp, args.device, gpus, getattr(args, "enable_sleep_mode", False)))
                   if e]
    if not errors and (e := tensor_parallel_model_error(args.model, getattr(args, "tensor_parallel_size", 1))):
        errors.append(e)  # the model's shapes, once it is known to load and the rank count makes sense
    return errors


def one_line(message: str) -> str:
    """Error text as a single line: a refusal is one line on stderr, whatever the cause said."""
    return " ".join(message.split())


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    """Builds engine settings; raises SystemExit with one clear line on a bad flag or policy file."""
    errors = boot_errors(args)
    if errors:
        raise SystemExit(f"graphkeeper worker: {one_line(errors[0])}")
    policy = pb.GraphPolicy()
    if args.policy_file:
        loaded, error = read_policy_file(args.policy_file, args.max_num_batched_tokens)
        if error:
            raise SystemExit(f"graphkeeper worker: {one_line(error)}")
        if loaded is None:
            log.warning("policy file %s does not exist (yet): starting with the default policy", args.policy_file)
        else:
            policy = loaded
    try:
        optimization = resolve_optimization(args.optimization_level, args.compile, device_kind(args.device)[0])
    except ValueError as err:
        raise SystemExit(f"graphkeeper worker: -O: {err}") from None
    if not policy.policy_uid and not args.graph_mode:
        policy.mode = optimization.default_graph_mode
    if args.graph_mode and not policy.policy_uid:
        if args.graph_mode not in MODE_BY_NAME:
            raise SystemExit(f"graphkeeper worker: --graph-mode {args.graph_mode!r} is not one of "
                             f"{', '.join(MODE_BY_NAME)}")
        policy.mode = MODE_BY_NAME[args.graph_mode]
    try:
        kv_cache_memory = parse_bytes(args.kv_cache_memory) if getattr(args, "kv_cache_memory", "") else 0
    except ValueError as err:
        raise SystemExit(f"graphkeeper worker: {err}") from None
    try:
        inject = frozenset(int(x) for x in os.environ.get(INJECT_ENV, "").split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"graphkeeper worker: {INJECT_ENV} must be comma-separated integers") from None
    return EngineSettings(
        model=args.model, model_revision=args.model_revision, device=args.device, dtype=args.dtype,
        max_num_seqs=args.max_num_seqs, max_seq_len=args.max_seq_len, kv_cache_memory=kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens, max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk, itl_target_ms=getattr(args, "itl_target_ms", 0.0), policy=policy,
        itl_max_ms=getattr(args, "itl_max_ms", 0.0), ttft_target_ms=getattr(args, "ttft_target_ms", 0.0),
        record_mixed_attention=getattr(args, "record_mixed_attention", True),
        inject_capture_failures=inject,
        inject_step_failure=_step_injection(os.environ.get(INJECT_STEP_ENV, "")),
        model_roots=tuple(args.model_root), optimization_level=args.optimization_level, compile=args.compile,
        compile_cache_dir=args.compile_cache_dir, quantization=args.quantization,
        kv_block_size=getattr(args, "kv_block_size", 16), prefix_caching=getattr(args, "prefix_caching", True),
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None) or 0.0,
        sleep_mode=getattr(args, "enable_sleep_mode", False),
        sleep_offload_context=getattr(args, "sleep_offload_context", True),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        process_started_at=process_started_at(),
    )


def missing_bytecode(source: str | None) -> str:
    """The bytecode file the module at ``source`` would load from, when it does not exist (else
    ''): without it Python compiles the module's source at every start, which for torch costs
    seconds."""
    if not source or not source.endswith(".py"):
        return ""
    cached = importlib.util.cache_from_source(source)
    return "" if os.path.exists(cached) else cached


def run(args: argparse.Namespace, spawned: engine_spawn.SpawnedCore | None = None) -> int:
    """The worker until it stops; ``spawned``: its engine core, spawned already (the caller
    abandons it if this raises before the engine takes it)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limit_logging()  # no client can fill a disk through the log
    torch_spec = importlib.util.find_spec("torch")  # the engine core imports it; this process does not
    if missing := missing_bytecode(torch_spec.origin if torch_spec else None):
        log.warning("no compiled bytecode for torch (%s): every start compiles its modules from source; install "
                    "with bytecode (pip's default) or set PYTHONPYCACHEPREFIX to a writable directory", missing)
    settings = settings_from_args(args)
    try:
        token = _read_token(args.control_token_file)
    except OSError as err:
        raise SystemExit(f"--control-token-file: {err}") from None
    # The engine thread must get the interpreter back quickly from the API layer's thread.
    sys.setswitchinterval(engine_spawn.SWITCH_INTERVAL_SECONDS)
    try:
        code = asyncio.run(_serve(args, settings, token, spawned))
    except (SizingError, ModelSourceError) as err:
        raise SystemExit(f"graphkeeper worker: {one_line(str(err))}") from None
    except OSError as err:
        raise SystemExit(f"graphkeeper worker: {err}") from None
    _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """Ends the process once everything is stopped, skipping the interpreter's teardown.

    With nothing left to do after "stopped", finalization still ran a full garbage collection
    over torch's heap of objects: 2-5 s of every exit (a SIGTERM, a rollout, a failed engine)
    spent on memory the kernel frees at once. Logs and standard streams are flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve(args: argparse.Namespace, settings: EngineSettings, token: str,
                 spawned: engine_spawn.SpawnedCore | None = None) -> int:
    """Runs the servers and the engine until SIGTERM/SIGINT (drain) or an engine failure (exit 1)."""
    loop = asyncio.get_running_loop()
    engine = make_engine(args, settings)
    hub = StreamHub(loop)
    watchdog = make_watchdog(engine, args)
    engine.publish = watchdog.wrap(hub.publish)
    limits = apply_fd_limit(limits_from_args(args), bool(getattr(args, "http_port", 0)))
    engine.lifecycle.subscribe(lambda s: log.info("lifecycle: %s", lifecycle_name(s)))
    startup = ReadyReport(engine, engine.metrics)
    if isinstance(engine, EngineClient):
        GcPauses(engine.metrics.gc_pause, "api").install()  # the engine core times its own
        # The engine core decides the sizes the servers are built with (and refuses a KV cache
        # that cannot fit) before a port is bound.
        engine.start(spawned)
        try:
            await asyncio.to_thread(engine.wait_sized)
        except SizingError:
            await asyncio.to_thread(engine.close)
            raise
    control_host = args.control_host or args.host
    if not token and not _is_loopback(control_host):
        log.warning("no --control-token-file: GraphControl listens on 127.0.0.1 only, not %s", control_host)
        control_host = "127.0.0.1"
    http = None
    http_host = getattr(args, "http_host", "") or args.host
    served_name = getattr(args, "served_model_name", "")
    registry = exported_registry(engine, served_name, getattr(args, "vllm_metric_names", True))
    servers = None
    try:
        servers = build_servers(engine, args.host, args.port, control_host, args.control_port, token, hub, limits)
        track_health(engine, servers.health, loop, watchdog)
        if args.metrics_port:
            serve_http(engine, args.host, args.metrics_port, registry=registry, watchdog=watchdog)
        if getattr(args, "http_port", 0):
            from graphkeeper.worker.serving.http_server import OpenAIServer  # aiohttp: only when served

            http = OpenAIServer(engine, hub, served_name, metrics=registry, limits=limits, watchdog=watchdog)
            await http.start(http_host, args.http_port)
        await servers.start()
    except BaseException:
        if servers is not None:  # the control gate's socket and private directory
            servers.control_gate.discard()
        if isinstance(engine, EngineClient):  # a port in use: the engine core must not outlive us
            await asyncio.to_thread(engine.close)
        raise
    log.info("gRPC inference on %s:%d, control on %s:%d%s, metrics on %s:%s, OpenAI HTTP on %s", args.host,
             servers.inference_port, control_host, servers.control_port, " (bearer token)" if token else "", args.host,
             args.metrics_port or "-", f"{http_host}:{http.port}" if http is not None else "-")
    startup.listening()
    if not isinstance(engine, EngineClient):
        engine.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    stalled = False
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)
        if watchdog.poll() != stalled:
            stalled = watchdog.stalled
            log.warning("the engine %s", f"holds work and made no progress for {watchdog.stall_seconds:g} s: "
                        "not ready until it does" if stalled else "progresses again: ready")
        if engine.failed is not None:
            log.error("engine failed: %s", engine.failed)
            code = 1
            break
    if code == 0:
        log.info("draining (up to %.0f s)", args.drain_seconds)
        await asyncio.to_thread(engine.drain_and_stop, args.drain_seconds)
    elif isinstance(engine, EngineClient):
        await asyncio.to_thread(engine.close)  # a failed engine core exits now; never left holding the device
    # The drain deadline is a deadline: whatever is still open ends now.
    await asyncio.gather(servers.stop(STOP_GRACE_SECONDS), *((http.stop(),) if http is not None else ()))
    log.info("stopped")
    return code


def make_engine(args: argparse.Namespace, settings: EngineSettings) -> Engine | EngineClient:
    """The engine core in a child process (the default), or on a thread of this one (only then
    is the device side imported here)."""
    if getattr(args, "engine_process", True):
        return EngineClient(settings, log_level=args.log_level.upper())
    from graphkeeper.worker.engine.core import Engine

    size_torch_threads()
    return Engine(settings)


def make_watchdog(engine: Engine | EngineClient, args: argparse.Namespace) -> StepWatchdog:
    """The step-loop watchdog (``engine/watchdog.py``) over the work the engine holds."""
    pending = engine.pending_streams if isinstance(engine, EngineClient) else (lambda: in_process_pending(engine))
    return StepWatchdog(pending, getattr(args, "stall_seconds", StepWatchdog.DEFAULT_STALL))


def _step_injection(value: str) -> tuple[int, bool] | None:
    if not value:
        return None
    token, _, kind = value.partition(":")
    try:
        return int(token), kind == "fatal"
    except ValueError:
        raise SystemExit(f"graphkeeper worker: {INJECT_STEP_ENV} must be <token> or <token>:fatal") from None


def _read_token(path: str) -> str:
    if not path:
        return ""
    token = Path(path).read_text().strip()
    if not token:
        raise OSError(f"{path} is empty")
    return token


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
