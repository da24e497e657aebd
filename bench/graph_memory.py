"""Graph memory on the GPU, told three ways, through a worker's life: a fresh capture, a model
revision change, idle release, and a budget that fits nothing.

For each moment it records what status reports (``graph_memory_bytes``, the ledger), what the
allocator holds by pool (``torch.cuda.memory_snapshot()``: the graph pool's own segments against
the regular pool's) and what the device holds (``cudaMemGetInfo``), so a figure that drifts from the
others shows which reading moved. It also times the capture stage as a user waits for it (from the
start of the step build to READY) beside what status says capture took.

This measures memory, not serving speed: the engine runs in this process, with no load beyond a
few requests, which is why it may (it drives no clients).

    python bench/graph_memory.py --preset llama-1b --out bench/results/graph-memory-h200.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import load_bench  # noqa: E402 - the commit and GPU name helpers

from graphkeeper.proto import worker_pb2 as pb  # noqa: E402
from graphkeeper.worker.engine import Engine, EngineSettings  # noqa: E402
from graphkeeper.worker.executor.graphs.pool_memory import REGULAR_POOL, snapshot_by_pool  # noqa: E402

MIB = 2**20


def policy(generation: int = 1, **fields) -> pb.GraphPolicy:
    p = pb.GraphPolicy(policy_uid="graph-memory", generation=generation, mode=pb.GRAPH_MODE_FULL_AND_PIECEWISE,
                       **fields)
    p.capture_sizes.ladder = pb.CAPTURE_LADDER_DEFAULT
    return p


def device_used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def reading(engine: Engine, label: str) -> dict:
    """Status's figures beside the allocator's and the device's, all in MiB."""
    status = engine.status()
    torch.cuda.synchronize()
    pools = snapshot_by_pool()
    graphs = engine.capture.graph_set
    pool = tuple(graphs.pool) if graphs is not None else None
    live = [c for c in status.captured if not c.released]
    row = {
        "label": label,
        "state": pb.LifecycleState.Name(status.state),
        "graphs": len(live), "released": len(status.captured) - len(live), "skipped": len(status.skipped),
        "status_graph_memory_mib": status.graph_memory_bytes / MIB,
        "sum_captured_device_mib": sum(c.device_bytes for c in live) / MIB,
        "graph_pool_mib": pools.get(pool, 0) / MIB if pool else 0.0,
        "all_graph_pools_mib": sum(v for k, v in pools.items() if k != REGULAR_POOL) / MIB,
        "regular_pool_mib": pools.get(REGULAR_POOL, 0) / MIB,
        "torch_reserved_mib": torch.cuda.memory_reserved() / MIB,
        "device_used_mib": device_used() / MIB,
        "capture_seconds_status": status.total_capture_seconds,
        # Per stage: device used and torch reserved (before the capture stage, all of it the regular pool's).
        "ledger_mib": {pb.LedgerStage.Name(e.stage).removeprefix("LEDGER_STAGE_").lower():
                       [e.device_used_bytes / MIB, e.torch_reserved_bytes / MIB] for e in status.ledger},
    }
    print(json.dumps(row))
    return row


def generate(engine: Engine, prompt: list[int], n: int = 8) -> None:
    done = threading.Event()
    engine.submit(pb.GenerateRequest(prompt_token_ids=prompt, stopping=pb.StoppingCriteria(
        max_new_tokens=n, ignore_eos=True)), lambda tokens, end: end is not None and done.set())
    if not done.wait(120):
        raise RuntimeError("a request did not finish")


def wait_for(predicate, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def start(args: argparse.Namespace, p: pb.GraphPolicy, utilization: float = 0.0) -> tuple[Engine, float]:
    settings = EngineSettings(model=f"random:{args.preset}", device="cuda", dtype=args.dtype,
                              max_num_seqs=args.max_num_seqs, max_seq_len=args.max_seq_len,
                              max_num_batched_tokens=args.budget,
                              kv_cache_memory=0 if utilization else args.kv_cache_memory,
                              gpu_memory_utilization=utilization, optimization_level=args.optimization_level, policy=p)
    t0 = time.perf_counter()
    engine = Engine(settings)
    engine.start()
    if not engine.ready.wait(900) or engine.failed is not None:
        raise RuntimeError(f"engine failed: {engine.failed}")
    return engine, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--kv-cache-memory", type=int, default=4 * 2**30)
    parser.add_argument("--optimization-level", type=int, default=1)
    parser.add_argument("--utilization", type=float, default=0.5, help="track B's --gpu-memory-utilization")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results: dict = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                     "commit": load_bench._commit(), "gpu": load_bench._gpu_name("cuda"), "preset": args.preset,
                     "dtype": args.dtype, "budget": args.budget, "readings": []}
    rows = results["readings"]

    engine, seconds = start(args, policy(idle_release_seconds=0))
    results["fresh_start_to_ready_seconds"] = seconds
    rows.append(reading(engine, "fresh"))
    for _ in range(3):
        generate(engine, [5, 6, 7])
    engine.load_revision(f"random:{args.preset}@5", "").result(600)
    wait_for(lambda: engine.status().state == pb.LIFECYCLE_STATE_READY, what="READY after the reload")
    rows.append(reading(engine, "after reload"))
    engine.apply_policy(policy(generation=2, idle_release_seconds=2))
    generate(engine, [5, 6, 7], 4)
    wait_for(lambda: all(c.released for c in engine.status().captured), what="every graph released")
    rows.append(reading(engine, "after idle release"))
    engine.drain_and_stop(10)
    del engine

    engine, seconds = start(args, policy(memory_budget_bytes=1))
    results["nothing_start_to_ready_seconds"] = seconds
    rows.append(reading(engine, "budget fits nothing"))
    engine.drain_and_stop(10)
    del engine

    # Track B: the KV cache sized after the measured graphs; its plan against what was then free.
    engine, seconds = start(args, policy(), utilization=args.utilization)
    kv = engine.status().kv_cache
    results["track_b"] = {"utilization": args.utilization, "planned_bytes": kv.planned_bytes,
                          "free_after_capture_bytes": kv.free_after_capture_bytes, "kv_bytes": kv.bytes,
                          "predicted_over_actual": kv.planned_bytes / max(1, kv.free_after_capture_bytes),
                          "reading": reading(engine, "track B")}
    engine.drain_and_stop(10)

    fresh, reload = rows[0], rows[1]
    results["summary"] = {
        "reload_over_fresh_status": reload["status_graph_memory_mib"] / max(fresh["status_graph_memory_mib"], 1e-9),
        "reload_over_fresh_pool": reload["graph_pool_mib"] / max(fresh["graph_pool_mib"], 1e-9),
        "idle_release_held_mib": rows[2]["status_graph_memory_mib"],
        "nothing_held_mib": rows[3]["status_graph_memory_mib"],
        "track_b_predicted_over_actual": results["track_b"]["predicted_over_actual"],
    }
    print(json.dumps(results["summary"]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
