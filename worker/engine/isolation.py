"""Step isolation: a step that raised fails only the requests that make it fail.

A step that raises at launch is re-run in halves, bisecting down to the sequences that fail on
their own, so a poison request fails alone and its batch-mates go on (``isolate``); the culprits,
or a step that raised once its successor was already launched, end with StepFailed
(``fail_step``). A broken device is not isolated: it stops the engine, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from graphkeeper.worker.engine.errors import StepFailed, device_broken
from graphkeeper.worker.engine.outputs import OutputProcessor, Update
from graphkeeper.worker.engine.scheduler import ScheduledStep, Scheduler, sub_step
from graphkeeper.worker.engine.sequence import Sequence

log = logging.getLogger(__name__)


def isolate(step: ScheduledStep, err: Exception, scheduler: Scheduler,
            run_alone: Callable[[ScheduledStep], None]) -> list[Sequence]:
    """The sequences of ``step`` (which raised ``err`` at launch) that fail on their own.

    Each sub-step is the failed step's own rows for its sequences (``sub_step``), which
    ``run_alone`` runs and reads at once (publishing its tokens); a sequence in no failing half is
    unaffected. At most ``2 x sequences`` sub-steps run; whatever is still suspect after that fails
    with the step. A broken device raises.
    """
    if device_broken(err):
        raise err
    scheduler.launch_failed(step)
    log.error("step of %d tokens (%d sequences) failed: %s: %s; isolating it", step.plan.num_tokens,
              len(step.sequences), type(err).__name__, err)
    suspects, culprits = [list(step.sequences)], []
    budget = 2 * len(step.sequences)
    while suspects:
        group = suspects.pop()
        if len(group) == 1 or budget <= 0:
            culprits += group
            continue
        half = len(group) // 2
        for part in (group[:half], group[half:]):
            budget -= 1
            try:
                run_alone(sub_step(step, set(part)))
            except Exception as sub_err:  # noqa: BLE001 - this half holds a culprit
                if device_broken(sub_err):
                    raise sub_err from err
                suspects.append(part)
    return culprits


def fail_step(outputs: OutputProcessor, sequences: list[Sequence], err: Exception) -> list[Update]:
    """The updates that end these requests of a step that raised; a broken device raises."""
    if device_broken(err):
        raise err
    if sequences:
        log.error("failing %d request(s) of a step that raised %s: %s", len(sequences), type(err).__name__, err)
    failure = StepFailed(f"the step running this request failed: {type(err).__name__}")
    return outputs.end(sequences, failure, outcome="error")
