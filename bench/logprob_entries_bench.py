"""The API process's work for a streamed token's log probabilities, on this CPU: a gRPC chunk's
message built from the packed line through ``TokenLogprob`` (the stream's entries before) or
straight from it (``PackedEntry``), serialized, and the collections of the young generation each
way makes. No engine, no GPU: only the conversion the API process repeats for every token.

    python bench/logprob_entries_bench.py --tokens 20000 --out bench/results/logprob-entries-cpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import subprocess
import sys
import time
from array import array
from pathlib import Path

import numpy as np

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.plan import PackedEntry, unpack_logprob
from graphkeeper.worker.serving.streams import token_logprobs


def packed_lines(tokens: int, computed: int, asked: int, seed: int = 0) -> list[tuple[int, tuple]]:
    """``tokens`` (token, packed line) pairs as they arrive from the engine: the line is
    ``[chosen, computed values, computed ids]`` as float32 bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(tokens):
        values = -np.sort(rng.random(1 + computed)).astype(np.float32)
        ids = rng.integers(0, 128256, computed).astype(np.float32)
        out.append((int(ids[0]), (computed, asked, array("f", [*values, *ids]).tobytes())))
    return out


def through_token_logprob(arrived: list[tuple[int, tuple]]) -> int:
    """The stream keeps ``TokenLogprob`` objects; gRPC builds its messages from them."""
    kept = [unpack_logprob(t, p) for t, p in arrived]
    return sum(len(pb.TokenChunk(token_ids=[e.token], logprobs=token_logprobs([e])).SerializeToString()) for e in kept)


def straight(arrived: list[tuple[int, tuple]]) -> int:
    """The stream keeps ``PackedEntry`` objects; gRPC reads each line into its message."""
    kept = [PackedEntry(t, p) for t, p in arrived]
    return sum(len(pb.TokenChunk(token_ids=[e.token], logprobs=token_logprobs([e])).SerializeToString()) for e in kept)


def measure(fn, entries: list[tuple[int, tuple]], repeats: int) -> dict:
    """The least CPU time per token over ``repeats`` runs, and the young collections of one run."""
    best, young = float("inf"), 0
    for _ in range(repeats):
        gc.collect()
        before = gc.get_stats()[0]["collections"]
        start = time.process_time()
        size = fn(entries)
        best = min(best, time.process_time() - start)
        young = gc.get_stats()[0]["collections"] - before
    return {"us_per_token": best / len(entries) * 1e6, "young_collections": young, "bytes": size}


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--computed", type=int, default=8, help="alternatives the step computed")
    parser.add_argument("--asked", type=int, default=5, help="alternatives a request asked for")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    entries = packed_lines(args.tokens, args.computed, args.asked)
    old, new = measure(through_token_logprob, entries, args.repeats), measure(straight, entries, args.repeats)
    assert old["bytes"] == new["bytes"], "the two ways must write the same messages"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "cpu": cpu_name(),
              "python": platform.python_version(), "commit": commit,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "tokens": args.tokens,
              "computed": args.computed, "asked": args.asked, "through_token_logprob": old, "straight": new,
              "ratio": new["us_per_token"] / old["us_per_token"]}
    print(f"through TokenLogprob: {old['us_per_token']:.2f} us/token, {old['young_collections']} young collections; "
          f"straight: {new['us_per_token']:.2f} us/token, {new['young_collections']} young collections "
          f"({report['ratio']:.2f} of the time)")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
