"""Metric labels expose no paths: the model-info series names a directory model by its
basename, and every label value the worker derives from outside input is bounded."""

from __future__ import annotations

from prometheus_client import generate_latest
from worker_harness import parse_metrics

from graphkeeper.worker.metrics import MAX_LABEL_CHARS, WorkerMetrics, bounded_label, source_label
from graphkeeper.worker.model.loader import load_model, save_hf_directory


def test_source_label():
    assert source_label("/var/lib/kubelet/pods/abc/volumes/models/llama-3-8b") == "dir:llama-3-8b"
    assert source_label("/models/llama-3-8b/") == "dir:llama-3-8b"
    assert source_label("relative/dir") == "dir:dir"
    assert source_label("random:tiny@5") == "random:tiny@5"
    assert len(source_label("/m/" + "x" * 500)) == MAX_LABEL_CHARS
    assert len(source_label("random:" + "x" * 500)) == MAX_LABEL_CHARS


def test_bounded_label():
    assert bounded_label("v1") == "v1"
    cut = bounded_label("r" * 200)
    assert len(cut) == MAX_LABEL_CHARS and cut.endswith("…")


def test_model_info_series_carries_no_path():
    metrics = WorkerMetrics()
    metrics.set_model("v" * 300, "/secret/mount/point/llama-3-8b", "bfloat16", "cuda:0")
    text = generate_latest(metrics.registry).decode()
    assert "/secret" not in text and "mount" not in text
    [labels] = [dict(k[1]) for k in parse_metrics(text) if k[0] == "graphkeeper_model_info"]
    assert labels["source"] == "dir:llama-3-8b"
    assert len(labels["revision"]) == MAX_LABEL_CHARS
    assert (labels["dtype"], labels["device"]) == ("bfloat16", "cuda:0")


def test_a_worker_serving_a_directory_exports_no_path(fresh_workers, tmp_path):
    model_dir = tmp_path / "deeply" / "nested" / "tiny-model"
    loaded = load_model("random:tiny@3", device="cpu", dtype="float32", max_positions=64)
    save_hf_directory(loaded.model, model_dir)
    worker = fresh_workers(model=str(model_dir))
    text = worker.metrics_text()
    assert str(tmp_path) not in text and "nested" not in text
    [labels] = [dict(k[1]) for k in parse_metrics(text) if k[0] == "graphkeeper_model_info"]
    assert labels["source"] == "dir:tiny-model"
    assert labels["revision"] == worker.model_info().revision
