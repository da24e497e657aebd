"""kopf handlers for Pods: an in-memory index of them, and wake-ups for the policies they affect.

The operator never lists pods per event: the index is kept current by the watch, and each
policy's selector is resolved against it in memory.
"""

from __future__ import annotations

from typing import Any

import kopf

from graphkeeper.operator.selection import WorkerPod, worker_from_pod


def index_pod(body: kopf.Body, namespace: str, **_: Any) -> dict[str, WorkerPod]:
    """``pods[namespace]`` -> the pods there, reduced to what the operator needs."""
    return {namespace: worker_from_pod(body)}


async def on_pod_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A new, restarted, re-annotated or deleted pod wakes the policies that select it."""
    memo.reconciler.on_pod(worker_from_pod(body), deleted=event.get("type") == "DELETED")
