"""Steps that broke the step budget's promise to decode rows (``engine/step_overruns.py``): a step
with decode rows slower than the stretch ceiling (the target without a guard) is counted in the
worker's real metrics and described with what the step-time model could not see; steps without
decode rows, or within the bound, or on a worker with no target, are not."""

from __future__ import annotations

import logging

import numpy as np
from test_step_budget import h200_like

from graphkeeper.worker.engine.step_budget import StepBudget, plan_step_budget
from graphkeeper.worker.engine.step_overruns import StepOverruns, allocator_note, overrun
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.plan import PrefillChunk, StepPlan


def plan(decode_positions: list[int], chunks: list[tuple[int, int]] = ()) -> StepPlan:
    """Decode rows at ``decode_positions``, then prefill chunks of (start, length)."""
    positions = list(decode_positions)
    prefill, row = [], len(positions)
    for slot, (start, length) in enumerate(chunks, start=100):
        prefill.append(PrefillChunk(row=row, length=length, slot=slot, start=start))
        positions += range(start, start + length)
        row += length
    return StepPlan(prompt_tokens=[1] * (row - len(decode_positions)), positions=np.array(positions, dtype=np.int64),
                    slots=np.zeros(row, dtype=np.int64), num_decode=len(decode_positions), prefill=prefill)


BUDGET = plan_step_budget(8192, 0.0, h200_like(), "cuda")  # target: the 512-token step, 4.56 ms


def test_a_step_with_decode_rows_past_the_stretch_ceiling_is_an_overrun_described_with_its_context():
    ceiling = BUDGET.guard.itl_max
    step = plan([999, 2999], [(1000, 500)])  # two decode rows, one chunk ending at position 1,500
    found = overrun(step, BUDGET, took=ceiling + 0.001, launch=0.004)
    assert found is not None
    assert (found.tokens, found.decode_rows, found.context_tokens) == (502, 2, 1000 + 3000 + 1500)
    assert found.bound == ceiling and found.predicted == BUDGET.model.seconds(502)
    assert "502 tokens (2 decode rows, 500 prompt tokens, 5500 context tokens" in found.describe()
    assert overrun(step, BUDGET, took=ceiling, launch=0.0) is None  # at the bound: kept


def test_an_overrun_says_where_its_time_went_launching_waiting_for_the_device_or_elsewhere():
    """A stalled engine thread and a slow device read differently: the wait at the read is the
    device's, what launch and wait leave is the thread's other work."""
    took = 0.020
    stalled = overrun(plan([999]), BUDGET, took=took, launch=0.001, wait=0.0005).describe()
    assert "launched it in 1.00 ms, waited 0.50 ms for the device at its read, and spent 18.50 ms on other work" \
        in stalled
    slow = overrun(plan([999]), BUDGET, took=took, launch=0.001, wait=0.019).describe()
    assert "waited 19.00 ms for the device at its read, and spent 0.00 ms on other work" in slow
    # Launched before the previous step's read: what it took starts there, its launch is not in it.
    piped = overrun(plan([999]), BUDGET, took=took, launch=0.001, wait=0.0005, overlapped=True).describe()
    assert "launched it in 1.00 ms before the previous step's read, waited 0.50 ms for the device at its read, " \
        "and spent 19.50 ms on other work" in piped


def test_without_decode_rows_or_without_a_target_nothing_is_promised():
    assert overrun(plan([], [(0, 4000)]), BUDGET, took=1.0, launch=0.0) is None  # nobody waits between tokens
    fixed = StepBudget.fixed(512)
    assert overrun(plan([10, 20]), fixed, took=1.0, launch=0.0) is None


def test_without_a_guard_the_bound_is_the_target():
    plain = StepBudget.for_target(8192, BUDGET.target, BUDGET.model, "test")
    assert overrun(plan([10]), plain, took=BUDGET.target * 1.01, launch=0.0).bound == BUDGET.target


def test_every_overrun_is_counted_and_one_line_every_few_seconds_describes_the_latest(caplog):
    metrics = WorkerMetrics()
    overruns = StepOverruns(metrics, every=5.0)
    slow, quick = BUDGET.guard.itl_max * 2, BUDGET.target / 2
    with caplog.at_level(logging.WARNING, logger="graphkeeper.worker.engine.step_overruns"):
        for now, took in ((100.0, slow), (101.0, slow), (102.0, quick), (103.0, slow), (106.0, slow)):
            overruns.check(plan([50, 60]), BUDGET, took, 0.001, now)
    assert metrics.registry.get_sample_value("graphkeeper_step_overruns_total") == 4.0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # at 100 s, then at 106 s (the two between were counted, not logged)
    assert lines[0].startswith("1 step(s)") and lines[1].startswith("3 step(s)")
    assert "2 decode rows" in lines[1]


def test_the_note_is_read_only_for_a_logged_line_and_a_cpu_device_has_none(caplog):
    import torch

    reads = []
    overruns = StepOverruns(WorkerMetrics(), every=5.0, note=lambda: reads.append(1) or "allocator: 0 retries")
    with caplog.at_level(logging.WARNING, logger="graphkeeper.worker.engine.step_overruns"):
        for now in (100.0, 101.0, 102.0):
            overruns.check(plan([50]), BUDGET, BUDGET.guard.itl_max * 2, 0.001, now)
    assert len(reads) == 1  # three overruns, one line
    assert caplog.records[0].getMessage().endswith("; allocator: 0 retries")
    assert allocator_note(torch.device("cpu")) is None
