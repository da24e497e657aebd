"""The step recorder (pure): each dispatched step is counted once, and the same counts reach the
worker's totals, its metrics and each request's execution summary."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.recorder import StepRecorder
from graphkeeper.worker.executor.graphs.dispatcher import FULL, NONE, PIECEWISE, BatchDescriptor, Dispatcher, GraphState
from graphkeeper.worker.metrics import WorkerMetrics

R = pb.FallbackReason
LADDER = (1, 2, 4, 8, 16)
DECODE3 = BatchDescriptor(num_tokens=3, uniform_decode=True, graphs_allowed=True)
MIXED5 = BatchDescriptor(num_tokens=5, uniform_decode=False, graphs_allowed=True)
CAPTURED = frozenset([*[(FULL, n) for n in (1, 2, 4)], *[(PIECEWISE, n) for n in LADDER]])
READY = GraphState(effective_mode=pb.GRAPH_MODE_FULL_AND_PIECEWISE, ladder=LADDER, captured=CAPTURED)


def test_recorder_counts_every_decision_once_for_status_metrics_and_requests():
    dispatcher, recorder = Dispatcher(READY), StepRecorder(WorkerMetrics())
    recorder.listed_tenants = frozenset({"gold"})
    steps = [DECODE3, DECODE3, MIXED5, MIXED5._replace(num_tokens=40),
             DECODE3._replace(graphs_allowed=False)]
    seq = SimpleNamespace(graph_steps=Counter(), eager_steps=Counter())
    decisions = [dispatcher.dispatch(d) for d in steps]
    for desc, decision in zip(steps, decisions, strict=True):
        recorder.record(decision, desc, [seq], {"gold", "other"}, 0.001)
    assert [d.mode for d in decisions] == [FULL, FULL, PIECEWISE, NONE, NONE]
    assert recorder.graph_steps == seq.graph_steps == {(FULL, 4): 2, (PIECEWISE, 8): 1}
    assert recorder.eager_steps == seq.eager_steps == {R.FALLBACK_REASON_EXCEEDS_MAX_CAPTURE_SIZE: 1,
                                                       R.FALLBACK_REASON_TENANT_DISABLED: 1}
    assert recorder.real_tokens == 3 + 3 + 5 + 40 + 3
    assert recorder.padded_tokens == 4 + 4 + 8 + 40 + 3
    m = recorder.metrics
    assert m.padded_tokens._value.get() == recorder.padded_tokens
    assert m.tenant_steps.labels("gold", "graph")._value.get() == 3
    assert m.tenant_steps.labels("gold", "eager")._value.get() == 2


def test_the_series_of_tenants_a_new_policy_no_longer_lists_are_removed():
    """8 generations of 256 tenants each used to leave 2,048 series behind; now only the listed
    tenants of the adopted policy keep theirs."""
    recorder = StepRecorder(WorkerMetrics())
    decision = Dispatcher(READY).dispatch(DECODE3)
    seq = SimpleNamespace(graph_steps=Counter(), eager_steps=Counter())
    for generation in range(8):
        tenants = {f"g{generation}-t{i}" for i in range(256)}
        recorder.listed_tenants = frozenset(tenants | {"gold"})
        recorder.record(decision, DECODE3, [seq], tenants | {"gold"}, 0.001)
    series = {s.labels["tenant"] for metric in recorder.metrics.tenant_steps.collect() for s in metric.samples}
    assert series == {f"g7-t{i}" for i in range(256)} | {"gold"}
    assert recorder.metrics.tenant_steps.labels("gold", "graph")._value.get() == 8  # kept while listed
