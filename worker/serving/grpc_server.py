"""The worker's gRPC API layer: InferenceWorker and health on the inference port, GraphControl on
its own authenticated port, both on one asyncio event loop.

The engine thread never talks to a client. At the end of each step it hands the step's tokens to
``StreamHub.publish`` once; the hub crosses to the event loop in one call and fans the tokens
out to the streams in one pass. Each stream coroutine writes whatever has accumulated since its
last write, so a client slower than the engine gets several tokens per message instead of a
queue of one message per token, and the engine never waits for a client.

Handlers map every refusal to a status code with a message: INVALID_ARGUMENT for bad input
(naming the field), RESOURCE_EXHAUSTED for a full queue, FAILED_PRECONDITION for a stale policy
generation, UNAVAILABLE while not serving, UNAUTHENTICATED for a control call without the token.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from graphkeeper.proto import SERVER_OPTIONS
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.proto.policy import PolicyError
from graphkeeper.worker.engine import (
    SERVING_STATES,
    CannotFit,
    ChatError,
    Engine,
    IncrementalDetokenizer,
    NotServing,
    QueueFull,
    ReloadRefused,
    StalePolicy,
    StepFailed,
)
from graphkeeper.worker.serving.admission import (
    AdmissionError,
    Oversize,
    max_request_bytes,
    validate_reload_request,
    validate_request,
    validate_tokenized,
)
from graphkeeper.worker.serving.wire import tolerant

log = logging.getLogger(__name__)

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["InferenceWorker"].full_name
CONTROL_SERVICE = pb.DESCRIPTOR.services_by_name["GraphControl"].full_name
RELOAD_TIMEOUT_SECONDS = 600.0
#: Connections each port holds at once; past them a new connection is closed at once. Idle
#: connections cost memory each (3,000 held 37 MB): clients and the kubelet need far fewer, and
#: the control port serves the operator and ``graphkeeper status`` only.
INFERENCE_MAX_CONNECTIONS = 1024
CONTROL_MAX_CONNECTIONS = 64
#: Prompts longer than this are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 4096
#: Pacing under load: a stream writes at most once per (this many seconds x open streams), at most
#: MAX_FLUSH_GAP, so the API layer's share of the interpreter stays bounded while the engine runs at
#: the GPU's pace; tokens that arrive in between go out together in the next message. Each write
#: costs the event loop tens of microseconds under the interpreter lock the engine thread needs: on
#: the H200 with 64 decoding streams, 0.1 ms per stream held the engine to 0.72 of its FULL-graph
#: step and 0.2 ms let it reach 0.89 (bench/results/README.md).
FLUSH_GAP_PER_STREAM = 0.0002
MAX_FLUSH_GAP = 0.016
#: Niceness of the threads that tokenize long prompts, which also run under SCHED_IDLE: the lowest
#: priority, so that a flood of expensive requests gets only CPU time that the engine core, the
#: event loop and the streams leave over (niceness alone still cost the streams 0.8 of their pace on
#: two busy CPUs, SCHED_IDLE 0.97); on a machine with spare cores it changes nothing
#: (bench/attack_bench.py).
TOKENIZE_NICENESS = 19


def _background_priority() -> None:
    """Lowers the calling thread's CPU priority (Linux: niceness and the scheduling policy are per
    thread, and lowering them needs no privilege)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZE_NICENESS)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
    except (OSError, AttributeError):  # not Linux: the thread keeps the process's priority
        log.debug("cannot lower the tokenizer threads' priority here")


TOKENIZE_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenize", initializer=_background_priority)


@dataclass(eq=False)
class TokenStream:
    """One Generate call's mailbox on the event loop: the hub appends, the handler drains."""

    tokens: list[int] = field(default_factory=list)
    end: pb.Completion | BaseException | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class StreamHub:
    """Carries each step's outputs from the engine thread to the streams, in one loop callback.

    Steps published while the loop has not yet run the last callback join it, so the engine
    wakes the loop (a write to its self-pipe) at most once per loop pass rather than once per step.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.open_streams = 0
        self._pending: list[list[tuple[Any, list[int], Any]]] = []
        self._lock = threading.Lock()

    def flush_gap(self) -> float:
        """Seconds a stream waits after a write before its next one (0 with a single stream)."""
        return 0.0 if self.open_streams <= 1 else min(MAX_FLUSH_GAP, FLUSH_GAP_PER_STREAM * self.open_streams)

    def publish(self, updates: list[tuple[Any, list[int], Any]]) -> None:
        """Engine thread: ``(stream, new tokens, end)`` for each stream; ``end`` is a Completion, an
        exception that fails the stream, or None while it continues."""
        if not updates:
            return
        with self._lock:
            self._pending.append(updates)
            wake = len(self._pending) == 1
        if wake:
            self.loop.call_soon_threadsafe(self._fan_out)

    def _fan_out(self) -> None:
        """Event loop: every step published since the last pass, in the order the engine made them."""
        with self._lock:
            steps, self._pending = self._pending, []
        for updates in steps:
            for stream, tokens, end in updates:
                if tokens:
                    stream.tokens.extend(tokens)
                if end is not None:
                    stream.end = end
                stream.wake.set()


class InferenceServicer(pb_grpc.InferenceWorkerServicer):
    def __init__(self, engine: Engine, hub: StreamHub | None = None) -> None:
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
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except QueueFull as err:
            engine.metrics.requests.labels("queue_full").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except CannotFit as err:
            engine.metrics.requests.labels("oversize").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except NotServing as err:
            engine.metrics.requests.labels("unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
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
                    chunk = pb.TokenChunk(token_ids=tokens, text=detok.add(tokens) if detok else "")
                    await context.write(pb.GenerateResponse(tokens=chunk))
                end = stream.end
                if isinstance(end, pb.Completion):
                    if detok and (rest := detok.flush()):
                        await context.write(pb.GenerateResponse(tokens=pb.TokenChunk(text=rest)))
                    await context.write(pb.GenerateResponse(completion=end))
                    return
                if isinstance(end, StepFailed):
                    await context.abort(grpc.StatusCode.INTERNAL, str(end))
                if isinstance(end, QueueFull):  # refused by an engine core in its own process
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(end))
                if isinstance(end, CannotFit):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(end))
                if isinstance(end, NotServing):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(end))
                if hub is not None and (gap := hub.flush_gap()):
                    await asyncio.sleep(gap)
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


async def admitted(engine: Engine, request: pb.GenerateRequest, fill_context: bool = False) -> pb.GenerateRequest:
    """The request checked against the served model, a text prompt tokenized (off the event
    loop when long) and checked again as token ids; raises AdmissionError or NotServing. Both
    front ends (gRPC here, OpenAI HTTP in ``http_server``) admit through this one function.

    Every size check runs before anything is copied or tokenized: a prompt that cannot fit
    the context costs its length checks, not its tokenization (``validate_text_length``).
    ``fill_context``: the client set no output length, so ``max_new_tokens`` (sent as 1) becomes
    whatever the context leaves after the prompt, as OpenAI-compatible servers do.
    """
    limits = engine.limits()
    if limits is None:
        raise NotServing("model not loaded yet")
    validate_request(request, limits)  # sizes and rules before any tokenizing
    if not request.prompt_text and not request.messages:
        if fill_context:
            request.stopping.max_new_tokens = max(1, limits.max_seq_len - len(request.prompt_token_ids))
        return request
    tokenizer = engine.tokenizer
    if request.messages:
        chat = [(m.role, m.content) for m in request.messages]
        encode, size = (lambda: tokenizer.encode_chat(chat)), sum(len(m.content) for m in request.messages)
    else:
        encode, size = (lambda: tokenizer.encode_ids(request.prompt_text)), len(request.prompt_text)
    try:
        ids = await asyncio.get_running_loop().run_in_executor(TOKENIZE_POOL, encode) \
            if size > INLINE_TOKENIZE_CHARS else encode()
    except ChatError as err:
        raise AdmissionError(err.field, str(err).removeprefix(f"{err.field}: ")) from None
    tokenized = pb.GenerateRequest()
    tokenized.CopyFrom(request)
    if fill_context:
        tokenized.stopping.max_new_tokens = max(1, limits.max_seq_len - len(ids))
    validate_tokenized(ids, tokenized.stopping.max_new_tokens, limits,
                       "messages" if request.messages else "prompt_text")
    tokenized.ClearField("prompt_text")
    tokenized.ClearField("messages")
    tokenized.prompt_token_ids.extend(ids)
    return tokenized


def public_model_info(info: pb.GetModelInfoResponse) -> pb.GetModelInfoResponse:
    """What the unauthenticated inference port tells anyone about the model: the source's last
    path component (its name), never the full path, which shows the node's directory layout."""
    public = pb.GetModelInfoResponse()
    public.CopyFrom(info)
    if not info.source.startswith("random:"):
        public.source = PurePosixPath(info.source).name
    return public


class GraphControlServicer(pb_grpc.GraphControlServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def ApplyGraphPolicy(self, request: pb.ApplyGraphPolicyRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            return self.engine.apply_policy(request.policy)
        except PolicyError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"policy.{err}")
        except StalePolicy as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))

    async def GetGraphStatus(self, request: pb.GetGraphStatusRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return self.engine.status()

    async def LoadModelRevision(self, request: pb.LoadModelRevisionRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            validate_reload_request(request)
            future = self.engine.load_revision(request.source, request.revision)
        except AdmissionError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except ReloadRefused as err:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        except NotServing as err:  # another reload is pending: retry later
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        try:
            revision = await asyncio.wait_for(asyncio.wrap_future(future), RELOAD_TIMEOUT_SECONDS)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "model reload did not finish in time")
        except ReloadRefused as err:  # relinked outside the roots between the request and the load
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        except Exception as err:  # noqa: BLE001 - reported to the caller; the worker keeps serving
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"source: {err}")
        return pb.LoadModelRevisionResponse(revision=revision, recapture_started=self.engine.captures_graphs)


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


def build_servers(engine: Engine, host: str, port: int, control_host: str, control_port: int,
                  token: str, hub: StreamHub | None = None) -> Servers:
    """Both servers with their services registered, bound and unstarted.

    Raises OSError naming the address when a port cannot be bound (in use, or not an address here).
    """
    inference = grpc.aio.server(options=(
        *_capped(INFERENCE_MAX_CONNECTIONS),
        ("grpc.max_receive_message_length", max_request_bytes(engine.settings.max_seq_len))))
    pb_grpc.add_InferenceWorkerServicer_to_server(InferenceServicer(engine, hub),
                                                  tolerant(inference, _undecodable_counter(engine)))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, inference)
    reflection.enable_server_reflection((INFERENCE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), inference)
    interceptors = (BearerTokenInterceptor(token),) if token else ()
    control = grpc.aio.server(options=_capped(CONTROL_MAX_CONNECTIONS), interceptors=interceptors)
    pb_grpc.add_GraphControlServicer_to_server(GraphControlServicer(engine), tolerant(control))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, control)
    bound = _bind(inference, host, port)
    bound_control = _bind(control, control_host, control_port)
    return Servers(inference, control, bound, bound_control, health_servicer)


def _capped(connections: int) -> tuple[tuple[str, int], ...]:
    """The server options with a cap on the connections the server holds at once."""
    return (*SERVER_OPTIONS, ("grpc.max_allowed_incoming_connections", connections))


def _undecodable_counter(engine: Engine) -> Callable[[str], None]:
    """Counts Generate requests whose bytes did not decode (``requests_total{outcome="undecodable"}``)."""
    def count(method: str) -> None:
        if method.endswith("/Generate"):
            engine.metrics.requests.labels("undecodable").inc()
    return count


def _bind(server: grpc.aio.Server, host: str, port: int) -> int:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as err:  # grpc raises RuntimeError when the port is taken
        raise OSError(f"cannot bind {address}: {err}") from None
    if bound == 0:
        raise OSError(f"cannot bind {address}: address in use or not available")
    return bound


def track_health(engine: Engine, servicer: health.aio.HealthServicer, loop: asyncio.AbstractEventLoop) -> None:
    """Inference is SERVING only while ready; the control plane answers from the start."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def set_all(status: int) -> None:
        await servicer.set(INFERENCE_SERVICE, status)
        await servicer.set("", status)

    def on_state(state: int) -> None:
        status = serving if state in SERVING_STATES and engine.failed is None else not_serving
        asyncio.run_coroutine_threadsafe(set_all(status), loop)

    asyncio.run_coroutine_threadsafe(servicer.set(CONTROL_SERVICE, serving), loop)
    engine.lifecycle.subscribe(on_state)
