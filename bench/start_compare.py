"""Worker start to READY, stage by stage, for two installs of the worker taken in turns: medians of
each stage, before and after a change, on one machine.

Each round starts a worker of the first install, then one of the second (``start_bench.start``:
READY from the worker process's start through ``/readyz``, the stages from its startup status), so
load from other work on a shared machine falls on both alike; the medians over the rounds are
what this reports. Both installs share one bytecode cache (``PYTHONPYCACHEPREFIX``), filled by an
untimed start of each first, as a pod on the image would find it.

Built for a CPU machine, where it measures what does not depend on a GPU (interpreter and
imports in both processes, flag checks, building the model, the engine core's setup): a CPU
worker compiles nothing and captures no graphs, so "cold" and "warm" starts do not differ there.

    python bench/start_compare.py --before /path/to/old-checkout/.venv/bin/python --rounds 5 \\
        --out bench/results/start-cpu.json --markdown bench/results/start-cpu.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from load_bench import _commit  # noqa: E402
from start_bench import STAGES, start  # noqa: E402


def commit_of(python: str) -> str:
    """The git commit of the checkout ``python``'s editable install runs (by the package's path)."""
    where = subprocess.run([python, "-c", "import graphkeeper, os; print(os.path.dirname(graphkeeper.__file__))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=where).stdout.strip()


def medians(rows: list[dict]) -> dict:
    """READY and each stage's median over ``rows`` (a stage a row lacks counts 0 s) (pure)."""
    out = {"seconds_to_ready": statistics.median(r["seconds_to_ready"] for r in rows)}
    for stage in STAGES:
        if any(stage in r["stages"] for r in rows):
            out[stage] = statistics.median(r["stages"].get(stage, 0.0) for r in rows)
    return out


def table(before: dict, after: dict, shown_from: float = 0.05) -> list[str]:
    """Markdown: one row per stage either side spends at least ``shown_from`` seconds on (pure)."""
    out = ["| stage | before (median s) | after (median s) | change (s) |", "|---|---|---|---|"]
    for stage in STAGES:
        b, a = before.get(stage, 0.0), after.get(stage, 0.0)
        if max(b, a) >= shown_from:
            out.append(f"| {stage} | {b:.2f} | {a:.2f} | {a - b:+.2f} |")
    b, a = before["seconds_to_ready"], after["seconds_to_ready"]
    out.append(f"| **READY (measured by the client)** | **{b:.2f}** | **{a:.2f}** | **{a - b:+.2f}** |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the interpreter of the install to compare against")
    parser.add_argument("--after", default=sys.executable, help="the interpreter of the changed install")
    parser.add_argument("--model", default="random:tiny", help="a random preset or any --model source")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker-args", default="-O2")
    parser.add_argument("--out", default="")
    parser.add_argument("--markdown", default="")
    args = parser.parse_args()
    sides = {"before": args.before, "after": args.after}
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), "
                         f"{len(__import__('os').sched_getaffinity(0))} CPUs",
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "bench_commit": _commit(),
              "commits": {side: commit_of(python) for side, python in sides.items()},
              "model": args.model, "max_num_seqs": args.max_num_seqs, "device": args.device, "rounds": args.rounds,
              "rows": {"before": [], "after": []}}
    pycache, logs = tempfile.mkdtemp(prefix="pycache-"), Path(tempfile.mkdtemp(prefix="start-compare-"))
    for round_ in range(-1, args.rounds):  # round -1 fills the bytecode cache and is not counted
        for side, python in sides.items():
            cache = tempfile.mkdtemp(prefix="compile-cache-")
            row = start(args.model, args.worker_args.split(), cache, logs / f"{side}-{round_}.log", args.max_num_seqs,
                        pycache, args.device, python)
            shutil.rmtree(cache, ignore_errors=True)
            if round_ >= 0:
                report["rows"][side].append(row)
                print(f"round {round_} {side:<6} READY after {row['seconds_to_ready']:.2f} s", flush=True)
    report["medians"] = {side: medians(rows) for side, rows in report["rows"].items()}
    report["table"] = table(report["medians"]["before"], report["medians"]["after"])
    print("\n".join(report["table"]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    return 0


def markdown(report: dict) -> str:
    """The result page: what was run, where, and the medians (pure)."""
    c = report["commits"]
    return "\n".join([
        f"## {report['model']} on a CPU ({report['date'][:10]})", "",
        "CPU figures only: they show what a start spends outside the GPU (interpreters, imports, flag "
        "checks, building the model). The H200 acceptance of issue 36 (READY warm <= 8 s for llama-1b, "
        "<= 12 s for llama-8b) is not measured here.", "",
        f"- date: {report['date']}", f"- machine: {report['machine']}",
        f"- command: `{report['command']}`",
        f"- before: commit {c['before']}; after: commit {c['after']} (bench at {report['bench_commit']})",
        f"- {report['rounds']} rounds, each one start of either install in turn: --model {report['model']} "
        f"--device {report['device']} --max-num-seqs {report['max_num_seqs']} --max-seq-len 1024; medians per stage",
        "",
        *report["table"], "",
    ])


if __name__ == "__main__":
    sys.exit(main())
