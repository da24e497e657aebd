"""An attention kernel alone, this tree's against another tree's (a baseline), on the GPU's clock:
seconds per launch, replayed from CUDA graphs as a captured step runs it (and as a share of what the
GPU's memory allows: the keys and values read at a plain copy's pace), the two kernels alternated
(and which goes first, round by round) so that drift hits both alike.

- ``--kernel decode``: the decode kernel at each batch size (``--rows``), every row ``--length``
  keys deep.
- ``--kernel varlen``: the varlen kernel over mixed steps (``--mixed``: decode rows beside prompt
  tokens, launched over a program per row of the padded size, as a recorded mixed step launches
  it); decode rows' depths drawn up to ``--length``, the prompt in chunks of ``--chunk`` tokens.

A kernel change that should cost nothing (a constant made a runtime argument, say), or should buy
something, is checked here before the whole-worker benchmarks, and stated with the figure that
shows it.

    python bench/attention_kernel_bench.py --baseline .baseline --out bench/results/attention-kernel.json
    python bench/attention_kernel_bench.py --kernel varlen --length 656 --baseline .baseline
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from load_bench import _commit  # noqa: E402
from mixed_step_bench import mixed_plan  # noqa: E402
from step_bench import copy_bandwidth  # noqa: E402  (the floor step_bench measures the step against)

from graphkeeper.worker.kernels import decode_kernel, varlen_kernel  # noqa: E402
from graphkeeper.worker.kernels.timing import replay_seconds  # noqa: E402


def load_baseline(tree: str, kernel: str = "decode"):
    """Another tree's ``<kernel>_kernel`` module, loaded from its file under a name of its own (it
    imports the rest of the worker from this tree: only the kernel file is compared)."""
    spec = importlib.util.spec_from_file_location(f"baseline_{kernel}_kernel",
                                                  Path(tree) / "worker" / "kernels" / f"{kernel}_kernel.py")
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


def mixed_work(decode: int, prompt: int, padded: int, args: argparse.Namespace) -> dict:
    """The varlen work list of ``mixed_step_bench.mixed_plan``'s step (decode rows up to ``--length``
    keys deep, the prompt in chunks of up to ``--chunk``; drawn from a seed made of the case), as the
    runner lists it (``varlen_kernel.fill_work_list``: the chunks' blocks of up to ``BLOCK_Q`` rows,
    then one block per decode row, the longest context first), within ``padded`` entries (a program
    per row of the padded size). Returns the blocks, the slot count and the keys the step reads."""
    plan = mixed_plan(decode, prompt, args.length, args.chunk, vocab=4, seed=decode * 1000 + prompt)
    table = np.zeros((4, plan.num_tokens), dtype=np.int64)  # a block holds one row or more
    count = varlen_kernel.fill_work_list(table, plan.prefill, plan.positions[:decode], plan.slots[:decode])
    blocks = [tuple(int(x) for x in column) for column in table[:, :count].T]
    keys = sum(pos + n for _, n, _, pos in blocks)  # each block's last row sees position + rows keys
    assert plan.num_tokens <= padded and len(blocks) <= padded, (decode, prompt, padded)
    return {"blocks": blocks, "slots": decode + len(plan.prefill), "keys": keys}


def varlen_launch_seconds(module, decode: int, prompt: int, padded: int, args: argparse.Namespace,
                          layout: str = "", launches: int = 20) -> float:
    """GPU seconds per ``varlen_attention`` call over one mixed step's work list (``mixed_work``),
    in a paged cache whose slots' blocks are scattered; ``layout``: how this tree launches the
    blocks (``varlen_kernel.LAYOUTS``; a baseline's kernel is called as it is)."""
    dtype, device = torch.bfloat16, "cuda"
    work = mixed_work(decode, prompt, padded, args)
    per_slot = -(-args.max_len // args.block_size)
    n_blocks = work["slots"] * per_slot
    k = torch.randn(n_blocks, args.block_size, args.kv_heads, args.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    table = torch.randperm(n_blocks, device=device).view(work["slots"], per_slot)
    entries = torch.zeros(4, padded, dtype=torch.long, device=device)
    entries[:, :len(work["blocks"])] = torch.tensor(work["blocks"], device=device).T
    q = torch.randn(padded, args.heads, args.head_dim, device=device, dtype=dtype)
    out = torch.empty(padded, args.heads * args.head_dim, device=device, dtype=dtype)

    how = {"layout": layout} if layout else {}

    def record() -> None:
        for _ in range(launches):
            module.varlen_attention(q, k, v, entries[0], entries[1], entries[2], entries[3], padded, table, out, **how)

    return replay_seconds(record, replays=args.replays) / launches


def kv_bytes(rows: int, args: argparse.Namespace) -> int:
    """Bytes of keys and values (bf16) a launch must read: each row's ``--length`` keys."""
    return 2 * rows * args.length * args.kv_heads * args.head_dim * 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=("decode", "varlen"), default="decode")
    parser.add_argument("--baseline", default="", help="another tree's root: its kernel is timed beside")
    parser.add_argument("--rows", default="1,2,3,4,8,12,16,24,32,64", help="decode: batch sizes")
    parser.add_argument("--mixed", default="64:0:64,60:68:128,52:76:128,32:96:128,16:240:256,0:512:512",
                        help="varlen: steps as decode rows:prompt tokens:padded size")
    parser.add_argument("--chunk", type=int, default=48, help="varlen: prompt tokens a chunk holds at most")
    parser.add_argument("--layouts", default="", help="varlen: this tree's ways of launching the blocks, each timed "
                        "(varlen_kernel.LAYOUTS; default: its default alone)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=8192, help="keys a slot's table holds (the context)")
    parser.add_argument("--length", type=int, default=1024, help="keys each decode row attends over (varlen: at most)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two kernels; the best kept")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    # name -> (module, layout): this tree's kernel (in each layout asked for), and the baseline's
    if args.kernel == "decode":
        kernels = {"this tree": (decode_kernel, "")}
    else:
        layouts = args.layouts.split(",") if args.layouts else [""]
        kernels = {f"this tree {layout}".strip(): (varlen_kernel, layout) for layout in layouts}
    if args.baseline:
        kernels["baseline"] = (load_baseline(args.baseline, args.kernel), "")
    ours = next(iter(kernels))
    if args.kernel == "decode":
        cases = {r: (lambda m, _, r=int(r): launch_seconds(m, r, args)) for r in args.rows.split(",")}
    else:
        cases = {c: (lambda m, layout, c=c: varlen_launch_seconds(m, *map(int, c.split(":")), args, layout))
                 for c in args.mixed.split(",")}
    best: dict[str, dict[str, float]] = {name: {} for name in kernels}
    for round_ in range(args.rounds):
        order = list(kernels.items())
        for case, timed in cases.items():
            for name, (module, layout) in order if round_ % 2 == 0 else order[::-1]:  # none always first
                seconds = timed(module, layout)
                best[name][case] = min(best[name].get(case, seconds), seconds)
    allowed = copy_bandwidth("cuda")
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "kernel": args.kernel, "copy_bytes_per_second": allowed,
              "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "commit": _commit(), "shape": {k: getattr(args, k) for k in ("heads", "kv_heads", "head_dim",
                                                                          "block_size", "max_len", "length", "chunk")},
              "rows": []}
    print(f"copy bandwidth {allowed / 1e12:.2f} TB/s; share: the keys and values read at that pace, against the launch")
    label = "rows splits" if args.kernel == "decode" else "decode:prompt:padded"
    print(f"{label:>20} " + " ".join(f"{name + ' us':>22}" for name in kernels) + "   ratio   share"
          + f"   (ratio: {ours} against the baseline; share: {ours})")
    for case in cases:
        if args.kernel == "decode":
            rows = int(case)
            splits, _ = decode_kernel.decode_splits(rows, args.kv_heads, args.max_len, torch.bfloat16)
            entry = {"rows": rows, "splits": splits}
            nbytes, shown = kv_bytes(rows, args), f"{rows} {splits}"
        else:
            work = mixed_work(*map(int, case.split(":")), args)
            entry = {"case": case, "blocks": len(work["blocks"])}
            nbytes, shown = 2 * work["keys"] * args.kv_heads * args.head_dim * 2, case
        entry.update({f"{name} us": best[name][case] * 1e6 for name in kernels})
        entry["share_of_copy_bandwidth"] = nbytes / allowed / best[ours][case]
        if args.baseline:
            entry["ratio"] = best[ours][case] / best["baseline"][case]
        report["rows"].append(entry)
        print(f"{shown:>20} " + " ".join(f"{best[name][case] * 1e6:>22.2f}" for name in kernels)
              + (f"   {entry['ratio']:.3f}" if args.baseline else " " * 8)
              + f"   {entry['share_of_copy_bandwidth']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
