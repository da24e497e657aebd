"""Steps that broke the step budget's promise to decode rows, counted and described.

The step budget (``step_budget.py``) sizes each step with decode rows from a step-time model
measured at capture, so that no decoding row waits longer than the stretch ceiling (the
inter-token target where there is no TTFT guard) for its next token. The model measures the
device's time at short contexts; a step can still run longer: attention over thousands of context
tokens, the host launching a piecewise step slower than the device runs it, a pause of the
collector. Such a step is exactly an inter-token gap past the target, so it is not left to a
histogram's tail: each one is counted (``graphkeeper_step_overruns_total``), and at most one log
line every few seconds describes the latest, with what the model could not see (the context its
rows attend over; its time split into the host's launch, the host's wait for the device at the read,
and the engine thread's other work in between), so what to fix is read, not guessed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from graphkeeper.worker.engine.step_budget import StepBudget
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.plan import StepPlan

if TYPE_CHECKING:
    import torch

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
    wait: float = 0.0  # seconds the host waited for the device to finish it, at its read
    #: Launched before the previous step was read (the engine's pipeline): what it took is counted
    #: from that read, so its own launch is not part of it.
    overlapped: bool = False

    def describe(self) -> str:
        own = 0.0 if self.overlapped else self.launch
        other = max(self.took - own - self.wait, 0.0)
        when = " before the previous step's read" if self.overlapped else ""
        return (f"{self.tokens} tokens ({self.decode_rows} decode rows, {self.tokens - self.decode_rows} prompt "
                f"tokens, {self.context_tokens} context tokens attended over) took {self.took * 1e3:.2f} ms against "
                f"a bound of {self.bound * 1e3:.2f} ms (predicted {self.predicted * 1e3:.2f} ms; the host launched "
                f"it in {self.launch * 1e3:.2f} ms{when}, waited {self.wait * 1e3:.2f} ms for the device at its read, "
                f"and spent {other * 1e3:.2f} ms on other work: publishing, admissions, the next step's scheduling "
                f"and launch)")


def overrun(plan: StepPlan, budget: StepBudget, took: float, launch: float, wait: float = 0.0,
            overlapped: bool = False) -> Overrun | None:
    """The step as an overrun when it has decode rows and took longer than the longest any of them
    was promised to wait (the stretch ceiling, or the target without a guard); else None (pure).
    ``launch`` and ``wait`` split what it took: the host launching it (unless ``overlapped``: it
    was launched before the previous step's read, where what it took starts), the host waiting for
    the device at its read; the rest is the engine thread's other work in between (a stall of the
    thread shows there, a slow device in the wait)."""
    bound = budget.decode_wait
    if bound is None or plan.num_decode == 0 or took <= bound:
        return None
    ends = [int(c.start + c.length) for c in plan.prefill]
    context = int(np.sum(plan.positions[:plan.num_decode] + 1)) + sum(ends)
    predicted = budget.model.seconds(plan.num_tokens) if budget.model is not None else 0.0
    return Overrun(plan.num_tokens, plan.num_decode, context, predicted, bound, took, launch, wait, overlapped)


def allocator_note(device: torch.device) -> Callable[[], str] | None:
    """For a CUDA device, what the log line adds about torch's caching allocator: an allocation
    it could not serve from its cache frees the whole cache (synchronising the device) and retries,
    a stall of the engine thread that no step-time model sees; None elsewhere."""
    if device.type != "cuda":
        return None
    import torch  # the engine core has it already; this module stays importable without it

    def note() -> str:
        stats, host = torch.cuda.memory_stats(device), torch.cuda.host_memory_stats()
        # Pinned host memory too: growing its pool is a slow driver call.
        return (f"torch's CUDA allocator since start: {stats.get('num_alloc_retries', 0)} retries after freeing "
                f"its cache, {stats.get('segment.all.allocated', 0)} device allocations, "
                f"{stats.get('segment.all.freed', 0)} frees; {host.get('num_host_alloc', 0)} pinned host "
                f"allocations, the longest {host.get('host_alloc_time.max', 0) / 1e3:.2f} ms")
    return note


class StepOverruns:
    """Counts overruns into the worker's metrics and logs the latest now and then (with ``note``'s
    line, when given: the allocator's counts, read only when a line is logged)."""

    def __init__(self, metrics: WorkerMetrics, every: float = LOG_EVERY_SECONDS,
                 note: Callable[[], str] | None = None) -> None:
        self.metrics = metrics
        self.every = every
        self.note = note
        self.unlogged = 0
        self._logged_at = float("-inf")

    def check(self, plan: StepPlan, budget: StepBudget, took: float, launch: float, now: float,
              wait: float = 0.0, overlapped: bool = False) -> None:
        """One finished step (``now``: time.perf_counter() when its tokens were read; ``wait``: how
        long reading them waited for the device; ``overlapped``: launched before the previous read)."""
        found = overrun(plan, budget, took, launch, wait, overlapped)
        if found is None:
            return
        self.metrics.step_overruns.inc()
        self.unlogged += 1
        if now - self._logged_at >= self.every:
            extra = f"; {self.note()}" if self.note is not None else ""
            log.warning("%d step(s) with decode rows ran past the step budget's bound since the last such line; "
                        "the latest: %s%s", self.unlogged, found.describe(), extra)
            self.unlogged, self._logged_at = 0, now
