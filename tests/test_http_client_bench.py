"""``bench/http_client.py``, the plain multi-process OpenAI HTTP client that shows whether a benchmark
client was the limit, runs end to end on CPU through ``bench/openai_bench.py`` (without GuideLLM):
its tokens are the worker's usage counts, never more than the requests it made could hold, and it
reports its own CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from http_client import percentiles  # noqa: E402  (bench/, not part of the package)

OUTPUT_TOKENS = 8


def test_percentiles_are_milliseconds_of_sorted_seconds():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    p = percentiles([0.001 * i for i in range(1, 101)])
    assert (round(p["p50"]), round(p["p90"]), round(p["p99"]), round(p["mean"], 1)) == (51, 91, 100, 50.5)


def test_the_plain_client_drives_a_worker_over_http_and_reports_its_cpu(tmp_path: Path):
    out = tmp_path / "ob"
    done = subprocess.run(
        [sys.executable, "bench/openai_bench.py", "--device", "cpu", "--dtype", "float32", "--preset", "tiny",
         "--prompt-tokens", "32", "--output-tokens", str(OUTPUT_TOKENS), "--concurrency", "1,3", "--seconds", "3",
         "--clients", "plain", "--client-processes", "2", "--paths", "http", "--models", str(tmp_path / "models"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "openai-tiny.json").read_text())
    assert result["clients"] == ["plain"] and result["http"] == [] and result["grpc"] == []
    rows = result["http_plain"]
    assert [row["concurrency"] for row in rows] == [1, 3] and [row["processes"] for row in rows] == [1, 2]
    for row in rows:
        assert row["errors"] == {} and row["requests_completed"] >= row["concurrency"]
        generated = row["tokens_per_s"] * 3
        # Counted from the worker's usage: at most every request's tokens, those still running included.
        assert 0 < generated <= (row["requests_completed"] + row["concurrency"]) * OUTPUT_TOKENS
        assert row["ttft_ms"]["p50"] > 0 and row["itl_ms"]["p50"] is not None
        cpu = row["client_cpu"]
        assert cpu["cores_used"] > 0 and cpu["busiest_process"] > 0 and isinstance(cpu["client_bound"], bool)
    assert "http (plain client)" in (out / "openai-tiny.md").read_text()
