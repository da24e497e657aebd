"""Tensor parallelism on two GPUs: two NCCL rank processes (GPU 0 and GPU 1) run the step plans of
``tests/tp_harness.py`` (batched prefill, a prefix-cache hit beside decoding rows, greedy decode
steps, paged KV) eagerly and from CUDA graphs recorded with the all-reduces inside, FULL and
PIECEWISE, on the plain, fused-kernel and compiled steps, and compute what one GPU holding the
whole model computes: the same greedy tokens in float32, logits close, and the very same logits
on both ranks.

Run on a machine with two GPUs (nvidia-h200-x2): ``pytest -m cuda tests/gpu/test_tensor_parallel_cuda.py``.
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch
from tp_harness import MAX_TOKENS, Step, eager_step, run_ranks, single

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.executor.graphs.capture import CaptureJob
from graphkeeper.worker.executor.graphs.graph_set import GraphSet
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.model.step import prepare_step

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="needs an NVIDIA GPU on each of two ranks: torch.cuda.device_count() >= 2 "
                              "(run pytest -m cuda on nvidia-h200-x2)"),
]

FULL, PIECEWISE = pb.GRAPH_MODE_FULL, pb.GRAPH_MODE_PIECEWISE
SOURCE = "random:tiny@5"
#: Captured sizes: 4 decode rows (FULL and PIECEWISE), the mixed step's 12 rows and the batched
#: prefill's 62 rows (PIECEWISE: attention between the pieces runs eagerly).
SIZES = (4, 16, MAX_TOKENS)
#: One GPU and two add up the output and down projections in different orders (two halves and
#: a sum against one pass), so float32 logits differ in their last bits; the tokens may not.
LOGIT_TOLERANCE = 1e-4


def graph_setup(runner: ModelRunner, mode: int | None, step: str) -> Step:
    """Prepares the rank's step (``plain``, ``fused`` kernels or ``compiled``), captures ``mode``'s
    graphs when ``mode`` is given (every rank the same keys, in the same order: each recording
    holds the same all-reduces), and returns how the scenario runs a plan."""
    if step != "plain":
        prepare_step(runner.model, compile=step == "compiled", cache_root=tempfile.mkdtemp(prefix="gk-tp-"),
                     quantization="none", warm_up=lambda: runner.warm_up(MAX_TOKENS), level=2, reason="test")
        runner.model.use_pieces(runner.model.pieces, runner.model.kernels)  # the general step at every size
    if mode is None:
        return eager_step
    graphs = GraphSet(runner)
    sizes = SIZES[:1] if mode == FULL else SIZES
    job = CaptureJob(graphs, [(mode, s) for s in reversed(sizes)], tolerance=1e-3)
    job.run_all()
    job.finish()
    if graphs.skipped:
        raise AssertionError(f"graphs skipped: {graphs.skipped}")
    return functools.partial(replay_step, graphs, mode, sizes)


def replay_step(graphs: GraphSet, mode: int, sizes: tuple[int, ...], runner: ModelRunner, plan) -> torch.Tensor:
    """Replays the smallest captured size that holds the plan; FULL graphs hold decode steps only,
    so a prefill runs eagerly there (as the dispatcher would run it)."""
    size = next((s for s in sizes if s >= plan.num_tokens), None)
    if size is None or (mode == FULL and not plan.uniform_decode):
        return eager_step(runner, plan)
    return graphs.replay(mode, size, runner.prepare(plan, size))


@pytest.fixture(scope="module")
def whole() -> dict[str, dict]:
    """One GPU's results for each step kind, eager (a replay computes what its eager step does)."""
    return {step: single(SOURCE, "cuda", functools.partial(graph_setup, mode=None, step=step))
            for step in STEPS}


STEPS = ("plain", "fused", "compiled")


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("mode", [None, FULL, PIECEWISE], ids=["eager", "full", "piecewise"])
def test_two_nccl_ranks_compute_the_one_gpu_tokens_in_every_graph_mode(tmp_path, whole, mode, step):
    ranks = run_ranks(2, SOURCE, "cuda", tmp_path, setup=functools.partial(graph_setup, mode=mode, step=step),
                      timeout_s=540)
    whole = whole[step]
    assert [r["heads"] for r in ranks] == [(2, 1, 64)] * 2
    assert [r["agreed"] for r in ranks] == ["rank 0's choice"] * 2
    first = ranks[0]
    assert first["tokens"] == whole["tokens"]
    for got, want in zip(first["logits"], whole["logits"], strict=True):
        assert (got - want).abs().max().item() <= LOGIT_TOLERANCE
    assert ranks[1]["tokens"] == first["tokens"]
    for a, b in zip(ranks[1]["logits"], first["logits"], strict=True):
        assert torch.equal(a, b)  # the all-reduce leaves the same sum on both ranks


def test_a_safetensors_checkpoint_loads_sharded_onto_two_gpus(tmp_path, whole):
    from graphkeeper.worker.model.loader import load_model, save_hf_directory

    checkpoint = tmp_path / "checkpoint"
    save_hf_directory(load_model(SOURCE, device="cpu", dtype="float32", max_positions=64).model, checkpoint)
    out = tmp_path / "ranks"
    out.mkdir()
    ranks = run_ranks(2, str(checkpoint), "cuda", out, timeout_s=300)
    assert ranks[0]["tokens"] == whole["plain"]["tokens"] == ranks[1]["tokens"]
