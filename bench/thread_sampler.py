"""Runs a worker under a sampling profiler of its Python threads, to see what sets a step's pace
(and, for experiments, with another interpreter switch interval or stream pacing).

Every ``--interval`` seconds a daemon thread reads each other thread's innermost frames
(``sys._current_frames``) and counts the stack; at exit it writes, per thread, the share of
samples of each stack, largest first. The engine thread waiting in ``Launched.tokens`` is the GPU
setting the pace; anything else it does is host time the GPU may wait for. The event loop thread
idle in its selector is the API layer keeping up. SIGUSR1 starts the count afresh (the load
benchmark sends it when its load begins, so startup is not counted).

    python bench/thread_sampler.py --out sample.json -- worker --model random:llama-1b --device cuda ...

Only the worker's Python threads are seen (gRPC's C threads are not); a sample needs the GIL, so
the profiler itself takes a little of the interpreter (one sample per 2 ms by default).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import signal
import sys
import threading
import time
from pathlib import Path

DEPTH = 16
SHOWN = 6


#: Folders of graphkeeper's own modules: the inclusive shares list only their functions.
PROJECT = ("worker/", "proto/", "graphkeeper/")


def stack_of(frame, depth: int = DEPTH) -> tuple[str, ...]:
    """The innermost ``depth`` frames as 'function (folder/file:line)', innermost first."""
    out = []
    while frame is not None and len(out) < depth:
        path = Path(frame.f_code.co_filename)
        out.append(f"{frame.f_code.co_name} ({path.parent.name}/{path.name}:{frame.f_lineno})")
        frame = frame.f_back
    return tuple(out)


class Sampler:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples = 0
        self.started = time.perf_counter()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self.stopped.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.counts[names.get(ident, str(ident))][stack_of(frame)] += 1
            self.samples += 1

    def reset(self, *_: object) -> None:
        """SIGUSR1: start counting afresh (the load begins; startup's samples are dropped)."""
        self.counts = collections.defaultdict(collections.Counter)
        self.samples = 0
        self.started = time.perf_counter()

    def summary(self, top: int = 40) -> dict:
        """Stops sampling and returns the shares per thread."""
        self.stopped.set()
        self.thread.join()
        threads = {}
        for name, counter in self.counts.items():
            total = sum(counter.values())
            threads[name] = {
                "samples": total,
                "stacks": _stack_shares(counter, top),
                "innermost": _innermost_shares(counter, top),
                "inclusive": _inclusive_shares(counter, top),
            }
        return {"interval_s": self.interval, "samples": self.samples,
                "seconds": time.perf_counter() - self.started, "threads": threads}


def _function(entry: str) -> str:
    """'name (file.py:12)' -> 'name (file.py)'."""
    return entry.rsplit(":", 1)[0] + ")"


def _stack_shares(counter: collections.Counter, top: int) -> list[dict]:
    """Share of samples by the innermost ``SHOWN`` frames."""
    short: collections.Counter = collections.Counter()
    for stack, n in counter.items():
        short[stack[:SHOWN]] += n
    total = sum(short.values())
    return [{"share": n / total, "stack": list(stack)} for stack, n in short.most_common(top)]


def _inclusive_shares(counter: collections.Counter, top: int) -> list[dict]:
    """Share of samples whose stack holds each of graphkeeper's functions anywhere (a caller's share
    includes its callees')."""
    inclusive: collections.Counter = collections.Counter()
    for stack, n in counter.items():
        for function in {_function(e) for e in stack if e.split(" (", 1)[1].startswith(PROJECT)}:
            inclusive[function] += n
    total = sum(counter.values())
    return [{"share": n / total, "function": f} for f, n in inclusive.most_common(top)]


def _innermost_shares(counter: collections.Counter, top: int) -> list[dict]:
    """Share of samples by innermost function alone (line numbers dropped)."""
    by_function: collections.Counter = collections.Counter()
    for stack, n in counter.items():
        by_function[_function(stack[0]) if stack else "?"] += n
    total = sum(by_function.values())
    return [{"share": n / total, "function": f} for f, n in by_function.most_common(top)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="where the samples go (none taken without it)")
    parser.add_argument("--interval", type=float, default=0.002)
    parser.add_argument("--switch-interval", type=float, default=0.0,
                        help="the worker's interpreter switch interval, seconds (0: the worker's own)")
    parser.add_argument("--flush-gap", type=float, default=0.0,
                        help="the API layer's pacing per open stream, seconds, with 200 times it as its cap "
                             "(0: the worker's own)")
    parser.add_argument("--max-flush-gap", type=float, default=0.0,
                        help="the pacing's cap, seconds (0: the worker's own, or 200 times --flush-gap with it)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then graphkeeper's command line")
    args = parser.parse_args()
    worker_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    if args.out:
        sampler = Sampler(args.interval)
        atexit.register(lambda: Path(args.out).write_text(json.dumps(sampler.summary(), indent=1) + "\n"))
        signal.signal(signal.SIGUSR1, sampler.reset)
        sampler.thread.start()
    if args.switch_interval:
        from graphkeeper.worker.engine import spawn as engine_spawn

        engine_spawn.SWITCH_INTERVAL_SECONDS = args.switch_interval
    if args.flush_gap or args.max_flush_gap:
        from graphkeeper.worker.serving import streams

        if args.flush_gap:
            streams.FLUSH_GAP_PER_STREAM, streams.MAX_FLUSH_GAP = args.flush_gap, 200 * args.flush_gap
        if args.max_flush_gap:
            streams.MAX_FLUSH_GAP = args.max_flush_gap
    from graphkeeper.cli import main as graphkeeper_main

    sys.argv = ["graphkeeper", *worker_args]
    sys.exit(graphkeeper_main())


if __name__ == "__main__":
    main()
