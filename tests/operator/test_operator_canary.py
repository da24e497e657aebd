"""The canary's decisions (pure): the comparison of a canary's window with the rest's, the state
machine Idle -> Canary -> Promoted | Reverted, its spec, and no flapping after a revert."""

from __future__ import annotations

import pytest

from graphkeeper.operator.canary import (
    CANARY,
    PROMOTE,
    PROMOTED,
    REVERT,
    REVERTED,
    WAIT,
    Canary,
    Reading,
    Window,
    advance,
    compare,
    percentile,
    reverted_set,
    start_canary,
    window,
)
from graphkeeper.operator.traffic import (
    APPLY,
    Applied,
    CanarySettings,
    FromTraffic,
    decide_apply,
    from_traffic_settings,
)
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import PolicyError
from graphkeeper.proto.serving_counters import ITL_BOUNDS_SECONDS, itl_bucket
from graphkeeper.proto.traffic_sizes import SizeChoice

SETTINGS = CanarySettings(workers=1, window_seconds=60, max_slowdown=0.02, max_itl_p99_increase=0.10)


def served(*, steps: int = 1000, eager: int = 0, step_seconds: float = 0.004, seqs: int = 8,
           since: float = 100.0) -> pb.ServingCounters:
    """Counters for ``steps`` steps of ``seqs`` sequences each taking ``step_seconds``."""
    itl = [0] * (len(ITL_BOUNDS_SECONDS) + 1)
    itl[itl_bucket(step_seconds)] = steps * seqs
    return pb.ServingCounters(generated_tokens=steps * seqs, sequence_seconds=steps * seqs * step_seconds,
                              graph_steps=steps - eager, eager_steps=eager, replayed_tokens=(steps - eager) * 8,
                              padded_tokens=(steps - eager), itl_bounds_seconds=ITL_BOUNDS_SECONDS,
                              itl_counts=itl, since_unix_seconds=since)


def side(**kw) -> list[Window]:
    return [window(None, served(**kw))]


def test_a_canary_as_fast_as_the_rest_is_promoted_with_its_figures():
    verdict = compare(side(step_seconds=0.004), side(step_seconds=0.004) * 2, SETTINGS)
    assert verdict.decision == PROMOTE
    assert verdict.reason.startswith("canary as fast per sequence as the rest, ITL p99 +0.0%")
    assert verdict.canary.workers == 1 and verdict.rest.workers == 2
    assert verdict.canary.coverage == 1 and verdict.canary.padding == pytest.approx(1 / 8)
    assert verdict.canary.tokens_per_second_per_sequence == pytest.approx(250)


def test_a_slower_canary_is_reverted_and_the_reason_gives_the_figure_and_the_limit():
    verdict = compare(side(step_seconds=0.004 / 0.939), side(step_seconds=0.004), SETTINGS)
    assert verdict.decision == REVERT
    assert verdict.reason == "canary 6.1% slower per sequence than the rest (limit 2%)"


def test_a_canary_whose_itl_p99_rises_past_the_limit_is_reverted():
    # As fast per sequence on average, but 2% of its tokens wait 50 ms.
    slow_tail = served(step_seconds=0.004)
    itl = list(slow_tail.itl_counts)
    moved = int(sum(itl) * 0.02)
    itl[itl_bucket(0.004)] -= moved
    itl[itl_bucket(0.05)] += moved
    del slow_tail.itl_counts[:]
    slow_tail.itl_counts.extend(itl)
    verdict = compare([window(None, slow_tail)], side(step_seconds=0.004), SETTINGS)
    assert verdict.decision == REVERT and "ITL p99" in verdict.reason and "limit 10%" in verdict.reason


def test_a_canary_that_runs_more_steps_eager_is_reverted():
    verdict = compare(side(eager=200), side(eager=10), SETTINGS)
    assert verdict.decision == REVERT
    assert verdict.reason.startswith("canary ran 20.0% of its steps eager against 1.0% on the rest")


def test_too_few_steps_wait():
    verdict = compare(side(steps=50), side(steps=5000), SETTINGS)
    assert verdict.decision == WAIT and "too few steps" in verdict.reason


def test_a_window_is_the_difference_of_two_readings_unless_the_worker_started_over():
    start, end = served(steps=1000), served(steps=3000)
    assert window(start, end).graph_steps == 2000
    restarted = served(steps=300, since=200.0)
    assert window(start, restarted).graph_steps == 300
    assert percentile((1.0, 2.0), (0, 10, 0), 0.5) == pytest.approx(1.5)


def readings(canary_holds: bool, t: float, canary_speed: float = 1.0) -> dict[str, Reading]:
    steps = int(t * 100)
    return {"ns/w-0": Reading(canary_holds, served(steps=steps, step_seconds=0.004 / canary_speed, since=50.0)),
            "ns/w-1": Reading(True, served(steps=steps)), "ns/w-2": Reading(True, served(steps=steps))}


@pytest.mark.parametrize(("speed", "phase"), [(1.0, PROMOTED), (1.1, PROMOTED), (0.9, REVERTED)])
def test_the_state_machine_opens_the_window_once_the_canary_holds_and_decides_at_its_end(speed, phase):
    previous, proposed = Applied((1, 2, 4), 1, 0.0, "Piecewise"), Applied((1, 8), 2, 100.0, "Piecewise")
    canary = start_canary(previous, proposed, ["ns/w-2", "ns/w-0", "ns/w-1"], SETTINGS, now=100.0)
    assert canary is not None and canary.phase == CANARY and canary.workers == ("ns/w-0",)
    canary = advance(canary, readings(False, 100, speed), SETTINGS, now=101.0)
    assert canary.window_start == 0 and canary.verdict.decision == WAIT  # not captured yet
    canary = advance(canary, readings(True, 102, speed), SETTINGS, now=102.0)
    assert canary.window_start == 102.0
    canary = advance(canary, readings(True, 150, speed), SETTINGS, now=150.0)
    assert canary.phase == CANARY and canary.verdict.reason.startswith("window ends in 12s")
    canary = advance(canary, readings(True, 170, speed), SETTINGS, now=170.0)
    assert canary.phase == phase and canary.finished == 170.0


def test_a_canary_that_never_captures_or_never_gets_enough_traffic_is_reverted_in_the_end():
    """No proposal holds a rollout forever: undecided GIVE_UP_WINDOWS windows after it started, it is
    reverted, saying why."""
    start = start_canary(Applied(), Applied((8,), 1, 0.0, "Full"), ["ns/w-0", "ns/w-1"], SETTINGS, 0.0)
    never = {"ns/w-0": Reading(False, None), "ns/w-1": Reading(True, None)}
    assert advance(start, never, SETTINGS, now=4 * 60 - 1).phase == CANARY
    stuck = advance(start, never, SETTINGS, now=4 * 60)
    assert stuck.phase == REVERTED and "did not hold the proposed sizes within 4 windows" in stuck.verdict.reason
    idle = {"ns/w-0": Reading(True, served(steps=5)), "ns/w-1": Reading(True, served(steps=5))}
    opened = advance(start, idle, SETTINGS, now=10.0)
    assert advance(opened, idle, SETTINGS, now=200.0).verdict.decision == WAIT  # too few steps: keep waiting
    quiet = advance(opened, idle, SETTINGS, now=240.0)
    assert quiet.phase == REVERTED and quiet.verdict.reason.startswith("still undecided after 4 windows (too few steps")


def test_no_canary_without_a_worker_left_to_compare_with():
    assert start_canary(Applied(), Applied((8,), 1, 0.0, "Full"), ["ns/w-0"], SETTINGS, 0.0) is None


def test_a_canary_worker_that_fails_to_capture_or_goes_away_reverts_it():
    canary = start_canary(Applied(), Applied((8,), 1, 0.0, "Full"), ["ns/w-0", "ns/w-1"], SETTINGS, 0.0)
    failed = advance(canary, {"ns/w-0": Reading(False, None, failed=True), "ns/w-1": Reading(True, None)},
                     SETTINGS, 1.0)
    assert failed.phase == REVERTED and "failed to capture" in failed.verdict.reason
    gone = advance(canary, {"ns/w-1": Reading(True, None)}, SETTINGS, 1.0)
    assert gone.phase == REVERTED and "gone" in gone.verdict.reason


def test_a_reverted_proposal_is_not_proposed_again_within_the_interval():
    """The revert is recorded as an applied set of the previous sizes, stamped at the revert, under
    a newer sequence: ``decide_apply`` holds the same proposal back for minIntervalSeconds."""
    settings = FromTraffic(mode=APPLY, max_graphs=3, min_interval_seconds=600, min_improvement=0.05,
                           canary=SETTINGS)
    canary = Canary(REVERTED, ("ns/w-0",), Applied((1, 8), 2, 100.0, "Piecewise"),
                    Applied((1, 2, 4), 1, 0.0, "Piecewise"))
    back = reverted_set(canary, now=1000.0)
    assert back == Applied((1, 2, 4), 3, 1000.0, "Piecewise")
    current, proposal = choice((1, 2, 4), cost=10.0), choice((1, 8), cost=8.0)
    apply, why = decide_apply(settings, back, 1300.0, current, proposal)
    assert not apply and "minIntervalSeconds is 600" in why
    assert decide_apply(settings, back, 1601.0, current, proposal)[0]
    # ...and after the interval a new proposal still needs minImprovementPercent.
    small = choice((1, 8), cost=9.8)
    assert not decide_apply(settings, back, 1601.0, current, small)[0]


def choice(sizes: tuple[int, ...], cost: float) -> SizeChoice:
    return SizeChoice(sizes=sizes, reasons=(), steps=1000, eligible_steps=1000, covered_steps=1000,
                      padded_tokens=0, padding_waste=0.0, cost=cost, eager_cost=20.0, cost_units="s",
                      memory_bytes=0, capture_seconds=0.0, graphs=len(sizes))


def spec(**canary) -> dict:
    return {"captureSizes": {"fromTraffic": {"mode": "Apply", "maxGraphs": 4, "canary": canary}}}


def test_the_canary_spec_is_validated_naming_the_field():
    assert from_traffic_settings(spec()).canary == CanarySettings()
    assert from_traffic_settings(spec(workers=2, windowSeconds=10, maxSlowdownPercent=5,
                                      maxItlP99IncreasePercent=20)).canary == CanarySettings(2, 10, 0.05, 0.20)
    assert from_traffic_settings({"captureSizes": {"fromTraffic": {"mode": "Apply", "maxGraphs": 4}}}).canary is None
    for bad, field in [({"workers": 0}, "workers"), ({"windowSeconds": 5}, "windowSeconds"),
                       ({"maxSlowdownPercent": -1}, "maxSlowdownPercent"),
                       ({"maxItlP99IncreasePercent": "10"}, "maxItlP99IncreasePercent")]:
        with pytest.raises(PolicyError) as err:
            from_traffic_settings(spec(**bad))
        assert err.value.field == f"spec.captureSizes.fromTraffic.canary.{field}"
    with pytest.raises(PolicyError) as err:
        from_traffic_settings({"captureSizes": {"fromTraffic": {"mode": "Recommend", "maxGraphs": 4,
                                                                "canary": {}}}})
    assert err.value.field == "spec.captureSizes.fromTraffic.canary" and "Apply" in err.value.message
