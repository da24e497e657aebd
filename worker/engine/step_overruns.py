"""Steps that broke the step budget's promise to decode rows, counted and described.

The step budget (``step_budget.py``) sizes each step with decode rows from a step-time model
measured at capture, so that no decoding row waits longer than the stretch ceiling (the
inter-token target where there is no TTFT guard) for its next token. The model measures the
device's time at short contexts; a step can still run longer: attention over thousands of context
tokens, the host launching a piecewise step slower than the device runs it, a pause of the
collector. Such a step is exactly an inter-token gap past the target, so it is not left to a
histogram's tail: each one is counted (``graphkeeper_step_overruns_total``), and at most one log
line every few seconds describes the latest, with what the model could not see (the context its
rows attend over, the host's launch time), so what to fix is read, not guessed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from graphkeeper.worker.engine.step_budget import StepBudget
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.plan import StepPlan

log = logging.getLogger(__name__)

#: Seconds between two log lines about overruns (the counter counts every one).
LOG_EVERY_SECONDS = 5.0


@dataclass(frozen=True)
class Overrun:
    """One step with decode rows that took longer than its bound (pure data, for the log line)."""

    tokens: int
    decode_rows: int
    context_tokens: int  # tokens the step's rows attend over: each decode row's, each chunk's end
    predicted: float
    bound: float
    took: float
    launch: float  # host seconds launching the step

    def describe(self) -> str:
        return (f"{self.tokens} tokens ({self.decode_rows} decode rows, {self.tokens - self.decode_rows} prompt "
                f"tokens, {self.context_tokens} context tokens attended over) took {self.took * 1e3:.2f} ms against "
                f"a bound of {self.bound * 1e3:.2f} ms (predicted {self.predicted * 1e3:.2f} ms; the host launched "
                f"it in {self.launch * 1e3:.2f} ms)")


def overrun(plan: StepPlan, budget: StepBudget, took: float, launch: float) -> Overrun | None:
    """The step as an overrun when it has decode rows and took longer than the longest any of them
    was promised to wait (the stretch ceiling, or the target without a guard); else None (pure)."""
    bound = budget.decode_wait
    if bound is None or plan.num_decode == 0 or took <= bound:
        return None
    ends = [int(c.start + c.length) for c in plan.prefill]
    context = int(np.sum(plan.positions[:plan.num_decode] + 1)) + sum(ends)
    predicted = budget.model.seconds(plan.num_tokens) if budget.model is not None else 0.0
    return Overrun(plan.num_tokens, plan.num_decode, context, predicted, bound, took, launch)


class StepOverruns:
    """Counts overruns into the worker's metrics and logs the latest now and then."""

    def __init__(self, metrics: WorkerMetrics, every: float = LOG_EVERY_SECONDS) -> None:
        self.metrics = metrics
        self.every = every
        self.unlogged = 0
        self._logged_at = float("-inf")

    def check(self, plan: StepPlan, budget: StepBudget, took: float, launch: float, now: float) -> None:
        """One finished step (``now``: time.perf_counter() when its tokens were read)."""
        found = overrun(plan, budget, took, launch)
        if found is None:
            return
        self.metrics.step_overruns.inc()
        self.unlogged += 1
        if now - self._logged_at >= self.every:
            log.warning("%d step(s) with decode rows ran past the step budget's bound since the last such line; "
                        "the latest: %s", self.unlogged, found.describe())
            self.unlogged, self._logged_at = 0, now
