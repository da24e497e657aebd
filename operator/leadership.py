"""Two operator replicas, one acting: a ``coordination.k8s.io`` Lease decides which.

The replica that holds the Lease runs kopf and the reconcile loops; the other waits, checking
the Lease every ``RETRY_SECONDS``, and takes it once it has not been renewed for
``LEASE_SECONDS`` of its own clock (the holder's clock is never compared with ours: a Lease
counts as expired when its ``resourceVersion`` has not moved for that long, as client-go's
leader election does). The holder renews every ``RENEW_SECONDS``; one that cannot renew within
the Lease's duration, or finds another holder, exits at once so that never two replicas push.

A standby starts kopf only once it holds the Lease, so it writes nothing meanwhile (kopf's own
bookkeeping annotations included). Its new loops read every worker before they push, so the
hand-over repeats no push. A replica stopped gracefully hands the Lease back, and the standby
takes it within ``RETRY_SECONDS``; after a ``kill -9`` within ``LEASE_SECONDS + RETRY_SECONDS``
plus kopf's start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kubernetes

from graphkeeper.operator import naming

logger = logging.getLogger("graphkeeper.operator")

#: Seconds a Lease holds without renewal; a standby takes over this long after the holder died.
LEASE_SECONDS = 8
#: How often the holder renews (three chances within one Lease).
RENEW_SECONDS = 2.0
#: How often a standby looks at the Lease.
RETRY_SECONDS = 1.0
#: Seconds one Lease request may take.
REQUEST_TIMEOUT = 5


@dataclass(frozen=True)
class Seen:
    """A Lease as a standby last saw it change: its resourceVersion, and when (our monotonic clock)."""

    version: str
    at: float


def may_take(holder: str, identity: str, seen: Seen, now: float, duration: float) -> bool:
    """Whether ``identity`` may take (or keep) the Lease (pure): it is free, ours, or has not
    changed for ``duration`` seconds of our own clock."""
    return not holder or holder == identity or now - seen.at > duration


def observe(previous: Seen | None, version: str, now: float) -> Seen:
    """What a standby remembers of the Lease after reading it at ``now`` (pure)."""
    return previous if previous is not None and previous.version == version else Seen(version, now)


class LeaseElector:
    """Takes and keeps one Lease for ``identity``."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, name: str, identity: str) -> None:
        self._coordination = kubernetes.client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity

    async def acquire(self) -> None:
        """Returns once this replica holds the Lease (waits as the standby until then)."""
        seen: Seen | None = None
        told = False
        while True:
            try:
                lease = await self._call(self._coordination.read_namespaced_lease, self.name, self.namespace,
                                         missing_ok=True)
                if lease is None:
                    if await self._write(None):
                        logger.info("leading: created the Lease %s/%s", self.namespace, self.name)
                        return
                else:
                    seen = observe(seen, lease.metadata.resource_version, time.monotonic())
                    holder = lease.spec.holder_identity or ""
                    duration = lease.spec.lease_duration_seconds or LEASE_SECONDS
                    if may_take(holder, self.identity, seen, time.monotonic(), duration):
                        if await self._write(lease):
                            logger.info("leading: took the Lease %s/%s (held by %r before)", self.namespace,
                                        self.name, holder)
                            return
                    elif not told:
                        logger.info("standby: the Lease %s/%s is held by %s", self.namespace, self.name, holder)
                        told = True
            except Exception as err:  # the API server away: a standby just keeps waiting
                logger.warning("could not read the Lease: %s", err)
            await asyncio.sleep(RETRY_SECONDS)

    async def keep(self, lost: Callable[[str], None]) -> None:
        """Renews the Lease until cancelled; calls ``lost`` (which must stop this replica) when
        another holds it or it could not be renewed within its duration."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(RENEW_SECONDS)
            try:
                lease = await self._call(self._coordination.read_namespaced_lease, self.name, self.namespace)
                if (lease.spec.holder_identity or "") != self.identity:
                    lost(f"the Lease is held by {lease.spec.holder_identity!r}")
                    return
                if await self._write(lease):
                    renewed = time.monotonic()
            except Exception as err:  # an API outage: keep trying while the Lease still holds
                logger.warning("could not renew the Lease: %s", err)
            if time.monotonic() - renewed > LEASE_SECONDS - RENEW_SECONDS:
                lost(f"not renewed for {time.monotonic() - renewed:.1f}s")
                return

    async def release(self) -> None:
        """Hands the Lease back (a graceful stop): the standby takes it at its next look."""
        try:
            lease = await self._call(self._coordination.read_namespaced_lease, self.name, self.namespace)
            if (lease.spec.holder_identity or "") == self.identity:
                lease.spec.holder_identity = ""
                await self._call(self._coordination.replace_namespaced_lease, self.name, self.namespace, lease)
        except Exception as err:  # the Lease then expires by itself
            logger.warning("could not hand the Lease back: %s", err)

    async def _write(self, lease: Any) -> bool:
        """Creates the Lease, or replaces it (at its resourceVersion) as held by us now; False when
        another replica wrote it first."""
        now = datetime.now(UTC)
        try:
            if lease is None:
                labels = {"app.kubernetes.io/managed-by": naming.FIELD_MANAGER}
                body = kubernetes.client.V1Lease(
                    metadata=kubernetes.client.V1ObjectMeta(name=self.name, namespace=self.namespace, labels=labels),
                    spec=kubernetes.client.V1LeaseSpec(holder_identity=self.identity,
                                                       lease_duration_seconds=LEASE_SECONDS,
                                                       acquire_time=now, renew_time=now, lease_transitions=0))
                await self._call(self._coordination.create_namespaced_lease, self.namespace, body)
                return True
            spec = lease.spec
            if (spec.holder_identity or "") != self.identity:
                spec.lease_transitions = (spec.lease_transitions or 0) + 1
                spec.acquire_time = now
            spec.holder_identity, spec.renew_time, spec.lease_duration_seconds = self.identity, now, LEASE_SECONDS
            await self._call(self._coordination.replace_namespaced_lease, self.name, self.namespace, lease)
            return True
        except kubernetes.client.ApiException as err:
            if err.status in (409, 422):
                return False  # another replica won this round
            raise

    async def _call(self, fn: Callable[..., Any], *args: Any, missing_ok: bool = False) -> Any:
        try:
            return await asyncio.to_thread(fn, *args, _request_timeout=REQUEST_TIMEOUT)
        except kubernetes.client.ApiException as err:
            if missing_ok and err.status == 404:
                return None
            raise
