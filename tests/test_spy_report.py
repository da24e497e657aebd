"""bench/spy_report.py on a recording shaped like py-spy's raw output in gpu_session's blocks: the
engine thread's shares per function, only the blocks asked for, other threads left out."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

REPORT = Path(__file__).resolve().parents[1] / "bench" / "spy_report.py"
ENGINE = ("process 7:\"python3 -c spawn\";Thread.run (threading.py:1);Engine._main (/w/core.py:261);"
          "Engine._loop (/w/core.py:314)")
API = "process 6:\"python3 -m graphkeeper.cli worker\";MainThread;serve (/w/http.py:10)"


def record(tmp_path: Path) -> Path:
    lines = ["### 1 100",
             f"{ENGINE};Engine._start (/w/core.py:390);apply (/w/penalty_counts.py:80) 30",
             f"{ENGINE};Engine._read (/w/core.py:412);Event.synchronize (/t/streams.py:254) 10",
             f"{API} 500",
             "### 2 103",
             f"{ENGINE};Engine._start (/w/core.py:390) 99"]
    path = tmp_path / "spy.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


def report(path: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, str(REPORT), str(path), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_shares_are_of_the_engine_thread_in_the_blocks_asked_for(tmp_path):
    path = record(tmp_path)
    text = report(path, "--blocks", "1")
    assert "block 1: 40 engine-thread samples" in text and "block 2" not in text
    assert " 0.750  Engine._start (core.py)" in text
    assert " 0.750  apply (penalty_counts.py)" in text  # inclusive and self alike: a leaf
    assert " 0.250  Event.synchronize (streams.py)" in text
    assert "serve" not in text  # the API process's thread is not the engine's
    everything = report(path)
    assert "block 2: 99 engine-thread samples" in everything
    assert f" {129 / 139:.3f}  Engine._start (core.py)" in everything
