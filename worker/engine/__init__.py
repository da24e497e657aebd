"""The engine: one thread that owns the device and runs schedule -> run -> postprocess.

This is the engine's face. The API layer (``serving/``) sees only what it exports: the engine,
its settings, the limits requests are checked against, what the engine refuses or fails with,
and the detokenizer that turns its tokens into text. When the engine core moves to a process of
its own, this is the seam.
"""

from graphkeeper.worker.engine.core import Engine
from graphkeeper.worker.engine.errors import NotServing, QueueFull, StalePolicy, StepFailed
from graphkeeper.worker.engine.lifecycle import SERVING_STATES
from graphkeeper.worker.engine.model_roots import ReloadRefused
from graphkeeper.worker.engine.sequence import Limits
from graphkeeper.worker.model.tokenizer import ChatError, IncrementalDetokenizer
from graphkeeper.worker.settings import EngineSettings

__all__ = [
    "SERVING_STATES", "ChatError", "Engine", "EngineSettings", "IncrementalDetokenizer", "Limits", "NotServing",
    "QueueFull",
    "ReloadRefused", "StalePolicy", "StepFailed",
]
