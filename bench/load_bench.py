"""Serving under load: a real worker process driven through gRPC by separate client processes.

Scenarios (each a fresh worker unless they share its flags):

- ``one``:     1 stream, short prompts, long outputs (inter-token latency against the batch-1 step)
- ``decode``:  64 streams, 8-token prompts, 400 new tokens each
- ``mixed``:   64 streams, prompts of 16-400 tokens (some beyond the token budget), 64-256 new tokens,
               arrivals staggered over the first seconds
- ``mixed256``: the same with 256 streams (and ``--max-num-seqs 256``)
- ``shared``:  64 streams whose prompts are one common 2,000-token prefix (a system prompt) and a
               distinct 8-32 token suffix, 32 new tokens each (context 4096); prefix caching on
- ``shared_nocache``: the same with ``--no-prefix-caching`` (TTFT p50 against ``shared``: the
               prefix cache's effect)

For each: generated tokens/s (over the window, and for a staggered scenario also once every
stream runs: ``tokens_per_s_all_started``), time to first token and inter-token latency (p50, p90,
p99, from the clients' clocks; a message carrying k tokens counts its gap once per token, divided
by k), errors by status code, requests per stream (no stream starved), graph coverage of steps
and padding waste (from the worker's /metrics). After the workers stop, the same process times the
engine's FULL-graph decode step at the matching batch sizes on the same GPU, so every throughput is
also a ratio to what the GPU allows: ``streams / step time``. A scenario with prompts to prefill is
also set against what its own work allows (``work_bound``: its generated and prompt tokens packed
into full steps priced at the worker's captured step times).

    python bench/load_bench.py --out bench/results/load-h200.json                 # everything, H200
    python bench/load_bench.py --scenarios mixed --worker-pythonpath /tmp/old --legacy  # an older commit
    python bench/load_bench.py --device cpu --preset tiny --seconds 5 --scenarios one,decode  # CPU smoke
    python bench/load_bench.py --scenarios one,decode,mixed --worker-args=--no-engine-process  # engine in-process
    python bench/load_bench.py --scenarios shared,shared_nocache --no-step-times  # prefix caching on vs off
    python bench/load_bench.py --scenarios c1-p1024-o128,c64-p1024-o128 --worker-args="--max-seq-len 2048"
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# bench/ (this file's helpers beside it) and tests/ (ports.py: below the ephemeral range, never handed out twice)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
from metrics_text import fetch, label, series_key, summed  # noqa: E402
from ports import free_port  # noqa: E402
from proc_stats import host_cpu  # noqa: E402

from graphkeeper.worker.engine.gc_pauses import GC_PROCESSES  # noqa: E402  (the process label's values)

SCENARIOS = {
    # name: (streams, prompt range, output range, stagger seconds)
    "one": (1, (8, 8), (400, 400), 0.0),
    "decode": (64, (8, 8), (400, 400), 0.0),
    "mixed": (64, (16, 400), (64, 256), 2.0),
    "mixed256": (256, (16, 400), (64, 256), 2.0),
    # Long prompts beside decoding streams: what the step budget's inter-token target is for.
    "long": (64, (500, 3000), (32, 256), 2.0),
    "shared": (64, (8, 32), (32, 32), 0.0),
    "shared_nocache": (64, (8, 32), (32, 32), 0.0),
}
#: Scenarios whose prompts start with one common prefix of this many tokens (the same for every
#: stream and client process), and the context their worker serves.
SHARED_PREFIX = {"shared": 2000, "shared_nocache": 2000}
CONTEXT = {"shared": 4096, "shared_nocache": 4096}
#: Extra worker flags per scenario.
SCENARIO_FLAGS = {"shared_nocache": ["--no-prefix-caching"]}


def scenario_spec(name: str) -> tuple[int, tuple[int, int], tuple[int, int], float]:
    """A named scenario, or ``c<streams>-p<prompt>-o<output>`` (fixed lengths, no stagger): the
    workload published serving numbers use, e.g. ``c64-p1024-o128`` (bench/openai_bench.py runs the
    same through HTTP)."""
    if name in SCENARIOS:
        return SCENARIOS[name]
    try:
        c, p, o = name.split("-")
        assert c[0] == "c" and p[0] == "p" and o[0] == "o"
        streams, prompt, output = int(c[1:]), int(p[1:]), int(o[1:])
    except (ValueError, AssertionError, IndexError):
        raise SystemExit(f"unknown scenario {name!r}: one of {', '.join(SCENARIOS)} or c<N>-p<P>-o<O>") from None
    return streams, (prompt, prompt), (output, output), 0.0


@dataclass
class WorkerFlags:
    max_num_seqs: int
    budget: int
    max_seq_len: int = 1024
    extra: tuple[str, ...] = ()


def add_worker_arguments(parser: argparse.ArgumentParser, *, preset: str) -> None:
    """The flags ``start_worker`` reads, for this benchmark and every one that reuses its worker
    (kv_capacity.py): one list, so a flag added here cannot be missing there."""
    parser.add_argument("--preset", default=preset)
    parser.add_argument("--model", default="", help="the worker's --model (default: random:<preset>); prompts "
                        "are drawn from the preset's vocabulary")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--worker-pythonpath", default="", help="run an older checkout's worker")
    parser.add_argument("--worker-args", default="",
                        help="extra worker flags, e.g. --no-engine-process (the engine core on a thread of the API "
                             "process, as before the split)")
    parser.add_argument("--legacy", action="store_true", help="the worker predates --control-port")
    parser.add_argument("--switch-interval", type=float, default=0.0,
                        help="run the workers with this interpreter switch interval, seconds (0: their own)")
    parser.add_argument("--flush-gap", type=float, default=0.0,
                        help="run the workers with this stream pacing per open stream, seconds (0: their own)")
    parser.add_argument("--max-flush-gap", type=float, default=0.0,
                        help="run the workers with this cap on the stream pacing, seconds (0: their own)")


class Worker(NamedTuple):
    """A started worker: its process, inference target, metrics URL and control target ("" for a
    ``--legacy`` worker, which has no control port)."""

    proc: subprocess.Popen
    target: str
    metrics: str
    control: str


def scenario_flags(scenario: str, budget: int, extra: tuple[str, ...] = ()) -> WorkerFlags:
    """The worker flags a scenario runs under: room for its streams and its longest sequence."""
    streams, prompt, output, _ = scenario_spec(scenario)
    return WorkerFlags(max_num_seqs=max(64, streams), budget=budget,
                       max_seq_len=CONTEXT.get(scenario, max(1024, prompt[1] + output[1])),
                       extra=(*SCENARIO_FLAGS.get(scenario, ()), *extra))


def start_worker(args: argparse.Namespace, flags: WorkerFlags, log_path: Path,
                 sample_out: Path | None = None) -> Worker:
    """A worker process for one scenario (under ``thread_sampler`` when ``sample_out`` is given)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port, metrics, control = free_port(), free_port(), "" if args.legacy else f"127.0.0.1:{free_port()}"
    launcher = ["-m", "graphkeeper.cli"]
    if sample_out is not None or args.switch_interval or args.flush_gap or args.max_flush_gap:
        launcher = [str(Path(__file__).parent / "thread_sampler.py"), "--out", str(sample_out or ""),
                    "--switch-interval", str(args.switch_interval), "--flush-gap", str(args.flush_gap),
                    "--max-flush-gap", str(args.max_flush_gap), "--"]
    cmd = [sys.executable, *launcher, "worker", "--model", args.model or f"random:{args.preset}",
           "--device", args.device, "--dtype", args.dtype, "--port", str(port), "--metrics-port", str(metrics),
           "--max-num-seqs", str(flags.max_num_seqs), "--max-seq-len", str(flags.max_seq_len),
           "--max-queue", "4096", "--log-level", "WARNING"]
    if flags.budget:  # 0: the worker's own default (sized to the device since issue 35; 512 before)
        cmd += ["--max-num-batched-tokens", str(flags.budget)]
    if not args.legacy:
        cmd += ["--control-port", control.rsplit(":", 1)[1], "--http-port", "0"]
    cmd += [*flags.extra, *args.worker_args.split()]
    env = dict(os.environ)
    if args.worker_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.worker_pythonpath, env.get("PYTHONPATH")) if p)
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    target = f"127.0.0.1:{port}"
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited during startup:\n{log_path.read_text()[-3000:]}")
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service="graphkeeper.worker.v1.InferenceWorker"),
                               timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return Worker(proc, target, f"http://127.0.0.1:{metrics}/metrics", control)
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise RuntimeError("worker did not become ready")


def scrape(url: str) -> dict[str, float]:
    """Sums of the series the coverage figures need (``metrics_text.summed``)."""
    return summed(fetch(url))


def run_cell(args: argparse.Namespace, scenario: str, flags: WorkerFlags, log: Path, vocab: int,
             sample_out: Path | None = None) -> dict:
    """One fresh worker under one scenario's load: the clients' figures, the worker's /metrics over
    the load, and what the worker says of its step budget and step times (``worker_report``)."""
    proc, target, metrics, control = start_worker(args, flags, log, sample_out)
    row: dict = {}
    try:
        if sample_out is not None:
            proc.send_signal(signal.SIGUSR1)  # the sampler counts the load only, not the startup
        before = scrape(metrics)
        row.update(drive(target, scenario, args.seconds, vocab, args.client_procs))
        row.update(coverage(before, scrape(metrics)))
        row["token_budget"] = flags.budget or "default"
        row["max_num_seqs"] = flags.max_num_seqs
        after = scrape(metrics)
        for name in ("graphkeeper_prefix_cache_queries_tokens_total", "graphkeeper_prefix_cache_hits_tokens_total",
                     "graphkeeper_preemptions_total", "graphkeeper_steps_stretched_total"):
            row[name.removeprefix("graphkeeper_")] = after.get(name, 0.0) - before.get(name, 0.0)
        row.update(engine_tails(before, after))
        if control:
            row.update(worker_report(control))
    finally:
        stopping = time.perf_counter()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:  # a finding, not the benchmark's end
            proc.kill()
            proc.wait()
            print(f"{scenario}: the worker had not exited 60 s after SIGTERM; killed", flush=True)
        row["exit_seconds"] = time.perf_counter() - stopping  # SIGTERM to exit (drain included)
    if sample_out is not None and sample_out.exists():
        row["thread_samples"] = json.loads(sample_out.read_text())
        print(sampled_summary(row["thread_samples"]), flush=True)
    sustained = row.get("tokens_per_s_all_started")
    once = f" ({sustained:.0f} once every stream runs)" if sustained is not None and row.get("stagger_seconds") else ""
    print(f"{scenario:<9} budget {str(flags.budget or 'auto'):>5}: {row['tokens_per_s']:>8.0f} tok/s{once}, TTFT p50 "
          f"{row['ttft_ms'].get('p50', 0):.1f} ms p99 {row['ttft_ms'].get('p99', 0):.1f} ms, ITL p50 "
          f"{row['itl_ms'].get('p50', 0):.2f} ms p99 {row['itl_ms'].get('p99', 0):.2f} ms, coverage "
          f"{100 * row['coverage']:.1f}%, padding {100 * row['padding_waste']:.1f}%, errors {row['errors']}, "
          f"min requests/stream {row['min_requests_per_stream']}, exit {row['exit_seconds']:.1f} s", flush=True)
    if "engine_itl_ms" in row:
        print(f"{'':<9} in the engine: {tails_line(row)}", flush=True)
    add_work_bound(row)
    if "ratio_to_work" in row:
        print(f"{'':<9} the work allows {row['work_allows_tokens_per_s']:.0f} tok/s on the worker's captured steps: "
              f"{row['ratio_to_work']:.2f} of it", flush=True)
    return row


def tails_line(row: dict) -> str:
    """The engine's inter-token gaps and step times over the load, in a line (pure)."""
    def one(label: str) -> str:
        t = row[label]
        if t["p99"] is None:
            return f"{label} none"
        return (f"{label} p50 {t['p50']:.2f} p99 {t['p99']:.2f}, over 12 ms "
                f"{100 * (t['over_12'] or 0.0):.2f}%")
    line = "; ".join(one(label) for label in ENGINE_HISTOGRAMS)
    if "step_overruns" in row:
        line += f"; {row['step_overruns']:.0f} steps past the budget's bound"
    for process, gc in row.get("gc", {}).items():
        line += (f"; GC ({process}) {gc['collections']:.0f} pauses, {gc['pause_ms_total']:.1f} ms in all, "
                 f"{gc['over_5ms']:.0f} over 5 ms")
    return line


def worker_report(control: str) -> dict:
    """From the worker's GraphStatus: the step budget it runs with (``step_budget``: tokens a step,
    tokens with decode rows, the inter-token target and where it came from, and the TTFT guard: the
    stretched bound, the stretch ceiling and TTFT target and where they came from) and the step times
    it measured at capture (``step_times``: replay and eager seconds per captured mode and size;
    ``skipped``: the sizes left without a graph, with their reason and eager seconds, such as the
    coarse sizes released as compute bound, whose steps the step-time model prices eager)."""
    import grpc

    from graphkeeper.proto import worker_pb2 as pb
    from graphkeeper.proto import worker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(control) as channel:
        status = pb_grpc.GraphControlStub(channel).GetGraphStatus(pb.GetGraphStatusRequest(), timeout=10)
    budget = status.step_budget
    return {"step_budget": {"tokens": budget.tokens, "tokens_with_decode": budget.tokens_with_decode,
                            "itl_target_ms": 1e3 * budget.itl_target_seconds, "source": budget.source,
                            "tokens_stretched": budget.tokens_stretched, "itl_max_ms": 1e3 * budget.itl_max_seconds,
                            "ttft_target_ms": 1e3 * budget.ttft_target_seconds, "guard_source": budget.guard_source},
            "step_times": [{"mode": g.mode, "size": g.size, "replay_seconds": g.replay_seconds,
                            "eager_seconds": g.eager_seconds} for g in status.captured],
            "skipped": [{"mode": s.mode, "size": s.size, "reason": s.reason, "eager_seconds": s.eager_seconds}
                        for s in status.skipped]}


# --- the client processes -------------------------------------------------------------------------


def client_process(target: str, streams: int, prompt: tuple[int, int], output: tuple[int, int], stagger: float,
                   seconds: float, seed: int, vocab: int, queue: mp.Queue, prefix: tuple[int, ...] = ()) -> None:
    queue.put(asyncio.run(_client(target, streams, prompt, output, stagger, seconds, seed, vocab, prefix)))


def shared_prefix(tokens: int, vocab: int) -> tuple[int, ...]:
    """The common prefix of a shared-prefix scenario: the same ids in every client process."""
    rng = random.Random(2000)
    return tuple(rng.randrange(3, vocab) for _ in range(tokens))


async def _client(target, streams, prompt, output, stagger, seconds, seed, vocab, prefix=()) -> dict:
    import grpc

    from graphkeeper.proto import worker_pb2 as pb
    from graphkeeper.proto import worker_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    ttft, itl, errors = [], [], {}
    tokens_in_window = tokens_all_started = 0
    per_stream_requests = [0] * streams
    start = time.perf_counter()
    deadline = start + seconds
    all_started = start + stagger  # no stream of this process starts later
    async with grpc.aio.insecure_channel(target, options=(("grpc.max_receive_message_length", 1 << 24),)) as ch:
        stub = pb_grpc.InferenceWorkerStub(ch)

        async def stream(i: int) -> None:
            nonlocal tokens_in_window, tokens_all_started
            await asyncio.sleep(rng.uniform(0, stagger))
            while time.perf_counter() < deadline:
                n_prompt, n_new = rng.randint(*prompt), rng.randint(*output)
                req = pb.GenerateRequest(
                    prompt_token_ids=[*prefix, *(rng.randrange(3, vocab) for _ in range(n_prompt))],
                    stopping=pb.StoppingCriteria(max_new_tokens=n_new, ignore_eos=True))
                sent = last = time.perf_counter()
                first = True
                try:
                    async for msg in stub.Generate(req, timeout=600):
                        now = time.perf_counter()
                        if msg.HasField("tokens") and msg.tokens.token_ids:
                            k = len(msg.tokens.token_ids)
                            if now <= deadline:
                                tokens_in_window += k
                                tokens_all_started += k if now >= all_started else 0
                            if first:
                                ttft.append(now - sent)
                                first = False
                                k -= 1
                            itl.extend([(now - last) / max(1, k)] * k)
                            last = now
                    per_stream_requests[i] += 1
                except grpc.aio.AioRpcError as err:
                    errors[err.code().name] = errors.get(err.code().name, 0) + 1

        await asyncio.gather(*(stream(i) for i in range(streams)))
    return {"ttft": ttft, "itl": itl, "errors": errors, "tokens": tokens_in_window,
            "tokens_all_started": tokens_all_started, "per_stream_requests": per_stream_requests,
            "window": seconds}


def sustained_rate(parts: list[dict], seconds: float, stagger: float) -> float | None:
    """Tokens/s once every stream runs: each client process's tokens after its last stream's
    latest start (``stagger`` after its own start) over the rest of the window, summed over the
    processes (pure). A staggered scenario's window figure carries the ramp (a stream staggered
    uniformly over 2 s of a 10 s window is live for 9 s on average); this one does not. None when
    the window ends before every stream could have started."""
    if seconds <= stagger:
        return None
    return sum(part["tokens_all_started"] for part in parts) / (seconds - stagger)


def drive(target: str, scenario: str, seconds: float, vocab: int, procs: int) -> dict:
    streams, prompt, output, stagger = scenario_spec(scenario)
    procs = max(1, min(procs, streams))
    share = [streams // procs + (1 if i < streams % procs else 0) for i in range(procs)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    prefix = shared_prefix(SHARED_PREFIX.get(scenario, 0), vocab)
    workers = [ctx.Process(target=client_process, args=(target, n, prompt, output, stagger, seconds, 1000 + i,
                                                         vocab, queue, prefix)) for i, n in enumerate(share)]
    for p in workers:
        p.start()
    parts = [queue.get(timeout=seconds + 900) for _ in workers]
    for p in workers:
        p.join()
    ttft = sorted(x for part in parts for x in part["ttft"])
    itl = sorted(x for part in parts for x in part["itl"])
    errors: dict[str, int] = {}
    for part in parts:
        for code, n in part["errors"].items():
            errors[code] = errors.get(code, 0) + n
    per_stream = [n for part in parts for n in part["per_stream_requests"]]
    tokens = sum(part["tokens"] for part in parts)
    return {
        "scenario": scenario, "streams": streams, "seconds": seconds, "generated_tokens": tokens,
        "tokens_per_s": tokens / seconds, "errors": errors, "stagger_seconds": stagger,
        "tokens_per_s_all_started": sustained_rate(parts, seconds, stagger),
        "requests_completed": sum(per_stream), "min_requests_per_stream": min(per_stream),
        "ttft_ms": _percentiles(ttft), "itl_ms": _percentiles(itl),
        "first_ttft_ms": [1e3 * part["ttft"][0] for part in parts if part["ttft"]],  # each client's first
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    pick = lambda q: 1e3 * values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": 1e3 * statistics.fmean(values)}


def coverage(before: dict[str, float], after: dict[str, float]) -> dict:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    graph = delta.get("graphkeeper_graph_replays_total", 0.0)
    eager = {k.split('"')[1]: v for k, v in delta.items() if k.startswith("graphkeeper_eager_steps_total") and v}
    steps = graph + sum(eager.values())
    real, padded = delta.get("graphkeeper_real_tokens_total", 0.0), delta.get("graphkeeper_padded_tokens_total", 0.0)
    return {"steps": steps, "graph_steps": graph, "eager_steps": eager,
            "coverage": graph / steps if steps else 0.0, "padding_waste": 1 - real / padded if padded else 0.0}


#: The worker's own histograms set beside the client's inter-token gaps: the gaps between a
#: request's tokens as the engine hands them out, and every step's wall time.
ENGINE_HISTOGRAMS = {"engine_itl_ms": "graphkeeper_inter_token_latency_seconds",
                     "step_ms": "graphkeeper_step_duration_seconds"}
#: Shares above these bounds (ms; each a bucket bound of the worker's histograms).
TAIL_BOUNDS_MS = (8, 12, 16)


def buckets(before: dict[str, float], after: dict[str, float], name: str,
            process: str = "") -> list[tuple[float, float]]:
    """A histogram's cumulative (upper bound in seconds, count) over the load, bounds ascending;
    ``process``: one process's series of a histogram kept apart by process (pure)."""
    out = []
    for key, value in after.items():
        if key.split("{", 1)[0] == f"{name}_bucket" and label(key, "process") == process:
            bound = label(key, "le")
            out.append((float("inf") if bound == "+Inf" else float(bound), value - before.get(key, 0.0)))
    return sorted(out)


def quantile(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus's ``histogram_quantile``: linear within the bucket that holds the q-th observation;
    the largest finite bound when it falls in +Inf; None without observations (pure)."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank, lower, below = q * cumulative[-1][1], 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = bound, count
    return lower


def count_above(cumulative: list[tuple[float, float]], bound: float) -> float | None:
    """How many observations lie above ``bound`` seconds, which must be a bucket bound; None when
    it is not one (pure)."""
    total = cumulative[-1][1] if cumulative else 0.0
    at = next((count for b, count in cumulative if abs(b - bound) < 1e-12), None)
    return None if at is None else total - at


def share_above(cumulative: list[tuple[float, float]], bound: float) -> float | None:
    """The share of observations above ``bound`` seconds, which must be a bucket bound (pure)."""
    total = cumulative[-1][1] if cumulative else 0.0
    above = count_above(cumulative, bound)
    return None if not total or above is None else above / total


def engine_tails(before: dict[str, float], after: dict[str, float]) -> dict:
    """p50, p99 and the shares above ``TAIL_BOUNDS_MS`` of the engine's inter-token gaps and step
    times over the load, from the worker's histograms: set beside the client's gaps, they say
    whether a long gap was a long step, a row left out of a step, or the way to the client (pure)."""
    out = {}
    for field, name in ENGINE_HISTOGRAMS.items():
        cum = buckets(before, after, name)
        p50, p99 = quantile(cum, 0.5), quantile(cum, 0.99)
        out[field] = {"p50": None if p50 is None else 1e3 * p50, "p99": None if p99 is None else 1e3 * p99,
                      **{f"over_{ms}": share_above(cum, ms / 1e3) for ms in TAIL_BOUNDS_MS}}
    out["gc"] = gc_pauses(before, after)
    overruns = "graphkeeper_step_overruns_total"
    out["step_overruns"] = after.get(overruns, 0.0) - before.get(overruns, 0.0)
    return out


def gc_pauses(before: dict[str, float], after: dict[str, float]) -> dict:
    """The collector's pauses over the load, per worker process (engine, api): how many, their
    total, and how many lasted past 5 and 10 ms (a step, or the streams' writes, held up that
    long; pure)."""
    name = "graphkeeper_gc_pause_seconds"
    out = {}
    for process in GC_PROCESSES:
        cum = buckets(before, after, name, process)
        key = series_key(f"{name}_sum", process)
        out[process] = {"collections": cum[-1][1] if cum else 0.0,
                        "pause_ms_total": 1e3 * (after.get(key, 0.0) - before.get(key, 0.0)),
                        **{f"over_{ms}ms": count_above(cum, ms / 1e3) or 0.0 for ms in (5, 10)}}
    return out


# --- what the GPU allows ----------------------------------------------------------------------------


def full_step_times(args: argparse.Namespace, batches: list[int], context: int) -> dict[int, dict]:
    """The engine's FULL-graph decode step, timed in this process after the workers stopped."""
    sys.path.insert(0, str(Path(__file__).parent))
    from decode_bench import bench_ours

    from graphkeeper.worker.model.loader import load_model

    loaded = load_model(f"random:{args.preset}", device=args.device, dtype=args.dtype, max_positions=1024 + 64)
    rows = bench_ours(loaded, batches, context, steps=200, graphs=args.device == "cuda")
    return {r["batch"]: r for r in rows}


def work_bound(generated: float, prompt: float, streams: int, with_decode: int,
               step_times: list[dict]) -> float | None:
    """Tokens/s the window's work allows on the worker's own captured steps (pure): ``generated``
    tokens decoded by ``streams`` rows a step, and ``prompt`` tokens prefilled, as if every step
    were full: a prefill step carries ``streams`` decode rows and ``with_decode - streams`` prompt
    tokens at the replay time of the smallest captured size that holds ``with_decode`` tokens, a
    decode-only step ``streams`` rows at the smallest that holds them (the fastest mode at each
    size; ``step_times`` is the worker's ``GraphStatus.step_times``, timed at capture, in the same
    run). An upper bound: capture times its steps at a short context, every stream is assumed
    live from the window's start, and no step waits on the host. None when a size is not
    captured or no prompt fits beside the decode rows."""
    def replay(tokens: int) -> float | None:
        sizes = [e for e in step_times if e.get("size", 0) >= tokens and e.get("replay_seconds")]
        if not sizes:
            return None
        size = min(e["size"] for e in sizes)
        return min(e["replay_seconds"] for e in sizes if e["size"] == size)

    room = with_decode - streams
    decode, prefill = replay(streams), replay(with_decode)
    if decode is None or prefill is None or room <= 0 or not generated:
        return None
    prefill_steps = prompt / room
    decode_steps = max(0.0, generated / streams - prefill_steps)
    return generated / (prefill_steps * prefill + decode_steps * decode)


def add_work_bound(row: dict) -> None:
    """Puts ``work_bound`` beside a row's tokens/s (the window's and once every stream runs),
    from the figures the row already holds."""
    budget = row.get("step_budget") or {}
    bound = work_bound(row.get("generated_tokens", 0), row.get("prefix_cache_queries_tokens_total", 0),
                       row["streams"], budget.get("tokens_with_decode", 0), row.get("step_times") or [])
    if bound:
        row["work_allows_tokens_per_s"] = bound
        row["ratio_to_work"] = row["tokens_per_s"] / bound
        if row.get("tokens_per_s_all_started"):
            row["ratio_to_work_all_started"] = row["tokens_per_s_all_started"] / bound


def add_gpu_ratios(args: argparse.Namespace, rows: list[dict]) -> dict[str, dict]:
    """Times the FULL-graph decode step at each row's stream count (``full_step_times``) and puts
    each row's throughput and inter-token latency beside it; returns the step times by batch."""
    steps = full_step_times(args, sorted({row["streams"] for row in rows}), context=256)
    for row in rows:
        step = steps[row["streams"]]
        for kind in ("median_ms", "gpu_median_ms"):
            if kind in step:  # on a CPU there are no CUDA events: wall time only
                allowed = row["streams"] / (step[kind] / 1e3)
                row[f"gpu_allows_tokens_per_s_{kind}"] = allowed
                row[f"ratio_to_gpu_{kind}"] = row["tokens_per_s"] / allowed
        row["itl_p50_over_step"] = row["itl_ms"].get("p50", 0) / step["median_ms"]
        row["itl_p99_over_step"] = row["itl_ms"].get("p99", 0) / step["median_ms"]
    return {str(b): r for b, r in steps.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_worker_arguments(parser, preset="llama-1b")
    parser.add_argument("--scenarios", default="one,decode,mixed,mixed256")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--budget", type=int, default=0, help="token budget (0: the worker's default)")
    parser.add_argument("--budgets", default="", help="comma list: sweep --budget-scenarios over these budgets")
    parser.add_argument("--budget-scenarios", default="mixed", help="comma list: the scenarios --budgets sweeps")
    parser.add_argument("--client-procs", type=int, default=8)
    parser.add_argument("--sample-threads", action="store_true",
                        help="run each worker under bench/thread_sampler.py and keep its summary")
    parser.add_argument("--no-step-times", action="store_true", help="skip timing the FULL-graph step afterwards")
    parser.add_argument("--logs", default="", help="directory for the workers' logs (default: a new temp dir)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from graphkeeper.worker.model.config import PRESETS

    vocab = PRESETS[args.preset].vocab_size
    results: dict = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "commit": _commit(), "label": args.label, "switch_interval": args.switch_interval,
        "flush_gap": args.flush_gap, "max_flush_gap": args.max_flush_gap, "preset": args.preset, "dtype": args.dtype,
        "gpu": _gpu_name(args.device), "host": platform.node(), "host_cpu": host_cpu(), "scenarios": [],
    }
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="load-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    plan = [(s, args.budget) for s in args.scenarios.split(",") if s]
    if args.budgets:
        plan += [(s, int(b)) for s in args.budget_scenarios.split(",") for b in args.budgets.split(",")]
    for scenario, budget in plan:
        flags = scenario_flags(scenario, budget)
        sample_out = logs / f"{scenario}-{budget}-threads.json" if args.sample_threads else None
        results["scenarios"].append(run_cell(args, scenario, flags, logs / f"{scenario}-{budget}.log", vocab,
                                             sample_out))
    by_name = {row["scenario"]: row for row in results["scenarios"]}
    if "shared" in by_name and "shared_nocache" in by_name:
        on, off = by_name["shared"]["ttft_ms"].get("p50", 0), by_name["shared_nocache"]["ttft_ms"].get("p50", 0)
        results["shared_prefix_ttft_p50_off_over_on"] = off / on if on else 0.0
        print(f"shared prefix: TTFT p50 {on:.1f} ms with prefix caching, {off:.1f} ms without "
              f"({results['shared_prefix_ttft_p50_off_over_on']:.1f}x)", flush=True)
    if args.device == "cuda" and not args.legacy and not args.no_step_times:
        results["full_step"] = add_gpu_ratios(args, results["scenarios"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "scenarios"}, indent=1)[:2000])
    return 0


def sampled_summary(samples: dict, threads: tuple[str, ...] = ("engine", "MainThread"), top: int = 10) -> str:
    """The largest innermost-function shares of the engine and event-loop threads, as text."""
    lines = []
    for name in threads:
        info = samples["threads"].get(name)
        if info:
            for kind in ("innermost", "inclusive"):
                shares = ", ".join(f"{100 * r['share']:.0f}% {r['function']}" for r in info[kind][:top])
                lines.append(f"    {name} ({kind}): {shares}")
    return "\n".join(lines)


def _commit() -> str:
    """GRAPHKEEPER_COMMIT when set (a copied tree's git metadata can lag its files), else git's HEAD."""
    if os.environ.get("GRAPHKEEPER_COMMIT"):
        return os.environ["GRAPHKEEPER_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


def _gpu_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    sys.exit(main())
