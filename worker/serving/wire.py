"""Requests that do not decode are the client's fault: INVALID_ARGUMENT, not INTERNAL.

gRPC's Python server answers a request whose bytes its deserializer cannot parse with
INTERNAL ("Exception deserializing request!"), which reads as a worker bug on every dashboard
and alert. ``tolerant(server)`` wraps a server (sync or ``grpc.aio``) for the generated
``add_*Servicer_to_server`` functions: each method's deserializer then never raises (it returns
an ``Undecodable`` marker), and the method answers INVALID_ARGUMENT before the servicer runs::

    pb_grpc.add_InferenceWorkerServicer_to_server(servicer, tolerant(server))

``tolerant(server, on_undecodable)`` also calls ``on_undecodable(method)`` for each such request
(the full method name), so the API layer can count them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

MESSAGE = "request: the bytes are not a valid {name} message"


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request whose bytes did not parse; ``message`` says which type was expected."""

    message: str


def tolerant_deserializer(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``parse``, except that a failure returns an ``Undecodable`` instead of raising."""
    owner = getattr(parse, "__self__", None)
    name = getattr(owner, "__name__", None) or getattr(type(owner), "__name__", "request")

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception:  # noqa: BLE001 - DecodeError, RecursionError...: all the client's bytes
            return Undecodable(MESSAGE.format(name=name))

    return deserialize


Counter = Callable[[str], None]


def _ignore(method: str) -> None:
    """The default ``on_undecodable``: counts nothing."""


def _guard(behavior: Callable, method: str = "", on_undecodable: Counter = _ignore) -> Callable:
    """``behavior`` that first answers INVALID_ARGUMENT for an ``Undecodable`` request."""
    if inspect.isasyncgenfunction(behavior):
        async def guarded_agen(request, context):
            if isinstance(request, Undecodable):
                on_undecodable(method)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for item in behavior(request, context):
                yield item
        return guarded_agen
    if inspect.iscoroutinefunction(behavior):
        async def guarded_coro(request, context):
            if isinstance(request, Undecodable):
                on_undecodable(method)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await behavior(request, context)
        return guarded_coro
    if inspect.isgeneratorfunction(behavior):
        def guarded_gen(request, context):
            if isinstance(request, Undecodable):
                on_undecodable(method)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            yield from behavior(request, context)
        return guarded_gen

    def guarded(request, context):
        if isinstance(request, Undecodable):
            on_undecodable(method)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return behavior(request, context)
    return guarded


def tolerant_handler(handler: grpc.RpcMethodHandler | None, method: str = "",
                     on_undecodable: Counter = _ignore) -> grpc.RpcMethodHandler | None:
    """The same method handler with a tolerant deserializer and a guarded behaviour (unary requests)."""
    if handler is None or handler.request_streaming or handler.request_deserializer is None:
        return handler
    if isinstance(handler.request_deserializer, _Tolerant):
        return handler
    field = "unary_stream" if handler.response_streaming else "unary_unary"
    return handler._replace(  # the handlers grpc builds are namedtuples
        request_deserializer=_Tolerant(tolerant_deserializer(handler.request_deserializer)),
        **{field: _guard(getattr(handler, field), method, on_undecodable)},
    )


class _Tolerant:
    """Marks a deserializer as already wrapped, so wrapping twice is harmless."""

    def __init__(self, fn: Callable[[bytes], Any]) -> None:
        self.fn = fn

    def __call__(self, data: bytes) -> Any:
        return self.fn(data)


class _TolerantGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, on_undecodable: Counter = _ignore) -> None:
        self.inner = inner
        self.on_undecodable = on_undecodable
        self._cache: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        cached = self._cache.get(method)
        if cached is None:
            cached = tolerant_handler(self.inner.service(handler_call_details), method, self.on_undecodable)
            if cached is not None:  # only this service's methods: a client's made-up names are not kept
                self._cache[method] = cached
        return cached


class _TolerantServer:
    """A server seen through ``tolerant``: handlers added through it decode tolerantly."""

    def __init__(self, server: Any, on_undecodable: Counter = _ignore) -> None:
        self._server = server
        self._on_undecodable = on_undecodable

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_TolerantGeneric(h, self._on_undecodable) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(
            service, {name: tolerant_handler(h, f"/{service}/{name}", self._on_undecodable)
                      for name, h in handlers.items()})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def tolerant(server: Any, on_undecodable: Counter = _ignore) -> Any:
    """``server`` for ``add_*Servicer_to_server``: undecodable requests become INVALID_ARGUMENT,
    each reported to ``on_undecodable(method)``."""
    return _TolerantServer(server, on_undecodable)
