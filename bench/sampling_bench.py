"""What the sampling parameters cost under load: a batch of ``--streams`` (64) OpenAI completions
streams where every request is plain, against the same batch where half the streams ask for log
probabilities (5 alternatives), penalties (frequency, presence, repetition) or a JSON schema, a
third of that half each (``--attribute``: also half the streams with each kind alone, to see which
kind costs what). Every request is greedy with ``ignore_eos``. A JSON-schema request would still end
when its grammar does, so its schema (an array of at least ``--output-tokens`` strings, each at
least three tokens of this tokenizer) cannot be complete before ``max_tokens``: every kind runs
the same number of tokens a request and starts the same number of requests, and the comparison
prices the grammar, not shorter requests. (Before 2026-12-05 the array had no minimum: the model
closed it after 58-63 of 128 tokens on the H200, and that kind started twice the requests.)
Tokens/s over ``--seconds`` per run, and the share of each request's steps that replayed graphs
(its ``graphkeeper.execution`` summary), which must stay 1.0.

The client is one asyncio process of plain HTTP (aiohttp, the worker's own dependency), one
connection per stream and one non-streaming response per request, so its work per token is nil;
the run also records its CPU time against its wall time to show it is not the limit. It records the
worker's two processes' CPU the same way (the API process, and the engine core, its busiest
child): a process near a whole core is the one that sets the pace. From the worker's ``/metrics``
it records the engine's steps over the run: their mean wall time, the sequences in a step, and the
share of the run spent stepping. A kind that costs throughput through slower steps is host or
device work on the step's path; one that costs it through fewer sequences a step is time between
a request's end and its stream's next request entering a step (the response, the client, admission).
Per kind it records that time directly: a request's time outside the engine, the client's wait
less the engine's own ``total_seconds``.

The model is ``random:<preset>`` saved with a byte-level tokenizer of the model's vocabulary (the
256 byte symbols, then placeholder words), so JSON can be spelt and every id decodes; prompts are
token ids.

    python bench/sampling_bench.py --attribute --out bench/results/sampling-h200.json          # H200
    python bench/sampling_bench.py --device cpu --dtype float32 --preset tiny --streams 8 \\
        --prompt-tokens 16 --output-tokens 16 --seconds 10 --out /tmp/sampling.json             # CPU check
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openai_bench  # noqa: E402  (bench/openai_bench.py, beside this file: the model directory)
from http_client import free_port, wait_ready  # noqa: E402  (bench/http_client.py, beside this file)
from metrics_text import fetch, series_key, summed  # noqa: E402  (bench/metrics_text.py, beside this file)
from proc_stats import host_cpu, tree_cpu_seconds  # noqa: E402  (bench/proc_stats.py, beside this file)

from graphkeeper.worker.engine.gc_pauses import GC_PROCESSES  # noqa: E402  (the process label's values)


def json_schema_kind(min_items: int = 0) -> dict:
    """A JSON-schema request's fields: an array of strings, at least ``min_items`` of them."""
    schema = {"type": "array", "items": {"type": "string"}, **({"minItems": min_items} if min_items else {})}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}


#: What the parameterised half of the streams asks for, in turn (``asked``: as a run sends it).
KINDS = {
    "logprobs": {"logprobs": 5},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1},
    "json_schema": json_schema_kind(),
}


def asked(output_tokens: int) -> dict[str, dict]:
    """``KINDS`` for requests of ``output_tokens`` tokens: the schema asks for at least that many
    strings, so a request cannot close its array before ``max_tokens``."""
    return {**KINDS, "json_schema": json_schema_kind(output_tokens)}


def engine_steps(metrics_url: str) -> dict[str, float]:
    """The engine's step counters from the worker's ``/metrics``: the steps' wall time (sum and
    count over every mode) and sequences per step (sum and count), summed over their labels."""
    sums = summed(fetch(metrics_url))
    wanted = {"graphkeeper_step_duration_seconds_sum": "seconds", "graphkeeper_step_duration_seconds_count": "steps",
              "graphkeeper_step_sequences_sum": "sequences", "graphkeeper_step_sequences_count": "sequence_steps"}
    for process in GC_PROCESSES:  # the collector's pauses, kept apart by process
        wanted[series_key("graphkeeper_gc_pause_seconds_sum", process)] = f"gc_{process}_seconds"
    return {short: sums.get(name, 0.0) for name, short in wanted.items()}


def step_summary(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """What the engine's steps did over a run: how many, their mean wall time, the sequences in
    a step, and the share of the run the engine spent stepping (below 1: it waited for work, so
    what limits the run is outside the engine)."""
    d = {k: after[k] - before[k] for k in after}
    return {"steps": d["steps"], "mean_step_ms": 1e3 * d["seconds"] / d["steps"] if d["steps"] else None,
            "sequences_per_step": d["sequences"] / d["sequence_steps"] if d["sequence_steps"] else None,
            "stepping_share": d["seconds"] / wall,
            "gc_ms": {p: 1e3 * d.get(f"gc_{p}_seconds", 0.0) for p in GC_PROCESSES}}


def worker_cpu_share(worker: int, before: dict[int, float], after: dict[int, float], wall: float) -> dict:
    """The worker's processes' CPU over ``wall`` seconds, in cores: the API process (``worker``)
    and the engine core (its busiest child)."""
    used = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    children = [v for pid, v in used.items() if pid != worker]
    return {"api_process": used.get(worker, 0.0) / wall, "engine_process": max(children, default=0.0) / wall}


def byte_tokenizer(vocab: int, path: Path) -> None:
    """A byte-level BPE over ``vocab`` ids: the 256 byte symbols, then placeholder words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = {s: i for i, s in enumerate(symbols)}
    words.update({f"w{i}": i for i in range(len(symbols), vocab)})
    tok = Tokenizer(models.BPE(vocab=words, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))


def prepare_model(preset: str, device: str, dtype: str, root: Path) -> Path:
    """``random:<preset>`` with a byte-level BPE tokenizer covering its whole vocabulary."""
    return openai_bench.prepare_model(preset, device, dtype, root, tokenizer=byte_tokenizer, suffix="-bytes")


class Served(NamedTuple):
    """A started worker: its process, its OpenAI HTTP base URL and its ``/metrics`` URL."""

    proc: subprocess.Popen
    url: str
    metrics: str


def start_worker(model: Path, args: argparse.Namespace, log: Path) -> Served:
    http, metrics = free_port(), free_port()
    cmd = [sys.executable, "-m", "graphkeeper.cli", "worker", "--model", str(model), "--device", args.device,
           "--dtype", args.dtype, "--port", str(free_port()), "--control-port", str(free_port()),
           "--metrics-port", str(metrics), "--http-port", str(http), "--served-model-name", "bench",
           "--max-num-seqs", str(max(64, args.streams)), "--max-seq-len", str(args.max_seq_len),
           "--max-num-batched-tokens", "512", "--log-level", "WARNING", *args.worker_args.split()]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}"
    wait_ready(proc, url, log)
    return Served(proc, url, f"http://127.0.0.1:{metrics}/metrics")


async def drive(worker: Served, args: argparse.Namespace, mix: tuple[str, ...], vocab: int) -> dict:
    """``--streams`` loops of requests for ``--seconds``, every other one asking for a kind of
    ``mix`` in turn (none: all plain); counts tokens and graph steps by kind, and the CPU of the
    client and of the worker's process tree."""
    import aiohttp

    rng = random.Random(7)
    asks = asked(args.output_tokens)
    kinds = ["plain"] * args.streams
    if mix:
        for i in range(args.streams // 2):
            kinds[2 * i + 1] = mix[i % len(mix)]
    stats = {k: {"requests": 0, "tokens": 0, "graph_steps": 0, "steps": 0, "errors": 0, "client_seconds": 0.0,
                 "engine_seconds": 0.0} for k in ("plain", *KINDS)}
    deadline = time.perf_counter() + args.seconds

    async def stream(session: aiohttp.ClientSession, kind: str) -> None:
        while time.perf_counter() < deadline:
            body = {"model": "bench", "prompt": [rng.randrange(256, vocab) for _ in range(args.prompt_tokens)],
                    "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True, **asks.get(kind, {})}
            sent = time.perf_counter()
            async with session.post(worker.url + "/v1/completions", json=body) as resp:
                reply = await resp.json()
            answered = time.perf_counter() - sent
            row = stats[kind]
            if resp.status != 200:
                row["errors"] += 1
                continue
            execution = reply["graphkeeper"]["execution"]
            graphs = sum(int(g["steps"]) for g in execution.get("graph_steps", []))
            row["requests"] += 1
            row["tokens"] += reply["usage"]["completion_tokens"]
            row["graph_steps"] += graphs
            row["steps"] += graphs + sum(int(e["steps"]) for e in execution.get("eager_steps", []))
            row["client_seconds"] += answered
            row["engine_seconds"] += reply["graphkeeper"]["total_seconds"]

    steps0 = engine_steps(worker.metrics)
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    tree0 = tree_cpu_seconds(worker.proc.pid)
    connector = aiohttp.TCPConnector(limit=args.streams)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(stream(session, k) for k in kinds))
    wall = time.perf_counter() - wall0
    cpu1, tree1 = resource.getrusage(resource.RUSAGE_SELF), tree_cpu_seconds(worker.proc.pid)
    steps = step_summary(steps0, engine_steps(worker.metrics), wall)
    tokens = sum(r["tokens"] for r in stats.values())
    seen = sum(r["steps"] for r in stats.values())
    name = "plain" if not mix else "half parameterised" if len(mix) > 1 else f"half {mix[0]}"
    return {"mix": name, "seconds": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "graph_step_share": sum(r["graph_steps"] for r in stats.values()) / seen
            if seen else None, "client_cpu_share": (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime)
            / wall, "worker_cpu": worker_cpu_share(worker.proc.pid, tree0, tree1, wall), "engine_steps": steps,
            "by_kind": {k: {**v, "outside_engine_ms": 1e3 * (v["client_seconds"] - v["engine_seconds"]) / v["requests"]
                            if v["requests"] else None} for k, v in stats.items() if v["requests"] or v["errors"]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=30.0, help="per run")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--worker-args", default="")
    parser.add_argument("--models", default="/tmp/sampling-bench-models")
    parser.add_argument("--attribute", action="store_true",
                        help="also run half the streams with each kind alone (which kind costs what)")
    parser.add_argument("--only", choices=sorted(KINDS), default=None,
                        help="plain, then half the streams with this kind alone (nothing else): to profile one kind")
    parser.add_argument("--out", default=os.environ.get("OUT", "sampling-bench.json"))
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = prepare_model(args.preset, args.device, args.dtype, Path(args.models))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    worker = start_worker(model, args, out.with_suffix(".worker.log"))
    try:
        asyncio.run(drive(worker, argparse.Namespace(**{**vars(args), "seconds": min(5.0, args.seconds)}),
                          tuple(KINDS), vocab))
        if args.only:
            mixes = [(), (args.only,)]
        else:
            mixes = [(), tuple(KINDS)] + ([(k,) for k in KINDS] if args.attribute else [])
        runs = [asyncio.run(drive(worker, args, mix, vocab)) for mix in mixes]
    finally:
        worker.proc.terminate()
        worker.proc.wait(120)
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "commit": os.environ.get("GRAPHKEEPER_COMMIT", ""), "host": platform.node(), "host_cpu": host_cpu(),
        "preset": args.preset,
        "device": args.device, "dtype": args.dtype, "streams": args.streams, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "runs": runs,
        "over_plain": {run["mix"]: run["tokens_per_s"] / runs[0]["tokens_per_s"] if runs[0]["tokens_per_s"] else None
                       for run in runs[1:]},
        "mixed_over_plain": runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"] if runs[0]["tokens_per_s"] else None,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        outside = ", ".join(f"{k} {v['outside_engine_ms']:.1f} ms" for k, v in run["by_kind"].items()
                            if v["outside_engine_ms"] is not None)
        print(f"{run['mix']:>22}: a request's time outside the engine (client minus engine): {outside}")
        print(f"{run['mix']:>22}: {run['tokens_per_s']:9.1f} tokens/s, graph steps {run['graph_step_share']}, "
              f"client CPU {run['client_cpu_share']:.2f}, worker CPU: API {run['worker_cpu']['api_process']:.2f}, "
              f"engine {run['worker_cpu']['engine_process']:.2f}; steps {run['engine_steps']['mean_step_ms']:.2f} ms, "
              f"{run['engine_steps']['sequences_per_step']:.1f} sequences, stepping "
              f"{run['engine_steps']['stepping_share']:.2f} of the run; tokens/request "
              f"{run['tokens'] / max(1, sum(r['requests'] for r in run['by_kind'].values())):.1f}; collector "
              f"pauses: engine {run['engine_steps']['gc_ms']['engine']:.1f} ms, API "
              f"{run['engine_steps']['gc_ms']['api']:.1f} ms", flush=True)
    print(f"{runs[1]['mix']} / plain: {result['mixed_over_plain']:.3f} (acceptance, all kinds: >= 0.90)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
