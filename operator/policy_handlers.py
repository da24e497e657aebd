"""kopf handlers for GraphPolicy objects: index them and drive their loops.

Handlers stay thin: what a spec asks for is decided in ``desired``, and the pushing, the
ConfigMap and the status writing happen in the policy's reconcile run (``reconciler``). No
handler here needs a finalizer or kopf's per-object bookkeeping, so deleting a policy never
waits for the operator and an edit costs the API server no write of ours but the status.
"""

from __future__ import annotations

from typing import Any

import kopf

from graphkeeper.operator.selection import PolicyRef, policy_ref_from_body


def index_policy(body: kopf.Body, namespace: str, **_: Any) -> dict[str, PolicyRef]:
    """``graphpolicies[namespace]`` -> the policies there, for selection and conflicts."""
    return {namespace: policy_ref_from_body(body)}


async def on_policy_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Every watch event: start the policy's loop, wake it on a new generation, stop it if gone."""
    memo.reconciler.on_policy(policy_ref_from_body(body), deleted=event.get("type") == "DELETED")
