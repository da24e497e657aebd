"""A model reload, run on the engine thread between steps once no sequence is running.

``Engine.load_revision`` judges what it can without loading and offers the reload to ``Control``;
the engine pauses admission, lets running sequences finish on the weights they started with, and
then calls ``reload_model``: the new weights load beside the old ones (on a thread of their own,
waited for with a timeout: ``load_bounded``), and only a complete load replaces anything. A
failed load leaves the old model serving, graphs and all.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.control import Reload
from graphkeeper.worker.engine.model_roots import ReloadRefused, check_model_root

if TYPE_CHECKING:
    from graphkeeper.worker.engine.core import Engine

log = logging.getLogger(__name__)
L = pb.LedgerStage
#: A load not finished in this long is abandoned and the reload fails (the old model serves on);
#: under the gRPC reload deadline, so the caller reads why.
LOAD_TIMEOUT_SECONDS = 540.0


def load_bounded(engine: Engine, reload: Reload, timeout: float) -> Any:
    """``engine.slot.load`` on a thread of its own, waited for at most ``timeout`` seconds.

    The step loop waits for a reload's load (admission is paused for it), but never forever: a
    read that blocks (a file that stops answering, on a network volume) fails the reload with
    TimeoutError, and its thread is left behind blocked rather than the engine.
    """
    result: Future = Future()

    def run() -> None:
        try:
            with torch.inference_mode():
                if engine.device.type == "cuda":
                    torch.cuda.set_device(engine.device.index or 0)
                result.set_result(engine.slot.load(reload.source, reload.revision))
        except BaseException as err:  # noqa: BLE001 - raised on the engine thread below
            result.set_exception(err)

    threading.Thread(target=run, name="model-load", daemon=True).start()
    try:
        return result.result(timeout)
    except FutureTimeout:
        raise TimeoutError(f"the weights did not load within {timeout:.0f} s (a read that blocks?)") from None


def reload_model(engine: Engine, reload: Reload) -> None:
    """Loads the new weights beside the old ones; only a complete load replaces anything.

    The resolved source is judged again here, just before loading: a directory whose
    entries were relinked outside the roots since the request is refused.
    """
    e = engine
    try:
        again = check_model_root(reload.source, e.settings.model, e.settings.model_roots)
        if again != reload.source:
            raise ReloadRefused("source", "changed since it was checked (a link was replaced)")
        e.ledger.begin_reload()  # the old generation, before the load's readings hold both models
        fresh = load_bounded(e, reload, LOAD_TIMEOUT_SECONDS)
    except Exception as err:  # noqa: BLE001 - the old model keeps serving, graphs and all
        message = f"model reload failed: {str(err)[:256]}"
        e.control.reload_failed(message)
        log.error(message)
        e.scheduler.admitting = True
        reload.future.set_exception(err)
        return

    def install() -> bool:
        e.capture.release()  # before the new weights serve: stale graphs can never replay
        e.capture.hold_eager()
        return e.slot.install(fresh)

    kept = e.control.swap_model(e.captures_graphs, install)
    # One coherent ledger of the new model: the old one's stages go, and the weights and KV
    # cache are measured again now that the old weights and graphs are freed.
    e.ledger.restart(e.device, e.slot.runner.cache.nbytes())
    if not kept:
        e.slot.prepare_step()
    e.ledger.record(L.LEDGER_STAGE_WARMUP, e.device)
    e.steps_since_ready = 0  # STEADY is measured again, on the new model
    e.recorder.set_attention(e.slot.runner.attention.name)
    e.blocks.reset_prefix_cache(e.slot.loaded.revision)  # nothing runs now: every block is free
    e.metrics.recaptures.labels("model_revision").inc()
    e.begin_capture()
    e.scheduler.admitting = True
    reload.future.set_result(e.slot.loaded.revision)
