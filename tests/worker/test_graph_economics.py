"""Graph economics, the pure parts: the traffic histogram (bounded, reset on adoption), which keys
a ``max_graphs`` limit keeps, which graphs idle release takes, what a budget gives back, the new
policy fields' validation, what the step recorder counts per graph, and the ``graphkeeper graphs``
table built from a status."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from graphkeeper.client import graph_rows, graphs_table
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import (
    MAX_GRAPHS_LIMIT,
    MAX_IDLE_RELEASE_SECONDS,
    PolicyError,
    recapture_key,
    validate_policy,
)
from graphkeeper.worker.engine.recorder import StepRecorder
from graphkeeper.worker.engine.traffic import TrafficHistogram
from graphkeeper.worker.executor.graphs.dispatcher import BatchDescriptor, Dispatcher, GraphState
from graphkeeper.worker.executor.graphs.economics import (
    idle_keys,
    key_for_step,
    limit_plan,
    over_budget_drops,
    traffic_per_key,
)
from graphkeeper.worker.executor.graphs.modes import FULL, PIECEWISE, capture_plan
from graphkeeper.worker.metrics import WorkerMetrics

R = pb.FallbackReason
LADDER = [1, 2, 4, 8, 16]
FP = pb.GRAPH_MODE_FULL_AND_PIECEWISE


# --- the traffic histogram ---------------------------------------------------------------------


def test_the_histogram_counts_each_shape_and_every_step():
    h = TrafficHistogram(now=100.0)
    for shape in [(3, 3, True), (3, 3, True), (17, 2, False), (3, 1, False)]:
        assert h.count(*shape)
    assert h.steps == 4 and h.overflow_steps == 0
    assert h.shapes() == {(3, 3, True): 2, (17, 2, False): 1, (3, 1, False): 1}
    assert h.tokens() == {(3, True): 2, (17, False): 1, (3, False): 1}
    proto = h.to_proto()
    assert [(s.num_tokens, s.num_seqs, s.uniform_decode, s.steps) for s in proto.shapes] == [
        (3, 1, False, 1), (3, 3, True, 2), (17, 2, False, 1)]
    assert (proto.steps, proto.overflow_steps, proto.since_unix_seconds) == (4, 0, 100.0)


def test_the_histogram_is_bounded_and_counts_what_finds_no_room():
    h = TrafficHistogram(max_shapes=3)
    for n in range(1, 11):
        h.count(n, 1, False)
    h.count(2, 1, False)  # a shape already held still counts
    assert len(h.shapes()) == 3
    assert h.steps == 11 and h.overflow_steps == 7
    assert sum(s.steps for s in h.to_proto().shapes) + h.overflow_steps == h.steps
    with pytest.raises(ValueError, match="max_shapes"):
        TrafficHistogram(max_shapes=0)


def test_adopting_a_policy_resets_the_histogram_and_stamps_it():
    h = TrafficHistogram(max_shapes=2, now=1.0)
    for n in (1, 2, 3):
        h.count(n, n, True)
    h.reset("uid-a", 7, now=50.0)
    proto = h.to_proto()
    assert (len(proto.shapes), proto.steps, proto.overflow_steps) == (0, 0, 0)
    assert (proto.policy_uid, proto.policy_generation, proto.since_unix_seconds) == ("uid-a", 7, 50.0)
    h.count(5, 5, True)
    assert h.shapes() == {(5, 5, True): 1}


# --- max_graphs ----------------------------------------------------------------------------------


def test_the_key_a_step_would_replay_follows_the_dispatcher():
    keys = set(capture_plan(FP, LADDER, 4))
    from graphkeeper.proto.policy import padding_table

    table = padding_table(LADDER)
    assert key_for_step(3, True, keys, table) == (FULL, 4)
    assert key_for_step(3, False, keys, table) == (PIECEWISE, 4)
    assert key_for_step(7, True, keys, table) == (PIECEWISE, 8)  # no FULL graph past max_num_seqs
    assert key_for_step(17, False, keys, table) is None  # past the largest size
    assert key_for_step(0, False, keys, table) is None


def test_max_graphs_keeps_the_keys_traffic_used_most_in_plan_order():
    plan = capture_plan(FP, LADDER, 4)  # FULL 4,2,1 then PIECEWISE 16,8,4,2,1
    traffic = {(3, True): 100, (4, True): 20, (12, False): 50, (1, False): 5}
    assert traffic_per_key(plan, LADDER, traffic)[(FULL, 4)] == 120
    kept, left = limit_plan(plan, 3, LADDER, traffic)
    assert kept == [(FULL, 4), (PIECEWISE, 16), (PIECEWISE, 1)]
    assert set(left) == set(plan) - set(kept)
    assert kept + left != plan and sorted(kept + left) == sorted(plan)


def test_without_traffic_max_graphs_keeps_the_smallest_sizes():
    plan = capture_plan(FP, LADDER, 4)
    kept, left = limit_plan(plan, 4, LADDER, None)
    assert kept == [(FULL, 2), (FULL, 1), (PIECEWISE, 2), (PIECEWISE, 1)]  # largest first, as captured
    assert limit_plan(plan, 0, LADDER) == (plan, [])  # 0: no limit
    assert limit_plan(plan, len(plan) + 5, LADDER) == (plan, [])


def test_a_size_left_out_by_max_graphs_falls_back_with_its_reason():
    plan = capture_plan(pb.GRAPH_MODE_PIECEWISE, LADDER, 4)
    kept, left = limit_plan(plan, 2, LADDER)
    state = GraphState(effective_mode=pb.GRAPH_MODE_PIECEWISE, ladder=tuple(LADDER), captured=frozenset(kept),
                       skipped=dict.fromkeys(left, R.FALLBACK_REASON_SIZE_OVER_MAX_GRAPHS))
    decision = Dispatcher(state).dispatch(BatchDescriptor(6, False, True))
    assert decision.eager and decision.reason == R.FALLBACK_REASON_SIZE_OVER_MAX_GRAPHS
    assert not Dispatcher(state).dispatch(BatchDescriptor(2, False, True)).eager


# --- idle release ---------------------------------------------------------------------------------


def test_idle_keys_are_those_unused_for_the_idle_time():
    last = {(FULL, 1): 100.0, (FULL, 2): 140.0, (PIECEWISE, 8): 159.0}
    assert idle_keys(last, now=160.0, idle_seconds=20) == {(FULL, 1), (FULL, 2)}
    assert idle_keys(last, now=160.0, idle_seconds=60) == {(FULL, 1)}
    assert idle_keys(last, now=160.0, idle_seconds=61) == set()
    assert idle_keys(last, now=1e9, idle_seconds=0) == set()  # 0: never


# --- the budget -----------------------------------------------------------------------------------


def test_over_budget_drops_the_last_captured_first_until_within():
    order = [((PIECEWISE, 16), 60), ((PIECEWISE, 8), 10), ((PIECEWISE, 4), 5), ((PIECEWISE, 2), 5)]
    assert over_budget_drops(order, held=80, budget=100) == []
    assert over_budget_drops(order, held=80, budget=0) == []  # unlimited
    assert over_budget_drops(order, held=80, budget=72) == [(PIECEWISE, 2), (PIECEWISE, 4)]
    assert over_budget_drops(order, held=80, budget=1) == [k for k, _ in reversed(order)]
    # A budget that fits nothing, with graphs whose cost reads 0 (they reused the pool): all go.
    assert over_budget_drops([((FULL, 1), 0), ((FULL, 2), 0)], held=40, budget=1) == [(FULL, 2), (FULL, 1)]


# --- the policy fields ------------------------------------------------------------------------------


def _policy(**fields) -> pb.GraphPolicy:
    return pb.GraphPolicy(policy_uid="u", generation=1, **fields)


@pytest.mark.parametrize(("fields", "field"), [
    ({"max_graphs": -1}, "max_graphs"),
    ({"max_graphs": MAX_GRAPHS_LIMIT + 1}, "max_graphs"),
    ({"idle_release_seconds": -5}, "idle_release_seconds"),
    ({"idle_release_seconds": MAX_IDLE_RELEASE_SECONDS + 1}, "idle_release_seconds"),
])
def test_bad_max_graphs_and_idle_release_are_refused_by_name(fields, field):
    with pytest.raises(PolicyError) as err:
        validate_policy(_policy(**fields))
    assert err.value.field == field


def test_max_graphs_recaptures_and_idle_release_does_not():
    validate_policy(_policy(max_graphs=MAX_GRAPHS_LIMIT, idle_release_seconds=MAX_IDLE_RELEASE_SECONDS))
    base = _policy()
    assert recapture_key(base, (4, 64)) != recapture_key(_policy(max_graphs=3), (4, 64))
    assert recapture_key(base, (4, 64)) == recapture_key(_policy(idle_release_seconds=30), (4, 64))
    assert recapture_key(base) != recapture_key(_policy(max_graphs=3))  # the operator's key too


# --- the recorder: shapes and what each graph earned --------------------------------------------------


def test_the_recorder_counts_shapes_and_what_each_graph_earned():
    captured = frozenset([(FULL, 4), *[(PIECEWISE, n) for n in LADDER]])
    dispatcher = Dispatcher(GraphState(effective_mode=FP, ladder=tuple(LADDER), captured=captured))
    recorder = StepRecorder(WorkerMetrics())
    recorder.set_attention("triton-decode+triton-varlen")
    recorder.graphs_captured(captured, now=10.0)
    seqs = [SimpleNamespace(graph_steps=Counter(), eager_steps=Counter()) for _ in range(3)]
    steps = [(BatchDescriptor(3, True, True), seqs, 11.0), (BatchDescriptor(3, True, True), seqs, 12.0),
             (BatchDescriptor(5, False, True), seqs[:2], 13.0), (BatchDescriptor(40, False, True), seqs[:1], 14.0)]
    for desc, ss, now in steps:
        recorder.record(dispatcher.dispatch(desc), desc, ss, set(), 0.001, now=now)
    assert recorder.traffic.shapes() == {(3, 3, True): 2, (5, 2, False): 1, (40, 1, False): 1}
    full4, pw8 = recorder.graph_use[(FULL, 4)], recorder.graph_use[(PIECEWISE, 8)]
    assert (full4.replays, full4.padded_tokens, full4.last_used) == (2, 2, 12.0)
    assert (pw8.replays, pw8.padded_tokens, pw8.last_used) == (1, 3, 13.0)
    assert recorder.graph_use[(PIECEWISE, 1)].replays == 0 and recorder.last_used()[(PIECEWISE, 1)] == 10.0
    m = recorder.metrics
    assert m.step_tokens.labels("decode")._sum.get() == 6
    assert m.step_tokens.labels("mixed")._sum.get() == 45
    assert m.step_sequences.labels("decode")._sum.get() == 6
    assert m.graph_padding.labels("full", "4")._value.get() == 2
    assert m.step_duration.labels("full", "triton")._sum.get() > 0
    assert m.step_duration.labels("eager", "triton")._sum.get() > 0  # the 40-token step
    recorder.set_attention("sdpa")
    assert recorder.attention_backend == "sdpa"


# --- the graphs table ---------------------------------------------------------------------------------


def _status() -> pb.GraphStatus:
    mib = 1 << 20
    status = pb.GraphStatus(
        effective_mode=FP, graph_memory_bytes=12 * mib, total_capture_seconds=1.5,
        captured=[
            pb.CapturedSize(mode=FULL, size=4, device_bytes=2 * mib, capture_seconds=0.5, replay_seconds=0.001,
                            eager_seconds=0.004, replays=30, padded_tokens=10),
            pb.CapturedSize(mode=PIECEWISE, size=16, device_bytes=10 * mib, capture_seconds=1.0,
                            replay_seconds=0.002, eager_seconds=0.003, replays=10, padded_tokens=40, released=True),
        ],
        skipped=[pb.SkippedSize(mode=PIECEWISE, size=8, reason=R.FALLBACK_REASON_SIZE_OVER_MAX_GRAPHS)],
        traffic=pb.StepHistogram(steps=41, overflow_steps=1, policy_uid="p", policy_generation=2,
                                 shapes=[pb.StepShape(num_tokens=3, num_seqs=3, uniform_decode=True, steps=30),
                                         pb.StepShape(num_tokens=12, num_seqs=2, steps=10)]))
    return status


def test_graph_rows_show_gain_per_mib_and_a_total():
    full, piecewise, total = graph_rows(_status())
    assert full["gain_ms"] == pytest.approx(3.0) and full["gain_ms_per_mib"] == pytest.approx(1.5)
    assert full["saved_s"] == pytest.approx(0.09)
    assert piecewise["released"] is True and piecewise["gain_ms_per_mib"] == pytest.approx(0.1)
    assert total["mode"] == "total" and total["size"] == 2
    assert total["memory_mib"] == 12 and total["capture_s"] == 1.5
    assert total["gain_ms"] == pytest.approx((30 * 3.0 + 10 * 1.0) / 40)  # averaged over replays
    assert total["gain_ms_per_mib"] == pytest.approx(total["gain_ms"] / 12)
    assert (total["replays"], total["padded_tokens"], total["released"]) == (40, 50, 1)


def test_the_graphs_table_prints_every_graph_the_total_and_the_traffic():
    lines = graphs_table(_status())
    assert lines[0].split()[:3] == ["MODE", "SIZE", "MEMORY"]
    assert lines[1].split()[:2] == ["full", "4"] and lines[2].split()[-1] == "yes"
    assert lines[3].split()[0] == "total"
    assert "skipped piecewise:8 size_over_max_graphs" in lines
    assert any(line.startswith("traffic: 41 steps (1 unbinned) in 2 shapes") for line in lines)
    empty = graphs_table(pb.GraphStatus(effective_mode=pb.GRAPH_MODE_NONE, mode_downgrade_reason="no CUDA"))
    assert empty[1] == "(no graphs captured: effective mode none, no CUDA)"
    assert graph_rows(pb.GraphStatus())[0]["gain_ms_per_mib"] is None


def test_steps_above_every_graph_are_compute_bound_only_when_the_largest_graph_buys_nothing():
    """The largest PIECEWISE graph (the mode a step with prompt tokens replays) decides: replayed
    within 3% of its eager time, larger steps are compute bound; clearly faster, they are not."""
    from graphkeeper.worker.executor.graphs.economics import compute_bound_above
    from graphkeeper.worker.executor.graphs.modes import FULL, PIECEWISE

    assert compute_bound_above([(PIECEWISE, 64, 0.0010, 0.0030), (PIECEWISE, 512, 0.0100, 0.0102)])
    assert not compute_bound_above([(PIECEWISE, 64, 0.0010, 0.0010), (PIECEWISE, 512, 0.0100, 0.0110)])
    # A large FULL graph does not speak for the mixed steps when a PIECEWISE one exists.
    assert not compute_bound_above([(FULL, 1024, 0.010, 0.010), (PIECEWISE, 512, 0.0100, 0.0120)])
    assert compute_bound_above([(FULL, 256, 0.005, 0.005), (FULL, 64, 0.001, 0.003)])  # FULL only: the largest
    assert not compute_bound_above([(PIECEWISE, 512, 0.0, 0.0)]), "nothing measured: nothing claimed"
    assert not compute_bound_above([])
