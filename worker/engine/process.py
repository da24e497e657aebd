"""The engine-core process: the ``Engine`` (device, scheduler, graphs), driven over the channel.

Started by ``EngineClient`` with the ``spawn`` method (a fresh interpreter: CUDA is never
initialised in a forked child). Three threads: the engine's own loop, this module's receiver
(submits, cancels, control calls from the API process) and a sender that ships what the engine
published, so the engine thread never waits on a pipe write. Steps the engine makes while the
sender is still writing the previous batch go out together in the next one.

The process lives exactly as long as its parent: the kernel kills it when the parent dies
(``PR_SET_PDEATHSIG``), and the receiver ends it at once when the channel closes (the parent's
end of the socket is closed by the kernel whatever way the parent ends). SIGINT and SIGTERM are
ignored here: the API process owns shutdown and drains the engine through the channel.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.core import Engine
from graphkeeper.worker.engine.cpu_quota import size_torch_threads
from graphkeeper.worker.engine.errors import classify
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
from graphkeeper.worker.engine.sequence import Sequence
from graphkeeper.worker.engine.sizing import SizingError
from graphkeeper.worker.engine.spawn import die_with_parent
from graphkeeper.worker.log_limits import limit_logging
from graphkeeper.worker.model.loader import ModelSourceError
from graphkeeper.worker.settings import EngineSettings

log = logging.getLogger(__name__)
#: How often the sender looks for a newly installed model when no step publishes anything.
IDLE_POLL_SECONDS = 0.05
#: Control calls answered in a thread of their own, so the receiver keeps taking cancels meanwhile.
SLOW_CALLS = frozenset({"drain_and_stop"})
#: Control calls the API process may make, and nothing else.
CALLS = frozenset({"apply_policy", "status", "load_revision", "sleep", "wake", "metrics", "drain_and_stop"})


class Outbox:
    """Messages for the API process, appended from any thread and sent by one sender thread."""

    def __init__(self) -> None:
        self.pending: list = []
        self.cond = threading.Condition()

    def put(self, message: Any) -> None:
        with self.cond:
            self.pending.append(message)
            self.cond.notify()

    def take(self, timeout: float) -> list:
        with self.cond:
            if not self.pending:
                self.cond.wait(timeout)
            taken, self.pending = self.pending, []
        return taken


class EngineHost:
    """The engine and its side of the channel."""

    def __init__(self, engine: Engine, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self.outbox = Outbox()
        self.sequences: dict[int, Sequence] = {}
        self._model: Any = None
        self._startup_sent = False
        self._budget: Any = None
        self._closed = threading.Event()
        engine.publish = self.publish
        engine.lifecycle.subscribe(self._on_state)

    # --- engine -> API process -------------------------------------------------------------

    def publish(self, updates: list[tuple[Any, list[int], Any]]) -> None:
        """Engine thread: one step's updates, queued as one message; streams are sids here."""
        out = []
        for sid, tokens, end in updates:
            if end is not None:
                self.sequences.pop(sid, None)
                if isinstance(end, BaseException):
                    end = ErrorBox.of(end)
            out.append((sid, tokens, end))
        if out:
            self.outbox.put(Outputs(out))

    def _on_state(self, state: int) -> None:
        """Any thread: a lifecycle move. The model is announced first, so requests admitted once
        the API process sees READY are checked against the model that serves them."""
        self._announce_model()
        if state == pb.LIFECYCLE_STATE_READY and not self._startup_sent and self.engine.startup.stages:
            self._startup_sent = True  # a recapture's READY is not a start
            self.outbox.put(Started(self.engine.startup.SerializeToString()))
        failed = self.engine.failed
        self.outbox.put(State(state, "" if failed is None else f"{type(failed).__name__}: {failed}"))

    def _announce_model(self) -> None:
        loaded = self.engine.slot.loaded
        if loaded is not None and loaded is not self._model:
            self._model = loaded
            info = self.engine.model_info()
            self.outbox.put(Model(loaded.source, self.engine.limits(), info.SerializeToString() if info else b""))
        budget = self.engine.scheduler.step_budget
        if budget is not self._budget:  # a capture phase ended: before READY, GetModelInfo has it
            self._budget = budget
            self.outbox.put(StepBudgetUpdate(budget.to_proto().SerializeToString()))

    def send_loop(self) -> None:
        """Sender thread: ships whatever accumulated, one send per batch, until the channel closes."""
        while not self._closed.is_set():
            batch = self.outbox.take(IDLE_POLL_SECONDS)
            self._announce_model()  # a reload installs a model without a lifecycle move on the CPU
            batch += self.outbox.take(0) if self.outbox.pending else []
            if not batch:
                continue
            try:
                self.channel.send(batch)
            except (OSError, EOFError):
                return

    def flush(self, timeout: float = 5.0) -> None:
        """Waits (bounded) until the sender has shipped everything queued so far."""
        deadline = time.monotonic() + timeout
        while self.outbox.pending and time.monotonic() < deadline:
            time.sleep(0.005)

    # --- API process -> engine -------------------------------------------------------------

    def receive_loop(self) -> None:
        """Receiver thread (the process's main thread): returns when the API process closes the
        channel or goes away."""
        while True:
            try:
                messages = self.channel.recv()
            except (EOFError, OSError):
                return
            for message in messages:
                self._handle(message)

    def _handle(self, message: Any) -> None:
        if isinstance(message, Submit):
            self._submit(message)
        elif isinstance(message, Cancel):
            seq = self.sequences.get(message.sid)
            if seq is not None:
                self.engine.cancel(seq, message.reason, message.outcome)
        elif isinstance(message, Call):
            if message.method in SLOW_CALLS:
                threading.Thread(target=self._answer, args=(message,), name=message.method, daemon=True).start()
            else:
                self._answer(message)

    def _submit(self, message: Submit) -> None:
        """A refusal (full queue, a request the cache cannot fit, not serving) ends the stream with
        its error, counted here by the errors table as the API layer counts a refusal it sees at once."""
        req = pb.GenerateRequest.FromString(message.request)
        try:
            seq = self.engine.submit(req, message.sid)
        except Exception as err:  # noqa: BLE001 - QueueFull, CannotFit or NotServing, reported on the stream
            self.engine.metrics.requests.labels(classify(err).outcome).inc()
            self.outbox.put(Outputs([(message.sid, [], ErrorBox.of(err))]))
            return
        if not seq.finished:  # a sequence that already ended was dropped by publish; keep none
            self.sequences[message.sid] = seq

    def _answer(self, call: Call) -> None:
        try:
            value = self._call(call.method, call.args)
        except Exception as err:  # noqa: BLE001 - the caller raises it in the API process
            self.outbox.put(Reply(call.call_id, error=ErrorBox.of(err)))
            return
        self.outbox.put(Reply(call.call_id, value))

    def _call(self, method: str, args: tuple) -> Any:
        if method not in CALLS:
            raise ValueError(f"no engine call {method!r}")
        if method == "metrics":
            return list(self.engine.metrics.registry.collect())
        if method == "load_revision":
            *call_args, reply_id = args
            return self._deferred(self.engine.load_revision(*call_args), reply_id)
        if method in ("sleep", "wake"):
            *call_args, reply_id = args
            return self._deferred(getattr(self.engine.sleep_control, method)(*call_args), reply_id)
        return getattr(self.engine, method)(*args)

    def _deferred(self, future: Future, reply_id: int) -> bool:
        """A call accepted (what it refuses at once is raised before this); its outcome follows as
        a Reply to ``reply_id`` (a reload once the new model serves, a sleep once the worker sleeps)."""

        def done(f) -> None:
            err = f.exception()
            self._announce_model()
            self.outbox.put(Reply(reply_id, None if err else f.result(), ErrorBox.of(err) if err else None))

        future.add_done_callback(done)
        return True

    def close(self) -> None:
        self._closed.set()
        with self.outbox.cond:
            self.outbox.cond.notify()


def main(conn: Connection, settings: EngineSettings, parent_pid: int, log_level: str, switch_interval: float) -> None:
    """The engine core with its settings (``spawn.engine_core_main`` calls it once they came)."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(switch_interval)  # the receiver and sender get the interpreter back quickly
    limit_logging()
    size_torch_threads()
    channel = Channel(conn)
    try:
        engine = Engine(settings)  # decides and checks the sizes, allocating nothing
    except (SizingError, ModelSourceError) as err:
        channel.send([Sized(None, str(err))])
        logging.shutdown()
        os._exit(2)
    channel.send([Sized(engine.settings)])
    host = EngineHost(engine, channel)
    sender = threading.Thread(target=host.send_loop, name="engine-sender", daemon=True)
    sender.start()
    host.engine.start()
    host.receive_loop()
    # The API process closed the channel: after a drain the engine has stopped; if the API
    # process died instead, nothing is left to serve and the device is freed by exiting now.
    engine = host.engine
    code = 0 if engine.failed is None and not engine.thread.is_alive() else 1
    host.close()
    logging.shutdown()
    os._exit(code)

