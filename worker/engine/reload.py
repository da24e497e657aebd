"""A model reload, run on the engine thread between steps once no sequence is running.

``Engine.load_revision`` judges what it can without loading and offers the reload to ``Control``;
the engine pauses admission, lets running sequences finish on the weights they started with, and
then calls ``reload_model``: the new weights load beside the old ones, and only a complete load
replaces anything. A failed load leaves the old model serving, graphs and all.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.control import Reload
from graphkeeper.worker.engine.model_roots import ReloadRefused, check_model_root

if TYPE_CHECKING:
    from graphkeeper.worker.engine.core import Engine

log = logging.getLogger(__name__)
L = pb.LedgerStage


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
        fresh = e.slot.load(reload.source, reload.revision)
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
