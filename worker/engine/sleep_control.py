"""Sleep and wake, the control side: which orders are taken, and when the engine carries them out.

GraphControl's Sleep and Wake arrive on any thread and become orders here, under one lock, as a
policy or a reload is offered to ``Control``: a Sleep is judged at once (``rule_sleep``) and, when
taken, waits as the one pending sleep with the futures of every caller that asked for it; a Wake
is judged (``rule_wake``) and waits for the engine thread. The engine thread calls
``between_steps`` first thing in every pass between two steps:

- a pending sleep pauses admission (running sequences finish on the model they started with; new
  ones wait) and is carried out by ``sleep_model`` once no step is in flight, no sequence that
  started runs, no capture phase or reload is under way, and the lifecycle is READY; then
  SLEEPING;
- asleep, the engine wakes (``wake_model``, then READY) as soon as anything needs the device: a
  Wake, a request (queued, never refused: it is served once the worker is awake), a command (a
  policy to adopt) or a model reload. Otherwise the pass ends there: nothing else runs on a
  sleeping device (no capture, no idle release). A draining worker is not woken: its requests
  end as the drain ends them.

The device-memory side (what is released and restored) is ``engine/sleep.py``'s; the decisions
here are pure functions, and the figures reach ``GraphStatus.sleep`` and the metrics.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import lifecycle_name
from graphkeeper.proto.field_checks import FieldError
from graphkeeper.proto.policy import sleep_level
from graphkeeper.worker.engine.control import Control
from graphkeeper.worker.engine.errors import SleepRefused, SleepWithdrawn, device_broken
from graphkeeper.worker.engine.sleep import LEVELS, sleep_model, sleep_refusal, wake_model
from graphkeeper.worker.engine.sleep_policy import idle_start, sleep_due
from graphkeeper.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from graphkeeper.worker.engine.core import Engine
    from graphkeeper.worker.engine.outputs import InFlight

log = logging.getLogger(__name__)
S = pb.LifecycleState
#: States in which a Sleep may be ordered (it is carried out once the worker is READY).
SLEEPABLE_STATES = frozenset({S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_RECAPTURING})


class Ruling(enum.Enum):
    """What becomes of a Sleep or a Wake."""

    INVALID = "invalid"  # a bad level: INVALID_ARGUMENT naming level
    REFUSED = "refused"  # FAILED_PRECONDITION with the reason
    ALREADY = "already"  # asleep at that level already: OK, nothing done
    JOIN = "join"  # the same sleep is pending: wait for it
    ORDER = "order"  # a new sleep (or wake) for the engine thread
    WITHDRAW = "withdraw"  # a Wake while a sleep is pending and the worker awake: the sleep is dropped
    NOTHING = "nothing"  # a Wake on a worker that is awake: OK, nothing done


def rule_sleep(level: int, refusal: str | None, state: int, asleep: int, pending: int) -> tuple[Ruling, str]:
    """A Sleep at ``level`` on a worker in lifecycle ``state``, asleep at ``asleep`` (0: awake)
    with a sleep at ``pending`` waiting (0: none); ``refusal`` is ``sleep_refusal``'s (pure)."""
    if level not in LEVELS:
        return Ruling.INVALID, f"must be 1 or 2, not {level}"
    if refusal:
        return Ruling.REFUSED, refusal
    if asleep:
        if asleep == level:
            return Ruling.ALREADY, ""
        return Ruling.REFUSED, f"the worker sleeps at level {asleep}: Wake it before a level {level} sleep"
    if state not in SLEEPABLE_STATES:
        return Ruling.REFUSED, f"the worker is {lifecycle_name(state)}: it sleeps only while it serves"
    if pending:
        if pending == level:
            return Ruling.JOIN, ""
        return Ruling.REFUSED, f"a level {pending} sleep is already waiting for running sequences to finish"
    return Ruling.ORDER, ""


def rule_wake(asleep: int, pending: int) -> Ruling:
    """A Wake on a worker asleep at ``asleep`` (0: awake) with a sleep at ``pending`` waiting (pure)."""
    if asleep:
        return Ruling.ORDER
    return Ruling.WITHDRAW if pending else Ruling.NOTHING


def wake_cause(ordered: bool, requests: bool, other_work: bool) -> str | None:
    """Why a sleeping engine wakes now (a ``graphkeeper_wakes_total`` cause), or None: it sleeps on (pure)."""
    if ordered:
        return "wake"
    if requests:
        return "request"
    return "control" if other_work else None


def settled(future: Future, value: Any) -> Future:
    future.set_result(value)
    return future


class SleepControl:
    """Sleep and Wake orders (any thread) and their execution (the engine thread)."""

    def __init__(self, device_type: str, sleep_mode: bool, control: Control, metrics: WorkerMetrics,
                 wake_loop: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self.device_type = device_type
        self.sleep_mode = sleep_mode
        self.control = control
        self.metrics = metrics
        self.wake_loop = wake_loop  # the engine loop's wake-up: an order is looked at in the next pass
        #: Why a Sleep is refused on this worker whatever its level (empty: it may sleep).
        self.unavailable = sleep_refusal(device_type, sleep_mode, LEVELS[0]) or ""
        self.level = 0
        self.pending = 0
        self._sleepers: list[Future] = []
        self._wakers: list[Future] = []
        self._since = 0.0
        self._fell_asleep_at = 0.0  # monotonic
        self._released = 0
        self._sleeps = 0
        self._wakes = 0
        self._last_wake_seconds = 0.0
        self._idle_since: float | None = None  # monotonic; when the current idle spell began (policy idle sleep)
        self._idle_refusal = ""  # the last reason an idle sleep was refused (logged once per reason)

    # --- any thread -----------------------------------------------------------------------

    def sleep(self, level: int) -> Future:
        """Raises FieldError (level) or SleepRefused; the future resolves to a ``SleepResponse``."""
        future: Future = Future()
        with self._lock:
            ruling, why = rule_sleep(level, sleep_refusal(self.device_type, self.sleep_mode, level),
                                     self.control.lifecycle.state, self.level, self.pending)
            if ruling is Ruling.INVALID:
                raise FieldError("level", why)
            if ruling is Ruling.REFUSED:
                raise SleepRefused(why)
            if ruling is Ruling.ALREADY:
                return settled(future, pb.SleepResponse(level=level, already_asleep=True))
            self.pending = level
            self._sleepers.append(future)
        self.wake_loop()
        return future

    def wake(self) -> Future:
        """The future resolves to a ``WakeResponse``; at once when the worker is awake."""
        future: Future = Future()
        with self._lock:
            ruling = rule_wake(self.level, self.pending)
            if ruling is Ruling.ORDER:
                self._wakers.append(future)
            elif ruling is Ruling.WITHDRAW:
                withdrawn, self._sleepers, self.pending = self._sleepers, [], 0
        if ruling is Ruling.NOTHING:
            return settled(future, pb.WakeResponse(was_asleep=False))
        if ruling is Ruling.WITHDRAW:
            log.info("a Wake withdrew the sleep that was waiting for running sequences")
            for sleeper in withdrawn:
                sleeper.set_exception(SleepWithdrawn("a Wake came before the sleep began: the worker stays awake"))
            return settled(future, pb.WakeResponse(was_asleep=False, withdrew_sleep=True))
        self.wake_loop()
        return future

    def status(self) -> pb.SleepStatus:
        with self._lock:
            return pb.SleepStatus(level=self.level, pending_level=self.pending, since_unix_seconds=self._since,
                                  released_bytes=self._released, sleeps=self._sleeps, wakes=self._wakes,
                                  last_wake_seconds=self._last_wake_seconds, unavailable_reason=self.unavailable)

    # --- the engine thread ----------------------------------------------------------------

    def between_steps(self, engine: Engine, inflight: InFlight | None) -> bool:
        """Carries out what is due; True when the engine sleeps and the pass has nothing more to do."""
        if not (self.level or self.pending):  # every step passes here: no lock while nothing is ordered
            self._idle_sleep(engine, inflight)
            if not self.pending:
                return False
        with self._lock:
            asleep, pending, ordered = self.level, self.pending, bool(self._wakers)
        draining = engine.lifecycle.state == S.LIFECYCLE_STATE_DRAINING
        if asleep:
            requests = bool(len(engine.mailbox) or engine.scheduler.waiting)
            cause = wake_cause(ordered, requests, engine.mailbox.has_commands() or engine.control.reload is not None)
            if draining or cause is None:
                return True
            self._wake_up(engine, cause)
            return False
        if not pending:
            return False
        if draining:
            self._fail_sleepers(SleepRefused("the worker began draining before the sleep"))
            return False
        engine.scheduler.admitting = False  # running sequences finish; new ones wait, and then wake it
        if inflight is None and self._quiet(engine):
            self._fall_asleep(engine, pending)
            return True
        return False

    def _idle_sleep(self, engine: Engine, inflight: InFlight | None) -> None:
        """Orders the adopted policy's idle sleep once the worker has been idle long enough
        (``sleep_policy``); a worker that cannot sleep says why once, in its log and in
        ``GraphStatus.sleep.unavailable_reason``."""
        policy = engine.control.policy
        after = policy.sleep_after_idle_seconds
        if after <= 0:
            self._idle_since = None
            return
        now = time.monotonic()
        requests = len(engine.scheduler.running) + len(engine.scheduler.waiting) + len(engine.mailbox)
        self._idle_since = idle_start(self._idle_since, requests + (inflight is not None), now)
        if not sleep_due(after, self._idle_since, now, asleep=False, requests=requests):
            return
        self._idle_since = None  # the next idle spell starts over, whatever this sleep becomes
        try:
            self.sleep(sleep_level(policy))
        except (SleepRefused, FieldError) as err:
            if str(err) != self._idle_refusal:
                self._idle_refusal = str(err)
                log.warning("policy %s: sleepAfterIdleSeconds %d s cannot put this worker to sleep: %s",
                            policy.policy_name or "(default)", after, err)
            return
        log.info("idle for %d s: sleeping at level %d (policy %s)", after, sleep_level(policy), policy.policy_name)

    @staticmethod
    def _quiet(engine: Engine) -> bool:
        """Nothing that uses the device is under way: no sequence that started, no capture, no reload."""
        return (engine.scheduler.drained and not engine.capture.active and engine.control.reload is None
                and engine.lifecycle.state == S.LIFECYCLE_STATE_READY)

    def _fall_asleep(self, engine: Engine, level: int) -> None:
        try:
            outcome = sleep_model(engine.slot, level)
        except Exception as err:  # noqa: BLE001 - the caller reads why; the worker stays awake and serves
            log.error("sleep at level %d failed: %s", level, err)
            engine.scheduler.admitting = True
            self._fail_sleepers(err)
            if device_broken(err):
                raise  # the device is unusable: the engine stops, as after a failed step
            return
        # What the KV cache held is gone: no cached prefix may be found in it after the wake.
        engine.blocks.reset_prefix_cache(engine.slot.loaded.revision)
        with self._lock:
            self.level, self.pending = level, 0
            self._since, self._fell_asleep_at = time.time(), time.monotonic()
            self._released = outcome.released_bytes
            self._sleeps += 1
            sleepers, self._sleepers = self._sleepers, []
            self.control.move(S.LIFECYCLE_STATE_SLEEPING)  # under the lock: status sees state and level together
        self.metrics.sleeping.set(level)
        self.metrics.sleeps.labels(str(level)).inc()
        log.info("SLEEPING at level %d: %d bytes of device memory released in %.2f s", level,
                 outcome.released_bytes, outcome.seconds)
        response = pb.SleepResponse(level=level, released_bytes=outcome.released_bytes, seconds=outcome.seconds,
                                    context_offloaded=outcome.context_offloaded, context_note=outcome.context_note)
        for sleeper in sleepers:
            sleeper.set_result(response)

    def _wake_up(self, engine: Engine, cause: str) -> None:
        """A wake that fails leaves a worker without its model: the error stops the engine (health
        NOT_SERVING, the worker exits and is restarted), after every waiting Wake is told why."""
        try:
            outcome = wake_model(engine.slot)
        except BaseException as err:
            with self._lock:
                wakers, self._wakers = self._wakers, []
            for waker in wakers:
                waker.set_exception(err)
            raise
        engine.recorder.slept(time.monotonic() - self._fell_asleep_at)  # time asleep is not idle time
        with self._lock:
            level, self.level, self._since = self.level, 0, 0.0
            self._wakes += 1
            self._last_wake_seconds = outcome.seconds
            wakers, self._wakers = self._wakers, []
            self.control.move(S.LIFECYCLE_STATE_READY)
        engine.scheduler.admitting = True
        self.metrics.sleeping.set(0)
        self.metrics.wakes.labels(cause).inc()
        self.metrics.wake_duration.set(outcome.seconds)
        log.info("READY: woke from level %d (%s) in %.2f s, %d bytes restored", level, cause, outcome.seconds,
                 outcome.restored_bytes)
        response = pb.WakeResponse(level=level, restored_bytes=outcome.restored_bytes, seconds=outcome.seconds,
                                   was_asleep=True)
        for waker in wakers:
            waker.set_result(response)

    def _fail_sleepers(self, err: BaseException) -> None:
        with self._lock:
            sleepers, self._sleepers, self.pending = self._sleepers, [], 0
        for sleeper in sleepers:
            sleeper.set_exception(err)
