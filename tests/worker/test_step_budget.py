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
    MIN_PREFILL_TOKENS,
    StepBudget,
    StepTimeModel,
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


def seq(prompt_len: int, max_new: int, name: str) -> Sequence:
    return Sequence(request_id=name, tenant="", prompt=list(range(3, 3 + prompt_len)), max_new_tokens=max_new,
                    sampling=SamplingSpec(), seed=0)


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


def test_timing_noise_never_makes_a_larger_eager_step_predicted_faster():
    noisy = [Timed(PW, 64, 0.001, 0.010), Timed(PW, 128, 0.002, 0.008), Timed(PW, 256, 0.003, 0.012)]
    model = StepTimeModel.from_captured(noisy)
    assert [secs for _, secs in model.eager] == [0.010, 0.010, 0.012]


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
    coarse = [Timed(PW, s, 0.002 + 5e-6 * s, 0.004 + 6e-6 * s) for s in (1024, 2048, 4096, 8192)]
    budget = plan_step_budget(8192, 0.0, [*h200_like(), *coarse], "cuda", tokens_source="sized to the device")
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


# --- a real worker ---------------------------------------------------------------------------


def test_a_worker_states_its_budget_and_where_it_came_from(module_workers):
    worker = module_workers("--max-num-seqs", "4", "--max-seq-len", "128", "--max-num-batched-tokens", "256",
                            "--itl-target-ms", "4")
    tokens, _ = generate(worker, make_request([5, 6, 7], 4))
    assert len(tokens) == 4
    status = worker.status().step_budget
    info = worker.model_info().step_budget
    for b in (status, info):  # a CPU worker records no graphs: nothing measured, no target
        assert b.tokens == 256 and b.tokens_with_decode == 256 and b.itl_target_seconds == 0
        assert b.source == "no step times measured (no graphs recorded on cpu)"
        assert b.tokens_source == "--max-num-batched-tokens"
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
    model = StepTimeModel.from_captured(held, gone)
    assert model.ceiling == 128
    assert model.seconds(512) == pytest.approx(0.004 + 6e-6 * 512)  # eager now, as measured at capture
    assert [s for s, _ in model.eager][-1] == 512
    graphs = SimpleNamespace(captured={(g.mode, g.size): g for g in held},
                             released={(g.mode, g.size): g for g in gone})
    settings = EngineSettings(max_num_batched_tokens=8192, itl_target_ms=0.0)
    before = install_step_budget(settings, SimpleNamespace(captured={(g.mode, g.size): g for g in h200_like()},
                                                           released={}), "cuda")
    after = install_step_budget(settings, graphs, "cuda", kept=before)
    assert before.model.ceiling == 512 and after.model.ceiling == 128
    assert after.target == before.target, "the latency target stays; what a step costs changed"
    assert after.source == before.source + "; graphs released since"
    # Steps above the new ceiling are priced eager: fewer tokens fit the same target beside decode rows.
    assert after.with_decode < before.with_decode
    assert after.with_decode == after.model.largest_within(before.target, 8192)
    fresh = install_step_budget(settings, graphs, "cuda")  # a capture phase derives the target again
    assert fresh.source.startswith("derived: a 128-token step")
    assert install_step_budget(settings, None, "cpu").target is None
