"""Tensor parallel on two GPUs, through real worker processes over gRPC: a worker with
``--tensor-parallel-size 2`` (rank 0 on cuda:0, its follower on cuda:1, NCCL between them) gives
the same greedy tokens as a one-GPU worker in float32, alone and batched, eager (-O0) and with
every graph mode captured (the all-reduces inside the graphs), with paged KV and a prompt prefix
served from the prefix cache; it reports two ranks and replays its graphs; a follower killed makes
it exit non-zero. Run with ``pytest -m cuda tests/gpu/test_tensor_parallel_worker_cuda.py`` on a
machine with two GPUs (``nvidia-h200-x2``)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))  # the worker tests' harness

from worker_harness import generate, generate_concurrently, make_request, start_worker  # noqa: E402

from graphkeeper.proto import worker_pb2 as pb  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs an NVIDIA GPU on each of two ranks: two GPUs "
                              "(run pytest -m cuda on nvidia-h200-x2)"),
]

MODEL = "random:llama-1b"
SHAPE = ("--device", "cuda", "--dtype", "float32", "--max-num-seqs", "8", "--max-seq-len", "512",
         "--max-num-batched-tokens", "256", "--kv-cache-memory", "2Gi")
PREFIX = [128000, *range(1000, 1040)]  # two and a half KV blocks, shared
PROMPTS = [PREFIX + [11, 12], PREFIX + [400, 401, 402], [128000, 5, 6, 7], PREFIX[:20] + [99]]
NEW_TOKENS = 16
MODES = ("", "Piecewise", "Full", "FullDecodeOnly", "FullAndPiecewise")


def tokens_of(worker, batched: bool) -> list[list[int]]:
    requests = [make_request(p, NEW_TOKENS, request_id=f"r{i}", ignore_eos=True) for i, p in enumerate(PROMPTS)]
    if batched:
        return [tokens for tokens, _ in generate_concurrently(worker, requests)]
    return [generate(worker, r)[0] for r in requests]


def start(tmp_path: Path, mode: str, *flags: str):
    """A worker of ``flags``: eager (-O0) when ``mode`` is empty, else that graph mode (-O1)."""
    graph = ("-O0",) if not mode else ("-O1", "--graph-mode", mode)
    return start_worker(tmp_path, *SHAPE, *graph, *flags, model=MODEL, base_args=False)


@pytest.mark.parametrize("mode", MODES)
def test_two_gpus_give_the_one_gpu_tokens_in_every_graph_mode(tmp_path, mode):
    single = start(tmp_path / "one", mode)
    try:
        want_alone, want_batched = tokens_of(single, False), tokens_of(single, True)
        one_status = single.status()
    finally:
        single.stop(timeout=60)
    double = start(tmp_path / "two", mode, "--tensor-parallel-size", "2")
    try:
        status = double.status()
        assert status.tensor_parallel_size == 2 and double.model_info().tensor_parallel_size == 2
        assert status.effective_mode == one_status.effective_mode
        if mode:  # what is kept may differ by the ranks' own timings; that graphs are held may not
            assert status.captured and one_status.captured
        assert tokens_of(double, False) == want_alone
        assert tokens_of(double, True) == want_batched
        assert double.status().kv_cache.prefix_hit_tokens >= 32
        if mode:
            assert double.status().graph_steps > 0  # the graphs (with their all-reduces) were replayed
    finally:
        assert double.stop(timeout=60) == 0


def test_a_killed_follower_ends_the_two_gpu_worker(tmp_path):
    worker = start(tmp_path, "FullAndPiecewise", "--tensor-parallel-size", "2")
    engine_core = psutil.Process(worker.proc.pid).children()
    follower = next(c for p in engine_core for c in p.children() if "spawn_main" in " ".join(c.cmdline()))
    os.kill(follower.pid, signal.SIGKILL)
    assert worker.proc.wait(timeout=60) != 0
    assert "tensor parallel: rank 1" in worker.log()


def test_model_info_reports_the_whole_model(tmp_path):
    worker = start(tmp_path, "", "--tensor-parallel-size", "2")
    try:
        info = worker.model_info()
        assert (info.num_attention_heads, info.num_key_value_heads, info.tensor_parallel_size) == (32, 8, 2)
        assert worker.status().state == pb.LIFECYCLE_STATE_READY
    finally:
        worker.stop(timeout=60)
