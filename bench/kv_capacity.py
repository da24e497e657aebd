"""How many short sequences run at once in a fixed KV cache memory: the paged cache against what
the static cache (one whole context per sequence) admitted in the same memory.

A worker serves ``--preset`` (default ``llama-8b``) at a context of ``--context`` tokens (8192)
with ``--kv-cache-memory`` fixed and ``--max-num-seqs 256``; ``--streams`` clients send short
requests (``--prompt`` tokens, ``--new`` new tokens) for ``--seconds``, while this process reads
``graphkeeper_running_sequences`` from /metrics every 100 ms. The static cache held
``memory // (context x bytes per token) - scratch`` sequences (its sizing rule, scratch slots for a
step's padding included); the ratio of the peak running sequences to that is the figure.

    python bench/kv_capacity.py --kv-cache-memory 16Gi --out bench/results/kv-capacity-h200.json
    python bench/kv_capacity.py --device cpu --dtype float32 --preset tiny --context 1024 \\
        --kv-cache-memory 8Mi --streams 32 --seconds 5    # a CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import load_bench  # noqa: E402 - the worker and client machinery of the load benchmark

from graphkeeper.proto.policy import parse_quantity  # noqa: E402
from graphkeeper.worker.engine.sizing import kv_bytes_per_token  # noqa: E402
from graphkeeper.worker.model.config import PRESETS  # noqa: E402

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def static_capacity(memory: int, context: int, per_token: int, step_tokens: int) -> int:
    """Sequences the static cache held in ``memory`` (pure): one aligned context each, after the
    scratch slots that a step's padding wrote to."""
    per_sequence = 16 * math.ceil(context / 16) * per_token
    scratch = max(1, math.ceil(step_tokens / (16 * math.ceil(context / 16))))
    return max(0, memory // per_sequence - scratch)


def read_running(url: str) -> float:
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith("graphkeeper_running_sequences "):
            return float(line.split()[1])
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    load_bench.add_worker_arguments(parser, preset="llama-8b")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--kv-cache-memory", default="16Gi")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--budget", type=int, default=512, help="token budget per step")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--new", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--client-procs", type=int, default=8)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    config = PRESETS[args.preset]
    memory = parse_quantity(args.kv_cache_memory, field="--kv-cache-memory")
    per_token = kv_bytes_per_token(config.n_layers, config.n_kv_heads, config.head_dim, DTYPE_BYTES[args.dtype])
    static = static_capacity(memory, args.context, per_token, args.budget)
    load_bench.SCENARIOS["capacity"] = (args.streams, (args.prompt, args.prompt), (args.new, args.new), 1.0)
    flags = load_bench.WorkerFlags(max_num_seqs=args.max_num_seqs, budget=args.budget, max_seq_len=args.context,
                                   extra=("--kv-cache-memory", args.kv_cache_memory))
    logs = Path(tempfile.mkdtemp(prefix="kv-capacity-"))
    proc, target, metrics, _ = load_bench.start_worker(args, flags, logs / "worker.log")
    peak, stop = [0.0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                peak[0] = max(peak[0], read_running(metrics))
            time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        row = load_bench.drive(target, "capacity", args.seconds, config.vocab_size, args.client_procs)
        after = load_bench.scrape(metrics)
    finally:
        stop.set()
        poller.join()
        proc.terminate()
        proc.wait(60)
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "gpu": load_bench._gpu_name(args.device),
        "preset": args.preset, "dtype": args.dtype, "context": args.context, "kv_cache_memory": memory,
        "kv_bytes_per_token": per_token, "static_capacity_sequences": static,
        "paged_peak_running_sequences": peak[0], "ratio": peak[0] / static if static else float("inf"),
        "kv_cache_blocks": after.get("graphkeeper_kv_cache_blocks", 0.0),
        "preemptions": after.get("graphkeeper_preemptions_total", 0.0),
        "tokens_per_s": row["tokens_per_s"], "errors": row["errors"], "ttft_ms": row["ttft_ms"],
        "streams": args.streams, "prompt": args.prompt, "new": args.new, "command": " ".join(sys.argv),
        "commit": load_bench._commit(),
    }
    print(f"{args.preset} context {args.context}, KV cache {memory} B: static held {static} sequences, paged ran "
          f"{peak[0]:.0f} at once ({result['ratio']:.1f}x); {row['tokens_per_s']:.0f} tok/s, errors {row['errors']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
