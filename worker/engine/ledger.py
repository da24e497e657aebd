"""The memory ledger: device and allocator memory recorded at each lifecycle stage.

Graph memory is measured, not estimated: the capture stage's growth in device memory in use is
what the graphs cost. The residual is device memory torch's allocator does not hold (the CUDA
context, libraries, other processes).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.metrics import WorkerMetrics


@dataclass(frozen=True)
class LedgerEntry:
    stage: int
    device_used: int
    torch_allocated: int
    torch_reserved: int

    @property
    def residual(self) -> int:
        return max(self.device_used - self.torch_reserved, 0)

    def to_proto(self) -> pb.LedgerEntry:
        return pb.LedgerEntry(
            stage=self.stage, device_used_bytes=self.device_used,
            torch_allocated_bytes=self.torch_allocated, torch_reserved_bytes=self.torch_reserved,
            residual_bytes=self.residual,
        )


def measure(stage: int, device: torch.device) -> LedgerEntry:
    """Reads the device's memory now; on a CPU every figure is 0 (nothing to measure)."""
    if device.type != "cuda":
        return LedgerEntry(stage, 0, 0, 0)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return LedgerEntry(stage, total - free, torch.cuda.memory_allocated(device),
                       torch.cuda.memory_reserved(device))


class Ledger:
    """The latest entry for each stage, in lifecycle order."""

    def __init__(self) -> None:
        self.entries: dict[int, LedgerEntry] = {}

    def record(self, stage: int, device: torch.device, settle: bool = False) -> LedgerEntry:
        """Measures ``stage`` now. ``settle`` first hands the allocator's unused cached blocks back
        to the device, so that what a stage reads is what it holds, not what loading it once
        needed (a load's temporaries stay cached otherwise: about 470 MiB for llama-1b)."""
        if settle and device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        entry = measure(stage, device)
        self.entries[stage] = entry
        return entry

    def restart(self, device: torch.device, kv_cache_bytes: int) -> None:
        """A new model revision was installed: the ledger starts over with it.

        The new weights were loaded beside the old model (only a complete load replaces
        anything), so what ``WEIGHTS`` and ``KV_CACHE`` read at load time held both models; here,
        with the old weights and graphs freed, both are measured again: ``KV_CACHE`` as the device
        holds now, ``WEIGHTS`` as that less the KV cache's bytes. ``CONTEXT`` (before any model)
        stays; the later stages are recorded again as the new model reaches them.
        """
        context = self.entries.get(pb.LEDGER_STAGE_CONTEXT)
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        now = measure(pb.LEDGER_STAGE_KV_CACHE, device)
        weights = LedgerEntry(pb.LEDGER_STAGE_WEIGHTS, *(max(v - kv_cache_bytes, 0) if device.type == "cuda" else 0
                                                         for v in (now.device_used, now.torch_allocated,
                                                                   now.torch_reserved)))
        self.entries = {pb.LEDGER_STAGE_WEIGHTS: weights, pb.LEDGER_STAGE_KV_CACHE: now}
        if context is not None:
            self.entries[pb.LEDGER_STAGE_CONTEXT] = context

    def export(self, metrics: WorkerMetrics) -> None:
        """Every stage's figures as the ledger gauge (stages no longer held lose their series)."""
        metrics.ledger.clear()
        for entry in list(self.entries.values()):
            stage = pb.LedgerStage.Name(entry.stage).removeprefix("LEDGER_STAGE_").lower()
            for kind, value in (("device_used", entry.device_used), ("torch_allocated", entry.torch_allocated),
                                ("torch_reserved", entry.torch_reserved), ("residual", entry.residual)):
                metrics.ledger.labels(stage, kind).set(value)

    def to_proto(self) -> list[pb.LedgerEntry]:
        return [self.entries[s].to_proto() for s in sorted(self.entries)]
