"""A plain multi-process OpenAI HTTP client: the check that a benchmark client is not the limit.

A published HTTP figure is only the worker's if the client that measured it had time to spare.
This client does as little as a client can: ``--processes`` processes (spawned, one asyncio loop
and one aiohttp session each) share ``--concurrency`` streams; each stream sends one streaming
``/v1/completions`` request after another (``ignore_eos``, vLLM's ``continuous_usage_stats`` so
every chunk says how many tokens came so far) and timestamps the chunks; nothing is tokenized
on the client (a prompt is token ids, or ``w<id>`` words for a word-level tokenizer that maps each
word to its id). Each process measures its own CPU time, so the report says how busy the client
was: a process near 100% busy may be the bottleneck, and its figure is then a floor, not the
worker's throughput.

Figures, as ``bench/load_bench.py`` reports gRPC: generated tokens/s within the window, time to
first token and inter-token latency percentiles (a chunk carrying k tokens counts its gap once per
token, divided by k), requests completed, errors by HTTP status, and the client's CPU
(``client_cpu``: cores used in all, and the busiest process's share of one core).

    python bench/http_client.py --url http://127.0.0.1:8000 --model my-model --concurrency 1,16,64 \\
        --prompt-tokens 1024 --output-tokens 128 --seconds 20 --vocab 128256 --out http-client.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ports import free_port  # noqa: E402, F401  (tests/ports.py, for the benchmarks that import it from here)

#: A client process busier than this share of one core may be what limits the figure.
BUSY = 0.9


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 900.0) -> None:
    """Waits until the worker at ``url`` answers ``/health`` 200; raises with the log's tail if it
    exits first, or once ``timeout`` passes (killing it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited during startup:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("worker did not become ready")


def prompt_for(rng: random.Random, tokens: int, vocab: int, words: bool) -> str | list[int]:
    """``tokens`` random token ids from ``[3, vocab)``, as ids or as ``w<id>`` words."""
    ids = [rng.randrange(3, vocab) for _ in range(tokens)]
    return " ".join(f"w{i}" for i in ids) if words else ids


def client_process(url: str, model: str, streams: int, prompt_tokens: int, output_tokens: int, seconds: float,
                   vocab: int, words: bool, seed: int, queue: mp.Queue) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    part = asyncio.run(_client(url, model, streams, prompt_tokens, output_tokens, seconds, vocab, words, seed))
    part["cpu_seconds"] = time.process_time() - cpu
    part["wall_seconds"] = time.perf_counter() - wall
    queue.put(part)


async def _client(url: str, model: str, streams: int, prompt_tokens: int, output_tokens: int, seconds: float,
                  vocab: int, words: bool, seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    ttft: list[float] = []
    itl: list[float] = []
    errors: dict[str, int] = {}
    tokens_in_window = completed = 0
    deadline = time.perf_counter() + seconds
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, timeout=timeout, connector=connector) as session:

        async def one_request() -> None:
            nonlocal tokens_in_window, completed
            body = {"model": model, "prompt": prompt_for(rng, prompt_tokens, vocab, words),
                    "max_tokens": output_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            sent = last = time.perf_counter()
            seen = 0
            async with session.post("/v1/completions", json=body) as resp:
                if resp.status != 200:
                    errors[str(resp.status)] = errors.get(str(resp.status), 0) + 1
                    await resp.read()
                    return
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    usage = json.loads(line[6:]).get("usage")
                    k = (usage or {}).get("completion_tokens", seen) - seen
                    if k <= 0:
                        continue
                    now = time.perf_counter()
                    seen += k
                    if now <= deadline:
                        tokens_in_window += k
                    if seen == k:  # the first chunk with tokens
                        ttft.append(now - sent)
                        k -= 1
                    itl.extend([(now - last) / max(1, k)] * k)
                    last = now
            completed += 1

        async def stream() -> None:
            while time.perf_counter() < deadline:
                try:
                    await one_request()
                except (TimeoutError, aiohttp.ClientError) as err:
                    errors[type(err).__name__] = errors.get(type(err).__name__, 0) + 1

        await asyncio.gather(*(stream() for _ in range(streams)))
    return {"ttft": ttft, "itl": itl, "errors": errors, "tokens": tokens_in_window, "completed": completed}


def drive(url: str, model: str, concurrency: int, *, prompt_tokens: int, output_tokens: int, seconds: float,
          vocab: int, words: bool = False, processes: int = 0) -> dict:
    """One concurrency: ``concurrency`` streams over ``processes`` client processes (0: one per
    core, at most one per stream); the figures and the client's CPU."""
    procs = max(1, min(processes or os.cpu_count() or 1, concurrency))
    share = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=client_process, args=(url, model, n, prompt_tokens, output_tokens, seconds,
                                                         vocab, words, 1000 + i, queue)) for i, n in enumerate(share)]
    for p in workers:
        p.start()
    parts = [queue.get(timeout=seconds + 900) for _ in workers]
    for p in workers:
        p.join()
    errors: dict[str, int] = {}
    for part in parts:
        for code, n in part["errors"].items():
            errors[code] = errors.get(code, 0) + n
    tokens = sum(part["tokens"] for part in parts)
    busiest = max(part["cpu_seconds"] / part["wall_seconds"] for part in parts)
    return {
        "concurrency": concurrency, "processes": procs, "seconds": seconds, "generated_tokens": tokens,
        "tokens_per_s": tokens / seconds, "requests_completed": sum(part["completed"] for part in parts),
        "errors": errors, "ttft_ms": percentiles(sorted(x for part in parts for x in part["ttft"])),
        "itl_ms": percentiles(sorted(x for part in parts for x in part["itl"])),
        "client_cpu": {"cores_used": sum(part["cpu_seconds"] for part in parts) / seconds,
                       "busiest_process": busiest, "client_bound": busiest > BUSY},
    }


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99 and the mean of sorted seconds, in milliseconds (None when there are none)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}

    def at(q: float) -> float:
        return 1e3 * values[min(len(values) - 1, int(q * len(values)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": 1e3 * sum(values) / len(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the worker's OpenAI HTTP base, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=20.0, help="per concurrency")
    parser.add_argument("--vocab", type=int, required=True, help="prompt ids are drawn from [3, vocab)")
    parser.add_argument("--words", action="store_true", help="prompts as w<id> words (a word-level tokenizer)")
    parser.add_argument("--processes", type=int, default=0, help="client processes (0: one per core)")
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        row = drive(args.url, args.model, c, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                    seconds=args.seconds, vocab=args.vocab, words=args.words, processes=args.processes)
        cpu = row["client_cpu"]
        print(f"c={c:<4} {row['tokens_per_s']:>9.0f} tok/s, TTFT p50 {row['ttft_ms']['p50']} ms, "
              f"client {cpu['cores_used']:.2f} cores (busiest process {100 * cpu['busiest_process']:.0f}%)",
              flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
