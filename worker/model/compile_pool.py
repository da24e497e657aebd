"""Inductor's compile workers: a pool of processes while a cold start compiles the step, none after.

Why: on a cold cache Inductor generates the step's Triton kernels and, in-process (one compile
thread, vLLM's setting), compiles them one after another: 14-18 s of an H100 host's cold start.
With a pool, Inductor hands each kernel to a worker process as it generates it, and the rest of
code generation goes on meanwhile. A pool outlives compilation though: its processes hold memory
while the worker serves, and the interpreter's exit waits for them (a worker that compiled cold
with a pool stayed alive over a minute after SIGTERM). So:

- a warm start (the compiled step already in the cache directory: nothing to compile) never
  starts one;
- a cold start starts it before kernel tuning, so that its processes have imported torch by the
  time Inductor asks (Inductor compiles in-process while the pool is not ready yet);
- the pool is shut down as soon as the step is built, and Inductor is left at one thread;
- the pool's processes get this interpreter's module path without the working directory: they
  import only torch and Triton, and a working directory may hold packages named like the standard
  library's modules (this repository's ``operator/`` is one), which stopped every pool process at
  its interpreter's first import (Inductor then compiled in-process while waiting for the pool).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from graphkeeper.worker.kernels.compile_ahead import thread_count, usable_cpus

log = logging.getLogger(__name__)

#: Where Inductor keeps the compiled graphs it can load instead of compiling (under its cache dir).
FX_GRAPH_DIR = Path("inductor") / "fxgraph"


def cached_graphs(cache_dir: str) -> int:
    """Compiled graphs the compile cache directory holds (0: a cold start compiles everything)."""
    root = Path(cache_dir) / FX_GRAPH_DIR
    try:
        return sum(1 for p in root.rglob("*") if p.is_file())
    except OSError:
        return 0


def pool_size(cached: int, cpus: int) -> int:
    """Compile workers (pure): none (1, in-process) when the cache holds compiled graphs, else one
    per usable CPU up to ``compile_ahead.MAX_THREADS``."""
    return 1 if cached else thread_count(cpus)


def worker_path(paths: list[str], cwd: str) -> list[str]:
    """The module path for the pool's processes (pure): ``paths`` without the working directory
    (an empty entry, or ``cwd`` itself)."""
    here = os.path.abspath(cwd)
    return [p for p in paths if p and os.path.abspath(p) != here]


def start(cache_dir: str) -> int:
    """Sets Inductor's compile threads for this cache directory and, for a pool, starts its
    processes now; returns the thread count (1: no pool)."""
    import torch._inductor.config as inductor_config

    threads = pool_size(cached_graphs(cache_dir), usable_cpus())
    inductor_config.compile_threads = threads
    if threads > 1:
        from torch._inductor.async_compile import AsyncCompile

        os.environ.setdefault("TORCH_CUSTOM_PYTHONPATH", os.pathsep.join(worker_path(sys.path, os.getcwd())))
        AsyncCompile.warm_pool()
        AsyncCompile.wakeup()
        log.info("nothing compiled in the cache yet: %d compile worker processes while the step compiles", threads)
    return threads


def stop(threads: int) -> None:
    """Shuts the pool down (if ``start`` started one) and leaves Inductor compiling in-process."""
    import torch._inductor.config as inductor_config

    if threads > 1:
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    inductor_config.compile_threads = 1
