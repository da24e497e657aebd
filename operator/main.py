"""Starts the operator: kopf's settings, the handler registrations, and ``run()`` for the CLI.

This module only wires things together; what each handler does lives in ``policy_handlers``,
``pod_handlers`` and ``reconciler``.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import kopf

from graphkeeper.operator import metrics, naming, pod_handlers, policy_handlers
from graphkeeper.operator.kube import Kube, load_client_config
from graphkeeper.operator.outage import OUTAGE
from graphkeeper.operator.reconciler import Reconciler
from graphkeeper.operator.selection import PolicyRef, WorkerPod
from graphkeeper.operator.workerclient import GraphControlClient

POLICIES = (naming.GROUP, naming.VERSION, naming.PLURAL)


async def startup(
    settings: kopf.OperatorSettings,
    memo: kopf.Memo,
    worker_pods: kopf.Index[str, WorkerPod],
    graph_policies: kopf.Index[str, PolicyRef],
    **_: Any,
) -> None:
    """kopf's settings, then the shared state every handler finds in ``memo``."""
    # Bookkeeping in annotations under our prefix, so .status holds only what our schema declares.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=naming.ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=naming.ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.persistence.finalizer = naming.FINALIZER
    # Watches that hang silently are the classic operator failure; make every one time out.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.watching.reconnect_backoff = 0.5
    # After an API outage the next spec change must be seen within a few seconds of the
    # server's return: retry every second (kopf's default backs off to 13 s and more), for up to
    # an hour before a request escalates. OUTAGE folds the retry lines into one per outage.
    settings.networking.error_backoffs = (0.5,) + (1.0,) * 3600
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 5
    OUTAGE.install()
    settings.peering.standalone = True
    # Our Events are posted explicitly (kopf.event); kopf's own "handler succeeded" chatter is not.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 4

    api = load_client_config()
    memo.kube = Kube(api)
    memo.reconciler = Reconciler(
        client=GraphControlClient(timeout=memo.rpc_timeout, token_file=memo.control_token_file),
        kube=memo.kube,
        pods=worker_pods,
        policies=graph_policies,
        interval=memo.status_interval,
        resync=memo.resync_interval,
    )
    memo.http = None
    if memo.metrics_port:
        memo.http = await metrics.serve(memo.metrics_port, memo.reconciler.health)


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stops the loops and the worker client, then the metrics server."""
    await memo.reconciler.shutdown()
    if memo.http is not None:
        await memo.http.cleanup()


def register(registry: kopf.OperatorRegistry | None = None) -> kopf.OperatorRegistry:
    """Registers every handler on ``registry`` (kopf's default one unless given)."""
    registry = registry or kopf.get_default_registry()
    kopf.on.startup(registry=registry)(startup)
    kopf.on.cleanup(registry=registry)(cleanup)

    kopf.index("pods", id="worker_pods", registry=registry)(pod_handlers.index_pod)
    kopf.on.event("pods", id="pod_event", registry=registry)(pod_handlers.on_pod_event)

    kopf.index(*POLICIES, id="graph_policies", registry=registry)(policy_handlers.index_policy)
    kopf.on.event(*POLICIES, id="policy_event", registry=registry)(
        policy_handlers.on_policy_event)
    # The id is kopf's key for its progress annotations on existing objects: kept from when this
    # handler rendered the ConfigMap (the reconcile run does now).
    changed = policy_handlers.on_policy_change
    kopf.on.resume(*POLICIES, id="render", registry=registry)(changed)
    kopf.on.create(*POLICIES, id="render", registry=registry)(changed)
    kopf.on.update(*POLICIES, id="render", field="spec", registry=registry)(changed)
    return registry


def run(args: argparse.Namespace) -> int:
    """``graphkeeper operator``: kopf's ``run`` with our handlers, standalone (no peering)."""
    level = str(args.log_level).upper()
    kopf.configure(verbose=level == "DEBUG")
    logging.getLogger().setLevel(level)
    if level != "DEBUG":
        # kopf logs every pod event's handler at INFO; what happened is in our own log lines.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    memo = kopf.Memo(
        status_interval=float(args.status_interval),
        resync_interval=float(getattr(args, "resync_interval", 60.0)),
        metrics_port=int(args.metrics_port),
        rpc_timeout=float(getattr(args, "rpc_timeout", 5.0)),
        control_token_file=str(getattr(args, "control_token_file", "") or ""),
    )
    kopf.run(
        registry=register(),
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=list(args.namespace),
        memo=memo,
    )
    return 0
