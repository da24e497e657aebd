"""Graph economics on a real GPU: what each graph buys (replay against eager GPU time), a budget
that fits nothing holds no graph memory, idle release gives memory back with its reason,
max_graphs is honoured, and the ledger is one model's after a reload. Run with ``pytest -m cuda``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Engine, EngineSettings

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]

FULL, PIECEWISE = pb.GRAPH_MODE_FULL, pb.GRAPH_MODE_PIECEWISE
MIB = 1 << 20
#: What "~0 MiB held" means: the caching allocator returns whole segments (empty_cache frees every
#: unused one) and cudaMemGetInfo moves in the driver's 2 MiB pages: what stays is below one page.
HELD_AT_MOST = 2 * MIB


def engine_for(policy: pb.GraphPolicy, model: str = "random:tiny", dtype: str = "bfloat16", **kw) -> Engine:
    settings = EngineSettings(model=model, device="cuda", dtype=dtype, max_num_seqs=16, max_seq_len=256,
                              max_num_batched_tokens=64, policy=policy, **kw)
    engine = Engine(settings)
    engine.start()
    assert engine.ready.wait(300) and engine.failed is None, engine.failed
    return engine


def policy(uid: str = "econ", generation: int = 1, **fields) -> pb.GraphPolicy:
    p = pb.GraphPolicy(policy_uid=uid, generation=generation, **fields)
    if not p.mode:
        p.mode = pb.GRAPH_MODE_FULL_AND_PIECEWISE
    if not p.capture_sizes.WhichOneof("sizes"):
        p.capture_sizes.ladder = pb.CAPTURE_LADDER_DEFAULT
    return p


def generate(engine: Engine, prompt: list[int], n: int = 8) -> pb.Completion:
    done, result = threading.Event(), {}

    def emit(tokens, end):
        if end is not None:
            result["completion"] = end
            done.set()

    engine.submit(pb.GenerateRequest(prompt_token_ids=prompt,
                                     stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True)), emit)
    assert done.wait(120)
    return result["completion"]


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def ledger(status: pb.GraphStatus) -> dict[int, pb.LedgerEntry]:
    return {e.stage: e for e in status.ledger}


def test_every_graph_reports_its_replay_and_eager_step_time():
    engine = engine_for(policy())
    try:
        status = engine.status()
        assert status.captured
        for c in status.captured:
            assert c.replay_seconds > 0 and c.eager_seconds > 0, c
        small = [c for c in status.captured if c.size <= 8]
        assert small and all(c.replay_seconds < c.eager_seconds for c in small), [
            (c.mode, c.size, c.replay_seconds, c.eager_seconds) for c in small]
        generate(engine, [5, 6, 7], 8)
        status = engine.status()
        full1 = next(c for c in status.captured if (c.mode, c.size) == (FULL, 1))
        assert full1.replays >= 7 and full1.padded_tokens == 0  # one sequence decoding: no padding
        assert status.traffic.steps == status.graph_steps + status.eager_steps
    finally:
        engine.drain_and_stop(5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_budget_that_fits_nothing_holds_no_graph_memory(dtype):
    engine = engine_for(policy(memory_budget_bytes=1), dtype=dtype)
    try:
        status = engine.status()
        assert not status.captured
        assert status.skipped and {s.reason for s in status.skipped} == {pb.FALLBACK_REASON_SIZE_OVER_BUDGET}
        assert status.graph_memory_bytes <= HELD_AT_MOST, status.graph_memory_bytes
        stages = ledger(status)
        grown = stages[pb.LEDGER_STAGE_CAPTURE].device_used_bytes - stages[pb.LEDGER_STAGE_WARMUP].device_used_bytes
        assert grown <= HELD_AT_MOST, f"the capture phase left {grown / MIB:.1f} MiB held with no graph"
        completion = generate(engine, [5, 6, 7], 4)
        assert {e.reason for e in completion.execution.eager_steps} == {pb.FALLBACK_REASON_SIZE_OVER_BUDGET}
    finally:
        engine.drain_and_stop(5)


@pytest.mark.parametrize("record_mixed", [False, True], ids=["pieces", "whole"])
def test_idle_graphs_are_released_with_their_memory_and_reason(record_mixed):
    """Released idle, every graph gives its memory back. A whole-step PIECEWISE key of the tiny
    model holds one allocator page at most (no piece buffers), too little to see go: that case
    runs a 1B model's graphs, without compiling its step."""
    model, level = ("random:llama-1b", 1) if record_mixed else ("random:tiny", 2)
    engine = engine_for(policy(idle_release_seconds=2), model=model, record_mixed_attention=record_mixed,
                        optimization_level=level)
    try:
        before = engine.status()
        assert before.captured and before.graph_memory_bytes > HELD_AT_MOST
        generate(engine, [5, 6, 7], 4)
        wait_for(lambda: (s := engine.status()).captured and all(c.released for c in s.captured), timeout=30,
                 what="every graph released")
        status = engine.status()
        assert status.graph_memory_bytes <= HELD_AT_MOST, status.graph_memory_bytes
        # The engine loop counts a release and exports the gauge just after the status shows it.
        metrics = engine.metrics
        wait_for(lambda: metrics.idle_releases._value.get() == len(status.captured)
                 and metrics.graph_memory._value.get() == status.graph_memory_bytes, timeout=5,
                 what="every release counted and the graph memory gauge exported")
        completion = generate(engine, [5, 6, 7], 4)
        assert not completion.execution.graph_steps  # nothing is captured on the request path
        assert {e.reason for e in completion.execution.eager_steps} == {pb.FALLBACK_REASON_GRAPH_RELEASED_IDLE}
        # A policy that changes the captured set brings graphs back (a capture phase).
        engine.apply_policy(policy(generation=2, idle_release_seconds=2, max_graphs=4))
        wait_for(lambda: engine.status().policy_generation == 2 and engine.status().state == pb.LIFECYCLE_STATE_READY
                 and any(not c.released for c in engine.status().captured), what="graphs captured again")
        assert generate(engine, [5, 6, 7], 4).execution.graph_steps
    finally:
        engine.drain_and_stop(5)


def test_max_graphs_is_honoured_and_keeps_the_graphs_traffic_used():
    engine = engine_for(policy(max_graphs=3))
    try:
        status = engine.status()
        kept = {(c.mode, c.size) for c in status.captured}
        assert kept == {(FULL, 1), (PIECEWISE, 1), (FULL, 2)}  # no traffic yet: the smallest sizes
        over = {(s.mode, s.size) for s in status.skipped if s.reason == pb.FALLBACK_REASON_SIZE_OVER_MAX_GRAPHS}
        assert over and not (over & kept)
        # 20-token prefills pad to a size left out. Each prompt starts with its own token: a repeated
        # prompt would find its first 16-token block in the prefix cache and prefill only 4 tokens.
        completion = generate(engine, list(range(3, 23)), 2)
        assert pb.FALLBACK_REASON_SIZE_OVER_MAX_GRAPHS in {e.reason for e in completion.execution.eager_steps}
        assert completion.execution.cached_prompt_tokens == 0
        for first in range(4, 7):
            assert generate(engine, list(range(first, first + 20)), 2).execution.cached_prompt_tokens == 0
        engine.apply_policy(policy(generation=2, max_graphs=2))
        wait_for(lambda: engine.status().policy_generation == 2 and engine.status().state == pb.LIFECYCLE_STATE_READY,
                 what="generation 2 captured")
        kept = {(c.mode, c.size) for c in engine.status().captured}
        assert len(kept) == 2 and (PIECEWISE, 24) in kept and (FULL, 1) in kept, kept  # what the traffic used
    finally:
        engine.drain_and_stop(5)


def test_the_ledger_is_the_new_model_s_after_a_reload():
    engine = engine_for(policy(), model="random:llama-1b", optimization_level=1)
    try:
        for _ in range(3):
            generate(engine, [5, 6, 7], 8)
        wait_for(lambda: pb.LEDGER_STAGE_STEADY in ledger(engine.status()), what="the steady stage")
        old = ledger(engine.status())
        engine.load_revision("random:llama-1b@5", "").result(300)
        wait_for(lambda: engine.status().state == pb.LIFECYCLE_STATE_READY, what="READY after the reload")
        new = ledger(engine.status())
        assert pb.LEDGER_STAGE_STEADY not in new
        w_old, w_new = old[pb.LEDGER_STAGE_WEIGHTS].device_used_bytes, new[pb.LEDGER_STAGE_WEIGHTS].device_used_bytes
        # The same shapes: the new weights stage is the old one's, not old and new weights together.
        assert abs(w_new - w_old) < 256 * MIB, (w_old / MIB, w_new / MIB)
        kv_old = old[pb.LEDGER_STAGE_KV_CACHE].device_used_bytes - w_old
        kv_new = new[pb.LEDGER_STAGE_KV_CACHE].device_used_bytes - w_new
        assert abs(kv_new - kv_old) < 256 * MIB
    finally:
        engine.drain_and_stop(5)


def test_idle_release_gives_the_device_its_memory_back():
    """Graph memory is the pool's; the device must have the memory back too, not only the figure."""
    engine = engine_for(policy(idle_release_seconds=2))
    try:
        generate(engine, [5, 6, 7], 4)
        wait_for(lambda: (s := engine.status()).captured and all(c.released for c in s.captured), timeout=30,
                 what="every graph released")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        left = total - free - engine.capture.graph_set.baseline_used
        assert left <= HELD_AT_MOST, f"{left / MIB:.1f} MiB more in use than before the first graph"
    finally:
        engine.drain_and_stop(5)
