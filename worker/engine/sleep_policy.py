"""When the adopted policy's ``sleep_after_idle_seconds`` puts this worker to sleep (pure).

Idle means no request running and none queued. The idle spell starts at the first look that
finds the worker idle (``idle_start``) and ends at the next request; waking (by a request or a
``Wake`` call) starts the clock over, so the caller sets ``idle_since`` to the wake time. Times
are ``time.monotonic()`` seconds. Whether the worker *can* sleep (a GPU device, started with
``--enable-sleep-mode``) is not decided here: that is the Sleep call's own check, whose refusal
the worker records as the reason it did not sleep.
"""

from __future__ import annotations


def idle_start(idle_since: float | None, requests: int, now: float) -> float | None:
    """When the current idle spell began: None while ``requests`` (running or queued) are in the
    worker, ``now`` at the first idle look, and the earlier start after that."""
    if requests > 0:
        return None
    return now if idle_since is None else idle_since


def sleep_due(sleep_after_seconds: int, idle_since: float | None, now: float, *,
              asleep: bool, requests: int) -> bool:
    """Whether the worker should go to sleep at ``now``.

    ``sleep_after_seconds`` is the adopted policy's (0: never); ``idle_since`` when the worker
    last became idle (None: it is not idle); ``requests`` running or queued right now (a request
    that arrived since ``idle_since`` was taken keeps it awake); ``asleep``: already sleeping.
    """
    if sleep_after_seconds <= 0 or asleep or requests > 0 or idle_since is None:
        return False
    return now - idle_since >= sleep_after_seconds


def seconds_until_sleep(sleep_after_seconds: int, idle_since: float | None, now: float) -> float | None:
    """How long the engine may wait before ``sleep_due`` can turn true (0 when it is due now);
    None when it never will without a change (sleep off, or not idle): the wait needs no bound."""
    if sleep_after_seconds <= 0 or idle_since is None:
        return None
    return max(0.0, idle_since + sleep_after_seconds - now)
