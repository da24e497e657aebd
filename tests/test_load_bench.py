"""``bench/load_bench.py``'s reading of the worker's own histograms: the engine's inter-token gaps
and step times over a load, from the worker's real metrics registry rendered as Prometheus text,
with quantiles as Prometheus's ``histogram_quantile`` computes them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from prometheus_client import generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from load_bench import (  # noqa: E402
    add_work_bound,
    buckets,
    engine_tails,
    quantile,
    share_above,
    sustained_rate,
    tails_line,
    work_bound,
)
from metrics_text import summed as parse_metrics  # noqa: E402

from graphkeeper.worker.metrics import WorkerMetrics  # noqa: E402

ITL = "graphkeeper_inter_token_latency_seconds"


def text(metrics: WorkerMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_a_quantile_interpolates_within_its_bucket_as_prometheus_does():
    cum = [(0.005, 0.0), (0.01, 50.0), (0.02, 100.0), (float("inf"), 100.0)]
    assert quantile(cum, 0.5) == 0.01  # the 50th of 100 is the top of the 5-10 ms bucket
    assert abs(quantile(cum, 0.75) - 0.015) < 1e-12  # halfway through 10-20 ms
    assert quantile([(0.01, 0.0), (float("inf"), 4.0)], 0.99) == 0.01  # in +Inf: the largest finite bound
    assert quantile([(0.01, 0.0), (float("inf"), 0.0)], 0.5) is None
    assert quantile([], 0.5) is None


def test_shares_above_a_bound_count_what_the_bucket_does_not():
    cum = [(0.008, 90.0), (0.012, 98.0), (0.016, 99.0), (float("inf"), 100.0)]
    assert abs(share_above(cum, 0.012) - 0.02) < 1e-12
    assert share_above(cum, 0.009) is None  # not a bucket bound: no share is made up
    assert share_above([], 0.012) is None


def test_the_engine_tails_over_a_load_come_from_the_workers_own_histograms():
    metrics = WorkerMetrics()
    metrics.inter_token_latency.observe(0.5)  # before the load: not counted
    before = parse_metrics(text(metrics))
    gaps = [0.0035] * 900 + [0.007] * 85 + [0.011] * 10 + [0.015] * 5  # 1.5% above 8 ms, 0.5% above 12
    for gap in gaps:
        metrics.inter_token_latency.observe(gap)
    for seconds in (0.0034, 0.0085):  # two execution modes: summed per bucket
        metrics.step_duration.labels("piecewise", "varlen").observe(seconds)
        metrics.step_duration.labels("full", "decode").observe(seconds)
    after = parse_metrics(text(metrics))

    cum = buckets(before, after, ITL)
    assert cum[-1] == (float("inf"), 1000.0)
    tails = engine_tails(before, after)
    itl = tails["engine_itl_ms"]
    assert abs(itl["over_8"] - 0.015) < 1e-12 and abs(itl["over_12"] - 0.005) < 1e-12 and itl["over_16"] == 0.0
    assert 3.0 < itl["p50"] < 4.0  # the 3-4 ms bucket holds the median
    assert itl["p99"] == 11.0  # the 990th of 1,000 halfway through the 10-12 ms bucket
    assert abs(np.percentile(gaps, 99) * 1e3 - itl["p99"]) < 4.0  # within the bucket's width
    steps = tails["step_ms"]
    assert steps["over_8"] == 0.5 and steps["over_12"] == 0.0
    assert "engine_itl_ms p50" in tails_line(tails) and "over 12 ms 0.50%" in tails_line(tails)


def test_gc_pauses_over_a_load_are_counted_per_process_from_the_workers_histogram():
    metrics = WorkerMetrics()
    metrics.gc_pause.labels("engine", "0").observe(0.0002)  # before the load: not counted
    metrics.step_overruns.inc()
    before = parse_metrics(text(metrics))
    for seconds, generation in ((0.0001, "0"), (0.0003, "1"), (0.007, "2"), (0.025, "2")):
        metrics.gc_pause.labels("engine", generation).observe(seconds)
    metrics.gc_pause.labels("api", "2").observe(0.012)
    after = parse_metrics(text(metrics))
    gc = engine_tails(before, after)["gc"]
    assert gc["engine"]["collections"] == 4.0 and gc["engine"]["over_5ms"] == 2.0 and gc["engine"]["over_10ms"] == 1.0
    assert abs(gc["engine"]["pause_ms_total"] - 32.4) < 1e-9
    assert gc["api"] == {"collections": 1.0, "pause_ms_total": 12.0, "over_5ms": 1.0, "over_10ms": 1.0}
    tails = engine_tails(before, after)
    assert "GC (engine) 4 pauses, 32.4 ms in all, 2 over 5 ms; GC (api) 1 pauses" in tails_line(tails)
    metrics.step_overruns.inc(3)
    assert engine_tails(before, parse_metrics(text(metrics)))["step_overruns"] == 3.0
    assert "0 steps past the budget's bound" in tails_line(tails)


def test_a_load_with_no_steps_says_none():
    metrics = WorkerMetrics()
    same = parse_metrics(text(metrics))
    tails = engine_tails(same, same)
    assert tails["step_ms"] == {"p50": None, "p99": None, "over_8": None, "over_12": None, "over_16": None}
    assert "step_ms none" in tails_line(tails)


def test_one_series_is_read_by_its_exact_labels():
    """``metrics_text.value``, as the sleep benchmark reads counters and gauges: the series with
    exactly the labels asked for, 0.0 for one that is absent."""
    from metrics_text import value

    metrics = WorkerMetrics()
    metrics.recaptures.labels("policy").inc(2)
    metrics.wakes.labels("request").inc()
    metrics.sleeping.set(1)
    rendered = text(metrics)
    assert value(rendered, "graphkeeper_recaptures_total", cause="policy") == 2.0
    assert value(rendered, "graphkeeper_recaptures_total", cause="model_revision") == 0.0
    assert value(rendered, "graphkeeper_wakes_total", cause="request") == 1.0
    assert value(rendered, "graphkeeper_sleeping") == 1.0
    assert value(rendered, "graphkeeper_wakes_total") == 0.0  # labels must match exactly


def test_the_rate_once_every_stream_runs_leaves_the_staggered_start_out():
    """Two client processes whose streams started within the first 2 s of a 10 s window: what they
    received after 2 s, over the 8 s left, summed; a window no longer than the stagger has none."""
    parts = [{"tokens": 9_000, "tokens_all_started": 8_000}, {"tokens": 8_500, "tokens_all_started": 8_000}]
    assert sustained_rate(parts, 10.0, 2.0) == 2_000.0  # against 1,750 tok/s over the whole window
    assert sustained_rate(parts, 2.0, 2.0) is None
    assert sustained_rate([{"tokens": 500, "tokens_all_started": 500}], 5.0, 0.0) == 100.0


def test_the_work_bound_packs_prompts_beside_full_decode_rows_on_the_captured_steps():
    """64 streams, 512 tokens a step with decode rows: 448 prompt tokens ride each prefill step
    (priced at the 512-token replay), the rest of the decoding in 64-row steps (the faster mode
    at the smallest size that holds 64); a size that is not captured, or no room, gives None."""
    times = [{"mode": 2, "size": 64, "replay_seconds": 0.0015}, {"mode": 3, "size": 64, "replay_seconds": 0.001},
             {"mode": 2, "size": 96, "replay_seconds": 0.0016}, {"mode": 2, "size": 512, "replay_seconds": 0.004}]
    # 6,400 generated tokens = 100 steps of 64; 4,480 prompt tokens = 10 of them carry prefill.
    assert abs(work_bound(6_400, 4_480, 64, 512, times) - 6_400 / (10 * 0.004 + 90 * 0.001)) < 1e-6
    assert abs(work_bound(6_400, 0, 60, 512, times) - 60 / 0.001) < 1e-6  # 60 rows: FULL at 64
    assert abs(work_bound(7_000, 0, 70, 512, times) - 70 / 0.0016) < 1e-6  # 70 rows: 96, the size that holds them
    assert work_bound(6_400, 4_480, 64, 1024, times) is None  # no captured step holds 1,024 tokens
    assert work_bound(6_400, 4_480, 64, 64, times) is None  # no room for a prompt beside the rows
    row = {"streams": 64, "generated_tokens": 6_400, "prefix_cache_queries_tokens_total": 4_480,
           "tokens_per_s": 25_000.0, "tokens_per_s_all_started": 30_000.0,
           "step_budget": {"tokens_with_decode": 512}, "step_times": times}
    add_work_bound(row)
    assert abs(row["ratio_to_work"] - 25_000 / row["work_allows_tokens_per_s"]) < 1e-12
    assert abs(row["ratio_to_work_all_started"] - 30_000 / row["work_allows_tokens_per_s"]) < 1e-12
    bare = {"streams": 64, "tokens_per_s": 1.0}
    add_work_bound(bare)  # a CPU run or an older worker: nothing to bound with
    assert "ratio_to_work" not in bare


def test_the_work_bound_of_the_h100_mixed_run_is_what_its_results_say():
    """The committed mixed run at 38b41b6 (``bench/results/load-defaults-38b41b6-h100.json``):
    38,905 tok/s on its worker's own step times, 0.70 in the window, 0.78 once every stream runs."""
    import json

    path = Path(__file__).resolve().parents[1] / "bench" / "results" / "load-defaults-38b41b6-h100.json"
    row = next(r for r in json.loads(path.read_text())["scenarios"] if r["scenario"] == "mixed")
    add_work_bound(row)
    assert round(row["work_allows_tokens_per_s"]) == 38_905
    assert round(row["ratio_to_work"], 2) == 0.70 and round(row["ratio_to_work_all_started"], 2) == 0.78


def test_the_host_cpu_names_its_model_and_usable_count():
    """Benchmarks record the host's CPU beside the GPU: two H100 machines differed by 12% in a plain
    batch's tokens/s on 2026-12-06 and nothing in the results said why."""
    import os

    from proc_stats import host_cpu

    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7R13 Processor\n"
    assert host_cpu(text) == f"AMD EPYC 7R13 Processor x{len(os.sched_getaffinity(0))}"
    assert host_cpu("").startswith("unknown CPU x")
    assert " x" in host_cpu()  # this machine's own
