"""The engine's garbage-collector pauses (``engine/gc_pauses.py``): each collection timed into the
worker's real histogram by generation, and the heap frozen after a capture phase (a real engine on
the CPU: its first READY freezes what startup built)."""

from __future__ import annotations

import gc
import threading

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.gc_pauses import GcPauses, freeze_heap
from graphkeeper.worker.metrics import WorkerMetrics


def count(metrics: WorkerMetrics, generation: str) -> float:
    return metrics.registry.get_sample_value("graphkeeper_engine_gc_pause_seconds_count",
                                             {"generation": generation}) or 0.0


def test_every_collection_is_timed_by_the_oldest_generation_it_collected():
    metrics = WorkerMetrics()
    pauses = GcPauses(metrics.gc_pause).install()
    try:
        gc.collect(0)
        gc.collect(1)
        gc.collect()
    finally:
        pauses.uninstall()
    assert [count(metrics, g) >= 1 for g in ("0", "1", "2")] == [True, True, True]
    total = metrics.registry.get_sample_value("graphkeeper_engine_gc_pause_seconds_sum", {"generation": "2"})
    assert total > 0.0
    gc.collect()  # uninstalled: no longer counted
    assert count(metrics, "2") == 1.0
    assert pauses._on_gc not in gc.callbacks


def test_the_series_exist_before_any_collection():
    metrics = WorkerMetrics()
    GcPauses(metrics.gc_pause)
    assert [count(metrics, g) for g in ("0", "1", "2")] == [0.0, 0.0, 0.0]


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
