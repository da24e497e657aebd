"""The step budget: decode rows first, prefill sized so that a step with decode rows stays within the
inter-token target on a step-time model built from capture measurements (synthetic here: the
scheduler and the budget are pure), the whole budget when nothing decodes, and no prompt that
waits forever. Last, a real worker states its budget and where it came from."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from worker_harness import generate, make_request

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.scheduler import Scheduler
from graphkeeper.worker.engine.sequence import Sequence
from graphkeeper.worker.engine.step_budget import (
    ITL_MAX_FACTOR,
    MIN_PREFILL_TOKENS,
    TTFT_TARGET_FACTOR,
    StepBudget,
    StepTimeModel,
    TTFTGuard,
    plan_step_budget,
)
from graphkeeper.worker.plan import SamplingSpec

PW, FULL = pb.GRAPH_MODE_PIECEWISE, pb.GRAPH_MODE_FULL
LADDER = [1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512]


@dataclass
class Timed:
    """A captured graph's timings, as ``CapturedGraph`` carries them."""

    mode: int
    size: int
    replay_seconds: float
    eager_seconds: float


def h200_like(modes: tuple[int, ...] = (FULL, PW)) -> list[Timed]:
    """Step times shaped like a small model's: a fixed cost plus a per-token one; eager pays launches."""
    return [Timed(m, s, 0.002 + 5e-6 * s, 0.004 + 6e-6 * s) for m in modes for s in LADDER]


#: The coarse PIECEWISE graphs a budget of 8,192 captures above the ladder (``large_steps.py``).
COARSE = [Timed(PW, s, 0.002 + 5e-6 * s, 0.004 + 6e-6 * s) for s in (1024, 2048, 4096, 8192)]


def seq(prompt_len: int, max_new: int, name: str, arrived: float = 0.0) -> Sequence:
    return Sequence(request_id=name, tenant="", prompt=list(range(3, 3 + prompt_len)), max_new_tokens=max_new,
                    sampling=SamplingSpec(), seed=0, arrived=arrived)


# --- the step-time model --------------------------------------------------------------------------


def test_a_replayed_step_costs_the_size_it_pads_to_and_an_eager_one_follows_the_measured_line():
    model = StepTimeModel.from_captured(h200_like())
    assert model.ceiling == 512
    assert model.seconds(300) == pytest.approx(0.002 + 5e-6 * 384)  # padded to 384: the padding is paid
    assert model.seconds(512) == pytest.approx(0.002 + 5e-6 * 512)
    # Above the ceiling: eager, extrapolated along the last measured segment.
    assert model.seconds(2048) == pytest.approx(0.004 + 6e-6 * 2048)


def test_without_piecewise_graphs_every_step_with_prompt_tokens_is_priced_eager():
    model = StepTimeModel.from_captured(h200_like((FULL,)))
    assert model.ceiling == 0
    assert model.seconds(100) == pytest.approx(0.004 + 6e-6 * 100)


def test_eager_steps_with_prompt_tokens_are_priced_from_the_piecewise_keys_probes():
    """A FULL key is timed on a decode step, a PIECEWISE key on a mixed one: the model prices
    steps with prompt tokens, so a faster decode probe at the same size does not lower the line."""
    timed = [Timed(FULL, 512, 0.001, 0.004), Timed(PW, 512, 0.002, 0.009)]
    model = StepTimeModel.from_captured(timed)
    assert model.eager == ((512, 0.009),)
    assert StepTimeModel.from_captured(timed[:1]).eager == ((512, 0.004),)  # no PIECEWISE key: the FULL one's


def test_timing_noise_never_makes_a_larger_eager_step_predicted_faster():
    """A launch-bound eager timing is inflated by any host hiccup, so a smaller size timed slower
    than a larger one is priced at the larger one's time, not the other way round."""
    noisy = [Timed(PW, 64, 0.001, 0.010), Timed(PW, 128, 0.002, 0.008), Timed(PW, 256, 0.003, 0.012)]
    model = StepTimeModel.from_captured(noisy)
    assert [secs for _, secs in model.eager] == [0.008, 0.008, 0.012]


def test_one_inflated_eager_timing_below_the_ceiling_does_not_price_every_larger_step_past_the_stretch():
    """As read on an H100: 512 tokens replayed in 3.4 ms, sizes 2-16 timed eager at ~9 ms against
    less from 32 up, and every coarse graph released as compute bound (no replay above 512).
    Carried up to every larger size, those timings priced a 513-token step above the 8.5 ms
    stretch ceiling, so no step ever stretched for a late prompt. The coarse sizes' own eager
    timings (kept when their graphs are given back) and the envelope price the steps above 512 as
    measured."""
    graphs = [Timed(m, s, 0.002 + 3e-6 * s, 0.009 if 2 <= s <= 16 else 0.0045 + 1e-6 * s)
              for m in (FULL, PW) for s in LADDER]
    coarse_eager = {1024: 0.0064, 2048: 0.0125, 4096: 0.025, 8192: 0.05}
    budget = plan_step_budget(8192, 0.0, graphs, "cuda", eager=coarse_eager)
    assert budget.target == pytest.approx(0.002 + 3e-6 * 512)
    assert budget.model.seconds(1024) == pytest.approx(0.0064)
    assert budget.model.seconds(128 + 512) < budget.guard.itl_max
    assert budget.can_stretch and budget.stretched > 1024
    # Without the coarse sizes' timings the line past 512 grows at least as a replayed token costs
    # the GPU (the eager line's end is launch bound, flatter than the work), still priced from
    # below: the small sizes' 9 ms are gone from it and the stretch ends where that line reaches the
    # ceiling.
    alone = plan_step_budget(8192, 0.0, graphs, "cuda")
    assert alone.model.tail_slope == pytest.approx(3e-6)
    assert alone.model.seconds(1512) == pytest.approx(0.0045 + 1e-6 * 512 + 3e-6 * 1000)
    assert alone.can_stretch and alone.stretched == alone.model.largest_within(alone.guard.itl_max, 8192) < 8192


def test_a_stretched_step_stops_at_the_largest_graph_within_the_ceiling_rather_than_just_past_it():
    """As read on an H100 (llama-1b, 5ce1976): the 1,024-token graph replays in 5.16 ms, eager steps
    were timed at capture at 6.09 ms (1,024) and 12.69 ms (2,048, its graph given back), and the
    stretch ceiling is 6.48 ms. The eager line priced a 1,084-token step at the ceiling, but under
    load such steps took 13.35 ms (the host launching them eager): with a graph above the normal
    bound that fits the ceiling, a stretched step stops there."""
    graphs = [Timed(PW, s, 0.0008 + 3.5e-6 * s, 0.006) for s in LADDER] + [Timed(PW, 1024, 0.00516, 0.00609)]
    budget = plan_step_budget(8192, 0.0, graphs, "cuda", itl_max_ms=6.48, eager={2048: 0.01269})
    assert budget.model.largest_within(0.00648, 8192) > 1024  # the eager line alone would go past the graph
    assert budget.stretched == 1024
    assert budget.prefill_tokens(60, budget.guard.ttft_target) == 1024 - 60
    # No graph above the normal bound within the ceiling: the eager line still gives the late prompt its stretch.
    slow = [g for g in graphs if g.size != 1024] + [Timed(PW, 1024, 0.0070, 0.00609)]
    eager_only = plan_step_budget(8192, 0.0, slow, "cuda", itl_max_ms=6.48, eager={2048: 0.01269})
    assert eager_only.stretched == eager_only.model.largest_within(0.00648, 8192) > eager_only.with_decode


def test_a_flat_launch_bound_eager_line_never_prices_the_whole_budget_at_its_last_time():
    """Eager steps timed at 7 ms from 24 to 512 tokens (launch bound, as on an H100 with a 1B model)
    and no timing above: a stretch ceiling above 7 ms must not let a step with decode rows carry
    all 8,192 tokens; past 512 a token costs at least what it adds to a replay."""
    graphs = [Timed(PW, s, 0.001 + 4e-6 * s, 0.007) for s in LADDER]
    budget = plan_step_budget(8192, 0.0, graphs, "cuda", itl_max_ms=8.0)
    assert budget.model.seconds(8192) == pytest.approx(0.007 + 4e-6 * (8192 - 512))
    assert budget.stretched == 512 + int(0.001 / 4e-6)


def test_nothing_timed_means_no_model_and_a_fixed_budget_that_says_why():
    assert StepTimeModel.from_captured([]) is None
    budget = plan_step_budget(512, 0.0, [], "cpu")
    assert budget.target is None and budget.prefill_tokens(10) == 502
    assert "no graphs recorded on cpu" in budget.source


# --- the budget --------------------------------------------------------------------------------


def test_the_derived_target_at_the_capture_ceiling_changes_nothing_at_todays_budget():
    """Budget 512 and the derived target (the measured 512-token step): exactly today's steps."""
    budget = plan_step_budget(512, 0.0, h200_like(), "cuda")
    assert budget.with_decode == 512
    assert all(budget.prefill_tokens(d) == 512 - d for d in range(0, 65))
    assert budget.source.startswith("derived: a 512-token step")


def test_a_large_budget_keeps_steps_with_decode_rows_at_the_target_and_gives_prefill_the_rest():
    budget = plan_step_budget(8192, 0.0, h200_like(), "cuda")
    assert budget.prefill_tokens(0) == 8192  # nobody waits between tokens: the whole budget
    assert budget.prefill_tokens(64) == 512 - 64  # decode rows wait: as short as the graph ceiling
    # An explicit, looser target lets steps with decode rows run eager past the ceiling.
    loose = plan_step_budget(8192, 12.0, h200_like(), "cuda")
    expected = int((0.012 - 0.004) / 6e-6)  # the eager line solved for 12 ms
    assert abs(loose.with_decode - expected) <= 1 and loose.source == "--itl-target-ms"
    assert loose.prefill_tokens(64) == loose.with_decode - 64


def test_coarse_graphs_above_512_price_long_prefill_but_never_widen_the_derived_target():
    """A budget sized to an H200 captures coarse PIECEWISE sizes (1,024 ... 8,192): a step of 1,500
    tokens is priced at the 2,048 replay, but the derived target stays the 512-token step, so
    decode rows wait no longer than at the default ceiling."""
    budget = plan_step_budget(8192, 0.0, [*h200_like(), *COARSE], "cuda", tokens_source="sized to the device")
    assert budget.model.ceiling == 8192 and budget.model.ceiling_within(512) == 512
    assert budget.model.seconds(1500) == pytest.approx(0.002 + 5e-6 * 2048)
    assert budget.source.startswith("derived: a 512-token step") and budget.with_decode == 512
    assert budget.prefill_tokens(0) == 8192 and budget.tokens_source == "sized to the device"
    assert budget.to_proto().tokens_source == "sized to the device"
    assert budget.describe().startswith("8192 tokens a step with no decode row (sized to the device); with decode")


def test_a_target_tighter_than_the_decode_rows_still_moves_prefill_on():
    budget = plan_step_budget(8192, 0.5, h200_like(), "cuda")  # 0.5 ms: below any measured step
    assert budget.with_decode == 0
    assert budget.prefill_tokens(64) == MIN_PREFILL_TOKENS
    assert budget.prefill_tokens(8190) == 2  # never past the whole budget


@pytest.mark.parametrize("seed", range(5))
def test_every_step_with_decode_rows_keeps_the_target_and_no_prompt_waits_forever(seed):
    """Random arrivals on the real scheduler under an 8,192-token budget and a 3 ms target: each
    step that carries decode rows and prefill is predicted within the target (or carries the floor
    when the decode rows alone exceed it); steps without decode rows may take the whole budget;
    every request finishes."""
    rng = random.Random(seed)
    model = StepTimeModel.from_captured(h200_like())
    budget = StepBudget.for_target(8192, 0.003, model, "test")
    sched = Scheduler(max_num_seqs=64, max_num_batched_tokens=8192, prefill_chunk=0)
    sched.step_budget = budget
    pending = [seq(rng.randint(16, 3000), rng.randint(1, 40), f"r{i}") for i in range(120)]
    done: set[str] = set()
    steps, full_budget_steps = 0, 0
    while len(done) < len(pending):
        for s in pending[steps // 3:steps // 3 + 1]:  # one arrival every third step
            if s.slot is None and not s.finished and s not in sched.waiting:
                sched.add(s)
        step = sched.schedule()
        steps += 1
        assert steps < 20_000, "a request waited forever"
        if step is None:
            continue
        plan = step.plan
        prefill = sum(c.length for c in plan.prefill)
        if plan.num_decode and prefill:
            within = model.seconds(plan.num_tokens) <= budget.target
            assert within or prefill <= MIN_PREFILL_TOKENS, (plan.num_decode, prefill)
        if not plan.num_decode and plan.num_tokens > 512:
            full_budget_steps += 1
        for s in step.samplers:  # tokens come back at once here; a sequence ends at its length
            s.output.append(7)
            if len(s.output) >= s.max_new_tokens and not s.finished:
                sched.finish(s)
                done.add(s.request_id)
    assert full_budget_steps > 0  # prefill alone used more than the 512-token graph ceiling


# --- the TTFT guard ------------------------------------------------------------------------------

H200_TARGET = 0.002 + 5e-6 * 512  # the derived target on h200_like: the measured 512-token step


def test_the_guard_is_derived_from_the_target_and_stretches_only_for_a_prompt_past_the_ttft_target():
    budget = plan_step_budget(8192, 0.0, h200_like(), "cuda")
    guard = budget.guard
    assert budget.target == pytest.approx(H200_TARGET)
    assert guard.itl_max == pytest.approx(ITL_MAX_FACTOR * H200_TARGET)
    assert guard.ttft_target == pytest.approx(TTFT_TARGET_FACTOR * H200_TARGET)
    assert guard.source == "stretch ceiling: 2.5 x the target; TTFT target: 10 x the target"
    # The stretched bound: the eager line solved for the ceiling (past the 512-token graphs).
    assert abs(budget.stretched - int((guard.itl_max - 0.004) / 6e-6)) <= 1 and budget.stretched > 512
    assert budget.prefill_tokens(64) == budget.prefill_tokens(64, guard.ttft_target * 0.99) == 512 - 64
    assert budget.prefill_tokens(64, guard.ttft_target) == budget.stretched - 64
    assert budget.prefill_tokens(0, 10.0) == budget.prefill_tokens(0) == 8192  # nothing decodes: the whole budget
    assert budget.model.seconds(budget.stretched) <= guard.itl_max < budget.model.seconds(budget.stretched + 1)


def test_the_guard_flags_set_the_ceiling_and_the_ttft_target_and_say_so():
    budget = plan_step_budget(8192, 0.0, h200_like(), "cuda", itl_max_ms=8.0, ttft_target_ms=30.0)
    assert budget.guard == TTFTGuard(itl_max=0.008, ttft_target=0.030,
                                     source="stretch ceiling: --itl-max-ms; TTFT target: --ttft-target-ms")
    assert budget.stretched == budget.model.largest_within(0.008, 8192)
    assert not budget.stretches(0.029) and budget.stretches(0.030)
    half = plan_step_budget(8192, 6.0, h200_like(), "cuda", ttft_target_ms=20.0)  # one flag: the other derived
    assert half.guard.itl_max == pytest.approx(0.015) and half.guard.ttft_target == pytest.approx(0.020)
    assert half.guard.source == "stretch ceiling: 2.5 x the target; TTFT target: --ttft-target-ms"


def test_a_ceiling_no_larger_step_fits_never_stretches_below_the_normal_bound():
    budget = plan_step_budget(8192, 0.0, h200_like(), "cuda", itl_max_ms=1.0)  # tighter than the target
    assert budget.stretched == budget.with_decode == 512
    assert not budget.stretches(100.0)
    assert budget.prefill_tokens(64, 100.0) == 512 - 64


def test_no_step_times_means_no_target_and_no_guard():
    budget = plan_step_budget(512, 0.0, [], "cpu", itl_max_ms=12.0, ttft_target_ms=50.0)
    assert budget.guard is None and budget.ttft_target is None and not budget.stretches(1e9)
    assert budget.prefill_tokens(10, 1e9) == 502
    b = budget.to_proto()
    assert (b.itl_max_seconds, b.ttft_target_seconds, b.tokens_stretched, b.guard_source) == (0.0, 0.0, 512, "")


def test_the_startup_line_and_the_status_state_the_guard_and_where_it_came_from():
    budget = plan_step_budget(8192, 0.0, h200_like(), "cuda", tokens_source="sized to the device")
    line = budget.describe()
    assert line.endswith(f"; at most {budget.stretched} once a prompt has waited 45.60 ms for its first token "
                         "(stretch ceiling 11.40 ms; stretch ceiling: 2.5 x the target; TTFT target: 10 x the target)")
    b = budget.to_proto()
    assert b.itl_max_seconds == pytest.approx(0.0114) and b.ttft_target_seconds == pytest.approx(0.0456)
    assert b.tokens_stretched == budget.stretched and b.guard_source == budget.guard.source


class Clock:
    """Synthetic time: each step advances it by the step's predicted time (what the GPU would take)."""

    def __init__(self, model: StepTimeModel) -> None:
        self.model, self.now = model, 0.0

    def run(self, sched: Scheduler) -> tuple | None:
        step = sched.schedule(now=self.now)
        if step is None:
            self.now += 0.001  # idle: the engine sleeps until a request arrives
            return None
        self.now += self.model.seconds(step.plan.num_tokens)
        return step


def serve(sched: Scheduler, clock: Clock, step) -> list[Sequence]:
    """Tokens come back at once; a sequence ends at its length. Returns those that finished."""
    done = []
    for s in step.samplers:
        if not s.output:
            s.first_token_at = clock.now
        s.output.append(7)
        if len(s.output) >= s.max_new_tokens and not s.finished:
            sched.finish(s)
            done.append(s)
    return done


def within(step, model: StepTimeModel, ceiling: float):
    """``step`` (None: idle), checked: one with decode rows and prefill is predicted within
    ``ceiling``, or carries no more than the starvation floor of prefill."""
    if step is not None and step.plan.num_decode and step.plan.prefill:
        assert model.seconds(step.plan.num_tokens) <= ceiling or \
            sum(c.length for c in step.plan.prefill) <= MIN_PREFILL_TOKENS
    return step


def guarded(budget: StepBudget) -> Scheduler:
    sched = Scheduler(max_num_seqs=64, max_num_batched_tokens=8192, prefill_chunk=0)
    sched.step_budget = budget
    return sched


def long_prompts_beside_decoding_rows(budget: StepBudget) -> tuple[Scheduler, list[Sequence], int]:
    """48 sequences decoding, then 16 prompts of 3,000 tokens at once (what the long scenario's 64
    streams look like): steps until the last prompt's first token, every step's decode-row bound
    checked against the stretch ceiling (or the target, without a guard)."""
    sched, clock = guarded(budget), Clock(budget.model)
    for i in range(48):
        sched.add(seq(32, 10_000, f"d{i}", arrived=clock.now))
    clock.run(sched)  # their prompts, alone: the whole budget
    prompts = [seq(3000, 4, f"p{i}", arrived=clock.now) for i in range(16)]
    for p in prompts:
        sched.add(p)
    ceiling = budget.guard.itl_max if budget.guard else budget.target
    steps = 0
    while not all(p.output for p in prompts):
        step = within(clock.run(sched), budget.model, ceiling)
        steps += 1
        assert steps < 1000, "a prompt waited forever"
        serve(sched, clock, step)
    return sched, prompts, steps


@pytest.mark.parametrize("coarse", [False, True], ids=["eager-above-512", "coarse-graphs"])
def test_long_prompts_past_the_ttft_target_get_stretched_steps_and_their_first_tokens_sooner(coarse):
    """With the coarse graphs a budget of 8,192 captures (``large_steps.py``) a stretched step replays
    the 1,024-token graph; without them it runs eager up to the ceiling. Either way the long prompts
    finish prefill in fewer steps and get their first tokens sooner (synthetic time)."""
    plain_budget = plan_step_budget(8192, 0.0, [*h200_like(), *(COARSE if coarse else [])], "cuda")
    unguarded = StepBudget.for_target(8192, plain_budget.target, plain_budget.model, "test")  # no guard
    plain, plain_prompts, plain_steps = long_prompts_beside_decoding_rows(unguarded)
    sched, prompts, steps = long_prompts_beside_decoding_rows(plain_budget)
    assert plain.steps_stretched == 0
    assert sched.steps_stretched > 0
    assert steps < plain_steps  # the last long prompt's first token, in steps
    ttft = sorted(p.first_token_at - p.arrived for p in prompts)
    plain_ttft = sorted(p.first_token_at - p.arrived for p in plain_prompts)
    assert ttft[len(ttft) // 2] < plain_ttft[len(plain_ttft) // 2] and ttft[-1] < plain_ttft[-1]


def test_without_a_prompt_past_the_ttft_target_the_normal_target_holds():
    """The same burst with a TTFT target no prompt reaches: no step stretches, each step with decode
    rows keeps the inter-token target exactly as without a guard."""
    base = plan_step_budget(8192, 0.0, h200_like(), "cuda", ttft_target_ms=1e6)
    sched, _, _ = long_prompts_beside_decoding_rows(
        StepBudget.for_target(8192, base.target, base.model, "test", guard=TTFTGuard(base.guard.itl_max, 1e3, "t")))
    assert sched.steps_stretched == 0
    budget = plan_step_budget(8192, 0.0, h200_like(), "cuda")
    sched = guarded(budget)
    for i in range(8):
        sched.add(seq(32, 100, f"d{i}"))
    sched.schedule(now=0.0)
    sched.add(seq(3000, 4, "late", arrived=0.0))
    step = sched.schedule(now=budget.guard.ttft_target * 0.9)
    assert step.plan.num_decode == 8 and sum(c.length for c in step.plan.prefill) == 512 - 8
    step = sched.schedule(now=budget.guard.ttft_target)
    assert sum(c.length for c in step.plan.prefill) == budget.stretched - 8 and sched.steps_stretched == 1


def test_a_stretched_step_grows_only_by_what_the_late_prompts_need():
    """Late short prompts past the normal bound get a step that carries them whole and no more (the
    prompt served ahead of a late one counts, since steps serve in order); a prompt behind them that
    is not late does not widen the step; late long prompts take the whole stretch."""
    budget = plan_step_budget(8192, 0.0, h200_like(), "cuda")
    ttft = budget.guard.ttft_target
    sched = guarded(budget)
    for i in range(8):
        sched.add(seq(32, 100, f"d{i}"))
    sched.schedule(now=0.0)  # the decoding rows' prompts
    first = seq(400, 4, "first", arrived=0.0)
    late = seq(300, 4, "late", arrived=0.0)
    fresh = seq(2000, 4, "fresh", arrived=ttft)
    for s in (first, late, fresh):
        sched.add(s)
    assert sched.late_prefill(ttft) == 0  # queued, not admitted: a stretch cannot serve them yet
    step = sched.schedule(now=ttft)  # admits all three, then sizes the step
    assert step.plan.num_decode == 8
    assert [c.length for c in step.plan.prefill] == [400, 300]  # both whole, nothing of the fresh one
    assert budget.prefill_tokens(8, ttft, 700) == 700 and budget.prefill_tokens(8, ttft, 10) == 512 - 8
    assert budget.prefill_tokens(8, ttft, 100_000) == budget.prefill_tokens(8, ttft) == budget.stretched - 8


@pytest.mark.parametrize("seed", range(3))
def test_short_prompt_traffic_served_within_the_ttft_target_never_stretches(seed):
    """The mixed scenario: 64 closed-loop streams (started a step apart) of 16-400-token prompts and
    64-256 new tokens: every first token comes within the TTFT target, so no step stretches and every
    step with decode rows keeps the inter-token target."""
    rng = random.Random(seed)
    budget = plan_step_budget(8192, 0.0, h200_like(), "cuda")
    sched, clock = guarded(budget), Clock(budget.model)
    served: list[Sequence] = []
    started, total, steps = 0, 400, 0
    while len(served) < total:
        if steps < 64 and started < total:  # the streams start one a step; then each asks again when served
            started += 1
            sched.add(seq(rng.randint(16, 400), rng.randint(64, 256), f"m{started}", arrived=clock.now))
        step = within(clock.run(sched), budget.model, budget.target)
        steps += 1
        assert steps < 50_000, "a request waited forever"
        if step is None:
            continue
        for _ in (finished := serve(sched, clock, step)):
            if started < total:
                started += 1
                sched.add(seq(rng.randint(16, 400), rng.randint(64, 256), f"m{started}", arrived=clock.now))
        served += finished
    assert sched.steps_stretched == 0
    assert max(s.first_token_at - s.arrived for s in served) < budget.guard.ttft_target


@pytest.mark.parametrize("seed", range(3))
def test_random_long_and_short_traffic_keeps_the_stretch_ceiling_and_finishes_every_request(seed):
    rng = random.Random(seed)
    budget = plan_step_budget(8192, 0.0, h200_like(), "cuda")
    sched, clock = guarded(budget), Clock(budget.model)
    pending = [seq(rng.choice([rng.randint(16, 400), rng.randint(500, 3000)]), rng.randint(8, 120), f"r{i}")
               for i in range(200)]
    done = 0
    steps = 0
    while done < len(pending):
        if steps < len(pending):  # one arrival a step: more prompt tokens than the target lets in
            pending[steps].arrived = clock.now
            sched.add(pending[steps])
        step = within(clock.run(sched), budget.model, budget.guard.itl_max)
        steps += 1
        assert steps < 50_000, "a request waited forever"
        if step is None:
            continue
        done += len(serve(sched, clock, step))
    assert sched.steps_stretched > 0  # the load put prompts past the TTFT target


def test_the_oldest_wait_counts_prompts_waiting_for_a_first_token_queued_or_mid_prefill():
    budget = plan_step_budget(8192, 0.0, h200_like(), "cuda")
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=8192, prefill_chunk=0)
    sched.step_budget = budget
    assert sched.oldest_wait(5.0) == 0.0  # nobody waits
    a, b, c = seq(32, 50, "a", arrived=1.0), seq(3000, 5, "b", arrived=2.0), seq(32, 5, "c", arrived=3.0)
    for s in (a, b, c):
        sched.add(s)
    assert sched.oldest_wait(5.0) == 4.0  # queued
    sched.schedule(now=5.0)  # a and b admitted, both prefilled whole (no decode row yet); c waits
    assert not a.prefilling and a.samples_scheduled == 1 and sched.oldest_wait(5.0) == 2.0  # c, queued
    sched.preempt(a)  # a sampled already: its recompute is not waiting for a first token
    assert sched.waiting[0] is a and sched.oldest_wait(6.0) == 3.0


def test_graphkeeper_status_states_the_guard():
    from graphkeeper.client import step_budget_line

    b = pb.StepBudgetStatus(tokens=8192, tokens_with_decode=512, itl_target_seconds=0.0048, source="derived",
                            tokens_source="sized to the device", itl_max_seconds=0.012, ttft_target_seconds=0.048,
                            tokens_stretched=1300, guard_source="stretch ceiling: 2.5 x the target")
    assert step_budget_line(b) == (
        "budget    8192 tokens a step with no decode row (sized to the device), 512 with decode rows "
        "(inter-token target 4.80 ms: derived), 1300 once a prompt has waited 48.00 ms for its first token "
        "(stretch ceiling 12.00 ms: stretch ceiling: 2.5 x the target)")


# --- a real worker ---------------------------------------------------------------------------


def test_a_worker_states_its_budget_and_where_it_came_from(module_workers):
    worker = module_workers("--max-num-seqs", "4", "--max-seq-len", "128", "--max-num-batched-tokens", "256",
                            "--itl-target-ms", "4", "--itl-max-ms", "12", "--ttft-target-ms", "50")
    tokens, _ = generate(worker, make_request([5, 6, 7], 4))
    assert len(tokens) == 4
    status = worker.status().step_budget
    info = worker.model_info().step_budget
    for b in (status, info):  # a CPU worker records no graphs: nothing measured, no target, no TTFT guard
        assert b.tokens == 256 and b.tokens_with_decode == 256 and b.itl_target_seconds == 0
        assert b.source == "no step times measured (no graphs recorded on cpu)"
        assert b.tokens_source == "--max-num-batched-tokens"
        assert b.itl_max_seconds == b.ttft_target_seconds == 0 and b.tokens_stretched == 256 and not b.guard_source
    assert worker.metric("graphkeeper_steps_stretched_total") == 0
    assert "step budget: 256 tokens a step (--max-num-batched-tokens; no step times measured" in worker.log()



def test_graphs_released_idle_are_priced_eager_and_the_budget_is_planned_again():
    """After an idle release the steps those graphs served run eager: the model stops pricing them
    as replays (the ceiling drops to the largest graph still held), keeps their eager timings,
    and ``install_step_budget`` plans from what the engine holds now."""
    from types import SimpleNamespace

    from graphkeeper.worker.engine.step_budget import install_step_budget
    from graphkeeper.worker.settings import EngineSettings

    held = [g for g in h200_like() if g.size <= 128]
    gone = [g for g in h200_like() if g.size > 128]
    model = StepTimeModel.from_captured(held, {g.size: g.eager_seconds for g in gone})
    assert model.ceiling == 128
    assert model.seconds(512) == pytest.approx(0.004 + 6e-6 * 512)  # eager now, as measured at capture
    assert [s for s, _ in model.eager][-1] == 512
    graphs = SimpleNamespace(captured={(g.mode, g.size): g for g in held},
                             eager_seconds={g.size: g.eager_seconds for g in h200_like()})
    settings = EngineSettings(max_num_batched_tokens=8192, itl_target_ms=0.0)
    before = install_step_budget(settings, SimpleNamespace(captured={(g.mode, g.size): g for g in h200_like()},
                                                           eager_seconds={}), "cuda")
    after = install_step_budget(settings, graphs, "cuda", kept=before)
    assert before.model.ceiling == 512 and after.model.ceiling == 128
    assert after.target == before.target, "the latency target stays; what a step costs changed"
    assert after.source == before.source + "; graphs released since"
    # Steps above the new ceiling are priced eager: fewer tokens fit the same target beside decode rows.
    assert after.with_decode < before.with_decode
    assert after.with_decode == after.model.largest_within(before.target, 8192)
    assert after.guard == before.guard, "the TTFT guard stays with the target"
    fresh = install_step_budget(settings, graphs, "cuda")  # a capture phase derives the target again
    assert fresh.source.startswith("derived: a 128-token step")
    assert install_step_budget(settings, None, "cpu").target is None
    flagged = install_step_budget(EngineSettings(max_num_batched_tokens=8192, itl_max_ms=9.0, ttft_target_ms=40.0),
                                  graphs, "cuda")
    assert flagged.guard == TTFTGuard(0.009, 0.040, "stretch ceiling: --itl-max-ms; TTFT target: --ttft-target-ms")
