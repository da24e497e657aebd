"""torch's compiler (Dynamo and Inductor) imported, and Triton's key hashed, on threads off a
start's path.

Why: the first use of ``torch.compile`` imports Dynamo and Inductor, about 2 s of module imports
(1.7 s on a 2-core machine); a start made them one after the other on its own path, after the
kernels were tuned and before the step was traced (a warm H100 start: 2.0-2.9 s of its 10.8 s).
And the first Triton kernel a process compiles or finds in its cache (the PDL probe's) waits for
Triton's key: a hash of its compiler's sources and its 400 MB library, about 1 s of an H100 host's
warm start (py-spy, 2026-12-07), mostly reading and hashing outside the interpreter lock: a thread
of its own hashes it beside the imports, and the probe waits for that thread (``wait_for_key``)
instead of hashing it a second time beside it. Two moments have the interpreter to spare:

- the engine core's start, from the end of its own imports: the worker tells it at its spawn
  whether its flags compile (``spawn.compiles``), and it starts the threads then (``start``),
  before its settings arrive. Its imports are the slower of the two processes' (a profiled H100
  start found it never waiting for its settings, 2026-12-07), so the threads run beside its setup
  and gain where that waits on the device or outside the interpreter lock (the key's hashing);
- kernel tuning, or installing shipped tuning, which spends its time mostly outside the
  interpreter lock (the GPU timing candidates, Triton's compiler on threads): a start that did not
  begin the import earlier begins it there (``ahead``).

The start joins the import before it compiles; an import that failed there is not reported there:
the start's own import then raises it, where it always did. Importing touches no device (a GPU
test checks that CUDA is not initialised by it) and reads no cache directory: Inductor and Triton
read theirs from the environment when they compile, after the start has chosen them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: What the first compilation imports, in the order it does.
MODULES = ("torch._dynamo", "torch._inductor.config", "torch._inductor.compile_fx")

_thread: threading.Thread | None = None  # imports MODULES
_key_thread: threading.Thread | None = None  # hashes Triton's key
_lock = threading.Lock()


def start() -> None:
    """Starts hashing Triton's key and importing ``MODULES``, each on a thread of its own (the hash
    mostly outside the interpreter lock, the imports inside it), once per process: a later call
    finds them started."""
    global _thread, _key_thread
    with _lock:
        if _thread is None:
            _key_thread = threading.Thread(target=_hash_triton_key, name="hash-triton-key", daemon=True)
            _key_thread.start()
            _thread = threading.Thread(target=_import, args=(time.perf_counter(),), name="import-compiler",
                                       daemon=True)
            _thread.start()


def ahead() -> Callable[[], None]:
    """``start`` (if nothing started the import yet); returns the join, which logs how long it waited."""
    start()
    thread = _thread

    def join() -> None:
        waited = time.perf_counter()
        thread.join()
        log.info("torch's compiler imported ahead; %.1f s waited for it", time.perf_counter() - waited)

    return join


def wait_for_key() -> None:
    """Waits for the hash of Triton's key, when ``start`` began it (else returns at once)."""
    if _key_thread is not None:
        _key_thread.join()


def _hash_triton_key() -> None:
    try:
        from triton.runtime.cache import triton_key

        triton_key()  # cached for the process: the first compile or cache lookup finds it
    except Exception as err:  # noqa: BLE001 - no Triton (or another one): its first compile hashes what it has
        log.debug("Triton's key not hashed ahead: %s", err)


def _import(started: float) -> None:
    import importlib

    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - the start's own import raises it again, where it is reported
            log.warning("importing %s ahead failed (the compile imports it): %s", name, err)
            return
    log.debug("imported torch's compiler in %.1f s", time.perf_counter() - started)
