"""``graphkeeper worker``: starts the engine, the gRPC server and the metrics port; drains on
SIGTERM. The gRPC server starts before the model loads, so health (NOT_SERVING until READY) and
graph status are answered during startup."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import MODE_BY_NAME, PolicyError, policy_from_json, validate_policy
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.http import serve_http
from graphkeeper.worker.lifecycle import state_name
from graphkeeper.worker.server import build_server

log = logging.getLogger("graphkeeper.worker")
INJECT_ENV = "GRAPHKEEPER_INJECT_CAPTURE_FAILURE"


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
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    engine = Engine(settings)
    engine.lifecycle.subscribe(lambda s: log.info("lifecycle: %s", state_name(s)))
    if args.metrics_port:
        serve_http(engine, args.host, args.metrics_port)
    server, port = build_server(engine, args.host, args.port)
    server.start()
    log.info("gRPC on %s:%d, metrics on %s:%s", args.host, port, args.host, args.metrics_port or "-")
    engine.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if engine.failed is not None:
            log.error("engine failed: %s", engine.failed)
            server.stop(grace=1)
            return 1
    log.info("draining (up to %.0f s)", args.drain_seconds)
    engine.drain_and_stop(args.drain_seconds)
    server.stop(grace=5).wait()
    log.info("stopped")
    return 0
