"""The three ways Operator III split one selection between two policies, each tried N times.

Runs the cluster suite's split repros (``tests/cluster/test_ownership.py``: a selector edit
mid-rollout, a policy created right after the first push lands, 20 policies in one apply) with
``GRAPHKEEPER_SPLIT_TRIALS=N`` on a real kube-apiserver with light stand-in workers, and writes
how many trials ended with one owner and one Ready policy. A trial that does not is a split (or
a selection that never settled): the test fails and the trial is counted against.

    python bench/operator_splits.py --trials 20
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPROS = {
    "test_a_selector_edit_mid_rollout_moves_the_whole_overlap_to_the_older_policy":
        "selector edit mid-rollout (then an operator restart and a change)",
    "test_a_policy_created_right_after_the_first_push_lands_never_splits_the_selection":
        "created right after the first push lands",
    "test_twenty_policies_in_one_apply_end_with_one_owner": "20 policies in one apply",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "operator-splits.md"))
    args = parser.parse_args()
    junit = Path(tempfile.mkdtemp(prefix="gk-splits-")) / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "tests/cluster/test_ownership.py", "-k", " or ".join(REPROS)]
    started = datetime.now(UTC)
    run = subprocess.run(command, cwd=ROOT, env={**os.environ, "GRAPHKEEPER_SPLIT_TRIALS": str(args.trials)})
    results: dict[str, list[tuple[bool, float]]] = defaultdict(list)
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "").split("[")[0]
        if name in REPROS:
            failed = case.find("failure") is not None or case.find("error") is not None
            results[name].append((not failed, float(case.get("time", 0))))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [
        "# One selection, one owner: the split repros (light stand-ins)",
        "",
        f"- Date: {started.strftime('%Y-%m-%d %H:%M UTC')}; commit {commit}",
        f"- Machine: 2-core CPU VM ({platform.machine()}, Python {platform.python_version()}), shared; a real "
        "kube-apiserver and etcd (`deploy/local/cluster.sh`), the operator as a process, four stand-in workers "
        "(`tests/fakes/fake_worker.py`, 1 s captures, maxUnavailable 1) per trial in a fresh namespace",
        f"- Command: `python bench/operator_splits.py --trials {args.trials}` (pytest exit status {run.returncode})",
        "- A trial passes when exactly one policy is Ready, every other is Degraded=Conflict naming it, and every "
        "worker holds its policy; anything else (a split, or no settled owner within 90 s) fails it.",
        "",
        "| Repro | trials | one owner | splits or unsettled | seconds per trial (median) |",
        "|---|---|---|---|---|",
    ]
    for name, label in REPROS.items():
        rows = results.get(name, [])
        ok = sum(1 for passed, _ in rows if passed)
        times = sorted(t for _, t in rows)
        median = times[len(times) // 2] if times else 0.0
        lines.append(f"| {label} | {len(rows)} | {ok} | {len(rows) - ok} | {median:.1f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
