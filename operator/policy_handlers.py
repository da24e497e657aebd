"""kopf handlers for GraphPolicy objects: index them, render their ConfigMap, drive their loops.

Handlers stay thin: decisions live in ``selection``, ``render`` and ``status``, and the pushing
and status writing in ``reconciler``. No handler here needs a finalizer, so deleting a policy
never waits for the operator.
"""

from __future__ import annotations

from typing import Any

import kopf

from graphkeeper.operator.render import build_configmap, configmap_differs
from graphkeeper.operator.selection import PolicyRef, policy_ref_from_body
from graphkeeper.operator.traffic import applied_from_status, effective_policy, from_traffic_settings
from graphkeeper.proto.policy import PolicyError, policy_from_spec


def index_policy(body: kopf.Body, namespace: str, **_: Any) -> dict[str, PolicyRef]:
    """``graphpolicies[namespace]`` -> the policies there, for selection and conflicts."""
    return {namespace: policy_ref_from_body(body)}


async def on_policy_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Every watch event: start the policy's loop, wake it on a new generation, stop it if gone."""
    memo.reconciler.on_policy(policy_ref_from_body(body), deleted=event.get("type") == "DELETED")


async def render_policy(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Create, update and resume: write the ConfigMap workers read at boot, then reconcile now.

    An invalid spec (one that slipped past the CRD's rules) leaves the last good ConfigMap in
    place; the reconcile loop reports it as Degraded/InvalidPolicy.
    """
    ref = policy_ref_from_body(body)
    try:
        wire = policy_from_spec(ref.spec, uid=ref.uid, name=ref.key, generation=ref.generation)
        # Sizes applied from traffic (kept in status) are what a booting worker must capture too.
        wire = effective_policy(wire, from_traffic_settings(ref.spec), applied_from_status(ref.status),
                                str(ref.spec.get("mode") or "FullAndPiecewise"))
    except PolicyError as err:
        logger.warning("not rendered: %s", err)
    else:
        desired = build_configmap(ref, wire)
        name = desired["metadata"]["name"]
        current = await memo.kube.read_configmap(ref.namespace, name)
        if configmap_differs(current, desired):
            await memo.kube.write_configmap(desired, exists=current is not None)
            logger.info("wrote ConfigMap %s for generation %d", name, ref.generation)
    memo.reconciler.on_policy(ref, deleted=False)
    memo.reconciler.wake(ref.uid)
