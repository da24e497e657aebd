"""Sleep and wake: the device-memory side (a stand-in on this branch, replaced at merge).

``sleep_refusal`` is the real rule; ``sleep_model`` and ``wake_model`` are written with the CUDA
virtual-memory side and raise here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphkeeper.worker.engine.blocks import BlockManager
    from graphkeeper.worker.engine.model_slot import ModelSlot


def sleep_refusal(device_type: str, sleep_mode: bool, level: int) -> str | None:
    """None when a sleep at ``level`` (1 or 2) may go ahead; else why not."""
    if level not in (1, 2):
        return "level must be 1 or 2"
    if device_type != "cuda":
        return f"sleep needs a CUDA device: this worker runs on {device_type}"
    if not sleep_mode:
        return "this worker started without --enable-sleep-mode"
    return None


@dataclass(frozen=True)
class SleepOutcome:
    level: int
    released_bytes: int
    seconds: float


@dataclass(frozen=True)
class WakeOutcome:
    level: int
    restored_bytes: int
    seconds: float


def sleep_model(slot: ModelSlot, blocks: BlockManager, level: int) -> SleepOutcome:
    """Engine thread, no step in flight, no sequence running."""
    raise NotImplementedError("sleep_model is the device-memory side's")


def wake_model(slot: ModelSlot, blocks: BlockManager) -> WakeOutcome:
    """Engine thread."""
    raise NotImplementedError("wake_model is the device-memory side's")
