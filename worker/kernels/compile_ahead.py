"""Compiling a batch of Triton kernels at once, on several threads, before any of them runs.

Why: kernel tuning at a cold start times about fifty candidate kernels (tiles of the skinny product
and of the fused row product, per reduction length), and Triton compiled each one at its first
launch, one after another on the engine thread: tuning took 12-18 s of an H100 host's cold start,
most of it compiling (5.6-7.9 s with the candidates compiled here first).
Triton's compiler spends most of its time outside the interpreter lock (MLIR and LLVM passes,
``ptxas`` in a subprocess), so threads compile side by side: on a 2-core machine, 24 of the skinny
kernels took 5.0 s one after another and 3.0 s on two threads.

``compiling(threads)`` opens Triton's asynchronous compile mode on a thread pool and makes every
launch made through ``launcher`` (and ``LaunchMemo``) a *dry* one: the kernel is specialized on the
call's real arguments exactly as a launch would be, its compilation is queued, and nothing runs on
the GPU. Leaving the block waits for every compilation; the real launches after it find their
kernels compiled. A compilation that fails is dropped here and fails again at its real launch, as
it did before.

Only calls whose outputs nobody reads belong inside the block (tuning's candidates on random
inputs): a dry launch leaves its output tensor as it was allocated.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

log = logging.getLogger(__name__)

#: At most this many compiler threads: past it the host's other work (the API process, the
#: tokenizer) would wait behind the compiler.
MAX_THREADS = 8

_dry: ContextVar[bool] = ContextVar("graphkeeper_compile_ahead", default=False)


def thread_count(cpus: int, limit: int = MAX_THREADS) -> int:
    """Compiler threads for ``cpus`` usable CPUs (pure): all of them up to ``limit``, at least one."""
    return max(1, min(limit, cpus))


def usable_cpus() -> int:
    """The CPUs this process may run on: torch's thread count, which the engine core sizes from the
    container's CPU quota and its CPU affinity (``engine/cpu_quota.py``)."""
    import torch

    return max(1, torch.get_num_threads())


def dry() -> bool:
    """Whether launches are being compiled ahead (not run)."""
    return _dry.get()


def launcher(kernel: Any, grid: tuple[int, ...]) -> Callable[..., Any]:
    """``kernel[grid]``, or inside ``compiling`` its dry launch (compile only, on the pool)."""
    if _dry.get():
        return lambda *args, **kwargs: kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid]


@contextlib.contextmanager
def compiling(what: str, threads: int | None = None) -> Iterator[None]:
    """Launches inside the block compile on ``threads`` threads (default: ``usable_cpus``, at most
    ``MAX_THREADS``) and run nothing; the block ends when every compilation has. With one thread,
    or without Triton's asynchronous mode, the dry launches compile one after another, as the real
    launches would have."""
    threads = threads or thread_count(usable_cpus())
    mode = _async_mode()
    if mode is None or threads <= 1:
        with _dry_launches():
            yield
        return
    start = time.perf_counter()
    # Left in reverse: dry launches end, then the mode waits for every compilation, then the pool.
    with (ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool,
          mode(pool, ignore_errors=True) as active, _dry_launches()):
        yield
    queued = len(active.raw_futures)
    log.info("compiled %d %s kernels ahead on %d threads in %.1f s", queued, what, threads,
             time.perf_counter() - start)


@contextlib.contextmanager
def _dry_launches() -> Iterator[None]:
    token = _dry.set(True)
    try:
        yield
    finally:
        _dry.reset(token)


def _async_mode() -> Any:
    """Triton's ``AsyncCompileMode`` (Triton 3.5+), or None where this Triton has none."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


def started(what: str, launches: Callable[[], None], threads: int | None = None) -> Callable[[], None]:
    """Opens a ``compiling`` block, makes ``launches()``'s launches in it (dry) and returns while
    their kernels compile; the returned wait leaves the block (the real launches after it find
    them compiled).

    Why: a start compiles kernels it knows it will launch while it does something else (kernel
    tuning times its candidates on the GPU, mostly waiting for it), and waits only before its first
    real launch of them. The block is opened in a copy of the caller's context, so the caller's own
    launches meanwhile run (and compile) as before, and another ``compiling`` block may open; the
    dry launches, and whatever they allocate on the device, are the caller's thread's, made before
    it goes on (nothing happens on another thread while it records a CUDA graph but compiling). A
    failure is logged, never raised: the real launches compile what is missing."""
    block = contextlib.ExitStack()
    context = contextvars.copy_context()

    def open_and_launch() -> None:
        block.enter_context(compiling(what, threads))
        launches()

    try:
        context.run(open_and_launch)
    except Exception as err:  # noqa: BLE001 - an optimization of the start, never a failed start
        log.warning("compiling the %s kernels ahead failed (their first launches compile them): %s", what, err)

    def wait() -> None:
        waited = time.perf_counter()
        context.run(block.close)
        log.info("%.1f s waited for the %s kernels compiled ahead", time.perf_counter() - waited, what)

    return wait
