"""``bench/kv_capacity.py`` runs end to end on CPU (it once crashed before its first request, on an
argument the load benchmark's worker launcher read and it did not define) and its static figure is
the static cache's own sizing rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from kv_capacity import static_capacity  # noqa: E402  (bench/, not part of the package)


def test_static_capacity_is_whole_contexts_less_the_scratch_slots():
    # 1,024-token contexts of 1 KiB per token in 8 MiB: 8 contexts, one scratch slot for a 512-token step.
    assert static_capacity(8 * 2**20, 1024, 1024, 512) == 7
    # A step longer than a context needs two scratch slots; nothing fits in less than one context.
    assert static_capacity(8 * 2**20, 1024, 1024, 1500) == 6
    assert static_capacity(2**20 - 1, 1024, 1024, 512) == 0


def test_the_capacity_bench_runs_on_cpu_and_the_paged_cache_holds_more_sequences(tmp_path: Path):
    out = tmp_path / "kv-capacity.json"
    done = subprocess.run(
        [sys.executable, "bench/kv_capacity.py", "--device", "cpu", "--dtype", "float32", "--preset", "tiny",
         "--context", "1024", "--kv-cache-memory", "8Mi", "--streams", "32", "--seconds", "3",
         "--client-procs", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {} and result["tokens_per_s"] > 0
    assert result["static_capacity_sequences"] == 15
    assert result["paged_peak_running_sequences"] > result["static_capacity_sequences"]
    assert result["gpu"] == "cpu" and result["date"] and result["command"]
