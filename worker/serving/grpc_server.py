"""The worker's gRPC API layer: InferenceWorker and health on the inference port, GraphControl on
its own authenticated port, both on one asyncio event loop.

A Generate call is admitted and streamed through what the front ends share (``streams``: one
admission, the stream hub that carries the engine's tokens to the event loop, one pacing).

Handlers map every refusal to a status code with a message: INVALID_ARGUMENT for bad input
(naming the field), FAILED_PRECONDITION for a stale policy generation, a reload or a Sleep this worker
cannot carry out, ABORTED for a Sleep a Wake withdrew, UNAUTHENTICATED for a control call
without the token; an engine error (a full queue, a request the cache cannot fit,
not serving, a failed step, anything else) gets the code of its row in the engine's errors table
(``engine.classify``), as on the HTTP port.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.proto.field_checks import FieldError
from graphkeeper.proto.policy import PolicyError
from graphkeeper.proto.watch import heartbeat_seconds, watch_status
from graphkeeper.worker.engine import (
    EngineFace,
    IncrementalDetokenizer,
    NotServing,
    ReloadRefused,
    ReloadUnsupported,
    SleepRefused,
    SleepWithdrawn,
    StalePolicy,
    StepWatchdog,
    classify,
    error_message,
    ready,
)
from graphkeeper.worker.serving.admission import (
    AdmissionError,
    Oversize,
    max_request_bytes,
    validate_reload_request,
)
from graphkeeper.worker.serving.control_gate import ControlGate
from graphkeeper.worker.serving.grpc_limits import server_options
from graphkeeper.worker.serving.limits import CONTROL_UPSTREAM_MAX_CONNECTIONS, ConnectionLimits
from graphkeeper.worker.serving.streams import (
    StreamHub,
    TokenStream,
    admitted,
    count_refusal,
    public_model_info,
    token_logprobs,
)
from graphkeeper.worker.serving.wire import tolerant

log = logging.getLogger(__name__)

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["InferenceWorker"].full_name
CONTROL_SERVICE = pb.DESCRIPTOR.services_by_name["GraphControl"].full_name
RELOAD_TIMEOUT_SECONDS = 600.0
#: A Sleep waits for running sequences to finish; a Wake may read the weights again (level 2).
SLEEP_TIMEOUT_SECONDS = 600.0
#: How often a WatchGraphStatus stream reads the engine's status for a change (a cheap read under
#: the control lock; a stream per operator replica).
WATCH_POLL_SECONDS = 0.2


class InferenceServicer(pb_grpc.InferenceWorkerServicer):
    def __init__(self, engine: EngineFace, hub: StreamHub | None = None) -> None:
        self.engine = engine
        self.hub = hub

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        stream = TokenStream()
        engine = self.engine
        text = bool(request.prompt_text or request.messages)
        try:
            request = await admitted(engine, request)
            seq = engine.submit(request, stream)
        except AdmissionError as err:
            engine.metrics.requests.labels("oversize" if isinstance(err, Oversize) else "invalid").inc()
            return _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except Exception as err:  # noqa: BLE001 - refused by the engine (or a bug): answered by the table
            count_refusal(engine, err)
            return _refuse(context, grpc.StatusCode[classify(err).grpc_code], error_message(err))
        detok = IncrementalDetokenizer(engine.tokenizer, list(request.prompt_token_ids)) if text else None
        hub = self.hub
        if hub is not None:
            hub.open_streams += 1
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                while stream.tokens:  # tokens that arrive during a write go out before the end
                    tokens, stream.tokens = stream.tokens, []
                    logprobs, stream.logprobs = stream.logprobs, []
                    chunk = pb.TokenChunk(token_ids=tokens, text=detok.add(tokens) if detok else "",
                                          logprobs=token_logprobs(logprobs))
                    await context.write(pb.GenerateResponse(tokens=chunk))
                end = stream.end
                if isinstance(end, pb.Completion):
                    if detok and (rest := detok.flush()):
                        await context.write(pb.GenerateResponse(tokens=pb.TokenChunk(text=rest)))
                    await context.write(pb.GenerateResponse(completion=end))
                    return
                if isinstance(end, BaseException):  # a failed step, or refused by an engine core in its own process
                    await _abort_for(context, end)
                if hub is not None and (gap := hub.flush_gap()):
                    await stream.pause(gap)
        except asyncio.CancelledError:
            # The client cancelled or went away, or the server is stopping: free the slot.
            engine.cancel(seq)
            raise
        finally:
            if hub is not None:
                hub.open_streams -= 1

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        info = self.engine.model_info()
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model not loaded yet")
        return public_model_info(info)


def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """Ends a call that was refused before it began with ``code``, without raising: an abort's
    exception would tie the handler's frame, and the request it holds (up to the message limit),
    into a reference cycle with the call's state, freed only by a full garbage collection, which
    a process holding torch's heap rarely runs; a flood of refused 1 MiB prompts grew the API
    process by 25-40 MB every 15 s that way."""
    context.set_code(code)
    context.set_details(message)


async def _abort_for(context: grpc.aio.ServicerContext, err: BaseException) -> None:
    """Ends the call with the status code the engine's errors table gives ``err``."""
    await context.abort(grpc.StatusCode[classify(err).grpc_code], error_message(err))


async def _watch_tick(timeout: float) -> None:
    await asyncio.sleep(min(timeout, WATCH_POLL_SECONDS))


class GraphControlServicer(pb_grpc.GraphControlServicer):
    """Each engine call runs off the event loop (an engine core that does not answer holds a
    worker thread for its timeout, never the loop every port is served on) and a call it
    cannot answer is UNAVAILABLE (retry), never UNKNOWN."""

    def __init__(self, engine: EngineFace) -> None:
        self.engine = engine

    async def ApplyGraphPolicy(self, request: pb.ApplyGraphPolicyRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            return await asyncio.to_thread(self.engine.apply_policy, request.policy)
        except PolicyError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"policy.{err}")
        except StalePolicy as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except NotServing as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))

    async def GetGraphStatus(self, request: pb.GetGraphStatusRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            return await asyncio.to_thread(self.engine.status)
        except NotServing as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))

    async def WatchGraphStatus(self, request: pb.WatchGraphStatusRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        """The status now, then on every change (``proto/watch.py``): the engine is read every
        ``WATCH_POLL_SECONDS``, so a change reaches the operator within that, without its polling."""
        try:
            async for status in watch_status(self.engine.status, heartbeat_seconds(request), _watch_tick):
                yield status
        except NotServing as err:  # the engine core stopped: the stream ends, the operator sees it
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))

    async def LoadModelRevision(self, request: pb.LoadModelRevisionRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            validate_reload_request(request)
            future = await asyncio.to_thread(self.engine.load_revision, request.source, request.revision)
        except AdmissionError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except ReloadRefused as err:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        except ReloadUnsupported as err:  # several tensor parallel ranks: a rollout changes the model
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except NotServing as err:  # another reload is pending: retry later
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        try:
            revision = await _outcome(future, RELOAD_TIMEOUT_SECONDS)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "model reload did not finish in time")
        except ReloadRefused as err:  # relinked outside the roots between the request and the load
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        except Exception as err:  # noqa: BLE001 - reported to the caller; the worker keeps serving
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"source: {err}")
        return pb.LoadModelRevisionResponse(revision=revision, recapture_started=self.engine.captures_graphs)

    async def Sleep(self, request: pb.SleepRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        """Answers once the worker sleeps. A caller that gives up (its deadline) leaves the sleep
        ordered: it happens once running sequences finish, unless a Wake withdraws it."""
        try:
            future = await asyncio.to_thread(self.engine.sleep_control.sleep, request.level)
        except FieldError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except SleepRefused as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except NotServing as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        try:
            return await _outcome(future)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "running sequences did not finish in time: the sleep stays ordered (Wake withdraws it)")
        except SleepWithdrawn as err:
            await context.abort(grpc.StatusCode.ABORTED, str(err))
        except SleepRefused as err:  # the worker began draining first
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except NotServing as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except Exception as err:  # noqa: BLE001 - the device side failed; the worker stays awake and serves
            await context.abort(grpc.StatusCode.INTERNAL, f"sleep failed: {type(err).__name__}: {err}")

    async def Wake(self, request: pb.WakeRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        """Answers once the worker is awake; at once, with was_asleep false, when it was."""
        try:
            future = await asyncio.to_thread(self.engine.sleep_control.wake)
            return await _outcome(future)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the wake did not finish in time")
        except NotServing as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except Exception as err:  # noqa: BLE001 - a failed wake stops the engine; the caller reads why
            await context.abort(grpc.StatusCode.INTERNAL, f"wake failed: {type(err).__name__}: {err}")


async def _outcome(future: Future, timeout: float = SLEEP_TIMEOUT_SECONDS) -> Any:
    """The engine's answer to an order (a reload, a sleep, a wake), waited for at most ``timeout``.
    Shielded: a caller that gives up or goes away must not cancel the future, which the engine
    (or, across the channel, the client's receiver thread) resolves later; resolving a cancelled
    future raises InvalidStateError in that thread."""
    return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry ``authorization: Bearer <token>`` (health excepted)."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self.expected):
            return await continuation(details)
        return _deny_handler(await continuation(details))


def _deny_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "GraphControl needs 'authorization: Bearer <token>'")

    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


@dataclass
class Servers:
    inference: grpc.aio.Server
    control: grpc.aio.Server
    inference_port: int
    control_port: int
    health: health.aio.HealthServicer
    #: What listens on the control port: it relays to ``control``, which listens on a Unix socket.
    control_gate: ControlGate

    async def start(self) -> None:
        await self.inference.start()
        await self.control.start()
        await self.control_gate.start()

    async def stop(self, grace: float) -> None:
        await self.control_gate.stop()
        await asyncio.gather(self.inference.stop(grace), self.control.stop(grace))


def build_servers(engine: EngineFace, host: str, port: int, control_host: str, control_port: int,
                  token: str, hub: StreamHub | None = None, limits: ConnectionLimits | None = None) -> Servers:
    """Both servers with their services registered, bound and unstarted, each with its
    connection limits (``grpc_limits``); the control server behind its gate (``control_gate``),
    which binds the control address.

    Raises OSError naming the address when a port cannot be bound (in use, or not an address here).
    """
    limits = limits or ConnectionLimits()
    inference = grpc.aio.server(options=(
        *server_options(limits, limits.max_connections),
        ("grpc.max_receive_message_length", max_request_bytes(engine.settings.max_seq_len))))
    pb_grpc.add_InferenceWorkerServicer_to_server(InferenceServicer(engine, hub),
                                                  tolerant(inference, _undecodable_counter(engine)))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, inference)
    reflection.enable_server_reflection((INFERENCE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), inference)
    interceptors = (BearerTokenInterceptor(token),) if token else ()
    # The gate holds the cap (``control_gate``); gRPC's own only bounds what it has not yet seen close.
    control = grpc.aio.server(options=server_options(limits, CONTROL_UPSTREAM_MAX_CONNECTIONS),
                              interceptors=interceptors)
    pb_grpc.add_GraphControlServicer_to_server(GraphControlServicer(engine), tolerant(control))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, control)
    bound = _bind(inference, host, port)
    gate = ControlGate(control_host, control_port)
    try:
        _bind(control, gate.upstream_target, None)
    except BaseException:
        gate.discard()
        raise
    return Servers(inference, control, bound, gate.port, health_servicer, gate)


def _undecodable_counter(engine: EngineFace) -> Callable[[str], None]:
    """Counts Generate requests whose bytes did not decode (``requests_total{outcome="undecodable"}``)."""
    def count(method: str) -> None:
        if method.endswith("/Generate"):
            engine.metrics.requests.labels("undecodable").inc()
    return count


def _bind(server: grpc.aio.Server, host: str, port: int | None) -> int:
    """Binds ``host:port`` (``host`` alone when ``port`` is None: a ``unix:`` address)."""
    address = host if port is None else f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as err:  # grpc raises RuntimeError when the port is taken
        raise OSError(f"cannot bind {address}: {err}") from None
    if bound == 0:
        raise OSError(f"cannot bind {address}: address in use or not available")
    return bound


def track_health(engine: EngineFace, servicer: health.aio.HealthServicer, loop: asyncio.AbstractEventLoop,
                 watchdog: StepWatchdog | None = None) -> None:
    """Inference is SERVING only while ready (``watchdog.ready``: the lifecycle serves and the step
    loop is not stalled); the control plane answers from the start."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def set_all(status: int) -> None:
        await servicer.set(INFERENCE_SERVICE, status)
        await servicer.set("", status)

    def refresh(_: object = None) -> None:
        status = serving if ready(engine, watchdog) else not_serving
        asyncio.run_coroutine_threadsafe(set_all(status), loop)

    asyncio.run_coroutine_threadsafe(servicer.set(CONTROL_SERVICE, serving), loop)
    engine.lifecycle.subscribe(refresh)
    if watchdog is not None:
        watchdog.subscribe(refresh)
