"""What a step costs beyond the capture-time model, learned from the steps the worker ran.

The step-time model (``step_budget.StepTimeModel``) is measured at capture on probe batches whose
rows sit in one scratch slot at positions 0..size-1: short contexts, all read from one slot's K/V,
which the GPU's L2 cache mostly holds. Serving rows each attend over their own context, up to
thousands of tokens read from device memory: a decode row costs about its context's K/V bytes over
the memory bandwidth (11 ns per context token per row measured on an H100 for llama-1b, 64 rows at
3,000 tokens doubling the step), and a prompt chunk's queries attend over the prompt before them.
And the model is the device's time, while a decoding row waits for the step's wall time, the host's
launches included. So steps with long contexts ran past the bound they were sized for.

``ContextCost`` fits that difference from the steps themselves. For every step with decode rows and
prompt tokens (the only steps whose size the budget chooses)::

    took - predicted = overhead + per_token * decode context tokens + per_pair * prompt query-key pairs

by least squares with exponential forgetting (the last few hundred steps count; a change of traffic
or of card is followed), each coefficient kept >= 0. The spread of what the fit leaves is kept too.

``StepLoad`` is what the scheduler hands the budget for one step: the decode rows' context priced,
the price of a prompt pair, and where the first prompt chunk starts. The normal bound (the target,
itself the model's time of a 512-token step) compares the model's time plus the context terms; the
stretch ceiling, a wall-clock promise to decoding rows, also adds the overhead and 1.5 spreads of
the residual, so that few stretched steps run past it.

Pure arithmetic (numpy on 3-vectors), no torch: it tests on synthetic steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from graphkeeper.worker.plan import StepPlan

log = logging.getLogger(__name__)

#: Weight of a step, per step since it ran: 0.995 keeps ~200 steps (about a second of long prompts).
FORGET = 0.995
#: Steps seen before the fit is used: until then steps are sized by the model alone.
MIN_STEPS = 64
#: Steps between two solutions of the fit (each is a 3 x 3 solve).
REFIT_EVERY = 16
#: Feature scales: decode context in 100k tokens, prompt pairs in millions (a well-conditioned solve).
SCALES = (1.0, 1e-5, 1e-6)
#: The most the overhead and spread may take off the stretch ceiling, as a share of it (a fit thrown
#: by a pause never shrinks stretched steps to nothing).
MOST_OF_CEILING = 0.3
#: Spreads of the residual a stretched step keeps under the ceiling: sized to the mean, half the
#: stretched steps would run past it; 1.5 spreads leave about one in fifteen (normal residuals).
SPREADS = 1.5
#: A step's residual counts at most this (seconds): one step stalled by something rare (a pause, a
#: preemption) moves the fit and its spread as a 5 ms miss would, not by its whole length.
RESIDUAL_CAP = 0.005
#: Seconds between two log lines about the fit.
LOG_EVERY_SECONDS = 60.0


def pairs(length: int, start: int) -> int:
    """Query-key pairs a causal prompt chunk of ``length`` tokens starting at ``start`` attends over."""
    return length * start + length * (length + 1) // 2


def step_context(plan: StepPlan) -> tuple[int, int]:
    """(context tokens the decode rows attend over, query-key pairs of the prompt chunks)."""
    decode = int(np.sum(plan.positions[:plan.num_decode])) + plan.num_decode
    return decode, sum(pairs(c.length, c.start) for c in plan.prefill)


@dataclass(frozen=True)
class StepLoad:
    """One step's context, priced (``ContextCost.load``): what the budget adds to the model's time."""

    #: Seconds the decode rows' context adds (fixed once the decode rows are known).
    decode_seconds: float
    #: Seconds per query-key pair of prompt tokens.
    pair_seconds: float
    #: Position the first prompt chunk starts at (its queries attend over the prompt before it).
    start: int
    #: Seconds added to a stretched step only: the fit's overhead and ``SPREADS`` spreads of its residual.
    wall_seconds: float = 0.0

    def seconds(self, prompt_tokens: int) -> float:
        """Context seconds of a step carrying ``prompt_tokens`` prompt tokens."""
        return self.decode_seconds + self.pair_seconds * pairs(prompt_tokens, self.start)


@dataclass(frozen=True)
class Fit:
    """The fitted terms, in seconds: per decode context token, per prompt pair, the overhead, and
    the spread (standard deviation) of what the fit leaves."""

    per_token: float = 0.0
    per_pair: float = 0.0
    overhead: float = 0.0
    spread: float = 0.0

    def describe(self) -> str:
        return (f"{self.per_token * 1e9:.2f} ns per decode context token, {self.per_pair * 1e12:.2f} ps per prompt "
                f"query-key pair, {self.overhead * 1e3:.2f} ms overhead, {self.spread * 1e3:.2f} ms spread")


def solve(xtx: np.ndarray, xty: np.ndarray, yty: float, weight: float) -> Fit:
    """The least-squares fit of the weighted sums (features scaled by ``SCALES``; column 0 the
    intercept), every context coefficient >= 0: a negative one is dropped and the rest solved again
    (the best of the non-negative subsets, by residual). Pure."""
    best: tuple[float, np.ndarray] | None = None
    for keep in ([0, 1, 2], [0, 1], [0, 2], [0]):
        a, b = xtx[np.ix_(keep, keep)], xty[keep]
        try:
            beta = np.linalg.solve(a + np.eye(len(keep)) * 1e-12 * max(np.trace(a), 1.0), b)
        except np.linalg.LinAlgError:
            continue
        if np.any(beta[1:] < 0):
            continue
        sse = yty - 2 * beta @ b + beta @ a @ beta
        if best is None or sse < best[0]:
            full = np.zeros(3)
            full[keep] = beta
            best = (sse, full)
    if best is None:
        return Fit()
    sse, beta = best
    beta = beta * np.array(SCALES)
    spread = float(np.sqrt(max(sse, 0.0) / weight)) if weight > 0 else 0.0
    return Fit(per_token=float(beta[1]), per_pair=float(beta[2]), overhead=float(beta[0]), spread=spread)


class ContextCost:
    """The online fit: ``observe`` every step that ran, ``load`` for the step being planned."""

    def __init__(self, forget: float = FORGET, min_steps: int = MIN_STEPS, refit_every: int = REFIT_EVERY) -> None:
        self.forget, self.min_steps, self.refit_every = forget, min_steps, refit_every
        #: The weighted sums of the normal equations, kept as floats (a step adds to them in a few
        #: microseconds): x = (1, decode context, prompt pairs) scaled, y = took - predicted.
        self._sums = [0.0] * 10  # x0x0 x0x1 x0x2 x1x1 x1x2 x2x2 x0y x1y x2y yy
        self._steps = 0
        self._since_fit = 0
        self._logged_at = float("-inf")
        #: The fit in force (all zeros until ``min_steps`` steps were seen).
        self.fit = Fit()

    def observe(self, plan: StepPlan, predicted: float | None, took: float, now: float = 0.0) -> None:
        """One step that ran ``took`` seconds (the wait its decode rows saw) against ``predicted``
        (the model's time for its size; None: no model, nothing learned). Steps without decode rows
        or without prompt tokens are not the budget's choice and teach nothing."""
        if predicted is None or plan.num_decode == 0 or not plan.prefill:
            return
        decode, prompt_pairs = step_context(plan)
        x1, x2 = decode * SCALES[1], prompt_pairs * SCALES[2]
        y = min(max(took - predicted, -RESIDUAL_CAP), RESIDUAL_CAP)
        f = self.forget
        terms = (1.0, x1, x2, x1 * x1, x1 * x2, x2 * x2, y, x1 * y, x2 * y, y * y)
        self._sums = [f * total + term for total, term in zip(self._sums, terms, strict=True)]
        self._steps += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every and self._steps >= self.min_steps:
            self._since_fit = 0
            w, s01, s02, s11, s12, s22, t0, t1, t2, yy = self._sums
            xtx = np.array([[w, s01, s02], [s01, s11, s12], [s02, s12, s22]])
            self.fit = solve(xtx, np.array([t0, t1, t2]), yy, w)
            if now - self._logged_at >= LOG_EVERY_SECONDS:
                self._logged_at = now
                log.info("step time beyond the capture-time model, fitted over the last steps: %s", self.fit.describe())

    def load(self, decode_context: int, start: int, ceiling: float) -> StepLoad | None:
        """The step being planned, priced: its decode rows attend over ``decode_context`` tokens and
        its first prompt chunk starts at ``start``; ``ceiling`` is the stretch ceiling, which the
        overhead and spread may shrink by at most ``MOST_OF_CEILING``. None before a fit."""
        fit = self.fit
        if not (fit.per_token or fit.per_pair or fit.overhead or fit.spread):
            return None
        wall = min(max(fit.overhead, 0.0) + SPREADS * fit.spread, MOST_OF_CEILING * ceiling)
        return StepLoad(fit.per_token * decode_context, fit.per_pair, start, wall)
