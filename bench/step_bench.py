"""The decode step itself, side by side in one run: our FULL-graph step compiled (-O2) and not
(-O1, fused Triton kernels), our eager step, fp8 weights, `transformers` eager and `transformers`
with a static cache and `torch.compile(mode="reduce-overhead")`, against the HBM floor measured in
the same run.

Every method decodes one token for each of ``batch`` sequences holding ``--context`` tokens of KV
cache, computes logits and the greedy token, and is timed by CUDA events around the step (GPU
time, the figure the floor bounds) and by the wall clock to the host's tokens. The floor is the
bytes a step must read (every weight once, each sequence's keys and values) over the copy
bandwidth measured here: ``2 * bytes / time`` of a 2 GiB device-to-device copy (read + write).

    python bench/step_bench.py --out bench/results/step-h200.json             # H200, everything
    python bench/step_bench.py --presets tiny --batches 1 --methods eager --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_bench import _transformers_batch, bench_ours, decode_plan, prepare, timed  # noqa: E402
from load_bench import _commit  # noqa: E402

from graphkeeper.worker.executor.graphs.graph_set import CapturedGraph, GraphSet  # noqa: E402
from graphkeeper.worker.executor.graphs.modes import FULL  # noqa: E402
from graphkeeper.worker.executor.runner import ModelRunner  # noqa: E402
from graphkeeper.worker.kernels import linear_kernel, row_kernel  # noqa: E402
from graphkeeper.worker.model.config import PRESETS  # noqa: E402
from graphkeeper.worker.model.kv_cache import KVCache  # noqa: E402
from graphkeeper.worker.model.loader import LoadedModel, load_model, save_hf_directory  # noqa: E402

METHODS = ("compiled", "fused", "eager", "fp8", "hf-eager", "hf-compiled")


def copy_bandwidth(device: str, gib: float = 2.0, repeats: int = 20) -> float:
    """Bytes per second a device-to-device copy moves, counting the read and the write."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def step_bytes(loaded: LoadedModel, batch: int, context: int) -> int:
    """What one decode step must read: every weight matrix once (the embedding only for its rows),
    and each sequence's keys and values for every layer."""
    model, c = loaded.model, loaded.config
    weights = 0
    for layer in model.layers:
        for linear in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2):
            weights += linear.weight.numel() * linear.weight.element_size()
        weights += 2 * c.dim * 2  # the two norms
    weights += model.output.weight.numel() * model.output.weight.element_size()
    kv = 2 * c.n_layers * batch * (context + 1) * c.n_kv_heads * c.head_dim * torch.finfo(loaded.dtype).bits // 8
    return weights + kv


def bench_transformers_eager(hf, batches: list[int], context: int, steps: int) -> list[dict]:
    """transformers' forward with a static cache, uncompiled (its eager step)."""
    from transformers import StaticCache

    rows = []
    for b in batches:
        cache = StaticCache(config=hf.config, max_cache_len=context + 16)
        vocab = hf.config.vocab_size
        with torch.inference_mode():
            hf(torch.randint(3, vocab, (b, context), device=hf.device), past_key_values=cache, use_cache=True)
        ids = torch.randint(3, vocab, (b, 1), device=hf.device)
        position = torch.tensor([context], device=hf.device)

        def prep(cache=cache):
            with torch.inference_mode():
                for layer in cache.layers:
                    layer.cumulative_length.fill_(context)

        def run(ids=ids, position=position, cache=cache):
            with torch.inference_mode():
                return hf(ids, cache_position=position, position_ids=position.expand(ids.shape[0], 1),
                          past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)

        stats = timed(prep, run, steps)
        print(f"  transformers eager       batch {b:>3}: {stats['median_ms']:.3f} ms wall, "
              f"{stats.get('gpu_median_ms', 0):.3f} ms GPU", flush=True)
        rows.append({"method": "transformers eager", "batch": b, **stats,
                     "tokens_per_s": b / (stats["median_ms"] / 1e3)})
    return rows


def profile_step(loaded: LoadedModel, step: str, batch: int, context: int) -> list[dict]:
    """The kernels one FULL-graph step replays (name, count, mean GPU microseconds), largest total first."""
    from torch.profiler import ProfilerActivity, profile

    cache = KVCache(loaded.config, batch, context + 16, device=loaded.device, dtype=loaded.dtype)
    runner = ModelRunner(loaded, cache, max(batch, 2))
    prepare(runner, step)
    plan = decode_plan(batch, context, loaded.config.vocab_size)
    meta = runner.prepare(plan, batch)
    graphs = GraphSet(runner)
    graphs.captured[(FULL, batch)] = CapturedGraph(FULL, batch, graphs.record(FULL, batch), 0.0, 0, 0)
    for _ in range(5):
        graphs.replay(FULL, batch, meta)
    torch.cuda.synchronize()
    replays = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.replay(FULL, batch, meta)
        torch.cuda.synchronize()
    table: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            table.setdefault(e.name[:90], []).append(e.device_time)
    rows = [{"kernel": k, "per_step": len(v) / replays, "mean_us": statistics.mean(v), "total_us_per_step":
             sum(v) / replays} for k, v in table.items()]
    rows.sort(key=lambda r: -r["total_us_per_step"])
    total = sum(r["total_us_per_step"] for r in rows)
    count = sum(r["per_step"] for r in rows)
    print(f"  profile {step} batch {batch}: {count:.0f} kernels, {total:.0f} us of kernel time per step", flush=True)
    for r in rows[:14]:
        print(f"    {r['per_step']:5.0f} x {r['mean_us']:7.2f} us = {r['total_us_per_step']:7.1f} us  {r['kernel']}",
              flush=True)
    graphs.release()
    return rows


def run_preset(preset: str, args: argparse.Namespace, bandwidth: float, report: dict) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    methods = set(args.methods.split(","))
    source = f"random:{preset}"
    positions = args.context + 32
    print(f"{preset}:", flush=True)
    rows: list[dict] = []
    with torch.inference_mode():
        loaded = load_model(source, device=args.device, dtype=args.dtype, max_positions=positions)
        floors = {b: step_bytes(loaded, b, args.context) / bandwidth * 1e3 for b in batches}
        for step in args.profile.split(",") if args.profile else []:
            torch.compiler.reset()
            report["profiles"][f"{preset}/{step}/1"] = profile_step(loaded, step, 1, args.context)
        if "compiled" in methods:
            rows += bench_ours(loaded, batches, args.context, args.steps, graphs=True, step="compiled",
                               label="graphkeeper FULL graph, compiled (-O2)")
        if "fused" in methods:
            torch.compiler.reset()
            rows += bench_ours(loaded, batches, args.context, args.steps, graphs=True, step="fused",
                               label="graphkeeper FULL graph, uncompiled (-O1)")
        if "eager" in methods:
            rows += bench_ours(loaded, batches, args.context, args.steps, graphs=False, step="fused",
                               label="graphkeeper eager (-O0)")
    hf = None
    if {"hf-eager", "hf-compiled"} & methods:
        import tempfile

        from transformers import LlamaForCausalLM

        with tempfile.TemporaryDirectory() as tmp:
            save_hf_directory(loaded.model, Path(tmp))
            hf = LlamaForCausalLM.from_pretrained(tmp, dtype=loaded.dtype).to(loaded.device).eval()
    del loaded
    gc.collect()
    torch.cuda.empty_cache()
    if hf is not None and "hf-eager" in methods:
        rows += bench_transformers_eager(hf, batches, args.context, args.steps)
    if hf is not None and "hf-compiled" in methods:
        if preset in args.skip_hf_compile.split(","):
            report["notes"].append(f"{preset}: transformers compiled not run (--skip-hf-compile): its compile "
                                   "takes minutes per batch size at this shape")
        else:
            for b in batches:
                torch.compiler.reset()
                rows.append(_transformers_batch(hf, __import__("transformers").StaticCache, b, args.context,
                                                args.steps))
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    if "fp8" in methods:
        with torch.inference_mode():
            torch.compiler.reset()
            q = load_model(source, device=args.device, dtype=args.dtype, max_positions=positions, quantization="fp8")
            fp8_floors = {b: step_bytes(q, b, args.context) / bandwidth * 1e3 for b in batches}
            fp8_rows = bench_ours(q, batches, args.context, args.steps, graphs=True, step="compiled",
                                  label="graphkeeper FULL graph, compiled, fp8 weights")
            for row in fp8_rows:
                row["own_floor_ms"] = fp8_floors[row["batch"]]
            rows += fp8_rows
            del q
            gc.collect()
            torch.cuda.empty_cache()
    for row in rows:
        row["preset"] = preset
        row["floor_ms"] = floors[row["batch"]]
        floor = row.get("own_floor_ms", row["floor_ms"])
        row["gpu_over_floor"] = row.get("gpu_median_ms", row["median_ms"]) / floor
        row["wall_over_floor"] = row["median_ms"] / floor
    report["rows"] += rows
    report["floors_ms"][preset] = floors
    report["linear_tuning"][preset] = tuning_summary()


def tuning_summary() -> list[dict]:
    """What linear tuning measured since the last call (printed: the winner of each shape and row
    bucket, and cuBLAS's time), as rows for the report; the measurements are then cleared."""
    rows = [dict(zip(("n", "k", "weight_dtype", "rows", "candidate", "us"), m, strict=True))
            for m in linear_kernel.measurements]
    best: dict[tuple, tuple] = {}
    for n, k, wd, r, name, us in linear_kernel.measurements:
        if (n, k, wd, r) not in best or us < best[(n, k, wd, r)][1]:
            best[(n, k, wd, r)] = (name, us)
    for (n, k, wd, r), (name, us) in sorted(best.items()):
        cublas = next((m[5] for m in linear_kernel.measurements if m[:4] == (n, k, wd, r) and m[4] == "cublas"), 0)
        nbytes = n * k * (1 if "float8" in wd else 2)
        print(f"    linear {n}x{k} {wd} rows {r}: {name} {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s), "
              f"cublas {cublas:.1f} us", flush=True)
    linear_kernel.measurements.clear()
    best_rows: dict[tuple, tuple] = {}
    for mode, n, k, wd, name, us in row_kernel.measurements:
        rows.append({"row_kernel_mode": mode, "n": n, "k": k, "weight_dtype": wd, "rows": 1, "candidate": name,
                     "us": us})
        if (mode, n, k, wd) not in best_rows or us < best_rows[(mode, n, k, wd)][1]:
            best_rows[(mode, n, k, wd)] = (name, us)
    for (mode, n, k, wd), (name, us) in sorted(best_rows.items()):
        nbytes = n * k * (1 if "float8" in wd else 2)
        print(f"    row kernel mode {mode} {n}x{k} {wd}: {name} {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s)", flush=True)
    row_kernel.measurements.clear()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,llama-1b,llama-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--skip-hf-compile", default="llama-8b", help="presets whose transformers compile is skipped")
    parser.add_argument("--profile", default="", help="steps to profile at batch 1: compiled,fused,plain")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(args.device)
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": _commit(), "dtype": args.dtype, "context": args.context,
        "copy_bandwidth_bytes_per_s": bandwidth, "rows": [], "floors_ms": {}, "notes": [], "profiles": {},
        "linear_tuning": {},
    }
    print(f"{report['gpu']}, torch {torch.__version__}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    start = time.perf_counter()
    for preset in args.presets.split(","):
        if preset not in PRESETS:
            raise SystemExit(f"unknown preset {preset}")
        run_preset(preset, args, bandwidth, report)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    report["seconds"] = time.perf_counter() - start
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def table(report: dict) -> str:
    lines = ["| shape | batch | method | GPU ms | wall ms | floor ms | GPU / floor |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        floor = r.get("own_floor_ms", r["floor_ms"])
        lines.append(f"| {r['preset']} | {r['batch']} | {r['method']} | {r.get('gpu_median_ms', 0):.3f} | "
                     f"{r['median_ms']:.3f} | {floor:.3f} | {r['gpu_over_floor']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
