"""The memory ledger: monotone within a model generation, a new generation at a revision change
with the previous one kept and labelled (pure, on the CPU: readings are given, not measured)."""

from __future__ import annotations

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.ledger import Ledger, LedgerEntry, settle_earlier

S = pb.LedgerStage
MIB = 2**20


def entry(stage: int, used_mib: int, reserved_mib: int = 0) -> LedgerEntry:
    return LedgerEntry(stage, used_mib * MIB, reserved_mib * MIB, reserved_mib * MIB)


def test_a_stage_below_an_earlier_one_lowers_it_to_its_reading():
    """After a revision change under load the KV cache stage read the old model's memory too; the
    capture stage, read once it was freed, is the truth the earlier stages are held to."""
    entries = {S.LEDGER_STAGE_WEIGHTS: entry(S.LEDGER_STAGE_WEIGHTS, 5653, 5000),
               S.LEDGER_STAGE_KV_CACHE: entry(S.LEDGER_STAGE_KV_CACHE, 5700, 5100)}
    lowered = settle_earlier(entries, entry(S.LEDGER_STAGE_CAPTURE, 5461, 4900))
    assert lowered == [S.LEDGER_STAGE_WEIGHTS, S.LEDGER_STAGE_KV_CACHE]
    assert {e.device_used for e in entries.values()} == {5461 * MIB}
    assert {e.torch_reserved for e in entries.values()} == {4900 * MIB}


def test_a_growing_ledger_is_left_as_read():
    entries = {S.LEDGER_STAGE_WEIGHTS: entry(S.LEDGER_STAGE_WEIGHTS, 3000)}
    assert settle_earlier(entries, entry(S.LEDGER_STAGE_KV_CACHE, 5000)) == []
    assert entries[S.LEDGER_STAGE_WEIGHTS].device_used == 3000 * MIB


def test_a_revision_change_starts_a_generation_and_keeps_the_previous_one():
    ledger, cpu = Ledger(), torch.device("cpu")
    for stage in (S.LEDGER_STAGE_CONTEXT, S.LEDGER_STAGE_WEIGHTS, S.LEDGER_STAGE_KV_CACHE, S.LEDGER_STAGE_STEADY):
        ledger.record(stage, cpu)
    ledger.begin_reload()
    ledger.record(S.LEDGER_STAGE_WEIGHTS, cpu)  # the load's readings (both models) are not the old generation's
    ledger.restart(cpu, kv_cache_bytes=0)
    ledger.record(S.LEDGER_STAGE_WARMUP, cpu)
    current, previous = ledger.to_proto(), ledger.previous_to_proto()
    assert [e.stage for e in current] == [S.LEDGER_STAGE_CONTEXT, S.LEDGER_STAGE_WEIGHTS, S.LEDGER_STAGE_KV_CACHE,
                                          S.LEDGER_STAGE_WARMUP]
    assert {e.generation for e in current} == {1}
    assert [e.stage for e in previous] == [S.LEDGER_STAGE_CONTEXT, S.LEDGER_STAGE_WEIGHTS, S.LEDGER_STAGE_KV_CACHE,
                                           S.LEDGER_STAGE_STEADY]
    assert {e.generation for e in previous} == {0}
