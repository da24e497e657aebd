"""What the tensor parallel channel costs rank 0 per step: the two commands a step sends each
follower (``Step`` with the plan and the decision, then ``Sample``), pickled once and written to
one pipe per follower (``FollowerRanks.send``, the real code), against a reader process per
follower that unpickles them as a follower does. Host work only, no device and no collective:
the figure to compare with a decode step's time (milliseconds on an H200 for an 8B model).

Plans: a decode step of ``--batch`` rows (block-table updates for a few rows, as the scheduler
sends when a row crosses into a new block) and a mixed step (the decode rows and one prefill chunk
of ``--prefill`` tokens).

    python bench/tp_channel_bench.py --followers 1 --out bench/results/tp-channel-cpu.json
    python bench/tp_channel_bench.py --followers 7 --batch 256       # eight GPUs' ranks
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from load_bench import _commit  # noqa: E402

from graphkeeper.worker.engine.tp_ranks import FollowerRanks, Sample, Step  # noqa: E402
from graphkeeper.worker.executor.graphs.dispatcher import Decision  # noqa: E402
from graphkeeper.worker.plan import PrefillChunk, StepPlan  # noqa: E402


def reader(pipe, count: int) -> None:
    """A follower's receiving side: unpickles every command, then reports how many it took."""
    taken = 0
    pipe.send("ready")  # imported and listening: rank 0 starts timing only now
    for _ in range(count):
        pipe.recv()
        taken += 1
    pipe.send(taken)


def decode_plan(batch: int) -> StepPlan:
    updates = np.array([[0, 1, 2, 3], [5, 5, 5, 5], [10, 11, 12, 13]], dtype=np.int64)
    return StepPlan(prompt_tokens=[], positions=np.full(batch, 700), slots=np.arange(batch), num_decode=batch,
                    sample_rows=np.arange(batch), sample_slots=np.arange(batch), block_updates=updates)


def mixed_plan(batch: int, prefill: int) -> StepPlan:
    n = batch + prefill
    return StepPlan(prompt_tokens=list(range(3, 3 + prefill)), positions=np.arange(n), slots=np.zeros(n, np.int64),
                    num_decode=batch, prefill=[PrefillChunk(row=batch, length=prefill, slot=batch, start=0)],
                    sample_rows=np.arange(batch + 1), sample_slots=np.arange(batch + 1))


class Pipes(FollowerRanks):
    """``FollowerRanks`` with its pipes only: ``send`` is the real method, no process group."""

    def __init__(self, pipes) -> None:  # noqa: D107 - the processes are the bench's readers
        import threading

        self.pipes = pipes
        self._send_lock = threading.Lock()


def measure(plan: StepPlan, followers: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    ends, procs = [], []
    for _ in range(followers):
        ours, theirs = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=reader, args=(theirs, 2 * steps))
        proc.start()
        ends.append(ours)
        procs.append(proc)
    assert [pipe.recv() for pipe in ends] == ["ready"] * followers
    ranks = Pipes(ends)
    decision = Decision(0, plan.num_tokens, 1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        ranks.send(Step(plan, decision))
        ranks.send(Sample(None, False))
        times.append(time.perf_counter() - start)
        time.sleep(0.0005)  # a step's device time: the readers keep up, as followers do
    taken = [pipe.recv() for pipe in ends]
    for proc in procs:
        proc.join()
    assert taken == [2 * steps] * followers
    times.sort()
    return {"steps": steps, "followers": followers, "rows": plan.num_tokens,
            "mean_us": 1e6 * statistics.fmean(times), "p50_us": 1e6 * times[len(times) // 2],
            "p99_us": 1e6 * times[int(len(times) * 0.99)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=448)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = [{"plan": "decode", **measure(decode_plan(args.batch), args.followers, args.steps)},
            {"plan": "mixed", **measure(mixed_plan(args.batch, args.prefill), args.followers, args.steps)}]
    result = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": platform.node(),
              "cpu": platform.processor() or platform.machine(), "commit": _commit(),
              "command": " ".join(["python", *sys.argv]), "rows": rows}
    for row in rows:
        print(f"{row['plan']:7s} {row['rows']:4d} rows, {row['followers']} follower(s): "
              f"mean {row['mean_us']:.1f} us, p50 {row['p50_us']:.1f} us, p99 {row['p99_us']:.1f} us per step")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
