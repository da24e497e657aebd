"""The collector's pauses (``engine/gc_pauses.py``): each collection timed into the worker's real
histogram by process and generation, and the heap frozen after a capture phase (a real engine on
the CPU: its first READY freezes what startup built) and in the API process once it serves (real
worker processes)."""

from __future__ import annotations

import gc
import threading

import pytest
from worker_harness import generate, make_request, wait_until

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.gc_pauses import GcPauses, freeze_heap
from graphkeeper.worker.metrics import WorkerMetrics


def count(metrics: WorkerMetrics, generation: str, process: str = "engine") -> float:
    return metrics.registry.get_sample_value("graphkeeper_gc_pause_seconds_count",
                                             {"process": process, "generation": generation}) or 0.0


def test_every_collection_is_timed_by_the_oldest_generation_it_collected():
    metrics = WorkerMetrics()
    pauses = GcPauses(metrics.gc_pause, "engine").install()
    try:
        gc.collect(0)
        gc.collect(1)
        gc.collect()
    finally:
        pauses.uninstall()
    assert [count(metrics, g) >= 1 for g in ("0", "1", "2")] == [True, True, True]
    total = metrics.registry.get_sample_value("graphkeeper_gc_pause_seconds_sum",
                                              {"process": "engine", "generation": "2"})
    assert total > 0.0
    gc.collect()  # uninstalled: no longer counted
    assert count(metrics, "2") == 1.0
    assert pauses._on_gc not in gc.callbacks


def test_the_series_exist_before_any_collection():
    metrics = WorkerMetrics()
    GcPauses(metrics.gc_pause, "engine")
    GcPauses(metrics.gc_pause, "api")
    assert [count(metrics, g, p) for p in ("engine", "api") for g in ("0", "1", "2")] == [0.0] * 6


def test_freezing_moves_what_is_alive_out_of_the_collectors_walk_and_thaws_the_last_freeze():
    class Cycle:
        pass

    try:
        kept = Cycle()
        kept.me = kept
        frozen = freeze_heap()
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # frozen: no generation holds it
        gone = Cycle()
        gone.me = gone
        del gone  # garbage made after the freeze is still collected
        assert gc.collect() >= 1
        kept = None  # frozen garbage waits for the next freeze, which collects it first
        assert freeze_heap() <= frozen
    finally:
        gc.unfreeze()


def test_a_ready_engine_has_frozen_its_startup_heap_and_reports_its_pauses():
    from graphkeeper.worker.engine.core import Engine
    from graphkeeper.worker.settings import EngineSettings

    gc.unfreeze()
    engine = Engine(EngineSettings(model="random:tiny", max_num_seqs=2, max_seq_len=64, max_num_batched_tokens=32))
    engine.start()
    try:
        assert engine.ready.wait(120) and engine.failed is None
        assert gc.get_freeze_count() > 0  # the first READY froze what startup built
        assert count(engine.metrics, "2") >= 1  # freezing's own full collection, timed
        done = threading.Event()
        engine.submit(pb.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                         stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True)),
                      lambda tokens, end: end is not None and done.set())
        assert done.wait(60)
    finally:
        engine.drain_and_stop(5)
        gc.unfreeze()
    assert engine.gc_pauses._on_gc not in gc.callbacks  # a stopped engine times nothing more


@pytest.fixture(autouse=True)
def _thawed():
    yield
    gc.unfreeze()


def test_a_worker_times_each_process_collections_apart_and_freezes_both_heaps(module_workers):
    """A real worker (engine core in its own process): both processes froze their heaps with one
    full collection each, timed under their own ``process`` label; the series merge, not add."""
    worker = module_workers("--max-num-seqs", "2", "--max-seq-len", "64")
    series = "graphkeeper_gc_pause_seconds_count"
    wait_until(lambda: worker.metric(series, process="api", generation="2") >= 1, what="the API process's freeze")
    assert worker.metric(series, process="engine", generation="2") >= 1
    tokens, _ = generate(worker, make_request([5, 6, 7], 4))
    assert len(tokens) == 4


def test_an_engine_in_the_api_process_is_timed_once(module_workers):
    """With the engine on a thread of the API process there is one process: its collections are
    timed once, as the engine's; nothing is counted twice under ``api``."""
    worker = module_workers("--max-num-seqs", "2", "--max-seq-len", "64", "--no-engine-process")
    series = "graphkeeper_gc_pause_seconds_count"
    wait_until(lambda: worker.metric(series, process="engine", generation="2") >= 2,
               what="the capture's and the serving freeze")
    assert [worker.metric(series, process="api", generation=g) for g in ("0", "1", "2")] == [0.0, 0.0, 0.0]
