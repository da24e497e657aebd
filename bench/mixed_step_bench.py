"""Where a mixed step's GPU time goes: one step of decode rows beside prompt chunks, recorded as the
worker records it (a whole-step PIECEWISE graph at the padded size, the varlen attention inside)
and replayed, against the FULL decode step of the same decode rows; each replay timed by CUDA
events, then profiled once, its kernels' time summed by kind (attention, KV write, projections,
norms and the rest).

Mixed traffic (``load_bench.py``'s ``mixed``) runs steps of about 52-60 decode rows and 70 prompt
tokens, padded to 128 rows; the decode rows sit 16 to 656 keys deep. The step's time sets that
scenario's pace where the device is the limit, so this says which kernels to work on.

    python bench/mixed_step_bench.py --out bench/results/mixed-step.json
    python bench/mixed_step_bench.py --steps 60:68:128,64:0:64 --depth 656 --chunk 48
    python bench/mixed_step_bench.py --layouts blocks,split,branch   # the varlen kernel's launch layouts
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_bench import prepare  # noqa: E402
from load_bench import _commit  # noqa: E402

from graphkeeper.worker.executor.graphs.capture import timed_once  # noqa: E402
from graphkeeper.worker.executor.graphs.graph_set import CapturedGraph, GraphSet  # noqa: E402
from graphkeeper.worker.executor.graphs.modes import FULL, PIECEWISE  # noqa: E402
from graphkeeper.worker.executor.runner import ModelRunner  # noqa: E402
from graphkeeper.worker.kernels import varlen_kernel  # noqa: E402
from graphkeeper.worker.model.kv_cache import KVCache  # noqa: E402
from graphkeeper.worker.model.loader import load_model  # noqa: E402
from graphkeeper.worker.plan import PrefillChunk, StepPlan  # noqa: E402

#: Kernel kinds, by the first pattern found in a kernel's name (lower case); the rest is "other".
KINDS = (("attention", ("varlen", "decode_kernel", "combine_kernel")), ("kv write", ("kv_write", "_write_kernel")),
         ("projections", ("gemm", "row_kernel", "skinny", "linear", "matmul", "sm90", "cutlass", "nvjet")),
         ("norms", ("norm",)))


def kind_of(name: str) -> str:
    """The kind a kernel's name says it is (pure)."""
    low = name.lower()
    for kind, patterns in KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other"


def mixed_plan(decode: int, prompt: int, depth: int, chunk: int, vocab: int, seed: int) -> StepPlan:
    """``decode`` rows, each in a slot of its own at a depth drawn from 16 .. ``depth``, then
    ``prompt`` tokens in chunks of up to ``chunk`` tokens (each in a slot of its own, from a start
    drawn below ``depth``); decode rows carry their token (no history here)."""
    rng = random.Random(seed)
    positions, slots, chunks, prompt_tokens = [], [], [], []
    for slot in range(decode):
        positions.append(rng.randint(16, depth) - 1)
        slots.append(slot)
    row, slot, left = decode, decode, prompt
    while left:
        n = min(chunk, left)
        start = rng.randint(0, max(0, depth - n))
        chunks.append(PrefillChunk(row=row, length=n, slot=slot, start=start))
        positions += range(start, start + n)
        slots += [slot] * n
        prompt_tokens += [rng.randrange(3, vocab) for _ in range(n)]
        row, slot, left = row + n, slot + 1, left - n
    sample_rows = np.array([*range(decode), *(c.row + c.length - 1 for c in chunks)], dtype=np.int64)
    slots_array = np.array(slots, dtype=np.int64)
    return StepPlan(prompt_tokens=prompt_tokens, positions=np.array(positions, dtype=np.int64), slots=slots_array,
                    num_decode=decode, prefill=chunks, sample_rows=sample_rows, sample_slots=slots_array[sample_rows],
                    decode_tokens=np.array([rng.randrange(3, vocab) for _ in range(decode)], dtype=np.int64))


def replay_ms(graphs: GraphSet, runner: ModelRunner, mode: int, size: int, plan: StepPlan, repeats: int) -> float:
    """Median GPU milliseconds of a replay, inputs prepared outside the timed span."""
    times = []
    for _ in range(repeats):
        meta = runner.prepare(plan, size)
        times.append(1e3 * timed_once(lambda meta=meta: graphs.replay(mode, size, meta))[1])
    return statistics.median(times)


def kernel_breakdown(graphs: GraphSet, runner: ModelRunner, mode: int, size: int, plan: StepPlan) -> dict:
    """Kernel microseconds of one replay, summed by kind, and the ten longest kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    meta = runner.prepare(plan, size)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs.replay(mode, size, meta)
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    names: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time if hasattr(e, "device_time") else e.cuda_time
        kinds[kind_of(e.name)] = kinds.get(kind_of(e.name), 0.0) + us
        names.setdefault(e.name[:80], []).append(us)
    top = sorted(((sum(v), len(v), n) for n, v in names.items()), reverse=True)[:10]
    return {"by_kind_us": kinds, "kernels": sum(len(v) for v in names.values()),
            "top": [{"name": n, "us": us, "launches": k} for us, k, n in top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", default="64:0:64,60:68:128,52:76:128", help="decode rows:prompt tokens:padded size")
    parser.add_argument("--depth", type=int, default=656, help="deepest decode row (keys)")
    parser.add_argument("--chunk", type=int, default=48)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--step", default="compiled", choices=("compiled", "fused"))
    parser.add_argument("--layouts", default="", help="the varlen kernel's launch layouts to record each mixed "
                        "step with (varlen_kernel.LAYOUTS; default: its default)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    cases = [tuple(map(int, c.split(":"))) for c in args.steps.split(",")]
    loaded = load_model(f"random:{args.preset}", device="cuda", dtype=args.dtype, max_positions=args.max_seq_len)
    slots = max(d + -(-p // args.chunk) for d, p, _ in cases)
    max_tokens = max(size for *_, size in cases)
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "commit": _commit(), "command": " ".join(["python3", *sys.argv]),
              "preset": args.preset, "dtype": args.dtype, "depth": args.depth, "chunk": args.chunk, "steps": []}
    with torch.inference_mode():
        cache = KVCache(loaded.config, slots, args.max_seq_len, device=loaded.device, dtype=loaded.dtype)
        cache.k.normal_(), cache.v.normal_()  # never time on zeros
        runner = ModelRunner(loaded, cache, max_tokens)
        report["build"] = prepare(runner, args.step)
        vocab = loaded.config.vocab_size
        for layout in args.layouts.split(",") if args.layouts else [varlen_kernel.LAYOUT]:
            varlen_kernel.LAYOUT = layout  # what the recorded steps launch
            graphs = GraphSet(runner)
            for decode, prompt, size in cases:
                plan = mixed_plan(decode, prompt, args.depth, args.chunk, vocab, seed=decode + prompt)
                mode = FULL if prompt == 0 and decode == size else PIECEWISE
                runner.forward_eager(runner.prepare(plan, size), size)  # library handles exist before the capture
                graphs.captured[(mode, size)] = CapturedGraph(mode, size, graphs.record(mode, size), 0.0, 0, 0)
                ms = replay_ms(graphs, runner, mode, size, plan, args.repeats)
                row = {"layout": layout, "decode": decode, "prompt": prompt, "size": size,
                       "mode": "FULL" if mode == FULL else "PIECEWISE", "replay_ms": ms,
                       **kernel_breakdown(graphs, runner, mode, size, plan)}
                report["steps"].append(row)
                kinds = ", ".join(f"{k} {v / 1e3:.3f}"
                                  for k, v in sorted(row["by_kind_us"].items(), key=lambda kv: -kv[1]))
                print(f"{layout:>7} {decode:>3} decode + {prompt:>3} prompt @ {size:>3} ({row['mode']}): replay "
                      f"{ms:.3f} ms; kernels (ms, summed): {kinds}", flush=True)
            graphs.release()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
