"""The step budget on a real capture: the target is derived from the step times the worker measured
(not a constant), stated in status and GetModelInfo with the TTFT guard derived from it, a target
no step can meet still moves every prompt on (the floor), with decode rows beside it, and a prompt
past the TTFT target gets stretched steps (counted in ``graphkeeper_steps_stretched_total``)."""

from __future__ import annotations

import threading

import pytest
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.engine.step_budget import ITL_MAX_FACTOR, MIN_PREFILL_TOKENS, TTFT_TARGET_FACTOR
from graphkeeper.worker.engine.step_overruns import allocator_note

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


def long_prompt(n: int) -> list[int]:
    """``n`` token ids inside the tiny model's vocabulary (512; ``Engine.submit`` refuses ids past
    it, as the API layers do)."""
    return [3 + i % 500 for i in range(n)]


def test_the_target_is_the_measured_time_of_the_largest_replayed_step():
    engine = start()
    try:
        budget = engine.status().step_budget
        assert budget.tokens == 256 and budget.tokens_with_decode == 256
        assert budget.itl_target_seconds > 0
        assert budget.source.startswith("derived: a 256-token step measured at")
        assert budget.itl_max_seconds == pytest.approx(ITL_MAX_FACTOR * budget.itl_target_seconds)
        assert budget.ttft_target_seconds == pytest.approx(TTFT_TARGET_FACTOR * budget.itl_target_seconds)
        assert budget.guard_source == "stretch ceiling: 2.5 x the target; TTFT target: 10 x the target"
        assert budget.tokens_stretched == 256  # the whole budget fits the target already: nothing to stretch
        assert engine.model_info().step_budget == budget
    finally:
        engine.drain_and_stop(5)


def test_a_target_no_step_meets_still_finishes_a_long_prompt_beside_decoding_rows():
    engine = start(itl_target_ms=1e-6)
    try:
        budget = engine.status().step_budget
        assert budget.tokens_with_decode == 0 and budget.source == "--itl-target-ms"
        decoding = [submit(engine, [5 + i, 6, 7], 64) for i in range(4)]
        long_done, long_out = submit(engine, long_prompt(20 * MIN_PREFILL_TOKENS), 4)
        assert long_done.wait(120) and len(long_out) == 4
        assert all(done.wait(120) and len(out) == 64 for done, out in decoding)
    finally:
        engine.drain_and_stop(5)


def test_a_prompt_past_the_ttft_target_gets_stretched_steps_beside_decoding_rows():
    """A target no step meets (decode rows leave only the floor), a ceiling every step meets and a
    1 ms TTFT target: the long prompt's steps stretch past the floor while rows decode, the counter
    says so, and every request finishes."""
    engine = start(itl_target_ms=1e-6, itl_max_ms=1000.0, ttft_target_ms=1.0)
    try:
        budget = engine.status().step_budget
        assert budget.tokens_with_decode == 0 and budget.tokens_stretched == 256
        assert budget.guard_source == "stretch ceiling: --itl-max-ms; TTFT target: --ttft-target-ms"
        decoding = [submit(engine, [5 + i, 6, 7], 200) for i in range(4)]
        long_done, long_out = submit(engine, long_prompt(40 * MIN_PREFILL_TOKENS), 4)
        assert long_done.wait(120) and len(long_out) == 4
        assert all(done.wait(120) and len(out) == 200 for done, out in decoding)
        assert engine.scheduler.steps_stretched > 0
        assert engine.metrics.registry.get_sample_value("graphkeeper_steps_stretched_total") == \
            engine.scheduler.steps_stretched
    finally:
        engine.drain_and_stop(5)


def test_an_overrun_line_on_cuda_reads_the_allocators_counts():
    """The overrun log's note on a CUDA device: torch's allocator counts (a retry after freeing its
    cache synchronises the device, a stall no step-time model sees), growing as memory is taken."""
    note = allocator_note(torch.device("cuda"))
    assert note is not None
    torch.cuda.empty_cache()  # nothing cached: the next allocation needs a new segment
    before = note()
    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    after = note()
    del held
    assert before.startswith("torch's CUDA allocator since start:") and "retries after freeing its cache" in after
    count = lambda line: int(line.split(" device allocations")[0].rsplit(" ", 1)[1])  # noqa: E731
    assert count(after) == count(before) + 1
