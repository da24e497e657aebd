"""Graphs for large steps: which coarse PIECEWISE sizes a budget above the 512 ceiling plans, which
of them a capture phase keeps given what they were measured at, and how the dispatcher labels the
steps of a size that was not kept (pure: the capture itself is tests/gpu/test_large_steps_cuda.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import PolicyError, default_ladder
from graphkeeper.worker.engine.kv_sizing import UtilizationSizing
from graphkeeper.worker.engine.sizing import UtilizationPlan
from graphkeeper.worker.engine.traffic import TrafficHistogram
from graphkeeper.worker.executor.graphs.controller import CaptureController, plan_capture
from graphkeeper.worker.executor.graphs.dispatcher import BatchDescriptor, Dispatcher, GraphState
from graphkeeper.worker.executor.graphs.graph_set import CapturedGraph, Skipped
from graphkeeper.worker.executor.graphs.large_steps import (
    coarse_sizes,
    judge_coarse,
    judged_sizes,
    planned_coarse_sizes,
)
from graphkeeper.worker.executor.graphs.modes import FULL, PIECEWISE
from graphkeeper.worker.metrics import WorkerMetrics

M = pb.GraphMode
DEFAULT = pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_DEFAULT)


@pytest.mark.parametrize(("budget", "sizes"), [
    (64, []), (512, []),  # within the ceiling: the plan is today's
    (600, [600]),
    (2048, [1024, 2048]),
    (3000, [1024, 2048, 3000]),  # the budget itself: every step it allows pads to a size
    (8192, [1024, 2048, 4096, 8192]),
    (20000, [1024, 2048, 4096, 8192]),  # never past the largest size a policy may name
])
def test_coarse_sizes_double_from_1024_up_to_the_budget(budget, sizes):
    assert coarse_sizes(budget) == sizes


def test_only_a_piecewise_ladder_whose_ceiling_is_left_to_the_worker_gets_coarse_sizes():
    fp = M.GRAPH_MODE_FULL_AND_PIECEWISE
    assert planned_coarse_sizes(DEFAULT, fp, 2048) == [1024, 2048]
    assert planned_coarse_sizes(pb.CaptureSizes(), fp, 2048) == [1024, 2048]  # no ladder named: the default
    assert planned_coarse_sizes(pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_INTERACTIVITY), M.GRAPH_MODE_PIECEWISE,
                                2048) == [1024, 2048]
    assert planned_coarse_sizes(pb.CaptureSizes(ladder=pb.CAPTURE_LADDER_DEFAULT, max_capture_size=256), fp,
                                2048) == []  # the policy chose its ceiling
    assert planned_coarse_sizes(pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=[8, 64])), fp, 2048) == []
    assert planned_coarse_sizes(DEFAULT, M.GRAPH_MODE_FULL_DECODE_ONLY, 2048) == []  # no PIECEWISE graphs
    assert planned_coarse_sizes(DEFAULT, M.GRAPH_MODE_NONE, 2048) == []


def plan(budget: int, *, cuda: bool = True, seqs: int = 256, mode: int = M.GRAPH_MODE_FULL_AND_PIECEWISE):
    return plan_capture(pb.GraphPolicy(mode=mode, capture_sizes=DEFAULT), None, cuda=cuda, graph_support=2,
                        max_num_seqs=seqs, max_num_batched_tokens=budget)


def test_a_budget_above_the_ceiling_plans_coarse_piecewise_keys_largest_first_and_no_full_ones():
    got = plan(2048, seqs=1024)
    assert got.coarse == [1024, 2048]
    assert got.ladder == [*default_ladder(512), 1024, 2048]  # what steps pad to
    pieces = [size for mode, size in got.keys if mode == PIECEWISE]
    assert pieces[:3] == [2048, 1024, 512]  # the largest sizes the shared pool first
    # FULL graphs stop at the fine ladder even with 1,024 sequences: no decode batch is that large.
    assert max(size for mode, size in got.keys if mode == FULL) == 512


def test_at_a_budget_within_the_ceiling_or_without_cuda_the_plan_is_unchanged():
    assert plan(512).coarse == [] and plan(512).ladder == default_ladder(512)
    cpu = plan(8192, cuda=False)
    assert cpu.coarse == [] and cpu.keys == [] and cpu.ladder == default_ladder(512)


LADDER = [*default_ladder(512), 1024, 2048, 4096]


def test_a_coarse_graph_stays_when_its_replay_beats_the_eager_steps_it_serves():
    # Launch bound (a small model): replay far below eager at every size.
    eager = {512: 0.004, 1024: 0.006, 2048: 0.010, 4096: 0.018}
    replay = {512: 0.001, 1024: 0.002, 2048: 0.004, 4096: 0.008}
    verdicts = judge_coarse([1024, 2048, 4096], LADDER, replay, eager)
    assert [(v.size, v.kept) for v in verdicts] == [(1024, True), (2048, True), (4096, True)]
    assert verdicts[0].eager_seconds == pytest.approx(0.005)  # the mean of eager(512) and eager(1024)
    assert "beats the steps it serves" in verdicts[0].message()


def test_a_compute_bound_coarse_graph_is_released_with_what_was_measured():
    eager = {512: 0.004, 1024: 0.008, 2048: 0.016}
    replay = {1024: 0.0079, 2048: 0.0159}  # within 3%: the graph buys nothing
    verdicts = judge_coarse([1024, 2048], LADDER, replay, eager)
    assert [v.kept for v in verdicts] == [False, False]
    assert verdicts[1].message() == ("replaying 2048 tokens (15.900 ms) does not beat the steps it serves run "
                                     "eager (12.000 ms on average) by 3%")


def test_a_graph_faster_than_its_own_size_eager_is_still_released_when_padding_makes_its_range_slower():
    """2,048 replays 10% faster than a 2,048-token step eager, but steps of 1,025 tokens pad up to
    it: on average over its range eager is faster, so it is not kept."""
    eager = {1024: 0.008, 2048: 0.016}
    replay = {1024: 0.006, 2048: 0.0144}
    verdicts = {v.size: v for v in judge_coarse([1024, 2048], LADDER, replay, eager)}
    assert verdicts[2048].kept is False and verdicts[2048].eager_seconds == pytest.approx(0.012)
    # Without a measured size below, the size's own eager time is all there is to judge by.
    assert judge_coarse([2048], [2048], {2048: 0.0144}, {2048: 0.016})[0].kept is True


def test_an_inflated_eager_timing_below_a_coarse_size_does_not_keep_a_graph_that_buys_nothing():
    """512 tokens timed eager slower than 1,024 (a host hiccup: a step of more tokens never costs
    less) would make the 1,024 graph look 25% faster than the steps it serves; priced from below,
    its range costs what 1,024 costs eager, which its replay does not beat."""
    eager = {512: 0.012, 1024: 0.008}
    verdict = judge_coarse([1024], LADDER, {1024: 0.0079}, eager)[0]
    assert verdict.eager_seconds == pytest.approx(0.008) and verdict.kept is False


def test_a_size_whose_capture_failed_or_went_over_budget_gets_no_verdict():
    assert judge_coarse([1024, 2048], LADDER, {1024: 0.002}, {512: 0.004, 1024: 0.006}) == [
        judge_coarse([1024], LADDER, {1024: 0.002}, {512: 0.004, 1024: 0.006})[0]]


def test_steps_padded_to_a_released_coarse_size_say_compute_bound_at_the_dispatcher():
    state = GraphState(effective_mode=M.GRAPH_MODE_FULL_AND_PIECEWISE, ladder=tuple(default_ladder(512)) + (1024, 2048),
                       captured=frozenset({(FULL, 256), (PIECEWISE, 512), (PIECEWISE, 1024)}),
                       skipped={(PIECEWISE, 2048): pb.FALLBACK_REASON_COMPUTE_BOUND})
    dispatcher = Dispatcher(state)
    assert dispatcher.dispatch(BatchDescriptor(900, False, True)) == (PIECEWISE, 1024, pb.FALLBACK_REASON_UNSPECIFIED)
    prefill = dispatcher.dispatch(BatchDescriptor(1500, False, True))
    assert prefill.eager and prefill.reason == pb.FALLBACK_REASON_COMPUTE_BOUND
    # A decode batch of 1,500 rows tries FULL first; no FULL key exists at a coarse size, so it
    # takes the PIECEWISE key's reason, not a capture failure that never happened.
    decode = dispatcher.dispatch(BatchDescriptor(1500, True, True))
    assert decode.eager and decode.reason == pb.FALLBACK_REASON_COMPUTE_BOUND
    assert dispatcher.dispatch(BatchDescriptor(600, True, True)) == (PIECEWISE, 1024, pb.FALLBACK_REASON_UNSPECIFIED)


def test_track_b_prices_a_policy_without_the_coarse_sizes_released_as_compute_bound():
    """A coarse graph released as compute bound holds nothing after the phase: pushing the same
    policy again is not refused for memory the 8,192-token graph would take if it were kept."""
    controller = CaptureController(Dispatcher(), WorkerMetrics(), max_num_seqs=4, max_num_batched_tokens=2048,
                                   inject_failures=frozenset())
    policy = pb.GraphPolicy(policy_uid="u", generation=2, mode=M.GRAPH_MODE_PIECEWISE, capture_sizes=DEFAULT)
    fine = {(PIECEWISE, s): CapturedGraph(PIECEWISE, s, [], 0.0, 1000, 0) for s in default_ladder(512)}
    released = {(PIECEWISE, s): Skipped(pb.FALLBACK_REASON_COMPUTE_BOUND, "measured") for s in (1024, 2048)}
    controller.graph_set = SimpleNamespace(captured=fine, skipped=released)
    sizing = UtilizationSizing(0.9)
    sizing.plan, sizing.graph_room = UtilizationPlan(1 << 20, 64, "test"), 1000 * len(fine)
    sizing.check_graphs_fit(controller, policy, TrafficHistogram())  # the graphs held now: they fit
    controller.graph_set.skipped = {}  # had they failed for another reason, they would be priced
    with pytest.raises(PolicyError, match="room for"):
        sizing.check_graphs_fit(controller, policy, TrafficHistogram())


def test_the_sizes_a_verdict_reads_are_the_coarse_ones_and_the_ladder_size_below_each():
    ladder = [1, 2, 4, 8, 256, 512, 1024, 2048]
    assert judged_sizes([1024, 2048], ladder) == {512, 1024, 2048}
    assert judged_sizes([], ladder) == frozenset()
    assert judged_sizes([600], [600]) == {600}  # nothing below it on the ladder
