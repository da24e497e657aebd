"""Coarse verdicts remembered between starts: which keys a restart leaves out, and a file that was
written for other facts, or does not parse, never used (pure and file-level; a real restart on a
GPU is tests/gpu/test_large_steps_cuda.py)."""

from __future__ import annotations

import json
import logging

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.executor.graphs.coarse_memory import (
    VERDICTS_FILE,
    CoarseMemory,
    Remembered,
    memory_facts,
    remembered_skips,
)
from graphkeeper.worker.executor.graphs.large_steps import Verdict
from graphkeeper.worker.executor.graphs.modes import FULL, PIECEWISE

FACTS = {"whole_mixed": True, "tp_size": 1, "block_size": 16, "source": "abc"}
LADDER = [1, 2, 4, 512, 1024, 2048, 4096, 8192]


def remembered(size: int, kept: bool) -> Remembered:
    return Remembered(size, replay_seconds=0.010, served_seconds=0.0101, eager_seconds=0.011, kept=kept,
                      below=size // 2)


def test_only_the_piecewise_keys_of_sizes_remembered_as_not_paying_are_left_out():
    plan = [(FULL, 8), (PIECEWISE, 4096), (PIECEWISE, 2048), (PIECEWISE, 1024), (PIECEWISE, 512)]
    kept, skips = remembered_skips(plan, {4096: remembered(4096, False), 2048: remembered(2048, True),
                                          512: remembered(512, False)})
    assert kept == [(FULL, 8), (PIECEWISE, 2048), (PIECEWISE, 1024)]
    assert set(skips) == {(PIECEWISE, 4096), (PIECEWISE, 512)}
    assert skips[(PIECEWISE, 4096)].reason == pb.FALLBACK_REASON_COMPUTE_BOUND
    assert "does not beat the steps it serves" in skips[(PIECEWISE, 4096)].message
    assert "earlier start" in skips[(PIECEWISE, 4096)].message
    assert remembered_skips(plan, {}) == (plan, {})


def test_a_phase_verdicts_are_written_and_read_back_over_what_it_left_out(tmp_path):
    memory = CoarseMemory.beside(str(tmp_path), FACTS)
    assert memory.path == tmp_path / VERDICTS_FILE and memory.recall([1024], LADDER) == {}
    verdicts = [Verdict(1024, 0.004, 0.0041, False), Verdict(2048, 0.008, 0.012, True)]
    memory.save(verdicts, {512: 0.002, 1024: 0.0045, 2048: 0.016}, {4096: remembered(4096, False)}, LADDER)
    got = CoarseMemory.beside(str(tmp_path), dict(FACTS)).recall([1024, 2048, 4096, 8192], LADDER)
    assert got == {1024: Remembered(1024, 0.004, 0.0041, 0.0045, False, 512),
                   2048: Remembered(2048, 0.008, 0.012, 0.016, True, 1024), 4096: remembered(4096, False)}
    assert set(memory.recall([2048], LADDER)) == {2048}


def test_a_verdict_judged_on_another_ladder_is_not_recalled(tmp_path):
    """A coarse size serves the steps above the ladder size below it: with another size below
    (a policy's ladder that stops at 256), the verdict was about other steps."""
    memory = CoarseMemory.beside(str(tmp_path), FACTS)
    memory.save([Verdict(1024, 0.004, 0.0041, False)], {1024: 0.0045}, {}, LADDER)
    assert set(memory.recall([1024], LADDER)) == {1024}
    assert memory.recall([1024], [1, 2, 4, 256, 1024]) == {}


def test_a_phase_that_judged_nothing_writes_nothing(tmp_path):
    memory = CoarseMemory.beside(str(tmp_path), FACTS)
    memory.save([], {}, {4096: remembered(4096, False)}, LADDER)
    assert not memory.path.exists()


def test_verdicts_measured_for_other_facts_are_ignored_with_what_differs(tmp_path, caplog):
    CoarseMemory.beside(str(tmp_path), FACTS).save([Verdict(1024, 0.004, 0.0041, False)], {1024: 0.0045}, {}, LADDER)
    with caplog.at_level(logging.WARNING):
        assert CoarseMemory.beside(str(tmp_path), {**FACTS, "block_size": 32}).recall([1024], LADDER) == {}
    assert "block_size" in caplog.text and "measured again" in caplog.text


def test_a_file_that_does_not_parse_is_ignored(tmp_path, caplog):
    memory = CoarseMemory.beside(str(tmp_path), FACTS)
    for text in ("{", "[1, 2]", json.dumps({"facts": FACTS, "sizes": {"1024": {"size": 1024}}})):
        memory.path.write_text(text)
        with caplog.at_level(logging.WARNING):
            assert memory.recall([1024], LADDER) == {}
    assert "unreadable" in caplog.text


def test_no_compile_cache_directory_remembers_nothing():
    assert CoarseMemory.beside("", FACTS) is None


def test_the_facts_name_the_recording_the_ranks_and_the_block_size():
    base = memory_facts(True, 1, 16)
    assert base["source"] and base == memory_facts(True, 1, 16)
    assert {k for k in base if base[k] != memory_facts(False, 2, 32)[k]} == {"whole_mixed", "tp_size", "block_size"}
