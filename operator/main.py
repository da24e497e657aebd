"""Starts the operator: kopf's settings, the handler registrations, and ``run()`` for the CLI.

This module only wires things together; what each handler does lives in ``policy_handlers``,
``pod_handlers`` and ``reconciler``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from typing import Any

import kopf

from graphkeeper.operator import metrics, naming, pod_handlers, policy_handlers
from graphkeeper.operator.kube import Kube, load_client_config
from graphkeeper.operator.leadership import LeaseElector
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
    if memo.metrics_port and memo.get("http") is None:
        memo.http = await metrics.serve(memo.metrics_port, memo.reconciler.health)
    if memo.get("elector") is not None:
        memo.lease = asyncio.create_task(memo.elector.keep(_lost_lease), name="lease")


def _lost_lease(why: str) -> None:
    """Another replica leads now (or may): this one stops at once, so that never two push."""
    logging.getLogger("graphkeeper.operator").critical("lost the Lease (%s): exiting", why)
    os._exit(3)


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stops the loops and the worker client, hands the Lease back, then stops the metrics server."""
    await memo.reconciler.shutdown()
    if memo.get("lease") is not None:
        memo.lease.cancel()
        await memo.elector.release()
    if memo.get("http") is not None:
        await memo.http.cleanup()


def register(registry: kopf.OperatorRegistry | None = None) -> kopf.OperatorRegistry:
    """Registers every handler on ``registry`` (kopf's default one unless given)."""
    registry = registry or kopf.get_default_registry()
    kopf.on.startup(registry=registry)(startup)
    kopf.on.cleanup(registry=registry)(cleanup)

    kopf.index("pods", id="worker_pods", registry=registry)(pod_handlers.index_pod)
    kopf.on.event("pods", id="pod_event", registry=registry)(pod_handlers.on_pod_event)

    kopf.index(*POLICIES, id="graph_policies", registry=registry)(policy_handlers.index_policy)
    # Every watch event (the initial listing included) starts, wakes or stops a policy's loop.
    # No create/update/resume handlers: kopf would patch its bookkeeping annotations onto the
    # policy on every spec change (one API request per edit) for nothing the loop needs.
    kopf.on.event(*POLICIES, id="policy_event", registry=registry)(
        policy_handlers.on_policy_event)
    return registry


def run(args: argparse.Namespace) -> int:
    """``graphkeeper operator``: kopf with our handlers, standalone (no kopf peering); with
    ``--leader-election-namespace``, one of several replicas acting at a time (``leadership``)."""
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
    where = {"clusterwide": not args.namespace, "namespaces": list(args.namespace)}
    lease_namespace = str(getattr(args, "leader_election_namespace", "") or "")
    if not lease_namespace:
        kopf.run(registry=register(), standalone=True, memo=memo, **where)
        return 0
    identity = str(getattr(args, "identity", "") or "") or f"{socket.gethostname()}-{os.getpid()}"
    elector = LeaseElector(load_client_config(), lease_namespace, args.leader_election_name, identity)
    asyncio.run(_run_elected(elector, memo, where))
    return 0


async def _run_elected(elector: LeaseElector, memo: kopf.Memo, where: dict[str, Any]) -> None:
    """As the standby until this replica holds the Lease (its /healthz answers meanwhile), then
    kopf and the reconcile loops, as the one replica that acts."""
    def health() -> dict[str, Any]:
        reconciler = memo.get("reconciler")
        return {"leading": True, **reconciler.health()} if reconciler is not None else {"leading": False}

    memo.http = await metrics.serve(memo.metrics_port, health) if memo.metrics_port else None
    await elector.acquire()
    memo.elector = elector
    await kopf.operator(registry=register(), standalone=True, memo=memo, **where)
