"""The channel between the API process and the engine-core process, and what travels on it.

One duplex ``multiprocessing`` connection (a Unix socketpair) carries pickled lists of messages,
both ways. Nothing outside the standard library is needed, so the GPU image needs no ZeroMQ or
msgspec. Each send is one list: the engine core sends every stream's new tokens of a step (or of
the steps made while the previous send was on its way) as one ``Outputs``, never one message per
token per stream.

Streams are named by small integers (``sid``) chosen by the API process; the API process keeps
the streams themselves, the engine core only the ids.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.field_checks import FieldError

# --- API process -> engine core ------------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    """An admitted request (its serialized ``GenerateRequest``) for stream ``sid``."""

    sid: int
    request: bytes


@dataclass(frozen=True)
class Cancel:
    sid: int
    reason: int = pb.FINISH_REASON_CANCELLED
    outcome: str | None = None


@dataclass(frozen=True)
class Call:
    """``engine.<method>(*args)`` in the engine core; answered by a ``Reply`` with the same id."""

    call_id: int
    method: str
    args: tuple = ()


# --- engine core -> API process ------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any = None
    error: ErrorBox | None = None


@dataclass(frozen=True)
class Sized:
    """The engine core's first message: the settings with the context length and sequence count
    decided (engine/sizing.py), or why it refused to start (one line: a KV cache that cannot fit,
    a model that cannot load), before anything was allocated."""

    settings: Any  # EngineSettings, or None when refused
    refused: str = ""


@dataclass(frozen=True)
class Outputs:
    """``(sid, new tokens, end)`` for every stream a step touched; ``end`` is a Completion, an
    ``ErrorBox`` or None while the stream continues."""

    updates: list[tuple[int, list[int], Any]]


@dataclass(frozen=True)
class State:
    """A lifecycle move, with the engine's failure (empty while it has none) set before it."""

    state: int
    failed: str = ""


@dataclass(frozen=True)
class Started:
    """The engine's startup stages until its READY (a serialized ``StartupStatus``), sent once,
    just before that READY's ``State``."""

    startup: bytes


@dataclass(frozen=True)
class StepBudgetUpdate:
    """The engine installed a step budget (after a capture phase): GetModelInfo states it."""

    budget: bytes  # a serialized StepBudgetStatus


@dataclass(frozen=True)
class Model:
    """A model was installed: what the API process needs to admit, tokenize and describe."""

    source: str
    limits: Any  # engine.sequence.Limits
    info: bytes  # a serialized GetModelInfoResponse


@dataclass(frozen=True)
class ErrorBox:
    """An exception that crosses the channel as its class and text, and comes back as the same
    class (a ``FieldError`` with its field), so the API layer maps it to the same status code."""

    cls: type
    text: str
    field: str = ""
    message: str = ""

    @classmethod
    def of(cls, err: BaseException) -> ErrorBox:
        if isinstance(err, FieldError):
            return cls(type(err), str(err), err.field, err.message)
        return cls(type(err), str(err))

    def rebuild(self) -> BaseException:
        if issubclass(self.cls, FieldError):
            return self.cls(self.field, self.message)
        try:
            return self.cls(self.text)
        except Exception:  # noqa: BLE001 - a class that takes other arguments: its text survives
            return RuntimeError(f"{self.cls.__name__}: {self.text}")


class Channel:
    """One end of the connection: ``send`` from any thread (one lock), ``recv`` from one thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, messages: list) -> None:
        """Raises OSError (or EOFError) once the other end is gone."""
        data = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self) -> list:
        """The next list of messages; EOFError when the other process closed or died, or when this
        end was closed by another thread while this one waited (``Connection.close`` drops the
        handle the blocked read uses next, which then fails with a TypeError)."""
        try:
            data = self.conn.recv_bytes()
        except TypeError:
            if self.conn.closed:
                raise EOFError("the channel was closed") from None
            raise
        return pickle.loads(data)

    def close(self) -> None:
        """Shuts the socket down before closing it: a thread blocked in ``recv`` on this end keeps
        the socket open past ``close`` alone, and the other process would never see EOF."""
        with contextlib.suppress(OSError, ValueError), socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
