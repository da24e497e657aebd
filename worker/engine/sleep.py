"""Sleep and wake: the served model's device memory given back and taken again, graphs kept.

A worker started with ``--enable-sleep-mode`` on a CUDA device keeps its weights and KV cache in
sleepable regions (``model/sleep_memory.py``): fixed device addresses whose physical memory can
go and come back. Sleep gives it back; wake maps memory at the same addresses, so every captured
graph replays as it was, with no recapture.

- Level 1: the weights wait in pinned host memory; wake copies them back (host to device speed).
- Level 2: the weights are dropped; wake loads them again from the model's source (disk speed),
  into the same tensors.

At both levels the KV cache's contents are dropped: wake zeroes it (padded rows read the dummy
slot's blocks, which must hold finite values), and the caller (``sleep_control``) makes the prefix
cache forget every block, since the keys and values it named are gone. The engine calls these
between steps, with nothing running.

Then, at both levels (unless ``--no-sleep-offload-context``), what the process still holds (its
CUDA context, the graphs and their pool, torch's buffers) goes to host memory through the driver's
process checkpoint (``context_offload.py``), and wake restores it first. Where the driver cannot,
the sleep goes on without it and says why.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from graphkeeper.worker.engine import context_offload
from graphkeeper.worker.engine.model_slot import ModelSlot
from graphkeeper.worker.engine.sizing import aligned
from graphkeeper.worker.model.loader import load_model

log = logging.getLogger(__name__)
LEVELS = (1, 2)


def sleep_refusal(device_type: str, sleep_mode: bool, level: int) -> str | None:
    """None when a sleep at ``level`` may go ahead; else why not, for the caller to answer with."""
    if level not in LEVELS:
        return f"level must be 1 (weights kept in host memory) or 2 (weights dropped), not {level}"
    if device_type != "cuda":
        return f"sleep needs a CUDA device: this worker runs on {device_type}"
    if not sleep_mode:
        return "this worker started without --enable-sleep-mode: its memory cannot be given back and kept addressable"
    return None


@dataclass(frozen=True)
class SleepOutcome:
    level: int
    #: Device memory given back, as the driver reports free memory before and after.
    released_bytes: int
    seconds: float
    #: The process's remaining device state went to host memory too (``context_offload``).
    context_offloaded: bool = False
    #: Why it did not ('' when it did, or when the worker runs with --no-sleep-offload-context).
    context_note: str = ""


@dataclass(frozen=True)
class WakeOutcome:
    level: int
    #: Device memory taken again, as the driver reports free memory before and after.
    restored_bytes: int
    seconds: float


def sleep_model(slot: ModelSlot, level: int) -> SleepOutcome:
    """Gives the weights' and the KV cache's memory back (engine thread, nothing running)."""
    refusal = sleep_refusal(slot.device.type, slot.sleepable, level)
    if refusal:
        raise ValueError(refusal)
    if slot.sleep_level:
        return SleepOutcome(slot.sleep_level, 0, 0.0)
    started = time.perf_counter()
    runner = slot.runner
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    runner.loaded.weights_region.release(keep=level == 1)
    runner.cache.region.release(keep=False)
    runner.penalties.release()
    gc.collect()
    torch.cuda.empty_cache()  # blocks torch's allocator keeps cached go back as well
    released = torch.cuda.mem_get_info()[0] - free_before
    offloaded, moved, note = _offload_context(slot)
    outcome = SleepOutcome(level, released + moved, time.perf_counter() - started, offloaded, note)
    log.info("asleep at level %d: %.2f GiB given back in %.2f s (weights and KV cache %.2f GiB; %s)", level,
             outcome.released_bytes / 2**30, outcome.seconds, released / 2**30,
             f"the rest of the process {moved / 2**30:.2f} GiB" if offloaded else f"the rest kept: {note}")
    return outcome


def _offload_context(slot: ModelSlot) -> tuple[bool, int, str]:
    """(offloaded, bytes it gave back, why not): the process's remaining device state to host
    memory. The engine thread makes no CUDA call until ``_restore_context``; nor may any other."""
    if not slot.settings.sleep_offload_context:
        return False, 0, "--no-sleep-offload-context"
    slot.context_uuid = slot.context_uuid or str(torch.cuda.get_device_properties(slot.device).uuid)
    result = context_offload.call_helper("offload", slot.context_uuid)
    if not result.ok:
        if not result.left_running:  # a helper that died or failed to unlock: settled by a restore
            _restore(slot.context_uuid)
        log.warning("sleep keeps the CUDA context and graph memory on the device: %s", result.error)
        return False, 0, result.error
    slot.context_offloaded = True
    # The collector stays off until the restore: a cycle it freed could hold a tensor, whose free
    # is a CUDA call, made on whichever thread collected, holding the interpreter, until the wake
    # that then could never run. (What was garbage went in sleep_model's collect.)
    gc.disable()
    if result.moved_bytes is None:
        return True, 0, "the process's own share not measured (no NVML)"
    return True, result.moved_bytes, ""


def _restore_context(slot: ModelSlot) -> int:
    """The process's device state back at its addresses, when a sleep offloaded it (before any
    CUDA call); the bytes it took."""
    if not slot.context_offloaded:
        return 0
    taken = _restore(slot.context_uuid)
    slot.context_offloaded = False
    gc.enable()
    return taken


def _restore(uuid: str) -> int:
    """Restores and unlocks this process from whatever state an offload left it in; the bytes
    that came back. A failure leaves the process without a usable device: raised as a CUDA error."""
    result = context_offload.call_helper("restore", uuid)
    if not result.ok:
        raise RuntimeError(f"CUDA error: the process's device state could not be restored: {result.error}")
    return result.moved_bytes or 0


def wake_model(slot: ModelSlot) -> WakeOutcome:
    """Takes the memory again at the same addresses and refills it (engine thread)."""
    level = slot.sleep_level
    if not level:
        return WakeOutcome(0, 0, 0.0)
    started = time.perf_counter()
    runner = slot.runner
    context = _restore_context(slot)
    free_before = torch.cuda.mem_get_info()[0]
    if not runner.loaded.weights_region.restore():
        _reload_weights(slot)
    runner.cache.region.restore()
    runner.cache.k.zero_()
    runner.cache.v.zero_()
    torch.cuda.synchronize()
    taken = free_before - torch.cuda.mem_get_info()[0] + context
    outcome = WakeOutcome(level, taken, time.perf_counter() - started)
    log.info("awake from level %d: %.2f GiB taken in %.2f s", level, taken / 2**30, outcome.seconds)
    return outcome


@torch.no_grad()
def _reload_weights(slot: ModelSlot) -> None:
    """Level 2: the weights loaded again from their source (the same loader, dtype,
    quantization and tensor-parallel shard as at start) and copied into the tensors the graphs read."""
    loaded = slot.runner.loaded
    s = slot.settings
    fresh = load_model(loaded.source, device=slot.device, dtype=s.dtype, max_positions=aligned(s.max_seq_len),
                       revision=loaded.revision, quantization=loaded.quantization, tp=loaded.tp)
    new = dict(fresh.model.named_parameters())
    for name, param in loaded.model.named_parameters():
        param.copy_(new[name])
    del fresh, new
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
