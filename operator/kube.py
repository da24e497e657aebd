"""The few Kubernetes API calls the operator makes itself (kopf makes the rest).

It writes GraphPolicy status and the policy ConfigMaps. The ``kubernetes`` client is
synchronous, so every call runs in a worker thread and never blocks kopf's event loop. Each
request is counted in ``graphkeeper_operator_api_requests_total``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes

from graphkeeper.operator import metrics, naming
from graphkeeper.operator.outage import OUTAGE

_MERGE_PATCH = "application/merge-patch+json"
#: Seconds one API request may take (a server that went away must not hang a reconcile).
REQUEST_TIMEOUT = 10


def load_client_config() -> kubernetes.client.ApiClient:
    """An API client from the in-cluster service account, else from KUBECONFIG."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    client = kubernetes.client.ApiClient()
    client.user_agent = f"{naming.FIELD_MANAGER}/python"
    return client


class Kube:
    """Status and ConfigMap writes for GraphPolicies."""

    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self._core = kubernetes.client.CoreV1Api(api)
        self._custom = kubernetes.client.CustomObjectsApi(api)

    async def _run(self, verb: str, resource: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        metrics.API_REQUESTS.labels(verb=verb, resource=resource).inc()
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        try:
            result = await asyncio.to_thread(fn, *args, **kwargs)
        except kubernetes.client.ApiException as err:
            if not api_unreachable(err):
                OUTAGE.ok()  # an answer, even a refusal, means the server is back
            raise
        OUTAGE.ok()
        return result

    async def patch_policy_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """Merge-patches ``/status``; a policy deleted meanwhile is not an error."""
        try:
            await self._run(
                "patch", "graphpolicies/status",
                self._custom.patch_namespaced_custom_object_status,
                naming.GROUP, naming.VERSION, namespace, naming.PLURAL, name, patch,
                field_manager=naming.FIELD_MANAGER, _content_type=_MERGE_PATCH,
            )
        except kubernetes.client.ApiException as err:
            if err.status != 404:
                raise

    async def read_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            cm = await self._run("get", "configmaps", self._core.read_namespaced_config_map,
                                 name, namespace)
        except kubernetes.client.ApiException as err:
            if err.status == 404:
                return None
            raise
        return self._core.api_client.sanitize_for_serialization(cm)

    async def write_configmap(self, body: dict[str, Any], exists: bool) -> None:
        """Creates the ConfigMap, or merge-patches the existing one to ``body``."""
        meta = body["metadata"]
        if not exists:
            try:
                await self._run("create", "configmaps", self._core.create_namespaced_config_map,
                                meta["namespace"], body, field_manager=naming.FIELD_MANAGER)
                return
            except kubernetes.client.ApiException as err:
                if _namespace_terminating(err):
                    return  # the policy goes away with its namespace; nothing to render for
                if err.status != 409:
                    raise
        await self._run(
            "patch", "configmaps", self._core.patch_namespaced_config_map,
            meta["name"], meta["namespace"], body,
            field_manager=naming.FIELD_MANAGER, _content_type=_MERGE_PATCH,
        )


def api_unreachable(err: BaseException) -> bool:
    """Whether ``err`` means the API server is away (no answer, or a 5xx), not a refusal."""
    import urllib3

    if isinstance(err, kubernetes.client.ApiException):
        return err.status == 0 or err.status >= 500
    return isinstance(err, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


def _namespace_terminating(err: kubernetes.client.ApiException) -> bool:
    return err.status == 403 and "being terminated" in str(err.body or "")
