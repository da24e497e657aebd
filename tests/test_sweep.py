"""``graphkeeper sweep`` end to end on CPU: fresh real worker processes per cell, the table, the JSON and
the plot drawn from it. Graphs do not capture on CPU: the cells still run and say so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from sweep import parse_ladders  # noqa: E402  (bench/, not part of the package)

PROFILE = {"steps": 1000, "shapes": [
    {"num_tokens": 1, "num_seqs": 1, "uniform_decode": True, "steps": 600},
    {"num_tokens": 8, "num_seqs": 8, "uniform_decode": True, "steps": 350},
    {"num_tokens": 40, "num_seqs": 2, "uniform_decode": False, "steps": 50}]}


def test_ladders_parse_with_fixed_lists():
    assert parse_ladders("default,traffic,fixed:8,16,32") == ["default", "traffic", "fixed:8,16,32"]
    assert parse_ladders("fixed:4,default") == ["fixed:4", "default"]
    with pytest.raises(SystemExit):
        parse_ladders("16")


def test_the_sweep_runs_every_cell_in_a_fresh_worker_and_writes_table_json_and_plot(tmp_path: Path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    out = tmp_path / "sweep-cpu"
    done = subprocess.run(
        [sys.executable, "-m", "graphkeeper.cli", "sweep", "--device", "cpu", "--dtype", "float32",
         "--preset", "tiny", "--modes", "Piecewise", "--ladders", "default,traffic", "--traffic-max-graphs", "2",
         "--seconds", "1", "--budget", "64", "--max-num-seqs", "8", "--scenario", "one", "--client-procs", "1",
         "--traffic-profile", str(profile), "--logs", str(tmp_path / "logs"), "--out", str(out)],
        capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    cells = {c["ladder"]: c for c in results["cells"]}
    assert set(cells) == {"default", "traffic"}
    assert cells["default"]["sizes"] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert cells["traffic"]["sizes"] == [8, 40] and "chosen from traffic" in cells["traffic"]["how"]
    for cell in cells.values():
        assert cell["effective_mode"] == "NONE" and "no CUDA device" in cell["note"]
        assert cell["graphs_captured"] == 0 and cell["tokens_per_s"] > 0 and cell["itl_ms"]["p50"] > 0
        assert cell["dispatch"]["eager_steps"].get("backend_unsupported", 0) > 0
    assert cells["default"]["profile"]["coverage"] == 1.0 and cells["default"]["profile"]["padding_waste"] == 0.0
    assert cells["traffic"]["profile"]["coverage"] == 1.0 and cells["traffic"]["profile"]["padding_waste"] > 0
    table = out.with_suffix(".md").read_text()
    assert "| Piecewise | traffic | 0 | 2 |" in table
    pytest.importorskip("matplotlib", reason="the bench extra (make setup installs it)")
    plotted = subprocess.run([sys.executable, str(ROOT / "bench" / "plot_sweep.py"), str(out.with_suffix(".json"))],
                             capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
