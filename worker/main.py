"""``graphkeeper worker``: starts the engine, the gRPC server and the metrics port; drains on
SIGTERM. The gRPC server starts before the model loads, so health (NOT_SERVING until READY) and
graph status are answered during startup."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import sys
from pathlib import Path

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import MODE_BY_NAME, PolicyError, policy_from_json, validate_policy
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.http import serve_http
from graphkeeper.worker.lifecycle import state_name
from graphkeeper.worker.server import StreamHub, build_servers, track_health

log = logging.getLogger("graphkeeper.worker")
INJECT_ENV = "GRAPHKEEPER_INJECT_CAPTURE_FAILURE"
SWITCH_INTERVAL_SECONDS = 0.0005
STOP_GRACE_SECONDS = 2.0


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    """Builds engine settings; raises SystemExit with a clear message on a bad flag or policy file."""
    policy = pb.GraphPolicy()
    if args.policy_file:
        path = Path(args.policy_file)
        if path.is_file():
            try:
                policy = policy_from_json(path.read_text())
                validate_policy(policy, args.max_num_batched_tokens)
            except PolicyError as err:
                raise SystemExit(f"--policy-file {path}: {err}") from None
        else:
            log.warning("policy file %s does not exist (yet): starting with the default policy", path)
    if args.graph_mode and not policy.policy_uid:
        if args.graph_mode not in MODE_BY_NAME:
            raise SystemExit(f"--graph-mode {args.graph_mode!r} is not one of {', '.join(MODE_BY_NAME)}")
        policy.mode = MODE_BY_NAME[args.graph_mode]
    inject = frozenset(int(x) for x in os.environ.get(INJECT_ENV, "").split(",") if x.strip())
    return EngineSettings(
        model=args.model, model_revision=args.model_revision, device=args.device, dtype=args.dtype,
        max_num_seqs=args.max_num_seqs, max_seq_len=args.max_seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk, policy=policy, inject_capture_failures=inject,
        model_roots=tuple(args.model_root),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    try:
        token = _read_token(args.control_token_file)
    except OSError as err:
        raise SystemExit(f"--control-token-file: {err}") from None
    # The engine thread must get the interpreter back quickly from the API layer's thread.
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    try:
        return asyncio.run(_serve(args, settings, token))
    except OSError as err:
        raise SystemExit(f"graphkeeper worker: {err}") from None


async def _serve(args: argparse.Namespace, settings: EngineSettings, token: str) -> int:
    """Runs the servers and the engine until SIGTERM/SIGINT (drain) or an engine failure (exit 1)."""
    loop = asyncio.get_running_loop()
    engine = Engine(settings)
    hub = StreamHub(loop)
    engine.publish = hub.publish
    engine.lifecycle.subscribe(lambda s: log.info("lifecycle: %s", state_name(s)))
    control_host = args.control_host or args.host
    if not token and not _is_loopback(control_host):
        log.warning("no --control-token-file: GraphControl listens on 127.0.0.1 only, not %s", control_host)
        control_host = "127.0.0.1"
    servers = build_servers(engine, args.host, args.port, control_host, args.control_port, token, hub)
    track_health(engine, servers.health, loop)
    if args.metrics_port:
        serve_http(engine, args.host, args.metrics_port)
    await servers.inference.start()
    await servers.control.start()
    log.info("gRPC inference on %s:%d, control on %s:%d%s, metrics on %s:%s", args.host, servers.inference_port,
             control_host, servers.control_port, " (bearer token)" if token else "", args.host,
             args.metrics_port or "-")
    engine.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)
        if engine.failed is not None:
            log.error("engine failed: %s", engine.failed)
            code = 1
            break
    if code == 0:
        log.info("draining (up to %.0f s)", args.drain_seconds)
        await asyncio.to_thread(engine.drain_and_stop, args.drain_seconds)
    # The drain deadline is a deadline: whatever is still open ends now.
    await asyncio.gather(servers.inference.stop(STOP_GRACE_SECONDS), servers.control.stop(STOP_GRACE_SECONDS))
    log.info("stopped")
    return code


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
