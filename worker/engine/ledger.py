"""The memory ledger: device and allocator memory recorded at each lifecycle stage.

Stages are recorded in lifecycle order, and within one model generation the ledger is monotone: a
stage that reads below an earlier one means the earlier one held memory freed since (after a
revision change under load, the old model's, released a step later), so the earlier stages are
lowered to it and the correction is logged (``settle_earlier``). A revision change starts a new
generation; the previous generation's stages are kept, labelled, for comparison. The residual is
device memory torch's allocator does not hold (the CUDA context, libraries, other processes).
Graph memory itself is measured from the graph pool, not from these stages (``graph_set``).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, replace

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LedgerEntry:
    stage: int
    device_used: int
    torch_allocated: int
    torch_reserved: int
    generation: int = 0

    @property
    def residual(self) -> int:
        return max(self.device_used - self.torch_reserved, 0)

    def to_proto(self) -> pb.LedgerEntry:
        return pb.LedgerEntry(
            stage=self.stage, device_used_bytes=self.device_used,
            torch_allocated_bytes=self.torch_allocated, torch_reserved_bytes=self.torch_reserved,
            residual_bytes=self.residual, generation=self.generation,
        )


def measure(stage: int, device: torch.device) -> LedgerEntry:
    """Reads the device's memory now; on a CPU every figure is 0 (nothing to measure)."""
    if device.type != "cuda":
        return LedgerEntry(stage, 0, 0, 0)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return LedgerEntry(stage, total - free, torch.cuda.memory_allocated(device),
                       torch.cuda.memory_reserved(device))


def settle_earlier(entries: dict[int, LedgerEntry], new: LedgerEntry) -> list[int]:
    """Lowers the stages before ``new``'s that read more device memory than it, in place, to its
    figures (pure). Returns the stages lowered: what they held beyond ``new`` was freed since, so it
    was not theirs (the memory a stage needs is at most what a later stage still holds)."""
    lowered = []
    for stage, entry in entries.items():
        if stage < new.stage and entry.device_used > new.device_used:
            entries[stage] = replace(entry, device_used=new.device_used,
                                     torch_allocated=min(entry.torch_allocated, new.torch_allocated),
                                     torch_reserved=min(entry.torch_reserved, new.torch_reserved))
            lowered.append(stage)
    return lowered


class Ledger:
    """The latest entry for each stage of the current model generation, in lifecycle order, and the
    previous generation's stages."""

    def __init__(self) -> None:
        self.entries: dict[int, LedgerEntry] = {}
        self.generation = 0
        self.previous: dict[int, LedgerEntry] = {}
        self._before_reload: dict[int, LedgerEntry] | None = None

    def begin_reload(self) -> None:
        """A reload is about to load new weights beside the old ones: the stages as they are now are
        the generation ``restart`` keeps as the previous one (the load's own readings hold both)."""
        self._before_reload = dict(self.entries)

    def record(self, stage: int, device: torch.device, settle: bool = False) -> LedgerEntry:
        """Measures ``stage`` now. ``settle`` first hands the allocator's unused cached blocks back
        to the device, so that what a stage reads is what it holds, not what loading it once
        needed (a load's temporaries stay cached otherwise: about 470 MiB for llama-1b)."""
        if settle and device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        entry = replace(measure(stage, device), generation=self.generation)
        self._add(entry)
        return entry

    def _add(self, entry: LedgerEntry) -> None:
        lowered = settle_earlier(self.entries, entry)
        if lowered:
            names = ", ".join(pb.LedgerStage.Name(s).removeprefix("LEDGER_STAGE_").lower() for s in lowered)
            log.info("ledger: %s read more device memory than %s does now; lowered to it (memory freed since, "
                     "not theirs)", names, pb.LedgerStage.Name(entry.stage).removeprefix("LEDGER_STAGE_").lower())
        self.entries[entry.stage] = entry

    def restart(self, device: torch.device, kv_cache_bytes: int) -> None:
        """A new model revision was installed: the ledger starts over with it.

        The new weights were loaded beside the old model (only a complete load replaces
        anything), so what ``WEIGHTS`` and ``KV_CACHE`` read at load time held both models; here,
        with the old weights and graphs freed, both are measured again: ``KV_CACHE`` as the device
        holds now, ``WEIGHTS`` as that less the KV cache's bytes. ``CONTEXT`` (before any model)
        stays; the later stages are recorded again as the new model reaches them.
        """
        context = self.entries.get(pb.LEDGER_STAGE_CONTEXT)
        self.previous = self._before_reload if self._before_reload is not None else dict(self.entries)
        self._before_reload = None
        self.generation += 1
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        now = replace(measure(pb.LEDGER_STAGE_KV_CACHE, device), generation=self.generation)
        weights = LedgerEntry(pb.LEDGER_STAGE_WEIGHTS, *(max(v - kv_cache_bytes, 0) if device.type == "cuda" else 0
                                                         for v in (now.device_used, now.torch_allocated,
                                                                   now.torch_reserved)), generation=self.generation)
        self.entries = {pb.LEDGER_STAGE_WEIGHTS: weights, pb.LEDGER_STAGE_KV_CACHE: now}
        if context is not None:
            self.entries[pb.LEDGER_STAGE_CONTEXT] = replace(context, generation=self.generation)

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

    def previous_to_proto(self) -> list[pb.LedgerEntry]:
        """The generation before the last revision change (empty before any)."""
        return [self.previous[s].to_proto() for s in sorted(self.previous)]
