"""The ``graphkeeper`` console script: one entry point, one subcommand per role.

Each subcommand imports its room lazily, so ``graphkeeper generate`` never loads torch and
``graphkeeper worker`` never loads kopf.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from graphkeeper.command_error import CommandError
from graphkeeper.proto import ports  # plain constants: no dependency is imported

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Where the client commands find a worker unless told: one on this machine, on the default ports.
DEFAULT_TARGET = f"127.0.0.1:{ports.GRPC_PORT}"
CONTROL_TARGET_HELP = f"its GraphControl address (default: same host, :{ports.CONTROL_PORT})"


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """A bad flag is one line on stderr and exit 2, not argparse's usage block.

    The worker runs under Kubernetes, where the last line of a crash-looping pod's log is what
    people read; a usage block pushes the reason out of ``kubectl logs --tail``.
    """

    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {' '.join(message.split())}\n")

    parser.error = error  # type: ignore[method-assign]


def _tokens_or_auto(text: str) -> int | None:
    """``--max-num-batched-tokens``: a whole number, or ``auto`` (None: sized to the device)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:32]!r} is neither a whole number nor auto") from None


def _worker(sub: argparse._SubParsersAction) -> None:
    from graphkeeper.worker import settings as d  # the engine's defaults (a leaf: no torch)

    p = sub.add_parser("worker", help="serve a model over gRPC and OpenAI-compatible HTTP until stopped")
    p.add_argument("--model", default=d.DEFAULT_MODEL,
                   help="an HF-style directory, a .gguf file, builtin:<name> or random:<preset>[@seed] "
                   "(default: %(default)s)")
    p.add_argument("--model-revision", default="", help="revision to report (default: content hash)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=ports.GRPC_PORT, help="inference gRPC port (InferenceWorker, health)")
    p.add_argument("--control-host", default="", help="GraphControl address (default: --host)")
    p.add_argument("--control-port", type=int, default=ports.CONTROL_PORT,
                   help="GraphControl gRPC port, never the inference one")
    p.add_argument("--control-token-file", default="",
                   help="bearer token every GraphControl call must carry; without it control binds loopback only")
    p.add_argument("--model-root", action="append", default=[],
                   help="where LoadModelRevision may load from (repeatable; none: no path may be loaded)")
    p.add_argument("--metrics-port", type=int, default=ports.METRICS_PORT, help="0 disables /metrics")
    p.add_argument("--http-host", default="", help="OpenAI-compatible HTTP address (default: --host)")
    p.add_argument("--http-port", type=int, default=ports.HTTP_PORT,
                   help="OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions, /health); 0 disables it")
    p.add_argument("--served-model-name", default="",
                   help="the model's name in the HTTP API (default: the model file or directory's name)")
    p.add_argument("--vllm-metric-names", action=argparse.BooleanOptionalAction, default=True,
                   help="also export queue, running and KV-cache gauges under vLLM's names (vllm:num_requests_waiting, "
                        "...) for inference gateways and autoscalers that read them (default: on)")
    p.add_argument("--device", default=d.DEFAULT_DEVICE, help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=d.DEFAULT_DTYPE, help=", ".join(d.DTYPES))
    p.add_argument("--max-num-seqs", type=int, default=d.DEFAULT_MAX_NUM_SEQS,
                   help="sequences at once (default: 256 on a GPU, 128 on a CPU, at most the step budget; admitted "
                        "by the KV blocks their prompts need)")
    p.add_argument("--max-seq-len", type=int, default=d.DEFAULT_MAX_SEQ_LEN,
                   help="tokens per sequence (default: the model's context, capped by memory)")
    p.add_argument("--kv-cache-memory", default="",
                   help="KV cache budget, e.g. 2Gi, per rank with --tensor-parallel-size (default: a share of "
                        "free memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: the KV cache takes what is left of this fraction of device memory, in (0, 1], after "
                        "the weights, the activation peak and the graphs (measured at startup)")
    p.add_argument("--kv-block-size", type=int, default=16,
                   help="tokens per KV cache block, a power of two (default 16)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes computed before (default: on)")
    p.add_argument("--max-num-batched-tokens", type=_tokens_or_auto, default=d.DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   metavar="N|auto",
                   help="token budget per step (default auto: 8192 on a GPU of >= 70 GiB, 2048 on a smaller one, "
                        "512 on a CPU; at most --max-num-seqs x --max-seq-len)")
    p.add_argument("--max-queue", type=int, default=d.DEFAULT_MAX_QUEUE,
                   help="queued requests before RESOURCE_EXHAUSTED")
    p.add_argument("--prefill-chunk", type=int, default=0, help="longest prefill chunk (0: token budget)")
    p.add_argument("--itl-target-ms", type=float, default=0.0,
                   help="inter-token target: a step with decode rows carries prefill only up to the size whose "
                        "measured step time fits it (0: the measured time of the largest replayed step)")
    p.add_argument("--itl-max-ms", type=float, default=0.0,
                   help="TTFT guard: the inter-token ceiling a step with decode rows may stretch to while a "
                        "prompt has waited past --ttft-target-ms for its first token (0: 2.5 x the target)")
    p.add_argument("--ttft-target-ms", type=float, default=0.0,
                   help="TTFT guard: how long the oldest prompt may wait for its first token before steps with "
                        "decode rows stretch to --itl-max-ms (0: 10 x the inter-token target)")
    p.add_argument("--record-mixed-attention", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: a PIECEWISE graph records the mixed step's attention too, so a mixed or prefill "
                        "step is one replay; off, the attention runs eagerly between the pieces (default: on)")
    p.add_argument("--policy-file", default="", help="GraphPolicy JSON to capture before ready")
    p.add_argument("--graph-mode", default="", help="graph mode without a policy (e.g. FullAndPiecewise)")
    p.add_argument("-O", "--optimization-level", type=int, default=d.DEFAULT_OPTIMIZATION_LEVEL, choices=(0, 1, 2),
                   help="0: eager, no graphs; 1: graphs, no compile; 2: compile, then graphs (default)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the step before capture (default: the -O preset; CUDA only)")
    p.add_argument("--compile-cache-dir", default=d.DEFAULT_COMPILE_CACHE_DIR,
                   help="on-disk cache of compiled steps, keyed by model, dtype, versions and source")
    p.add_argument("--quantization", default="none", choices=d.QUANTIZATIONS,
                   help="fp8: decoder weights in float8 e4m3 with per-channel scales (fp8-tensor: one scale)")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="CUDA: accept GraphControl Sleep (the weights' and KV cache's device memory given back, "
                        "the graphs kept; the next request wakes the worker); off, Sleep is refused")
    p.add_argument("--sleep-offload-context", action=argparse.BooleanOptionalAction, default=True,
                   help="with --enable-sleep-mode: a sleep also moves the process's CUDA context, graphs and "
                        "graph memory to host memory (the driver's process checkpoint, display driver 570+), "
                        "restored before the wake's first step; without it they stay on the device")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model across this many ranks, 1 to 8 (default 1): rank r runs on cuda:r with "
                        "--device cuda, or on the CPU (Gloo) with --device cpu; heads must divide evenly")
    p.add_argument("--drain-seconds", type=float, default=30.0)
    p.add_argument("--stall-seconds", type=float, default=30.0,
                   help="not ready (health NOT_SERVING, /readyz 503) while the engine holds work and made no "
                        "progress for this long")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="connections the gRPC inference port and the HTTP port each hold at once")
    p.add_argument("--max-connections-per-peer", type=int, default=1024,
                   help="connections one client address may hold on the HTTP port")
    p.add_argument("--connection-idle-seconds", type=float, default=60.0,
                   help="a connection with no request in flight is closed after this long")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request head (HTTP) or the HTTP/2 handshake (gRPC) may take")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds an HTTP request body may take")
    p.add_argument("--write-timeout", type=float, default=30.0,
                   help="an HTTP response (a stream) whose client takes none of its bytes for this long is cut off "
                        "and its request cancelled")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core (device, scheduler, graphs) in a process of its own, apart from "
                        "the API layer (default); --no-engine-process runs both in one process")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    _one_line_errors(p)
    p.set_defaults(func=_run_worker)


def _generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream tokens from a worker")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--prompt-ids", default="", help="comma-separated token ids")
    p.add_argument("--prompt", default="", help="text prompt (the model must carry a tokenizer)")
    p.add_argument("--chat", default="", help="a user message, rendered by the model's chat template")
    p.add_argument("--system", default="", help="a system message before --chat")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tenant", default="")
    p.add_argument("--stop-ids", default="", help="comma-separated stop token ids")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=_run_generate)


def _status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="print a worker's model info and graph status")
    p.add_argument("--target", default=DEFAULT_TARGET, help="the worker's inference address")
    p.add_argument("--control-target", default="", help=CONTROL_TARGET_HELP)
    p.add_argument("--token-file", default="", help="GraphControl bearer token (or $GRAPHKEEPER_CONTROL_TOKEN_FILE)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_run_status)


def _graphs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graphs", help="print what each captured graph costs and buys, and the worker's traffic")
    p.add_argument("--target", default=DEFAULT_TARGET, help="the worker's inference address (its host is used)")
    p.add_argument("--control-target", default="", help=CONTROL_TARGET_HELP)
    p.add_argument("--token-file", default="", help="GraphControl bearer token (or $GRAPHKEEPER_CONTROL_TOKEN_FILE)")
    p.add_argument("--json", action="store_true", help="one row per graph and the total, and the whole histogram")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_run_graphs)


def _operator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the GraphPolicy operator (a wrapper over kopf run)")
    p.add_argument("--namespace", action="append", default=[], help="watch only these (default: all)")
    p.add_argument("--metrics-port", type=int, default=ports.OPERATOR_METRICS_PORT,
                   help="operator metrics and /healthz")
    p.add_argument("--status-interval", type=float, default=5.0,
                   help="seconds between a policy's reconcile runs (no worker is read unless it needs it)")
    p.add_argument("--resync-interval", type=float, default=60.0,
                   help="seconds after which a settled worker whose pod did not change is read again")
    p.add_argument("--rpc-timeout", type=float, default=5.0,
                   help="deadline of every GraphControl call but a model reload")
    p.add_argument("--control-token-file", default=os.environ.get("GRAPHKEEPER_CONTROL_TOKEN_FILE", ""),
                   help="bearer token sent on every GraphControl call "
                        "(default: $GRAPHKEEPER_CONTROL_TOKEN_FILE)")
    p.add_argument("--leader-election-namespace", default=os.environ.get("GRAPHKEEPER_LEADER_ELECTION_NAMESPACE", ""),
                   help="run as one of several replicas: the one holding the Lease in this namespace acts, "
                        "the others stand by (default: $GRAPHKEEPER_LEADER_ELECTION_NAMESPACE; empty: the only one)")
    p.add_argument("--leader-election-name", default="graphkeeper-operator", help="the Lease's name")
    p.add_argument("--identity", default=os.environ.get("POD_NAME", ""),
                   help="this replica's name in the Lease (default: $POD_NAME, else host and pid)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_run_operator)


# Each command imports its room only when it runs (torch, grpc and kopf load for the command that needs them).


def _run_worker(args: argparse.Namespace) -> int:
    """Spawns the engine core first (it imports torch while this process checks the flags and
    imports its servers: ``worker/engine/spawn.py``), then runs the worker."""
    spawned = None
    if args.engine_process:
        from graphkeeper.worker.engine.spawn import compiles, spawn_core  # the standard library only

        spawned = spawn_core(args.log_level.upper(), compiles(args.optimization_level, args.compile, args.device))
    try:
        from graphkeeper.worker.main import run

        return run(args, spawned)
    except BaseException:
        if spawned is not None:  # a refused flag or a failure before the engine took its settings
            spawned.abandon()
        raise


def _run_generate(args: argparse.Namespace) -> int:
    from graphkeeper.client import generate_cmd

    return generate_cmd(args)


def _run_status(args: argparse.Namespace) -> int:
    from graphkeeper.client import status_cmd

    return status_cmd(args)


def _run_graphs(args: argparse.Namespace) -> int:
    from graphkeeper.client import graphs_cmd

    return graphs_cmd(args)


def _run_operator(args: argparse.Namespace) -> int:
    from graphkeeper.operator.main import run

    return run(args)


def _sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", add_help=False,
                       help="the graph-economics sweep (bench/sweep.py of a checkout; --help for its flags)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: _run_sweep(a.rest))


def _run_sweep(rest: list[str]) -> int:
    """Runs ``bench/sweep.py`` of the checkout this package is installed from (the benchmarks are
    not part of the wheel: they drive workers from a source tree and write to bench/results/)."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "sweep.py"
    if not script.exists():
        print(f"graphkeeper sweep: {script} not found: the sweep runs from a source checkout "
              "(pip install -e .)", file=sys.stderr)
        return 2
    import runpy

    sys.argv = [str(script), *rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphkeeper", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_worker, _generate, _status, _graphs, _operator, _sweep):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sweep"]:  # every flag after it is the sweep's (argparse would claim --help and the like)
        return _run_sweep(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CommandError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
