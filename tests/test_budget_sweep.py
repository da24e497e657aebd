"""``bench/budget_sweep.py``: its settings and scenarios parse as documented, each cell's worker
gets the flags of its setting, TTFT is set against a prefill predicted from capture timings, and
the sweep runs end to end on CPU (fresh real worker processes per cell, real gRPC clients in their
own processes) into rows, a table and the plot's input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from budget_sweep import Setting, parse_scenarios, parse_settings, prefill_allowed_ms  # noqa: E402
from plot_budget_sweep import Point, points  # noqa: E402

from graphkeeper.proto import worker_pb2 as pb  # noqa: E402


def test_settings_are_the_grid_or_the_pairs_given():
    assert parse_settings("512,8192", "default,8") == [Setting(512, 0.0), Setting(512, 8.0), Setting(8192, 0.0),
                                                       Setting(8192, 8.0)]
    assert parse_settings("512", "0,default,12") == [Setting(512, 0.0), Setting(512, 12.0)]  # 0 is the default
    assert parse_settings("1,2", "5", settings="8192:default,8192:12.5") == [Setting(8192, 0.0), Setting(8192, 12.5)]
    assert [s.label for s in parse_settings("8192", "default,12")] == ["8192/default", "8192/12ms"]


@pytest.mark.parametrize(("budgets", "targets", "settings", "says"), [
    ("512", "-1", "", "ITL target '-1'"), ("512", "nan", "", "ITL target 'nan'"), ("512", "fast", "", "'fast'"),
    ("0", "default", "", "token budget '0'"), ("5x", "default", "", "'5x'"), ("", "", "", "no settings"),
    ("", "", "8192", "budget:target pairs"), ("", "", "8192:inf", "ITL target 'inf'")])
def test_bad_settings_say_what_is_wrong(budgets, targets, settings, says):
    with pytest.raises(SystemExit, match=says):
        parse_settings(budgets, targets, settings)


def test_the_sweep_refuses_scenarios_whose_prompts_are_not_fresh():
    assert parse_scenarios("long,mixed,decode,c4-p40-o16") == ["long", "mixed", "decode", "c4-p40-o16"]
    with pytest.raises(SystemExit, match="shares a prompt prefix"):
        parse_scenarios("long,shared")
    with pytest.raises(SystemExit, match="unknown scenario"):
        parse_scenarios("longest")


def test_a_cell_runs_its_worker_with_its_budget_and_only_the_target_it_asks():
    asked = Setting(8192, 12.0).worker_flags("long")
    assert asked.budget == 8192 and asked.extra == ("--itl-target-ms", "12")
    assert asked.max_seq_len == 3000 + 256 and asked.max_num_seqs == 64  # the longest prompt and output fit
    assert Setting(512).worker_flags("decode").extra == ()  # default: the worker derives its own


def test_ttft_is_set_against_one_step_of_the_prompt_alone_from_capture_timings():
    piecewise, full = pb.GRAPH_MODE_PIECEWISE, pb.GRAPH_MODE_FULL
    timings = [{"mode": full, "size": 64, "replay_seconds": 0.002, "eager_seconds": 0.004},
               {"mode": piecewise, "size": 256, "replay_seconds": 0.003, "eager_seconds": 0.004},
               {"mode": piecewise, "size": 512, "replay_seconds": 0.005, "eager_seconds": 0.006}]
    assert prefill_allowed_ms(timings, 300) == pytest.approx(5.0)  # padded to the 512 graph, replayed
    # Past the largest graph the step runs eager: the measured eager line, extended (2 ms per 256 tokens).
    assert prefill_allowed_ms(timings, 1024) == pytest.approx(10.0)
    assert prefill_allowed_ms([], 1024) is None  # a CPU worker measures nothing


def test_the_plot_input_is_one_point_per_measured_setting_per_scenario():
    cells = [{"scenario": "long", "setting": "512/default", "ttft_ms": {"p50": 400.0, "p99": 600.0},
              "itl_ms": {"p50": 4.8, "p99": 7.5}},
             {"scenario": "long", "setting": "8192/12ms", "error": "worker exited during startup"},
             {"scenario": "mixed", "setting": "512/default", "ttft_ms": {}, "itl_ms": {}},  # nothing measured
             {"scenario": "long", "setting": "8192/default", "ttft_ms": {"p50": 50.0, "p99": 190.0},
              "itl_ms": {"p50": 4.9, "p99": 11.0}}]
    assert points({"cells": cells}) == {"long": [Point("512/default", 7.5, 400.0, 600.0),
                                                 Point("8192/default", 11.0, 50.0, 190.0)]}


def test_the_sweep_runs_each_setting_in_a_fresh_worker_and_writes_rows_table_and_plot(tmp_path: Path):
    out = tmp_path / "budget-sweep-cpu"
    done = subprocess.run(
        [sys.executable, "bench/budget_sweep.py", "--device", "cpu", "--dtype", "float32", "--preset", "tiny",
         "--scenarios", "c4-p40-o16", "--settings", "64:default,96:5", "--seconds", "1", "--client-procs", "2",
         "--logs", str(tmp_path / "logs"), "--out", str(out)],
        capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    assert results["gpu"] == "cpu" and results["commit"] and results["settings"] == ["64/default", "96/5ms"]
    rows = {r["setting"]: r for r in results["cells"]}
    assert set(rows) == {"64/default", "96/5ms"}
    assert len(list((tmp_path / "logs").glob("*.log"))) == 2  # a worker each
    for setting, row in rows.items():
        budget = int(setting.split("/")[0])
        assert row["budget"] == row["token_budget"] == row["step_budget"]["tokens"] == budget  # as the worker says
        # A CPU worker measures no step times: whatever the target asked, it runs a fixed budget, and says so.
        assert row["itl_target_ms_reported"] == 0.0 and "no step times measured" in row["target_source"]
        # ... and no TTFT guard: nothing stretches.
        assert row["step_budget"]["ttft_target_ms"] == row["step_budget"]["itl_max_ms"] == 0.0
        assert row["step_budget"]["guard_source"] == "" and row["steps_stretched_total"] == 0
        assert row["step_times"] == [] and row["prefill_allowed_ms"]["p50"]["ms"] is None
        assert "ttft_p50_over_prefill" not in row
        # Fresh prompts: every prompt asked the prefix cache and none hit.
        assert row["prefix_cache_queries_tokens_total"] > 0 and row["prefix_cache_hits_tokens_total"] == 0
        assert row["fresh_prompts"] is True
        assert row["tokens_per_s"] > 0 and row["errors"] == {}
        # No stagger: every stream runs from the start, so the figure once all run is the window's.
        assert row["stagger_seconds"] == 0.0 and row["tokens_per_s_all_started"] == row["tokens_per_s"]
        for figure in ("ttft_ms", "itl_ms"):
            assert 0 < row[figure]["p50"] <= row[figure]["p99"]
        assert row["coverage"] == 0.0 and row["eager_steps"]["backend_unsupported"] == row["steps"] > 0
        # Against the decode step timed in-process afterwards (eager on a CPU: wall time only).
        assert row["ratio_to_gpu_median_ms"] > 0 and row["itl_p99_over_step"] >= row["itl_p50_over_step"] > 0
    assert rows["64/default"]["itl_target_ms_requested"] == 0.0 and rows["96/5ms"]["itl_target_ms_requested"] == 5.0
    assert set(results["full_step"]) == {"4"}
    table = out.with_suffix(".md").read_text()
    assert "| c4-p40-o16 | 96 | 5.0 | none (no step times measured" in table
    plotted = points(results)
    assert [p.label for p in plotted["c4-p40-o16"]] == ["64/default", "96/5ms"]
    drawn = subprocess.run([sys.executable, "bench/plot_budget_sweep.py", str(out.with_suffix(".json"))],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert drawn.returncode == 0, drawn.stderr
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
