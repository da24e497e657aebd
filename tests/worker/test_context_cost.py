"""What a step costs beyond the capture-time model (``engine/context_cost.py``): the fit recovers
synthetic costs per decode context token and per prompt pair, never prices context negatively, and
learns nothing from steps the budget did not size; then the scheduler, on a synthetic clock whose
steps cost what long contexts cost, keeps stretched steps within the ceiling once it has learned,
where the model alone runs past it."""

from __future__ import annotations

import numpy as np
import pytest
from test_step_budget import COARSE, guarded, h200_like, seq, serve
from test_step_overruns import plan

from graphkeeper.worker.engine.context_cost import (
    MOST_OF_CEILING,
    ContextCost,
    StepLoad,
    pairs,
    step_context,
)
from graphkeeper.worker.engine.step_budget import MIN_PREFILL_TOKENS, plan_step_budget

BUDGET = plan_step_budget(8192, 0.0, h200_like(), "cuda")  # eager above 512: steps sized to the ceiling
#: The synthetic truth: what a step costs beyond the model.
OVERHEAD, PER_TOKEN, PER_PAIR = 0.0004, 8e-9, 1e-10


def truth(step_plan) -> float:
    decode, prompt_pairs = step_context(step_plan)
    return BUDGET.model.seconds(step_plan.num_tokens) + OVERHEAD + PER_TOKEN * decode + PER_PAIR * prompt_pairs


def test_a_step_context_counts_each_decode_rows_tokens_and_each_chunks_pairs():
    assert pairs(3, 0) == 6 and pairs(2, 10) == 2 * 10 + 3  # causal: 1 + 2 + 3; 11 + 12
    step = plan([99, 9], [(100, 50), (0, 10)])
    assert step_context(step) == (100 + 10, pairs(50, 100) + pairs(10, 0))


def random_steps(n: int, rng: np.random.Generator):
    for _ in range(n):
        rows = int(rng.integers(1, 64))
        start, length = int(rng.integers(0, 3000)), int(rng.integers(16, 900))
        yield plan(list(rng.integers(0, 3000, rows)), [(start, length)])


def test_the_fit_recovers_the_cost_of_context_and_the_overhead_from_the_steps_that_ran():
    cost, rng = ContextCost(), np.random.default_rng(0)
    for i, step in enumerate(random_steps(400, rng)):
        cost.observe(step, BUDGET.model.seconds(step.num_tokens), truth(step), now=i)
    assert cost.fit.per_token == pytest.approx(PER_TOKEN, rel=1e-3)
    assert cost.fit.per_pair == pytest.approx(PER_PAIR, rel=1e-3)
    assert cost.fit.overhead == pytest.approx(OVERHEAD, rel=1e-3)
    assert cost.fit.spread < 1e-6  # the truth is linear: nothing left over


def test_noise_leaves_a_spread_and_context_that_costs_nothing_is_never_priced_below_zero():
    cost, rng = ContextCost(), np.random.default_rng(1)
    for i, step in enumerate(random_steps(600, rng)):
        predicted = BUDGET.model.seconds(step.num_tokens)
        decode, _ = step_context(step)
        # Longer decode contexts run *faster* here (and pairs cost nothing): the fit drops the term.
        took = predicted + 0.001 - 1e-9 * decode + rng.normal(0, 0.0005)
        cost.observe(step, predicted, took, now=i)
    assert cost.fit.per_token == 0.0
    assert cost.fit.per_pair >= 0.0
    assert cost.fit.spread == pytest.approx(0.0005 * np.sqrt(1 + 0.0), rel=0.5)


def test_steps_the_budget_did_not_size_teach_nothing_and_nothing_is_used_before_enough_steps():
    cost = ContextCost(min_steps=64)
    for _ in range(500):
        cost.observe(plan([], [(0, 4000)]), 0.01, 1.0)  # no decode row: nobody waited on its size
        cost.observe(plan([3000] * 8), 0.002, 1.0)  # no prompt tokens: nothing was chosen
        cost.observe(plan([3000], [(0, 100)]), None, 1.0)  # no step-time model
    assert cost.load(1000, 0, 0.01) is None
    for i, step in enumerate(random_steps(63, np.random.default_rng(2))):
        cost.observe(step, BUDGET.model.seconds(step.num_tokens), truth(step), now=i)
    assert cost.load(1000, 0, 0.01) is None  # 63 steps: not yet
    step = plan([3000] * 64, [(0, 100)])
    cost.observe(step, BUDGET.model.seconds(step.num_tokens), truth(step))
    load = cost.load(1000, 50, 0.01)
    assert load is not None and load.decode_seconds == pytest.approx(1000 * PER_TOKEN, rel=1e-3)
    assert load.wall_seconds == pytest.approx(OVERHEAD, rel=1e-3)


def test_the_overhead_never_takes_more_than_its_share_of_the_ceiling():
    cost = ContextCost()
    for i in range(200):
        step = plan([i * 10] * 4, [(i, 64)])
        cost.observe(step, 0.001, 0.5, now=i)  # a pause-ridden fit: half a second a step
    assert cost.load(0, 0, 0.0114).wall_seconds == pytest.approx(MOST_OF_CEILING * 0.0114)


@pytest.mark.parametrize("coarse", [False, True], ids=["eager-above-512", "coarse-graphs"])
def test_a_loaded_step_is_sized_so_its_model_time_and_context_stay_within_the_bound(coarse):
    budget = plan_step_budget(8192, 0.0, [*h200_like(), *(COARSE if coarse else [])], "cuda")
    model = budget.model
    for target, decode_seconds in ((budget.target, 0.0015), (budget.guard.itl_max, 0.004)):
        load = StepLoad(decode_seconds=decode_seconds, pair_seconds=2e-10, start=2000)
        tokens = model.largest_loaded(target, 8192, 48, load)
        assert 48 < tokens < model.largest_within(target, 8192)  # the context took some of the room
        assert model.seconds(tokens) + load.seconds(tokens - 48) <= target
        # And no more than it had to: the next captured size, or one token more past the graphs.
        bigger = next((s for s, _ in model.replay if s > tokens), tokens + 1)
        assert model.seconds(bigger) + load.seconds(bigger - 48) > target
    nothing = StepLoad(0.0, 0.0, 0)
    assert model.largest_loaded(budget.target, 8192, 48, nothing) == model.largest_within(budget.target, 8192)


def test_a_load_that_fills_the_bound_still_moves_a_prompt_on():
    load = StepLoad(decode_seconds=1.0, pair_seconds=0.0, start=0)
    assert BUDGET.prefill_tokens(64, load=load) == MIN_PREFILL_TOKENS


def long_contexts(learn: bool) -> tuple[list[float], list[float]]:
    """48 rows decoding after 3,000-token prompts, then 16 more such prompts: on a clock where each
    step costs ``truth`` (context included), the wall time of every step with decode rows and
    prompt tokens, stretched and not, once the fit has had 100 steps (or none, ``learn`` False)."""
    sched = guarded(BUDGET)
    now = 0.0
    stretched, normal = [], []

    def run() -> None:
        nonlocal now
        before = sched.steps_stretched
        step = sched.schedule(now=now)
        took = truth(step.plan)
        now += took
        if learn:
            sched.ran(step.plan, took, now)
        if step.plan.num_decode and step.plan.prefill and steps > 100:
            (stretched if sched.steps_stretched > before else normal).append(took)
        serve(sched, type("C", (), {"now": now})(), step)

    steps = 0
    for i in range(48):
        sched.add(seq(3000, 10_000, f"d{i}", arrived=now))
    while sched.prefilling or sched.waiting:
        steps += 1
        run()
    for round_ in range(6):
        prompts = [seq(3000, 2, f"p{round_}-{i}", arrived=now) for i in range(16)]
        for p in prompts:
            sched.add(p)
        while not all(p.output for p in prompts):
            steps += 1
            assert steps < 5000, "a prompt waited forever"
            run()
    return stretched, normal


def test_once_learned_stretched_steps_keep_the_ceiling_where_the_model_alone_runs_past_it():
    ceiling = BUDGET.guard.itl_max
    blind, blind_normal = long_contexts(learn=False)
    assert blind and max(blind) > ceiling  # the model alone: long contexts overrun the ceiling
    assert max(blind_normal) > BUDGET.target + OVERHEAD
    learned, normal = long_contexts(learn=True)
    assert learned, "no step stretched"
    assert max(learned) <= ceiling * (1 + 1e-6)
    assert max(normal) <= BUDGET.target + OVERHEAD + 1e-6  # the target bounds the model's time and context
