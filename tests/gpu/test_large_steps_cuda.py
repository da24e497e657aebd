"""Graphs for large steps on a real GPU: a budget of 2,048 tokens captures coarse PIECEWISE graphs
of 1,024 and 2,048 tokens beside the default ladder; a 1,500-token prefill step replayed on the
2,048 graph equals the same step eager (float32: the same greedy tokens, hidden states within
1e-4); each coarse size the phase did not keep says ``compute_bound``, and so do the steps that
pad to it. Run with ``pytest -m cuda -k large_steps`` on the GPU machine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_graphs_cuda import generate  # tests/gpu

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.executor.graphs.capture import CaptureJob
from graphkeeper.worker.executor.graphs.coarse_memory import VERDICTS_FILE
from graphkeeper.worker.executor.graphs.graph_set import GraphSet
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.model.loader import load_model
from graphkeeper.worker.plan import PrefillChunk, StepPlan

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]

PIECEWISE = pb.GRAPH_MODE_PIECEWISE
BUDGET, PROMPT, CONTEXT = 2048, 1500, 2048


def test_a_1500_token_prefill_replayed_on_the_2048_graph_equals_eager():
    """The runner level, whatever the economics decide: the graph is recorded, validated and
    replayed for a real prefill step padded from 1,500 to 2,048 tokens."""
    loaded = load_model("random:tiny@5", device="cuda", dtype="float32", max_positions=CONTEXT)
    cache = KVCache(loaded.config, 2, CONTEXT, device=loaded.device, dtype=loaded.dtype, scratch_slots=1)
    runner = ModelRunner(loaded, cache, max_tokens=BUDGET)
    graphs = GraphSet(runner)
    job = CaptureJob(graphs, [(PIECEWISE, 2048), (PIECEWISE, 1024)], tolerance=1e-4)  # no coarse verdict here
    job.run_all()
    job.finish()
    assert set(graphs.captured) == {(PIECEWISE, 2048), (PIECEWISE, 1024)}, graphs.skipped
    prompt = torch.randint(3, 500, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    slots = np.zeros(PROMPT, dtype=np.int64)
    plan = StepPlan(prompt_tokens=prompt, positions=np.arange(PROMPT, dtype=np.int64), slots=slots, num_decode=0,
                    prefill=[PrefillChunk(0, PROMPT, 0, 0)], sample_rows=np.array([PROMPT - 1]),
                    sample_slots=slots[[PROMPT - 1]], decode_tokens=np.zeros(0, dtype=np.int64))
    eager = runner.forward_eager(runner.prepare(plan, PROMPT), PROMPT)[:PROMPT].clone()
    got = graphs.replay(PIECEWISE, 2048, runner.prepare(plan, 2048))[:PROMPT]
    assert ((got - eager).norm() / eager.norm()).item() < 1e-4
    rows = torch.arange(0, PROMPT, 25, device=loaded.device)
    assert torch.equal(loaded.model.logits(got[rows]).argmax(-1), loaded.model.logits(eager[rows]).argmax(-1))
    graphs.release()


def engine(mode: int, cache_dir: str = "") -> Engine:
    settings = EngineSettings(model="random:tiny@5", device="cuda", dtype="float32", max_num_seqs=4,
                              max_seq_len=CONTEXT, max_num_batched_tokens=BUDGET,
                              policy=pb.GraphPolicy(mode=mode))
    if cache_dir:
        settings.compile_cache_dir = cache_dir
    e = Engine(settings)
    e.start()
    assert e.ready.wait(600) and e.failed is None, e.failed
    return e


def test_a_worker_with_budget_2048_keeps_coarse_graphs_that_pay_and_labels_the_rest_compute_bound():
    prompt = torch.randint(3, 500, (PROMPT,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = engine(pb.GRAPH_MODE_NONE)
    try:
        expected, _ = generate(reference, prompt, 8)
    finally:
        reference.drain_and_stop(5)
    e = engine(pb.GRAPH_MODE_FULL_AND_PIECEWISE)
    try:
        status = e.status()
        captured = {c.size: c for c in status.captured if c.mode == PIECEWISE}
        skipped = {s.size: s for s in status.skipped if s.mode == PIECEWISE}
        for size in (1024, 2048):  # both recorded and timed; each either kept or released as compute bound
            assert size in captured or skipped[size].reason == pb.FALLBACK_REASON_COMPUTE_BOUND, (size, skipped)
            if size in skipped:
                assert "does not beat the steps it serves" in skipped[size].message
            else:
                assert captured[size].replay_seconds > 0 and captured[size].eager_seconds > 0
        got, completion = generate(e, prompt, 8)
        assert got == expected, "the 1,500-token prefill step and the decode after it changed the tokens"
        run = completion.execution
        if 2048 in captured:  # the whole prompt in one step (nothing else decodes), padded to 2,048
            assert any(g.mode == PIECEWISE and g.size == 2048 and g.steps >= 1 for g in run.graph_steps), run
        else:
            assert any(x.reason == pb.FALLBACK_REASON_COMPUTE_BOUND for x in run.eager_steps), run
        assert all(x.reason == pb.FALLBACK_REASON_COMPUTE_BOUND for x in run.eager_steps), run
        assert status.step_budget.tokens == BUDGET and status.step_budget.tokens_source == "--max-num-batched-tokens"
    finally:
        e.drain_and_stop(5)


def coarse_status(e: Engine) -> tuple[set[int], dict[int, pb.SkippedSize]]:
    status = e.status()
    return ({c.size for c in status.captured if c.mode == PIECEWISE},
            {s.size: s for s in status.skipped if s.mode == PIECEWISE})


def test_a_restart_leaves_out_the_coarse_sizes_an_earlier_start_measured_not_to_pay(tmp_path):
    """The first start judges 1,024 and 2,048 and writes their verdicts beside the compile cache;
    a restart with a verdict saying 1,024 does not pay (whatever this GPU measured) captures no
    1,024 graph, labels its steps compute bound with the earlier verdict and prices them with the
    remembered eager time; a file measured for other facts is ignored and rewritten."""
    fp = pb.GRAPH_MODE_FULL_AND_PIECEWISE
    first = engine(fp, str(tmp_path))
    try:
        path = Path(first.slot.compile_report.cache_dir) / VERDICTS_FILE
    finally:
        first.drain_and_stop(5)
    data = json.loads(path.read_text())
    assert set(data["sizes"]) == {"1024", "2048"}, data
    assert all(v["replay_seconds"] > 0 and v["eager_seconds"] > 0 for v in data["sizes"].values()), data
    data["sizes"]["1024"].update(kept=False, eager_seconds=0.123)
    path.write_text(json.dumps(data))

    second = engine(fp, str(tmp_path))
    try:
        captured, skipped = coarse_status(second)
        assert 1024 not in captured
        assert skipped[1024].reason == pb.FALLBACK_REASON_COMPUTE_BOUND
        assert "earlier start" in skipped[1024].message and skipped[1024].eager_seconds == pytest.approx(0.123)
        prompt = torch.randint(3, 500, (900,), generator=torch.Generator().manual_seed(3)).tolist()
        _, completion = generate(second, prompt, 2)  # 900 prompt tokens in one step: it pads to 1,024
        run = completion.execution
        assert any(x.reason == pb.FALLBACK_REASON_COMPUTE_BOUND for x in run.eager_steps), run
        assert not any(g.size == 1024 for g in run.graph_steps), run
    finally:
        second.drain_and_stop(5)
    assert json.loads(path.read_text())["sizes"]["1024"]["eager_seconds"] == pytest.approx(0.123)  # kept as left out

    data = json.loads(path.read_text())
    data["facts"]["block_size"] = -1
    path.write_text(json.dumps(data))
    third = engine(fp, str(tmp_path))
    try:
        captured, skipped = coarse_status(third)
        assert 1024 in captured or "earlier start" not in skipped[1024].message, skipped
    finally:
        third.drain_and_stop(5)
    assert json.loads(path.read_text())["facts"]["block_size"] != -1
