"""The step budget on a real capture: the target is derived from the step times the worker measured
(not a constant), stated in status and GetModelInfo, and a target no step can meet still moves
every prompt on (the floor), with decode rows beside it."""

from __future__ import annotations

import threading

import pytest
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.engine.step_budget import MIN_PREFILL_TOKENS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]


def start(**kw) -> Engine:
    settings = EngineSettings(model="random:tiny", device="cuda", dtype="bfloat16", max_num_seqs=8, max_seq_len=1024,
                              max_num_batched_tokens=256, policy=pb.GraphPolicy(), **kw)
    engine = Engine(settings)
    engine.start()
    assert engine.ready.wait(300) and engine.failed is None, engine.failed
    return engine


def submit(engine: Engine, prompt: list[int], n: int) -> tuple[threading.Event, list[int]]:
    done, out = threading.Event(), []

    def emit(tokens, end):
        out.extend(tokens)
        if end is not None:
            done.set()

    engine.submit(pb.GenerateRequest(prompt_token_ids=prompt,
                                     stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True)), emit)
    return done, out


def test_the_target_is_the_measured_time_of_the_largest_replayed_step():
    engine = start()
    try:
        budget = engine.status().step_budget
        assert budget.tokens == 256 and budget.tokens_with_decode == 256
        assert budget.itl_target_seconds > 0
        assert budget.source.startswith("derived: a 256-token step measured at")
        assert engine.model_info().step_budget == budget
    finally:
        engine.drain_and_stop(5)


def test_a_target_no_step_meets_still_finishes_a_long_prompt_beside_decoding_rows():
    engine = start(itl_target_ms=1e-6)
    try:
        budget = engine.status().step_budget
        assert budget.tokens_with_decode == 0 and budget.source == "--itl-target-ms"
        decoding = [submit(engine, [5 + i, 6, 7], 64) for i in range(4)]
        long_done, long_out = submit(engine, list(range(3, 3 + 20 * MIN_PREFILL_TOKENS)), 4)
        assert long_done.wait(120) and len(long_out) == 4
        assert all(done.wait(120) and len(out) == 64 for done, out in decoding)
    finally:
        engine.drain_and_stop(5)
