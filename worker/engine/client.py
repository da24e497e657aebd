"""The engine as the API process sees it when the engine core runs in a process of its own.

``EngineClient`` has the public surface the servers use (``submit``, ``cancel``,
``apply_policy``, ``load_revision``, ``sleep_control``, ``status``, ``model_info``, ``limits``,
``tokenizer``, ``metrics``, ``lifecycle``, ``alive``, ``captures_graphs``, ``failed``, ``publish``,
``start``, ``drain_and_stop``), so the gRPC layer serves either. Tokenization, detokenization, validation
and streaming stay in this process; the device, the scheduler and the graphs live in the child
(``engine.process``), so no amount of CPU work here can hold the interpreter lock the step loop
needs.

What is asked often is kept here, pushed by the engine core when it changes: the lifecycle state
(health and readiness read it), the served model's limits and info, and the tokenizer (loaded in
this process from the model's directory). What must be exact is asked: ``status``,
``apply_policy``, ``load_revision``, Sleep and Wake and the metrics are calls over the channel,
answered by the child's receiver thread in well under a millisecond of its time (a reload's, a
sleep's or a wake's outcome follows as a second reply when it is done).

Either process dying ends the worker: the child dies with its parent (``PR_SET_PDEATHSIG`` and
the channel's EOF), and when the child dies this side marks the engine failed, which
``worker.main`` turns into exit 1, exactly as a dead device in one process.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.enums import lifecycle_name
from graphkeeper.worker.engine.errors import NotServing
from graphkeeper.worker.engine.ipc import (
    Call,
    Cancel,
    Channel,
    ErrorBox,
    Model,
    Outputs,
    Reply,
    Sized,
    Started,
    State,
    StepBudgetUpdate,
    Submit,
)
from graphkeeper.worker.engine.lifecycle import SERVING_STATES
from graphkeeper.worker.engine.outputs import direct_publish
from graphkeeper.worker.engine.sequence import Limits
from graphkeeper.worker.engine.sizing import SizingError
from graphkeeper.worker.engine.spawn import SpawnedCore, compiles, spawn_core
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.model.tokenizer import Tokenizer, load_tokenizer
from graphkeeper.worker.settings import EngineSettings

log = logging.getLogger(__name__)
S = pb.LifecycleState
#: A control call (status, a policy) is answered in milliseconds; this bounds a wedged child.
CALL_TIMEOUT_SECONDS = 10.0
#: A scrape waits this long for the engine core's metrics before answering with this side's alone.
METRICS_TIMEOUT_SECONDS = 5.0
#: Time the child gets to exit after its channel closed before it is killed.
EXIT_GRACE_SECONDS = 10.0
#: Families whose samples add up across the two processes; for the others the engine core's wins.
ADDITIVE_TYPES = frozenset({"counter", "histogram", "summary"})


class LifecycleMirror:
    """The engine core's lifecycle state as last reported, with the same listener interface."""

    def __init__(self) -> None:
        self.state = S.LIFECYCLE_STATE_LOADING
        self._listeners: list[Callable[[int], None]] = []

    def subscribe(self, listener: Callable[[int], None]) -> None:
        self._listeners.append(listener)
        listener(self.state)

    def set(self, state: int) -> None:
        self.state = state
        for listener in self._listeners:
            listener(state)

    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES


def merge_families(core: list, api: list) -> list:
    """One exposition from both processes' metric families (pure).

    A family only one side has passes as it is. For one both have (``WorkerMetrics`` registers
    every family in both, and the API process counts refusals in ``requests_total``), counters and
    histograms add sample by sample; gauges and infos are the engine core's, which alone sets them,
    except a family the engine core has no sample of (the startup stages, which only the API process
    can finish): this process's.
    """
    api_by_name = {f.name: f for f in api}
    merged = []
    for family in core:
        other = api_by_name.pop(family.name, None)
        if other is not None and not family.samples:  # set by the API process alone (the startup stages)
            merged.append(other)
            continue
        if other is None or family.type not in ADDITIVE_TYPES:
            merged.append(family)
            continue
        totals: dict[tuple, float] = {}
        order: list = []
        for sample in (*family.samples, *other.samples):
            key = (sample.name, tuple(sorted(sample.labels.items())))
            if key not in totals:
                order.append(sample)
                totals[key] = 0.0
            totals[key] += sample.value
        combined = copy.copy(family)
        combined.samples = [s._replace(value=totals[(s.name, tuple(sorted(s.labels.items())))]) for s in order]
        merged.append(combined)
    merged.extend(api_by_name.values())
    return merged


class MergedRegistry:
    """What ``/metrics`` exports: the engine core's registry merged with this process's."""

    def __init__(self, local: Any, client: EngineClient) -> None:
        self.local = local
        self.client = client

    def collect(self) -> list:
        try:
            core = self.client.call("metrics", timeout=METRICS_TIMEOUT_SECONDS)
        except Exception as err:  # noqa: BLE001 - a dead or wedged core: this side's series still export
            log.debug("engine core metrics unavailable: %s", err)
            core = []
        return merge_families(core, list(self.local.collect()))


class RemoteSleep:
    """Sleep and Wake carried to the engine core's ``SleepControl`` (``face.SleepOrders``)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def sleep(self, level: int) -> Future:
        return self.client.deferred_call("sleep", (level,))

    def wake(self) -> Future:
        return self.client.deferred_call("wake")


class EngineClient:
    """The API process's handle on the engine-core process."""

    def __init__(self, settings: EngineSettings, metrics: WorkerMetrics | None = None,
                 log_level: str = "INFO") -> None:
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        self.metrics.registry = MergedRegistry(self.metrics.registry, self)
        self.lifecycle = LifecycleMirror()
        self.captures_graphs = settings.device.split(":")[0] == "cuda"
        self.publish: Callable[[list[tuple[Any, list[int], Any]]], None] = direct_publish
        self.failed: BaseException | None = None
        self.sleep_control = RemoteSleep(self)
        #: The start's stages as the engine core reported them at READY (empty before), finished
        #: here with the last stage by ``startup.ReadyReport``.
        self.startup = pb.StartupStatus()
        self.log_level = log_level
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._channel: Channel | None = None
        self._streams: dict[int, Any] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._limits: Limits | None = None
        self._info: pb.GetModelInfoResponse | None = None
        self._tokenizer: Tokenizer | None = None
        self._draining = False
        self._closing = False
        self._sized = threading.Event()
        self._refused = ""
        self._receiver = threading.Thread(target=self._receive_loop, name="engine-receiver", daemon=True)

    # --- start and stop -----------------------------------------------------------------------

    def start(self, spawned: SpawnedCore | None = None) -> None:
        """Hands the engine core its settings: ``spawned``, started while the worker checked its
        flags (``spawn``), or one spawned now (call from the main thread: the child dies
        with this thread)."""
        s = self.settings
        spawned = spawned or spawn_core(self.log_level, compiles(s.optimization_level, s.compile, s.device))
        self.settings = dataclasses.replace(self.settings, engine_spawned_at=spawned.spawned_at)
        self.proc = spawned.proc
        spawned.send_settings(self.settings)
        self._channel = Channel(spawned.conn)
        self._receiver.start()
        log.info("engine core started in process %d", self.proc.pid)

    def wait_sized(self, timeout: float = 600.0) -> None:
        """Waits for the engine core's first message; afterwards ``settings`` holds the decided
        context length and sequence count. Raises SizingError (one line) when the engine core
        refused to start or exited first."""
        if not self._sized.wait(timeout):
            raise SizingError(f"the engine core did not start within {timeout:.0f} s")
        if self._refused:
            raise SizingError(self._refused)
        if self.failed is not None:
            raise SizingError(f"{self.failed} before it started; its log is above")

    def drain_and_stop(self, timeout: float) -> None:
        """The engine core drains (as ``Engine.drain_and_stop``), then the child exits."""
        self._draining = True
        try:
            self.call("drain_and_stop", (timeout,), timeout=timeout + 15)
        except Exception as err:  # noqa: BLE001 - a dead child has nothing left to drain
            log.warning("engine core drain: %s", err)
        self.close()

    def close(self) -> None:
        """Closes the channel and reaps the child (killed if it does not exit in time)."""
        self._closing = True
        if self._channel is not None:
            self._channel.close()
        if self.proc is not None and self.proc.pid is not None:
            self.proc.join(EXIT_GRACE_SECONDS)
            if self.proc.is_alive():
                log.error("engine core did not exit: killing it")
                self.proc.kill()
                self.proc.join(EXIT_GRACE_SECONDS)

    # --- the servers' surface -----------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    def limits(self) -> Limits | None:
        return self._limits

    def model_info(self) -> pb.GetModelInfoResponse | None:
        return self._info

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive() and self.failed is None

    def submit(self, req: pb.GenerateRequest, stream: Any) -> int:
        """Queues an admitted request; returns its stream id (the handle ``cancel`` takes).

        Raises NotServing at once where this side knows it; a full queue is known only to the
        engine core, which ends the stream with QueueFull.
        """
        if self._draining or self.failed is not None or not self.lifecycle.serving or self._limits is None:
            raise NotServing(f"worker is {lifecycle_name(self.lifecycle.state)}")
        sid = next(self._ids)
        self._streams[sid] = stream
        self._send(Submit(sid, req.SerializeToString()))
        return sid

    def cancel(self, sid: int, reason: int = pb.FINISH_REASON_CANCELLED, outcome: str | None = None) -> None:
        self._send(Cancel(sid, reason, outcome))

    def apply_policy(self, policy: pb.GraphPolicy) -> pb.ApplyGraphPolicyResponse:
        return self.call("apply_policy", (policy,))

    def load_revision(self, source: str, revision: str) -> Future:
        """Raises ReloadRefused at once; the future resolves when the new model serves."""
        return self.deferred_call("load_revision", (source, revision))

    def deferred_call(self, method: str, args: tuple = ()) -> Future:
        """A call the engine core answers twice: at once (accepted, or the refusal raised here) and
        with its outcome, which resolves the future returned."""
        reply_id = next(self._ids)
        future: Future = Future()
        self._calls[reply_id] = future
        try:
            self.call(method, (*args, reply_id))
        except BaseException:
            self._calls.pop(reply_id, None)
            raise
        return future

    def status(self) -> pb.GraphStatus:
        status = self.call("status")
        if self.startup.stages:  # with the stage only this process sees
            status.startup.CopyFrom(self.startup)
        return status

    def pending_streams(self) -> int:
        """Streams submitted to the engine core and not ended yet (the watchdog's work)."""
        return len(self._streams)

    # --- the channel --------------------------------------------------------------------------

    def call(self, method: str, args: tuple = (), timeout: float = CALL_TIMEOUT_SECONDS) -> Any:
        """``engine.<method>(*args)`` in the engine core; its exception is raised here."""
        call_id = next(self._ids)
        future: Future = Future()
        self._calls[call_id] = future
        try:
            self._send(Call(call_id, method, args))
            return future.result(timeout)
        except FutureTimeout:
            raise NotServing(f"the engine core did not answer {method} within {timeout:.0f} s") from None
        finally:
            self._calls.pop(call_id, None)

    def _send(self, message: Any) -> None:
        if self._channel is None:
            raise NotServing("the engine core has not started")
        try:
            self._channel.send([message])
        except (OSError, EOFError, ValueError):
            raise NotServing("the engine core has stopped") from None

    def _receive_loop(self) -> None:
        """Receiver thread: applies what the engine core sends, in order, until the channel ends."""
        while True:
            try:
                messages = self._channel.recv()
            except (EOFError, OSError, ValueError):
                break
            for message in messages:
                self._apply(message)
        self._child_gone()

    def _apply(self, message: Any) -> None:
        if isinstance(message, Sized):
            if message.settings is None:
                self._refused = message.refused
            else:
                self.settings = message.settings
            self._sized.set()
        elif isinstance(message, Outputs):
            self._publish(message.updates)
        elif isinstance(message, Reply):
            future = self._calls.pop(message.call_id, None)
            if future is not None:
                if message.error is not None:
                    future.set_exception(message.error.rebuild())
                else:
                    future.set_result(message.value)
        elif isinstance(message, State):
            newly_failed = bool(message.failed) and self.failed is None
            if newly_failed:
                self.failed = RuntimeError(message.failed)  # before the move: health reads both
            if newly_failed or message.state != self.lifecycle.state:
                self.lifecycle.set(message.state)
        elif isinstance(message, Model):
            self._install(message)
        elif isinstance(message, Started):
            self.startup = pb.StartupStatus.FromString(message.startup)
        elif isinstance(message, StepBudgetUpdate) and self._info is not None:
            self._info.step_budget.ParseFromString(message.budget)

    def _install(self, model: Model) -> None:
        tokenizer = load_tokenizer(model.source)
        self._tokenizer = tokenizer
        info = pb.GetModelInfoResponse.FromString(model.info) if model.info else None
        if info is not None:  # text is served here, with this process's tokenizer
            info.tokenizer = tokenizer is not None
            info.chat_template = tokenizer is not None and tokenizer.has_chat_template
        self._info = info
        self._limits = dataclasses.replace(model.limits, text_prompts=tokenizer is not None,
                                           chat=tokenizer is not None and tokenizer.has_chat_template)

    def _publish(self, updates: list[tuple[int, list[int], Any]]) -> None:
        out = []
        for sid, tokens, end in updates:
            stream = self._streams.get(sid)
            if end is not None:
                self._streams.pop(sid, None)
                if isinstance(end, ErrorBox):
                    end = end.rebuild()
            if stream is not None:
                out.append((stream, tokens, end))
        self.publish(out)

    def _child_gone(self) -> None:
        """The channel ended: on purpose (close), or the engine core died, which fails the worker."""
        if not self._closing and self.failed is None and not self._refused:
            code = None
            if self.proc is not None:
                self.proc.join(1)
                code = self.proc.exitcode
            self.failed = RuntimeError(f"the engine core process exited (exit code {code})")
            log.error("%s", self.failed)
            self.lifecycle.set(S.LIFECYCLE_STATE_DRAINING)
        self._sized.set()  # a child gone before it sized itself: wait_sized reports it
        why = NotServing("the engine core has stopped")
        leftover, self._streams = self._streams, {}
        self.publish([(stream, [], why) for stream in leftover.values()])
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(why)
