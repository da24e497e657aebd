"""The engine as the API layer sees it: ``EngineFace``, what serving is written against.

Two classes stand behind it: ``Engine`` (core.py), the engine on a thread of this process (tests,
benchmarks, ``--no-engine-process``), and ``EngineClient`` (client.py), the handle on an engine
core in a process of its own (how ``graphkeeper worker`` serves). Serving annotates with this
protocol rather than with either class, so it can use nothing that only one of them has;
``tests/worker/test_engine_face.py`` checks that both satisfy it, signature by signature.

What ``submit`` returns is opaque to the API layer: a ``Sequence`` from ``Engine``, a stream id
from ``EngineClient``. The caller keeps it only to hand it back to ``cancel``; the protocol is
generic in it (``Handle``) so that neither class has to pretend to return the other's.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar, runtime_checkable

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.sequence import Limits
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.model.tokenizer import Tokenizer
from graphkeeper.worker.settings import EngineSettings

#: What ``submit`` returns and ``cancel`` takes back.
Handle = TypeVar("Handle")


@runtime_checkable
class LifecycleView(Protocol):
    """The lifecycle state and its listeners (``Lifecycle``, or ``EngineClient``'s mirror of it)."""

    state: int

    def subscribe(self, listener: Callable[[int], None]) -> None: ...

    @property
    def serving(self) -> bool: ...


@runtime_checkable
class SleepOrders(Protocol):
    """GraphControl's Sleep and Wake as the servicer gives them to the engine (``SleepControl`` in
    the engine, ``RemoteSleep`` across the engine-core channel).

    Each raises at once what it refuses (``FieldError`` naming ``level``, ``SleepRefused``) and
    otherwise returns a future of its response: a Sleep resolves once the worker sleeps (running
    sequences finish first), or fails with ``SleepWithdrawn`` when a Wake came first.
    """

    def sleep(self, level: int) -> Future: ...

    def wake(self) -> Future: ...


@runtime_checkable
class EngineFace(Protocol[Handle]):
    """Everything the servers, ``worker.main`` and the probes use of an engine."""

    settings: EngineSettings
    metrics: WorkerMetrics
    lifecycle: LifecycleView
    #: Why the engine stopped for good; None while it works.
    failed: BaseException | None
    #: Whether this worker records CUDA graphs (a reload then recaptures).
    captures_graphs: bool
    #: Where each step's ``(stream, new tokens, end)`` updates go (the server's stream hub).
    publish: Callable[[list[tuple[Any, list[int], Any]]], None]
    #: GraphControl's Sleep and Wake.
    sleep_control: SleepOrders

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    def start(self) -> None: ...

    def limits(self) -> Limits | None: ...

    def model_info(self) -> pb.GetModelInfoResponse | None: ...

    def alive(self) -> bool: ...

    def submit(self, req: pb.GenerateRequest, stream: Any) -> Handle: ...

    def cancel(self, handle: Handle, /, reason: int = pb.FINISH_REASON_CANCELLED,
               outcome: str | None = None) -> None: ...

    def apply_policy(self, policy: pb.GraphPolicy) -> pb.ApplyGraphPolicyResponse: ...

    def load_revision(self, source: str, revision: str) -> Future: ...

    def status(self) -> pb.GraphStatus: ...

    def drain_and_stop(self, timeout: float) -> None: ...
