"""Capture sizes chosen from traffic (``graphkeeper.proto.traffic_sizes``): the selection is exact,
never exceeds its limits, and says why it chose each size."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import default_ladder
from graphkeeper.proto.traffic_sizes import (
    DEFAULT_GRAPH_BYTES,
    CostModel,
    Measurements,
    Traffic,
    choose_sizes,
    evaluate_sizes,
    graph_keys,
    measurements_from,
    merge_histograms,
)

PW, FDO, FAP = pb.GRAPH_MODE_PIECEWISE, pb.GRAPH_MODE_FULL_DECODE_ONLY, pb.GRAPH_MODE_FULL_AND_PIECEWISE
MiB = 2**20


def test_a_budget_that_fits_nothing_chooses_nothing_and_says_so():
    traffic = Traffic(decode={1: 100, 8: 50})
    choice = choose_sizes(traffic, mode=PW, max_capture_size=512, memory_budget_bytes=1 * MiB)
    assert choice.sizes == ()
    assert choice.coverage == 0.0 and choice.covered_steps == 0 and choice.eligible_steps == 150
    assert choice.memory_bytes == 0 and choice.graphs == 0
    assert "fits no graph" in choice.note and str(DEFAULT_GRAPH_BYTES) in choice.note


def test_max_graphs_below_one_size_chooses_nothing_and_says_so():
    """Under FULL_AND_PIECEWISE a size is two graphs: one graph fits no size."""
    choice = choose_sizes(Traffic(decode={4: 10}), mode=FAP, max_capture_size=512, max_graphs=1)
    assert choice.sizes == () and choice.coverage == 0.0
    assert "maxGraphs 1 fits no size" in choice.note


def test_one_token_count_is_one_exact_size():
    choice = choose_sizes(Traffic(decode={24: 1000}), mode=PW, max_capture_size=512, max_graphs=4)
    assert choice.sizes == (24,)
    assert choice.coverage == 1.0 and choice.padded_tokens == 0 and choice.padding_waste == 0.0
    (reason,) = choice.reasons
    assert (reason.size, reason.steps, reason.share, reason.padded_tokens) == (24, 1000, 1.0, 0)
    assert choice.memory_bytes == DEFAULT_GRAPH_BYTES and choice.graphs == 1


def test_one_dominant_batch_size_gets_its_own_graph():
    decode = {t: 5 for t in range(1, 65)}
    decode[32] = 10_000
    choice = choose_sizes(Traffic(decode=decode), mode=PW, max_capture_size=512, max_graphs=2)
    assert 32 in choice.sizes and len(choice.sizes) <= 2
    reason = next(r for r in choice.reasons if r.size == 32)
    assert reason.steps >= 10_000 and reason.share > 0.9
    assert "10" in reason.text() and "tokens" in reason.text()


def test_a_long_tail_is_covered_by_few_graphs_and_beats_the_default_ladder_in_graphs():
    """Zipf-like decode traffic up to 256 and a thin mixed tail: 8 sizes serve nearly every step."""
    decode = {t: max(1, 20_000 // t) for t in range(1, 257)}
    mixed = {t: 3 for t in range(260, 513, 7)}
    traffic = Traffic(decode=decode, mixed=mixed)
    choice = choose_sizes(traffic, mode=PW, max_capture_size=512, max_graphs=8)
    ladder = evaluate_sizes(traffic, default_ladder(512), PW)
    assert len(choice.sizes) == 8 and list(choice.sizes) == sorted(choice.sizes)
    assert choice.coverage > 0.95
    assert choice.cost < choice.eager_cost
    assert ladder.graphs > 4 * choice.graphs and ladder.memory_bytes > 4 * choice.memory_bytes
    # Every step of a bucket is served by its size, and the buckets tile 1..max.
    assert sum(r.steps for r in choice.reasons) == choice.covered_steps
    assert [r.low for r in choice.reasons] == [1, *[s + 1 for s in choice.sizes[:-1]]]


def test_full_decode_only_ignores_mixed_steps():
    traffic = Traffic(decode={1: 10, 4: 10}, mixed={100: 1000})
    choice = choose_sizes(traffic, mode=FDO, max_capture_size=512)
    assert choice.sizes == (1, 4) and choice.eligible_steps == 20 and choice.eligible_coverage == 1.0
    # Coverage has one meaning: the share of all steps replayed (what the workers will count).
    assert choice.steps == 1020 and choice.coverage == 20 / 1020


def test_mode_none_chooses_nothing():
    choice = choose_sizes(Traffic(decode={1: 10}), mode=pb.GRAPH_MODE_NONE, max_capture_size=8)
    assert choice.sizes == () and "None" in choice.note


def test_sizes_never_exceed_the_maximum_capture_size():
    choice = choose_sizes(Traffic(decode={4: 10}, mixed={300: 1000}), mode=PW, max_capture_size=256)
    assert choice.sizes == (4,) and choice.eligible_steps == 1010


def test_measured_times_are_used_and_change_the_units():
    """A worker that measured its graphs: replay 1 ms at every size, eager 5 ms; costs in seconds."""
    captured = [pb.CapturedSize(size=s, mode=pb.GRAPH_MODE_PIECEWISE, replay_seconds=0.001,
                                eager_seconds=0.005, device_bytes=2 * MiB, capture_seconds=0.01)
                for s in (1, 8, 64)]
    model = CostModel(PW, measurements_from(captured))
    choice = choose_sizes(Traffic(decode={1: 100, 64: 10}), mode=PW, max_capture_size=512, max_graphs=1,
                          model=model)
    assert choice.cost_units == "seconds"
    # Flat replay time: one size at 64 serves everything for 110 replays of 1 ms.
    assert choice.sizes == (64,) and choice.cost == pytest.approx(0.110)
    assert choice.eager_cost == pytest.approx(0.550)
    assert choice.memory_bytes == 2 * MiB and choice.capture_seconds == pytest.approx(0.01)


def test_histograms_merge_across_workers():
    a = pb.StepHistogram(steps=12, overflow_steps=2, since_unix_seconds=100.0, shapes=[
        pb.StepShape(num_tokens=8, num_seqs=8, uniform_decode=True, steps=10)])
    b = pb.StepHistogram(steps=7, since_unix_seconds=50.0, shapes=[
        pb.StepShape(num_tokens=8, num_seqs=8, uniform_decode=True, steps=3),
        pb.StepShape(num_tokens=8, num_seqs=2, uniform_decode=False, steps=4)])
    traffic = merge_histograms([a, b])
    assert traffic.decode == {8: 13} and traffic.mixed == {8: 4}
    assert (traffic.overflow, traffic.workers, traffic.since, traffic.steps) == (2, 2, 50.0, 19)


def _brute_force(traffic: Traffic, mode: int, max_graphs: int, budget: int) -> float:
    model = CostModel(mode)
    counts = sorted(set(traffic.decode) | set(traffic.mixed))
    best = evaluate_sizes(traffic, (), mode, model).cost
    for k in range(1, len(counts) + 1):
        for subset in itertools.combinations(counts, k):
            judged = evaluate_sizes(traffic, subset, mode, model)  # graphs counted as a worker records them
            if (max_graphs and judged.graphs > max_graphs) or (budget and judged.memory_bytes > budget):
                continue
            best = min(best, judged.cost)
    return best


traffics = st.builds(
    Traffic,
    decode=st.dictionaries(st.integers(1, 64), st.integers(1, 1000), max_size=6),
    mixed=st.dictionaries(st.integers(1, 200), st.integers(1, 1000), max_size=4),
)


@settings(max_examples=60, deadline=None)
@given(traffics, st.sampled_from([PW, FDO, FAP]), st.integers(0, 6), st.sampled_from([0, 4, 8, 12, 20]))
def test_the_choice_is_optimal_and_within_its_limits(traffic, mode, max_graphs, budget_mib):
    """Exhaustive search over every subset agrees with the dynamic programme (budgets in whole
    graph sizes, so rounding to budget units loses nothing)."""
    budget = budget_mib * MiB
    choice = choose_sizes(traffic, mode=mode, max_capture_size=512, max_graphs=max_graphs,
                          memory_budget_bytes=budget)
    assert not max_graphs or choice.graphs <= max_graphs
    assert not budget or choice.memory_bytes <= budget
    assert choice.cost <= choice.eager_cost + 1e-9
    assert choice.cost == pytest.approx(_brute_force(traffic, mode, max_graphs, budget))


@settings(max_examples=60, deadline=None)
@given(traffics, st.sampled_from([PW, FDO, FAP]))
def test_more_graphs_never_cost_more(traffic, mode):
    """0 is no limit: the last and least."""
    costs = [choose_sizes(traffic, mode=mode, max_capture_size=512, max_graphs=n).cost for n in [*range(1, 9), 0]]
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(costs))


@settings(max_examples=60, deadline=None)
@given(traffics, st.sampled_from([PW, FDO, FAP]))
def test_more_budget_never_costs_more(traffic, mode):
    costs = [choose_sizes(traffic, mode=mode, max_capture_size=512, memory_budget_bytes=b * MiB).cost
             for b in (4, 8, 16, 32, 64)]
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(costs))


def test_unmeasured_runtime_mode_borrows_the_measured_one():
    model = CostModel(FAP, Measurements(graph_bytes={pb.GRAPH_MODE_PIECEWISE: {8: 3 * MiB}}))
    assert model.graph_bytes(8) == 6 * MiB  # FULL unmeasured: PIECEWISE's figure, both counted


@settings(max_examples=200, deadline=None)
@given(traffics, st.sampled_from([PW, FDO, FAP]))
def test_without_a_limit_every_eligible_step_replays(traffic, mode):
    """Under the default step-time model (an eager step costs more than replaying it exactly) a
    search with no limit leaves no step eager that the mode could replay. Coverage is not what the
    search minimises: under a graph limit it may trade a rare mixed step for less decode padding
    (two graphs of a decode size against one of a mixed size), so it need not grow with the limit;
    the expected step time does (``test_more_graphs_never_cost_more``)."""
    choice = choose_sizes(traffic, mode=mode, max_capture_size=512)
    assert choice.covered_steps == choice.eligible_steps


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=1, max_size=12, unique=True), st.integers(1, 600),
       st.sampled_from([PW, FDO, FAP]))
def test_graphs_are_counted_as_the_worker_records_them(sizes, max_num_seqs, mode):
    """``graph_keys`` and the worker's capture plan agree key for key: a size no decode step pads
    to is one graph under FULL_AND_PIECEWISE, so maxGraphs buys what the worker will capture."""
    from graphkeeper.worker.executor.graphs.modes import capture_plan

    ladder = sorted(sizes)
    assert sorted(graph_keys(ladder, mode, max_num_seqs)) == sorted(capture_plan(mode, ladder, max_num_seqs))


def _h200_like(mode: int) -> CostModel:
    """Step times shaped as a 1B decoder's on a large GPU: a FULL decode step nearly flat in rows
    (weights read once), PIECEWISE steps linear above 128 tokens (compute-bound), eager steps bound
    by the host's launches (3 ms) below that."""
    ladder = default_ladder(512)

    def pieces(s: int) -> float:
        return 1.2e-3 + max(0, s - 128) * 3e-6 + s * 0.2e-6

    def full(s: int) -> float:
        return 0.8e-3 + s * 1e-6

    return CostModel(mode, Measurements(
        replay_seconds={pb.GRAPH_MODE_FULL: {s: full(s) for s in ladder},
                        pb.GRAPH_MODE_PIECEWISE: {s: pieces(s) for s in ladder}},
        eager_seconds={pb.GRAPH_MODE_FULL: {s: max(3e-3, full(s)) for s in ladder},
                       pb.GRAPH_MODE_PIECEWISE: {s: max(3.2e-3, pieces(s)) for s in ladder}}))


FAMILIES = {
    # Zipf-like decode batches and a thin tail of long mixed steps.
    "long tail": Traffic(decode={t: max(1, 20_000 // t) for t in range(1, 65)},
                         mixed={t: 3 for t in range(70, 513, 7)}),
    # One batch size nearly always (a saturated decode fleet), a little of everything else.
    "one dominant": Traffic(decode={**{t: 2 for t in range(1, 65)}, 64: 50_000}, mixed={t: 1 for t in range(66, 513)}),
    # Prompts arriving all the time: mixed steps of every size up to the token budget.
    "prefill-heavy": Traffic(decode={t: 20 for t in range(1, 65)}, mixed={t: 40 + t % 17 for t in range(2, 513)}),
    # Long generations: decode steps of every batch size, few prefills.
    "decode-heavy": Traffic(decode={t: 500 + 30 * t for t in range(1, 65)}, mixed={t: 2 for t in range(66, 513, 3)}),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("measured", [False, True], ids=["token model", "h200-like"])
def test_half_the_default_ladder_s_graphs_keep_its_expected_throughput(family, measured):
    """The stated tolerance: with at most half the Default ladder's graphs, sizes chosen from
    traffic are expected within 2% of the ladder's throughput (and report the figure)."""
    traffic = FAMILIES[family]
    model = _h200_like(FAP) if measured else CostModel(FAP)
    ladder = evaluate_sizes(traffic, default_ladder(512), FAP, model, full_limit=64)
    choice = choose_sizes(traffic, mode=FAP, max_capture_size=512, max_graphs=ladder.graphs // 2, model=model,
                          full_limit=64)
    assert choice.graphs <= ladder.graphs // 2
    assert choice.default_cost == pytest.approx(ladder.cost) and choice.default_graphs == ladder.graphs == 62
    assert choice.throughput_vs_default >= 0.98, (choice.sizes, choice.throughput_vs_default)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.integers(1, 64), st.integers(1, 1000), max_size=20),
       st.dictionaries(st.integers(2, 512), st.integers(1, 1000), min_size=1, max_size=300),
       st.sampled_from([PW, FAP]))
def test_with_room_for_the_default_ladder_the_choice_is_never_slower_than_it(decode, mixed, mode):
    """Without a limit that the ladder breaks, the search has the ladder's sizes among its
    candidates (also when it coarsens a histogram of many token counts): never an expected step
    time above the ladder's."""
    traffic = Traffic(decode=decode, mixed=mixed)
    choice = choose_sizes(traffic, mode=mode, max_capture_size=512, model=_h200_like(mode))
    assert choice.cost <= choice.default_cost * (1 + 1e-9)
    assert choice.throughput_vs_default >= 1 - 1e-9
