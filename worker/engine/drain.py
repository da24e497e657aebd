"""The start of a drain: requests that never started are refused at once, so their clients retry
on another replica now rather than wait out the whole drain to be refused at its end.

A request "never started" when it is still waiting for its first admission (submitted, or queued
and never run); one that ran and was preempted back into the queue has tokens its client already
holds, so it stays and finishes within the drain like a running one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphkeeper.worker.engine.errors import NotServing

if TYPE_CHECKING:
    from graphkeeper.worker.engine.core import Engine

REFUSAL = "the worker is draining (shutting down): retry on another replica"


def refuse_unstarted(engine: Engine) -> None:
    """Engine thread (a mailbox command): ends every never-started request with UNAVAILABLE."""
    unstarted = [seq for seq in engine.scheduler.waiting if not seq.preemptions and not seq.output]
    unstarted += engine.mailbox.take()
    if unstarted:
        engine.publish(engine.outputs.end(unstarted, NotServing(REFUSAL), "unavailable"))
