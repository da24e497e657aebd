"""The decode attention kernel alone, this tree's against another tree's (a baseline), on the GPU's
clock: seconds per launch at each batch size, replayed from CUDA graphs as a captured step runs it
(and as a share of what the GPU's memory allows: the keys and values read at a plain copy's pace),
the two kernels alternated (and which goes first, round by round) so that drift hits both alike.

A kernel change that should cost nothing (a constant made a runtime argument, say) is checked here
before the whole-worker benchmarks, and stated with the figure that shows it.

    python bench/attention_kernel_bench.py --baseline .baseline --out bench/results/attention-kernel.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from load_bench import _commit  # noqa: E402

from graphkeeper.worker.kernels import decode_kernel  # noqa: E402
from graphkeeper.worker.kernels.timing import replay_seconds  # noqa: E402


def load_baseline(tree: str):
    """Another tree's decode_kernel module, loaded from its file under a name of its own (it
    imports the rest of the worker from this tree: only the kernel file is compared)."""
    spec = importlib.util.spec_from_file_location("baseline_decode_kernel",
                                                  Path(tree) / "worker" / "kernels" / "decode_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_seconds(module, rows: int, args: argparse.Namespace, launches: int = 20) -> float:
    """GPU seconds per ``decode_attention`` launch at ``rows`` rows, each row ``--length`` keys deep
    in its own slot of a paged cache whose tables hold ``--max-len`` keys."""
    dtype, device = torch.bfloat16, "cuda"
    per_slot, used = args.max_len // args.block_size, -(-args.length // args.block_size)
    k = torch.randn(rows * used, args.block_size, args.kv_heads, args.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    # Each row's live blocks scattered through the cache; the table's unused entries past them valid too.
    table = torch.randint(0, rows * used, (rows, per_slot), device=device)
    table[:, :used] = torch.randperm(rows * used, device=device).view(rows, used)
    q = torch.randn(rows, args.heads, args.head_dim, device=device, dtype=dtype)
    slots = torch.arange(rows, device=device)
    lengths = torch.full((rows,), args.length, device=device)
    out = torch.empty(rows, args.heads * args.head_dim, device=device, dtype=dtype)

    def record() -> None:
        for _ in range(launches):
            module.decode_attention(q, k, v, slots, lengths, table, out)

    return replay_seconds(record, replays=args.replays) / launches


def copy_bandwidth(replays: int) -> float:
    """Bytes per second a device-to-device copy of 1 GiB moves (read plus write), replayed from a
    CUDA graph: what this GPU's memory allows, in this run, for a kernel that reads its inputs once."""
    src = torch.empty(2**29, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    seconds = replay_seconds(lambda: dst.copy_(src), replays=replays)
    return 2 * src.numel() * src.element_size() / seconds


def kv_bytes(rows: int, args: argparse.Namespace) -> int:
    """Bytes of keys and values (bf16) a launch must read: each row's ``--length`` keys."""
    return 2 * rows * args.length * args.kv_heads * args.head_dim * 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="", help="another tree's root: its decode kernel is timed beside")
    parser.add_argument("--rows", default="1,2,3,4,8,12,16,24,32,64")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=8192, help="keys a slot's table holds (the context)")
    parser.add_argument("--length", type=int, default=1024, help="keys each row attends over")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two kernels; the best kept")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    kernels = {"this tree": decode_kernel}
    if args.baseline:
        kernels["baseline"] = load_baseline(args.baseline)
    rows_list = [int(r) for r in args.rows.split(",")]
    best: dict[str, dict[int, float]] = {name: {} for name in kernels}
    for round_ in range(args.rounds):
        order = list(kernels.items())
        for rows in rows_list:
            for name, module in order if round_ % 2 == 0 else order[::-1]:  # neither one always first
                seconds = launch_seconds(module, rows, args)
                best[name][rows] = min(best[name].get(rows, seconds), seconds)
    allowed = copy_bandwidth(args.replays)
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "copy_bytes_per_second": allowed,
              "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "commit": _commit(), "shape": {k: getattr(args, k) for k in ("heads", "kv_heads", "head_dim",
                                                                          "block_size", "max_len", "length")},
              "rows": []}
    print(f"copy bandwidth {allowed / 1e12:.2f} TB/s; share: the keys and values read at that pace, against the launch")
    print(f"{'rows':>5} {'splits':>6} " + " ".join(f"{name + ' us':>14}" for name in kernels) + "   ratio   share")
    for rows in rows_list:
        splits, _ = decode_kernel.decode_splits(rows, args.kv_heads, args.max_len, torch.bfloat16)
        entry = {"rows": rows, "splits": splits, **{f"{name} us": best[name][rows] * 1e6 for name in kernels},
                 "share_of_copy_bandwidth": kv_bytes(rows, args) / allowed / best["this tree"][rows]}
        if args.baseline:
            entry["ratio"] = best["this tree"][rows] / best["baseline"][rows]
        report["rows"].append(entry)
        print(f"{rows:>5} {splits:>6} " + " ".join(f"{best[name][rows] * 1e6:>14.2f}" for name in kernels)
              + (f"   {entry['ratio']:.3f}" if args.baseline else " " * 8)
              + f"   {entry['share_of_copy_bandwidth']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
