"""Inductor's compile workers around a cold compile: none when the cache directory holds compiled
graphs, a pool of real worker processes when it holds none, and nothing left of the pool after
``stop`` (a pool that outlived compilation kept a worker alive after SIGTERM)."""

from __future__ import annotations

import pytest

from graphkeeper.worker.kernels.compile_ahead import MAX_THREADS, usable_cpus
from graphkeeper.worker.model import compile_pool


def test_pool_size_is_one_thread_whenever_the_cache_holds_a_compiled_graph():
    assert compile_pool.pool_size(cached=3, cpus=16) == 1
    assert compile_pool.pool_size(cached=0, cpus=16) == MAX_THREADS
    assert compile_pool.pool_size(cached=0, cpus=1) == 1


def test_the_pool_s_module_path_leaves_out_the_working_directory(tmp_path):
    here = str(tmp_path)
    assert compile_pool.worker_path(["", here, here + "/", "/usr/lib/python3.11", "/site"], here) == [
        "/usr/lib/python3.11", "/site"]


def test_cached_graphs_counts_the_fx_graph_files(tmp_path):
    assert compile_pool.cached_graphs(str(tmp_path)) == 0
    assert compile_pool.cached_graphs(str(tmp_path / "missing")) == 0
    graphs = tmp_path / compile_pool.FX_GRAPH_DIR / "ab"
    graphs.mkdir(parents=True)
    (graphs / "one").write_bytes(b"x")
    (graphs / "two").write_bytes(b"y")
    assert compile_pool.cached_graphs(str(tmp_path)) == 2


def test_a_warm_cache_starts_no_pool(tmp_path):
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config

    graphs = tmp_path / compile_pool.FX_GRAPH_DIR
    graphs.mkdir(parents=True)
    (graphs / "graph").write_bytes(b"x")
    threads = compile_pool.start(str(tmp_path))
    try:
        assert threads == 1 and inductor_config.compile_threads == 1
        assert not async_compile._pool_set
    finally:
        compile_pool.stop(threads)


def test_a_cold_cache_starts_a_pool_of_processes_and_stop_ends_them(tmp_path):
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config

    if usable_cpus() < 2:
        pytest.skip("one usable CPU: a cold compile runs in-process, there is no pool to start")
    threads = compile_pool.start(str(tmp_path))
    try:
        assert threads == min(MAX_THREADS, usable_cpus()) and inductor_config.compile_threads == threads
        pools = list(async_compile._pool_set)
        assert len(pools) == 1
        sidecar = pools[0].process
        # Its processes start and answer (run from this repository's root, whose operator/
        # package once stopped them at their first import): Inductor uses the pool only then.
        assert async_compile.AsyncCompile._ready_future.result(timeout=120) == "ready"
        assert async_compile.AsyncCompile.use_process_pool()
        assert sidecar.poll() is None
    finally:
        compile_pool.stop(threads)
    assert sidecar.wait(timeout=60) is not None
    assert not async_compile._pool_set and inductor_config.compile_threads == 1
