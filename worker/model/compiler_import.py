"""torch's compiler (Dynamo and Inductor) imported on a thread while a start tunes its kernels.

Why: the first use of ``torch.compile`` imports Dynamo and Inductor, about 2.5 s of module imports
(``torch._inductor.config`` alone 1.3 s on a 2-core machine); a start made them one after the other on
its own path, after the kernels were tuned and before the step was traced (a warm H100 start: 2.5 s
of its 10.8 s). Tuning, and installing shipped tuning, spend their time mostly outside the
interpreter lock (the GPU timing candidates, Triton's compiler on threads), where the imports can
run. The start joins the thread before it compiles; an import that failed there is not reported
there: the start's own import then raises it, where it always did.

Started once the compile cache is chosen (Inductor reads its cache directory from the environment),
and joined before the first ``torch.compile`` call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: What the first compilation imports, in the order it does.
MODULES = ("torch._dynamo", "torch._inductor.config", "torch._inductor.compile_fx")


def ahead() -> Callable[[], None]:
    """Starts importing ``MODULES`` on a thread; returns the join, which logs how long it waited."""
    started = time.perf_counter()
    thread = threading.Thread(target=_import, args=(started,), name="import-compiler", daemon=True)
    thread.start()

    def join() -> None:
        waited = time.perf_counter()
        thread.join()
        log.info("torch's compiler imported beside tuning; %.1f s waited for it", time.perf_counter() - waited)

    return join


def _import(started: float) -> None:
    import importlib

    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - the start's own import raises it again, where it is reported
            log.warning("importing %s ahead failed (the compile imports it): %s", name, err)
            return
    log.debug("imported torch's compiler in %.1f s", time.perf_counter() - started)
