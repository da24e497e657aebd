"""The decode step split across GPUs: a FULL-graph decode step of a tensor-parallel model (the
all-reduces recorded inside the graph), per tensor-parallel size, against each rank's HBM floor.

For each size N in ``--sizes`` it starts N rank processes (GPU r for rank r; N = 1 is one process
and no torch.distributed), each loading its shard of ``random:<preset>``, building the step as the
worker does (``--step``: ``compiled`` -O2 or ``fused`` -O1, rank 0's timing decisions on every
rank), recording one FULL graph per batch size and timing its replay with the LM head and greedy
argmax (``decode_bench.bench_ours``). Rank 0 reports. A rank's floor is the bytes it must read
(its shard of every projection, the replicated LM head and norms, its key/value heads of every
sequence's cache) over the copy bandwidth measured on its GPU; the all-reduces' time is inside
the measured step and not in the floor, so GPU / floor shows what they and the split cost.
Also the device memory the rank's FULL graphs took (allocator bytes after recording, less before).

    python bench/tp_step_bench.py --out bench/results/tp-step-llama8b-h200x2.json    # two H200
    python bench/tp_step_bench.py --device cpu --preset tiny --sizes 1,2 --batches 1,4 --steps 5   # smoke test
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_bench import bench_ours  # noqa: E402
from load_bench import _commit  # noqa: E402
from step_bench import copy_bandwidth, step_bytes  # noqa: E402

from graphkeeper.worker.model.loader import load_model  # noqa: E402
from graphkeeper.worker.model.tensor_parallel import end_rank, init_tensor_parallel  # noqa: E402


def rank_main(rank: int, size: int, init_method: str, args: argparse.Namespace, out: str) -> None:
    """One rank: its shard, its step, its graphs; rank 0 writes the rows."""
    tp = init_tensor_parallel(rank, size, init_method, args.device, timeout_s=600)
    cuda = args.device == "cuda"
    loaded = load_model(f"random:{args.preset}", device=args.device, dtype=args.dtype,
                        max_positions=args.context + 16, tp=tp)
    batches = [int(b) for b in args.batches.split(",")]
    before = torch.cuda.memory_allocated() if cuda else 0
    rows = bench_ours(loaded, batches, args.context, args.steps, graphs=cuda, step=args.step,
                      label=f"TP={size} FULL graph" if cuda else f"TP={size} eager")
    graph_bytes = torch.cuda.memory_allocated() - before if cuda else 0
    bandwidth = copy_bandwidth("cuda") if cuda else 0.0
    for row in rows:
        floor_s = step_bytes(loaded, row["batch"], args.context) / bandwidth if bandwidth else 0.0
        row |= {"tensor_parallel_size": size, "floor_ms": 1e3 * floor_s,
                "gpu_over_floor": row.get("gpu_median_ms", 0.0) / (1e3 * floor_s) if floor_s else 0.0,
                "rank_heads": [loaded.config.n_heads, loaded.config.n_kv_heads],
                "rank_graph_and_cache_bytes": graph_bytes, "copy_bandwidth_bytes_per_s": bandwidth}
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    end_rank(tp)


def run_size(size: int, args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gk-tp-bench-") as tmp:
        out = str(Path(tmp) / "rows.json")
        init_method = f"file://{Path(tmp) / 'rendezvous'}"
        mp.start_processes(rank_main, args=(size, init_method, args, out), nprocs=size, join=True,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-8b")
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--step", default="compiled", choices=("compiled", "fused", "plain"))
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.device == "cuda" and max(sizes) > torch.cuda.device_count():
        raise SystemExit(f"--sizes {args.sizes} needs {max(sizes)} GPUs; {torch.cuda.device_count()} visible")
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "gpus": torch.cuda.device_count() if args.device == "cuda" else 0, "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": _commit(), "preset": args.preset,
        "dtype": args.dtype, "step": args.step, "context": args.context, "rows": [],
    }
    start = time.perf_counter()
    for size in sizes:
        print(f"tensor parallel size {size}:", flush=True)
        report["rows"] += run_size(size, args)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    report["seconds"] = time.perf_counter() - start
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def table(report: dict) -> str:
    lines = ["| TP | batch | GPU ms | wall ms | tokens/s | rank floor ms | GPU / floor |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['tensor_parallel_size']} | {r['batch']} | {r.get('gpu_median_ms', 0):.3f} | "
                     f"{r['median_ms']:.3f} | {r['tokens_per_s']:.0f} | {r['floor_ms']:.3f} | "
                     f"{r['gpu_over_floor']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
