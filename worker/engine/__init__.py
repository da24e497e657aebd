"""The engine: one thread that owns the device and runs schedule -> run -> postprocess.

This module is the engine's face: the API layer (``serving/``) and ``main.py`` import only what
it exports here.
"""

from graphkeeper.worker.engine.core import Engine, EngineSettings, NotServing, QueueFull, StalePolicy, StepFailed

__all__ = ["Engine", "EngineSettings", "NotServing", "QueueFull", "StalePolicy", "StepFailed"]
