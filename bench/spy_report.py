"""Where the engine thread's time goes, from py-spy recordings of a worker under load.

``gpu_session.sh``'s ``profile-*`` entries record the worker and its engine core with
``py-spy record --idle --subprocesses --format raw`` in 3-second blocks while a benchmark runs,
each block headed ``### <n> <unix time>``, gzipped. This prints, per block, the engine thread's
sample count and its largest parts, then each function's inclusive and self share of the engine
thread's samples over the blocks chosen (all by default). ``--idle`` keeps the samples where the
thread waits (``Event.synchronize``: for the device; ``Mailbox.sleep``: for work), so a share of
1.0 for the loop with little waiting means the host, not the device, sets the step's pace.

    python bench/spy_report.py gpu-out/spy-penalties.txt.gz --blocks 34,35,36
    python bench/spy_report.py gpu-out/spy-start.txt.gz --frame "Engine._startup (core.py)" --blocks 9,10,11
    python bench/spy_report.py gpu-out/spy-start.txt.gz --phases --blocks 14,15,16,17
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
from collections.abc import Iterator

ENGINE = "Engine._loop (core.py)"


def blocks(path: str) -> Iterator[tuple[str, list[tuple[list[str], int]]]]:
    """(block name, [(frames, samples)]) per recorded block."""
    name, rows = None, []
    with gzip.open(path, "rt") as f:
        for line in f:
            if line.startswith("### "):
                if rows:
                    yield name, rows
                name, rows = line.split()[1], []
                continue
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if stack:
                rows.append(([short(frame) for frame in stack.split(";")], int(n)))
    if rows:
        yield name, rows


def short(frame: str) -> str:
    """``func (path/file.py:line)`` as ``func (file.py)``."""
    m = re.match(r"(.*?) \((.*?)(:\d+)?\)$", frame)
    return f"{m.group(1)} ({m.group(2).split('/')[-1]})" if m else frame


#: A start's phases (``--phases``): the first of these frames a sample's stack holds names its
#: phase, so the order matters (capture's parts before the capture job, the dry launches before the
#: sampling they make, the warm-up's sampling before the warm-up).
START_PHASES = (
    ("CaptureJob._prime (capture.py)", "capture: prime"), ("validate (capture.py)", "capture: validate"),
    ("least_time (capture.py)", "capture: timing"), ("CaptureJob.run_all (capture.py)", "capture: other"),
    ("_choose_row_step (step.py)", "row step"),
    ("ModelRunner.launches_ahead (runner.py)", "compile ahead: dry launches"),
    ("ModelRunner.warm_up_sampling (runner.py)", "warm-up: sampling"),
    ("ModelRunner.warm_up (runner.py)", "warm-up: steps (a compiled step's first call traces or loads it)"),
    ("wait_for_key (compiler_import.py)", "waiting for Triton's key"),
    ("ahead.<locals>.join (compiler_import.py)", "waiting for the compiler's import"), ("probe (pdl.py)", "PDL probe"),
    ("tune_model (tuning.py)", "kernel tuning"), ("prepare_step (step.py)", "building the step: other"),
    ("freeze_heap (gc_pauses.py)", "freezing the heap"), ("Engine._startup (core.py)", "start: other"))


def phases(path: str, chosen: set[str] | None, top: int = 3) -> None:
    """Seconds of the engine thread's start in each phase (``START_PHASES``; py-spy's 250 samples a
    second), each with its largest leaf frames."""
    seconds, leaves = collections.Counter(), collections.defaultdict(collections.Counter)
    for name, rows in blocks(path):
        if chosen and name not in chosen:
            continue
        for frames, n in rows:
            if "Engine._startup (core.py)" not in frames:
                continue
            phase = next((label for frame, label in START_PHASES if frame in frames), "?")
            seconds[phase] += n / 250
            leaves[phase][frames[-1]] += n / 250
    for phase, s in seconds.most_common():
        print(f"{s:6.2f} s  {phase}: " + "; ".join(f"{f} {v:.2f}" for f, v in leaves[phase].most_common(top)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--blocks", default="", help="comma-separated block numbers (default: all)")
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--frame", default=ENGINE,
                        help="the samples counted: those with this frame (profile-start: 'Engine._startup (core.py)')")
    parser.add_argument("--phases", action="store_true",
                        help="a start's recording (profile-start): seconds of the engine thread by phase")
    args = parser.parse_args()
    chosen = set(args.blocks.split(",")) if args.blocks else None
    if args.phases:
        phases(args.path, chosen)
        return 0
    inclusive, own, total = collections.Counter(), collections.Counter(), 0
    for name, rows in blocks(args.path):
        engine = [(frames, n) for frames, n in rows if args.frame in frames]
        if not engine or (chosen and name not in chosen):
            continue
        samples = sum(n for _, n in engine)
        marks = collections.Counter()
        for frames, n in engine:
            for frame in set(frames):
                marks[frame] += n
            own[frames[-1]] += n
        inclusive.update(marks)
        total += samples
        parts = [f for f, _ in marks.most_common(14) if f.endswith(("(core.py)", "(runner.py)"))][2:6]
        print(f"block {name}: {samples} engine-thread samples; "
              + ", ".join(f"{f.split(' (')[0]} {marks[f] / samples:.2f}" for f in parts))
    print(f"\ninclusive share of {total} engine-thread samples")
    for frame, n in inclusive.most_common(args.top):
        if not frame.startswith(("process ", "Thread.", " spawn_main")):
            print(f"{n / max(total, 1):6.3f}  {frame}")
    print("\nself share")
    for frame, n in own.most_common(args.top // 2):
        print(f"{n / max(total, 1):6.3f}  {frame}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
