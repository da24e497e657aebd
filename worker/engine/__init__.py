"""The engine: one thread that owns the device and runs schedule -> run -> postprocess.

This is the engine's face. The API layer (``serving/``) sees only what it exports: the
``EngineFace`` protocol it is written against, its settings, the limits requests are checked
against, what the engine refuses or fails with and how each is answered (``classify``), and the
detokenizer that turns its tokens into text, the step-loop watchdog and the one readiness rule
every probe answers (``ready``). Two classes satisfy ``EngineFace``: ``Engine`` runs
in the process that builds it (tests, benchmarks); ``EngineClient`` runs an ``Engine`` in a
process of its own (``engine.process``), which is how ``graphkeeper worker`` serves. Serving
names neither; ``worker.main`` picks one.
"""

from typing import TYPE_CHECKING, Any

from graphkeeper.worker.engine.errors import (
    UNKNOWN_ERROR,
    CannotFit,
    ErrorStatus,
    InvalidTokens,
    NotServing,
    QueueFull,
    ReloadUnsupported,
    SleepRefused,
    SleepWithdrawn,
    StalePolicy,
    StepFailed,
    classify,
    error_message,
)
from graphkeeper.worker.engine.face import EngineFace, LifecycleView
from graphkeeper.worker.engine.lifecycle import SERVING_STATES
from graphkeeper.worker.engine.model_roots import ReloadRefused
from graphkeeper.worker.engine.sequence import Limits
from graphkeeper.worker.engine.structured import constraint_error
from graphkeeper.worker.engine.watchdog import StepWatchdog, ready
from graphkeeper.worker.model.tokenizer import ChatError, IncrementalDetokenizer
from graphkeeper.worker.settings import EngineSettings

if TYPE_CHECKING:
    from graphkeeper.worker.engine.client import EngineClient
    from graphkeeper.worker.engine.core import Engine


def __getattr__(name: str) -> Any:
    """``Engine`` and ``EngineClient`` are imported when first asked for: the API process of a
    worker never builds an ``Engine``, and importing one loads the whole device side (the model,
    the kernels, Triton) for nothing."""
    if name == "Engine":
        from graphkeeper.worker.engine.core import Engine

        return Engine
    if name == "EngineClient":
        from graphkeeper.worker.engine.client import EngineClient

        return EngineClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SERVING_STATES", "CannotFit", "ChatError", "Engine", "EngineClient", "EngineFace", "EngineSettings",
    "ErrorStatus", "IncrementalDetokenizer", "InvalidTokens", "LifecycleView", "Limits", "NotServing", "QueueFull",
    "ReloadRefused", "ReloadUnsupported", "SleepRefused", "SleepWithdrawn", "StalePolicy", "StepFailed", "StepWatchdog",
    "UNKNOWN_ERROR", "classify", "constraint_error", "error_message", "ready",
]
