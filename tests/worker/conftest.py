"""Fixtures that run real worker processes on loopback (see worker_harness.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from worker_harness import Worker, start_worker


@pytest.fixture(scope="module")
def module_workers(tmp_path_factory) -> Iterator[Callable[..., Worker]]:
    """Starts workers that live until the end of the module: ``module_workers(*flags, model=...)``."""
    started: list[Worker] = []
    log_dir = tmp_path_factory.mktemp("workers")

    def start(*flags: str, **kwargs) -> Worker:
        worker = start_worker(log_dir, *flags, **kwargs)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop(timeout=20)


@pytest.fixture
def fresh_workers(tmp_path) -> Iterator[Callable[..., Worker]]:
    """Starts workers that live until the end of one test."""
    started: list[Worker] = []

    def start(*flags: str, **kwargs) -> Worker:
        worker = start_worker(tmp_path / "workers", *flags, **kwargs)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop(timeout=20)


@pytest.fixture(scope="module")
def worker(module_workers) -> Worker:
    """The shared default worker of a module: random:tiny, 4 sequences, 128 tokens of context."""
    return module_workers()


@pytest.fixture(scope="module")
def runner():
    """A ModelRunner for ``random:tiny`` on the CPU (4 slots of 64 tokens, 64 tokens a step)."""
    from graphkeeper.worker.executor.runner import ModelRunner
    from graphkeeper.worker.model.kv_cache import KVCache
    from graphkeeper.worker.model.loader import load_model

    loaded = load_model("random:tiny", device="cpu", dtype="float32", max_positions=64)
    cache = KVCache(loaded.config, 4, 64, device=loaded.device, dtype=loaded.dtype)
    return ModelRunner(loaded, cache, max_tokens=64)
