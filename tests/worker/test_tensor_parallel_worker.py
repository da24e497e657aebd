"""Tensor parallel on the CPU: real workers over real gRPC, two ranks over Gloo.

A worker started with ``--tensor-parallel-size 2`` runs its engine core as rank 0 and one follower
process as rank 1, each holding half of the heads; its greedy tokens must equal the one-rank
worker's and ``transformers``' on the same float32 weights, one request at a time and batched,
with paged KV and a prompt prefix served from the prefix cache. A follower that dies, hangs or
fails to load takes the worker down (non-zero exit, the reason in its log) rather than leaving it
hanging; a follower whose engine core dies exits; sizes the worker cannot serve are refused at
boot, and a reload is refused with FAILED_PRECONDITION.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import grpc
import psutil
import pytest
from hf_reference import hf_greedy, tiny_hf_model
from worker_harness import GRAPHKEEPER, generate, generate_concurrently, make_request, wait_until

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.main import tensor_parallel_error

SHAPE = ("--dtype", "float32", "--max-num-seqs", "4", "--max-seq-len", "128", "--max-num-batched-tokens", "64")
PREFIX = [(7 * i + 3) % 500 + 3 for i in range(40)]  # two and a half blocks of 16, shared
PROMPTS = [PREFIX + [11, 12], PREFIX + [400, 401, 402], [5, 6, 7], PREFIX[:20] + [99]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict:
    """random:tiny@11 saved as a Hugging Face directory, and transformers' greedy tokens for it."""
    path = tmp_path_factory.mktemp("tiny-hf")
    hf = tiny_hf_model(path)
    return {"path": str(path), "refs": {tuple(p): hf_greedy(hf, p, MAX_NEW) for p in PROMPTS}}


@pytest.fixture(scope="module")
def workers(module_workers, model):
    """The same weights served by one rank and by two."""
    return (module_workers(*SHAPE, model=model["path"]),
            module_workers(*SHAPE, "--tensor-parallel-size", "2", model=model["path"]))


def request(prompt: list[int], name: str) -> pb.GenerateRequest:
    return make_request(prompt, MAX_NEW, request_id=name, ignore_eos=True)


def test_two_ranks_give_the_one_rank_tokens_and_transformers_tokens_one_at_a_time(workers, model):
    single, double = workers
    for i, prompt in enumerate(PROMPTS):
        want = model["refs"][tuple(prompt)]
        assert generate(single, request(prompt, f"one-{i}"))[0] == want
        assert generate(double, request(prompt, f"two-{i}"))[0] == want, f"prompt {i}"
    kv = double.status().kv_cache
    assert kv.prefix_caching and kv.prefix_hit_tokens >= 32  # the shared prefix came from the cache


def test_two_ranks_give_the_same_tokens_batched(workers, model):
    single, double = workers
    batch = [request(p, f"batch-{i}") for i, p in enumerate(PROMPTS * 2)]
    want = [model["refs"][tuple(p)] for p in PROMPTS * 2]
    assert [tokens for tokens, _ in generate_concurrently(double, batch)] == want
    assert [tokens for tokens, _ in generate_concurrently(single, batch)] == want
    assert double.status().kv_cache.blocks_used == 0  # every block came back


def test_a_seeded_drawn_request_gets_the_one_rank_tokens(workers):
    """Every rank draws with the seed rank 0 put in the plan, so a seeded request's tokens are the
    one-rank worker's (float32 logits that differ in the last bits do not move these draws)."""
    single, double = workers
    drawn = make_request(PROMPTS[0], MAX_NEW, temperature=0.8, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    assert generate(double, drawn)[0] == generate(single, drawn)[0]


def test_status_and_model_info_report_the_ranks(workers):
    single, double = workers
    assert single.status().tensor_parallel_size == 1 and single.model_info().tensor_parallel_size == 1
    info = double.model_info()
    assert double.status().tensor_parallel_size == 2 and info.tensor_parallel_size == 2
    # The model's shapes are the whole model's, not rank 0's half.
    assert (info.num_attention_heads, info.num_key_value_heads) == (4, 2)
    assert info.parameter_count < single.model_info().parameter_count  # rank 0 holds a shard
    token = double.log_path.parent / f"token-{double.target.rsplit(':', 1)[1]}"
    shown = subprocess.run([str(GRAPHKEEPER), "status", "--target", double.target, "--control-target",
                            double.control_target, "--token-file", str(token)],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "2 tensor parallel ranks (rank 0's shard)" in shown.stdout and "graph memory per rank" in shown.stdout


def test_a_reload_is_refused_with_failed_precondition_and_the_worker_serves_on(workers, model):
    _, double = workers
    with pytest.raises(grpc.RpcError) as err:
        double.control.LoadModelRevision(pb.LoadModelRevisionRequest(source=model["path"], revision="r2"),
                                         timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--tensor-parallel-size 2" in err.value.details()
    assert generate(double, request(PROMPTS[2], "after-reload"))[0] == model["refs"][tuple(PROMPTS[2])]


def follower_of(worker) -> psutil.Process:
    """Rank 1: the child of the engine core (itself the worker's child) running the follower."""
    for engine_core in psutil.Process(worker.proc.pid).children():
        for child in engine_core.children():
            if "spawn_main" in " ".join(child.cmdline()):  # not the resource tracker, the other child
                return child
    raise AssertionError("no follower process under the engine core")


def test_a_follower_that_dies_fails_the_worker_and_it_exits_non_zero(fresh_workers):
    worker = fresh_workers(*SHAPE, "--tensor-parallel-size", "2")
    follower = follower_of(worker)
    stream = worker.inference.Generate(make_request([5, 6, 7], 100, ignore_eos=True), timeout=60)
    os.kill(follower.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError):  # the stream ends with an error, it does not hang
        for _ in stream:
            pass
    assert worker.proc.wait(timeout=30) != 0
    assert time.monotonic() - started < 30
    assert "tensor parallel: rank 1" in worker.log(), worker.log()[-4000:]


def test_a_follower_that_hangs_fails_the_worker_once_the_collective_times_out(fresh_workers):
    worker = fresh_workers(*SHAPE, "--tensor-parallel-size", "2", env={"GRAPHKEEPER_TP_TIMEOUT_SECONDS": "10"})
    follower = follower_of(worker)
    os.kill(follower.pid, signal.SIGSTOP)  # alive, but never answers: only the timeout can tell
    try:
        stream = worker.inference.Generate(make_request([5, 6, 7], 20, ignore_eos=True), timeout=120)
        with pytest.raises(grpc.RpcError):
            for _ in stream:
                pass
        assert worker.proc.wait(timeout=60) != 0
        assert "tensor parallel: rank 0's forward pass failed" in worker.log()
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            follower.kill()


def test_a_follower_that_fails_to_load_ends_the_start_with_its_reason(fresh_workers):
    worker = fresh_workers(*SHAPE, "--tensor-parallel-size", "2", wait=False,
                           env={"GRAPHKEEPER_INJECT_RANK_LOAD_FAILURE": "1"})
    assert worker.proc.wait(timeout=120) != 0
    assert "tensor parallel: rank 1 failed: RuntimeError: injected load failure on rank 1" in worker.log()


def test_a_drained_worker_stops_its_follower_and_exits_zero(fresh_workers):
    worker = fresh_workers(*SHAPE, "--tensor-parallel-size", "2")
    follower = follower_of(worker)
    assert worker.stop(timeout=60) == 0
    follower.wait(timeout=30)


def test_a_follower_whose_engine_core_dies_exits(fresh_workers):
    worker = fresh_workers(*SHAPE, "--tensor-parallel-size", "2")
    follower = follower_of(worker)
    engine_core = follower.parent()
    os.kill(engine_core.pid, signal.SIGKILL)
    follower.wait(timeout=30)  # raises psutil.TimeoutExpired if it outlived its rank 0
    assert worker.proc.wait(timeout=30) != 0


@pytest.mark.parametrize(("flags", "message"), [
    (("--tensor-parallel-size", "3"), "do not split evenly over tensor parallel size 3"),
    (("--tensor-parallel-size", "0"), "--tensor-parallel-size must be in 1..8"),
    (("--tensor-parallel-size", "9"), "--tensor-parallel-size must be in 1..8"),
    (("--tensor-parallel-size", "2", "--enable-sleep-mode"), "--enable-sleep-mode is not supported"),
])
def test_a_size_the_worker_cannot_serve_is_refused_at_boot(tmp_path, flags, message):
    out = subprocess.run([str(GRAPHKEEPER), "worker", "--model", "random:tiny", *flags],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_the_rank_count_is_checked_against_the_gpus_there_are():
    assert tensor_parallel_error(1, "cuda", 0) is None  # one rank is the plain worker
    assert tensor_parallel_error(2, "cuda", 2) is None
    assert tensor_parallel_error(2, "cuda:0", 2) is None
    assert "shows 1 CUDA device" in tensor_parallel_error(2, "cuda", 1)
    assert "--device must be cuda or cuda:0" in tensor_parallel_error(2, "cuda:1", 4)
    assert tensor_parallel_error(2, "cpu", 0) is None
    assert "1..8" in tensor_parallel_error(16, "cuda", 16)


def test_one_rank_is_the_plain_worker(tmp_path):
    """TP=1 builds no follower, no facade: the slot's runner and capture controller are the plain ones."""
    from graphkeeper.worker.engine.core import Engine
    from graphkeeper.worker.engine.tp_ranks import MirroredCapture, RankedRunner
    from graphkeeper.worker.executor.runner import ModelRunner
    from graphkeeper.worker.settings import EngineSettings

    engine = Engine(EngineSettings(model="random:tiny", dtype="float32", max_num_seqs=2, max_seq_len=64,
                                   max_num_batched_tokens=64, compile_cache_dir=str(tmp_path)))
    engine.start()
    assert engine.ready.wait(120) and engine.failed is None
    assert engine.slot.ranks is None and type(engine.slot.runner) is ModelRunner
    assert not isinstance(engine.capture, MirroredCapture) and not isinstance(engine.slot.runner, RankedRunner)
    engine.drain_and_stop(5)
    wait_until(lambda: not engine.thread.is_alive(), what="engine stopped")
