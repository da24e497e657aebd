"""Decode-step benchmark on the GPU: eager, FULL graph replay, and transformers' compiled peer;
the capture cost of whole ladders; graph coverage and padding waste on mixed traffic.

Every timed step is a whole engine decode step as the worker runs it: fill the inputs, run the
model (eagerly or by replay), compute logits for the sample rows, take the greedy tokens back to
the host. Times are wall-clock medians per step after warm-up (the host sync at the end of each
step makes wall time the step's real latency).

    python bench/decode_bench.py --out bench/results/decode.json            # everything, H200
    python bench/decode_bench.py --device cpu --preset tiny --parts eager   # smoke test on a CPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import mode_name, reason_name
from graphkeeper.proto.policy import default_ladder
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.executor.graphs.capture import CaptureJob
from graphkeeper.worker.executor.graphs.graph_set import CapturedGraph, GraphSet
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.executor.sampling import sample
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.model.loader import LoadedModel, load_model, save_hf_directory
from graphkeeper.worker.plan import StepPlan

FULL = pb.GRAPH_MODE_FULL


def timed(prep, run, steps: int, warmup: int = 10) -> dict[str, float]:
    """Wall time of whole steps (``prep`` on the host, then ``run`` to the host's tokens), and
    CUDA-event time of ``run`` alone up to its last kernel (the recorded part, LM head and argmax)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        prep()
        run().tolist()
    walls, gpus = [], []
    for _ in range(steps):
        start = time.perf_counter()
        prep()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        tokens = run()
        if cuda:
            end.record()
        tokens.tolist()
        walls.append(time.perf_counter() - start)
        if cuda:
            gpus.append(begin.elapsed_time(end) / 1e3)
    walls.sort()
    result = {"median_ms": 1e3 * statistics.median(walls), "p10_ms": 1e3 * walls[len(walls) // 10],
              "p90_ms": 1e3 * walls[(9 * len(walls)) // 10]}
    if gpus:
        result["gpu_median_ms"] = 1e3 * statistics.median(gpus)
    return result


def decode_plan(batch: int, context: int, vocab: int) -> StepPlan:
    tokens = np.array([random.randrange(3, vocab) for _ in range(batch)], dtype=np.int64)
    return StepPlan(prompt_tokens=[], positions=np.full(batch, context), slots=np.arange(batch), num_decode=batch,
                    sample_rows=np.arange(batch), sample_slots=np.arange(batch), decode_tokens=tokens)


def prepare(runner: ModelRunner, step: str, cache_root: str = "") -> dict:
    """Builds the runner's step as the worker would: ``plain`` torch ops, ``fused`` (-O1: Triton
    kernels, uncompiled) or ``compiled`` (-O2); returns the compile report as a dict."""
    from graphkeeper.worker.model.step import prepare_step
    from graphkeeper.worker.settings import DEFAULT_COMPILE_CACHE_DIR

    rows = min(64, runner.max_tokens)
    if step == "plain":
        runner.warm_up(rows)
        return {}
    report = prepare_step(runner.model, compile=step == "compiled", cache_root=cache_root or DEFAULT_COMPILE_CACHE_DIR,
                          quantization=runner.loaded.quantization, warm_up=lambda: runner.warm_up(rows), level=2,
                          reason="bench")
    return {"compile_seconds": report.seconds, "cache": report.cache, "compiled_graphs": report.graphs,
            "kernels": runner.model.kernels, "row_step": report.row_step}


def bench_ours(loaded: LoadedModel, batches: list[int], context: int, steps: int, graphs: bool,
               step: str = "compiled", label: str = "") -> list[dict]:
    cache = KVCache(loaded.config, max(batches), context + 16, device=loaded.device, dtype=loaded.dtype)
    runner = ModelRunner(loaded, cache, max(batches))
    built = prepare(runner, step if loaded.device.type == "cuda" else "plain")
    graph_set = GraphSet(runner) if graphs else None
    rows = []
    for b in batches:
        plan = decode_plan(b, context, loaded.config.vocab_size)
        meta = runner.prepare(plan, b)
        runner.forward_eager(meta, b)  # library handles (cuBLAS) exist before any capture
        if graph_set is not None:
            graph_set.captured[(FULL, b)] = CapturedGraph(FULL, b, graph_set.record(FULL, b), 0.0, 0, 0)

        def prep(plan=plan, b=b):
            runner.prepare(plan, b)

        def run(plan=plan, b=b, meta=meta):
            hidden = graph_set.replay(FULL, b, meta) if graph_set else runner.forward_eager(meta, b)
            return sample(runner.model.head(runner.sample_rows(hidden, plan)), None)  # greedy, as the worker samples

        stats = timed(prep, run, steps)
        method = label or ("graphkeeper FULL graph" if graphs else "graphkeeper eager")
        rows.append({"method": method, "batch": b, "step": step, **built, **stats,
                     "tokens_per_s": b / (stats["median_ms"] / 1e3)})
        print(f"  {rows[-1]['method']:<24} batch {b:>3}: {stats['median_ms']:.3f} ms wall, "
              f"{stats.get('gpu_median_ms', 0):.3f} ms GPU", flush=True)
    return rows


def count_kernels(loaded: LoadedModel, context: int) -> dict:
    """GPU kernels one eager decode step launches at batch 1 (what a FULL graph records)."""
    from torch.profiler import ProfilerActivity, profile

    cache = KVCache(loaded.config, 1, context + 16, device=loaded.device, dtype=loaded.dtype)
    runner = ModelRunner(loaded, cache, 1)
    plan = decode_plan(1, context, loaded.config.vocab_size)
    runner.forward_eager(runner.prepare(plan, 1), 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward_eager(runner.prepare(plan, 1), 1)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names: dict[str, int] = {}
    for e in kernels:
        names[e.name[:60]] = names.get(e.name[:60], 0) + 1
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    print(f"  one eager decode step (model forward, batch 1): {len(kernels)} GPU kernels", flush=True)
    return {"kernels_per_forward": len(kernels), "top": top}


def bench_transformers(loaded: LoadedModel, batches: list[int], context: int, steps: int) -> list[dict]:
    """transformers LlamaForCausalLM, StaticCache, torch.compile(mode='reduce-overhead'), same weights."""
    from transformers import LlamaForCausalLM, StaticCache

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_directory(loaded.model, Path(tmp))
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=loaded.dtype).to(loaded.device).eval()
    for b in batches:
        rows.append(_transformers_batch(hf, StaticCache, b, context, steps))
        torch._dynamo.reset()
    return rows


def _transformers_batch(hf, static_cache, b: int, context: int, steps: int) -> dict:
    device, vocab = hf.device, hf.config.vocab_size
    cache = static_cache(config=hf.config, max_cache_len=context + 16)
    with torch.inference_mode():
        hf(torch.randint(3, vocab, (b, context), device=device), past_key_values=cache, use_cache=True)
    ids = torch.randint(3, vocab, (b, 1), device=device)
    position = torch.tensor([context], device=device)

    def forward(ids, position):
        return hf(ids, cache_position=position, position_ids=position.expand(ids.shape[0], 1),
                  past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)

    compiled = torch.compile(forward, mode="reduce-overhead", fullgraph=True)

    def prep():
        with torch.inference_mode():
            for layer in cache.layers:  # keep the context at `context` tokens every step
                layer.cumulative_length.fill_(context)

    def run():
        with torch.inference_mode():
            return compiled(ids, position)

    start = time.perf_counter()
    prep()
    run().tolist()
    compile_s = time.perf_counter() - start
    stats = timed(prep, run, steps)
    print(f"  transformers compiled    batch {b:>3}: {stats['median_ms']:.3f} ms wall, "
          f"{stats.get('gpu_median_ms', 0):.3f} ms GPU (compile {compile_s:.1f} s)", flush=True)
    return {"method": "transformers compiled", "batch": b, **stats, "compile_s": compile_s,
            "tokens_per_s": b / (stats["median_ms"] / 1e3)}


def bench_ladder(loaded: LoadedModel, max_num_seqs: int, max_tokens: int, mode: int, context: int) -> dict:
    """Captures a whole default ladder the way the worker does; returns per-size cost."""
    from graphkeeper.worker.executor.graphs.modes import capture_plan

    ladder = default_ladder(min(2 * max_num_seqs, 512, max_tokens))
    cache = KVCache(loaded.config, max_num_seqs, context + 16, device=loaded.device, dtype=loaded.dtype)
    runner = ModelRunner(loaded, cache, max_tokens)
    runner.warm_up(max_num_seqs)
    torch.cuda.synchronize()
    plan = capture_plan(mode, ladder, max_num_seqs)
    graphs = GraphSet(runner)
    job = CaptureJob(graphs, plan, tolerance=2e-2)
    start = time.perf_counter()
    job.run_all()
    wall = time.perf_counter() - start
    job.finish()
    result = {
        "mode": mode_name(mode), "max_num_seqs": max_num_seqs, "ladder_sizes": len(ladder), "graphs": len(plan),
        "captured": len(graphs.captured),
        "skipped": {f"{mode_name(m)}:{s}": v.message for (m, s), v in graphs.skipped.items()},
        "capture_seconds_sum": job.parts["warm_up"] + job.parts["record"], "phase_wall_seconds_incl_validation": wall,
        "device_memory_bytes": graphs.memory_bytes,
        "per_size": [{"mode": mode_name(m), "size": s, "seconds": e.seconds, "device_bytes": e.device_bytes,
                      "reserved_bytes": e.reserved_bytes} for (m, s), e in graphs.captured.items()],
    }
    graphs.release()
    del graphs, runner, cache
    torch.cuda.empty_cache()
    print(f"  ladder {result['mode']}: {result['captured']}/{result['graphs']} graphs, capture "
          f"{result['capture_seconds_sum']:.2f} s (phase {wall:.2f} s with validation), "
          f"{result['device_memory_bytes'] / 2**20:.1f} MiB", flush=True)
    return result


def bench_mixed(source: str, mode: int, seconds_per_level: float, dtype: str) -> dict:
    """Mixed traffic (1..64 concurrent streams, random prompt and output lengths) through an engine."""
    policy = pb.GraphPolicy(policy_uid="bench", generation=1, mode=mode)
    policy.capture_sizes.ladder = pb.CAPTURE_LADDER_DEFAULT
    engine = Engine(EngineSettings(model=source, device="cuda", dtype=dtype, max_num_seqs=64, max_seq_len=1024,
                                   max_num_batched_tokens=512, max_queue=1024, policy=policy))
    engine.start()
    assert engine.ready.wait(600) and engine.failed is None, engine.failed
    rng = random.Random(0)
    generated = 0
    lock = threading.Lock()
    start = time.perf_counter()
    for concurrency in (1, 4, 16, 64):
        deadline = time.perf_counter() + seconds_per_level

        def client(deadline: float) -> None:
            nonlocal generated
            while time.perf_counter() < deadline:
                done = threading.Event()
                count = [0]

                def emit(tokens, end, done=done, count=count):
                    count[0] += len(tokens)
                    if end is not None:
                        done.set()

                with lock:
                    n_prompt, n_new = rng.randint(16, 384), rng.randint(16, 256)
                req = pb.GenerateRequest(prompt_token_ids=[rng.randrange(3, 500) for _ in range(n_prompt)],
                                         stopping=pb.StoppingCriteria(max_new_tokens=n_new, ignore_eos=True))
                engine.submit(req, emit)
                done.wait()
                with lock:
                    generated += count[0]

        threads = [threading.Thread(target=client, args=(deadline,)) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elapsed = time.perf_counter() - start
    d = engine.recorder
    result = {
        "mode": mode_name(mode), "generated_tokens": generated, "seconds": elapsed,
        "tokens_per_s": generated / elapsed,
        "graph_steps": {f"{mode_name(m)}:{s}": n for (m, s), n in sorted(d.graph_steps.items())},
        "eager_steps": {reason_name(r): n for r, n in d.eager_steps.items()},
        "coverage": sum(d.graph_steps.values()) / max(1, sum(d.graph_steps.values()) + sum(d.eager_steps.values())),
        "padding_waste": 1 - d.real_tokens / max(1, d.padded_tokens),
        "real_tokens": d.real_tokens, "padded_tokens": d.padded_tokens,
    }
    engine.drain_and_stop(30)
    torch.cuda.empty_cache()
    print(f"  mixed traffic {result['mode']}: {result['tokens_per_s']:.0f} tok/s, coverage "
          f"{100 * result['coverage']:.1f}% of steps, padding waste {100 * result['padding_waste']:.1f}%", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--parts", default="kernels,eager,graph,transformers,ladder,mixed")
    parser.add_argument("--mixed-seconds", type=float, default=8.0, help="seconds per concurrency level")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    source = f"random:{args.preset}"
    loaded = load_model(source, device=args.device, dtype=args.dtype, max_positions=args.context + 16)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    report: dict = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "gpu": gpu, "torch": torch.__version__,
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]), "preset": args.preset,
        "dtype": args.dtype, "context": args.context, "decode": [],
    }
    print(f"{gpu}, torch {torch.__version__}, {args.preset} {args.dtype}, context {args.context}", flush=True)
    with torch.inference_mode():
        if "kernels" in parts:
            report["kernels"] = count_kernels(loaded, args.context)
        if "eager" in parts:
            report["decode"] += bench_ours(loaded, batches, args.context, args.steps, graphs=False)
        if "graph" in parts:
            report["decode"] += bench_ours(loaded, batches, args.context, args.steps, graphs=True)
    if "transformers" in parts:
        report["decode"] += bench_transformers(loaded, batches, args.context, args.steps)
    with torch.inference_mode():
        if "ladder" in parts:
            report["ladders"] = [
                bench_ladder(loaded, 512, 512, pb.GRAPH_MODE_FULL_DECODE_ONLY, args.context),
                bench_ladder(loaded, 256, 512, pb.GRAPH_MODE_FULL_AND_PIECEWISE, args.context),
            ]
    del loaded
    if "mixed" in parts:
        report["mixed"] = [bench_mixed(source, m, args.mixed_seconds, args.dtype)
                           for m in (pb.GRAPH_MODE_FULL_AND_PIECEWISE, pb.GRAPH_MODE_NONE)]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
