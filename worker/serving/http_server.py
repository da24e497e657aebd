"""The OpenAI-compatible HTTP API (aiohttp) on the worker's asyncio loop, beside gRPC.

``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``
(200 only while the worker serves, a sleeping one included: a request wakes it), ``GET
/is_sleeping`` (vLLM's ``{"is_sleeping": ...}``) and ``GET /metrics``. A request is read by the pure rules of
``openai_api``, admitted by the same function as a gRPC Generate (``streams.admitted``),
submitted to the same engine face (``EngineFace``: the in-process ``Engine`` or the
``EngineClient`` of the engine-core process) and fed by the same ``StreamHub``: each stream writes
what accumulated since its last write: one SSE event per token while the client keeps up, several
tokens per event when it does not or when many streams are open (paced like the gRPC streams,
``StreamHub.flush_gap``).

A client that goes away cancels its sequence (the handler is cancelled on disconnect, and a write
to a closed connection fails), so its slot returns at once. Every refusal is an OpenAI error
object with its status: 400 naming the field (what is not supported included: never a 5xx,
which the SDKs retry), 404 for another model, 413 for a body over the cap; an engine error (429
for a full queue, 400 for a request the cache cannot fit, 503 while not serving, 500 for a failed
step or anything else) gets the status of its row in the engine's errors table
(``engine.classify``), as on the gRPC port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.field_checks import clipped_repr
from graphkeeper.worker.engine import (
    EngineFace,
    IncrementalDetokenizer,
    StepWatchdog,
    classify,
    error_message,
    ready,
)
from graphkeeper.worker.log_limits import rate_key
from graphkeeper.worker.plan import unpacked
from graphkeeper.worker.serving.admission import MAX_PROMPT_TEXT_BYTES, AdmissionError, Oversize
from graphkeeper.worker.serving.http_limits import (
    ConnectionGate,
    HandlerLog,
    clipped,
    expect_handler,
    handler_factory,
    parse_json,
    read_body,
    runner_options,
)
from graphkeeper.worker.serving.limits import ConnectionLimits
from graphkeeper.worker.serving.openai_api import (
    EXECUTION_HEADER,
    TENANT_HEADER,
    ApiError,
    Parsed,
    StopMatcher,
    choice,
    envelope,
    extension,
    finish_reason,
    models_list,
    new_id,
    parse_chat,
    parse_completion,
    usage,
)
from graphkeeper.worker.serving.openai_sampling import chat_logprobs, completion_logprobs, echoed_entries
from graphkeeper.worker.serving.openai_types import type_error
from graphkeeper.worker.serving.streams import StreamHub, TokenStream, admitted, count_refusal, public_model_info

log = logging.getLogger(__name__)

#: JSON may spell a character in up to 12 bytes (a surrogate pair of \\u escapes) and a token id
#: in up to 12 (``2147483647, ``): past this a body cannot be a valid request and is refused (413)
#: before it is read whole.
JSON_OVERHEAD_BYTES = 64 << 10
BACKLOG = 1024
#: What open requests get to finish once the worker stops (the drain already waited for them).
SHUTDOWN_SECONDS = 2.0
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def max_body_bytes(max_seq_len: int) -> int:
    """The largest body a valid request could have on a worker with ``max_seq_len``."""
    return 6 * MAX_PROMPT_TEXT_BYTES + 12 * max_seq_len + JSON_OVERHEAD_BYTES


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def sse(value: Any) -> bytes:
    return b"data: " + dumps(value) + b"\n\n"


#: A string's JSON as ``dumps`` writes it, without building a new encoder per call.
_json_string = json.JSONEncoder(ensure_ascii=False).encode
_TEXT_MARK = "\x00graphkeeper-text\x00"
_USAGE_MARK = "\x00graphkeeper-usage\x00"


class TextEvents:
    """A stream's plain text chunks as SSE bytes: the same bytes as ``sse(envelope(..., [choice(...)]))``
    (with ``"usage"`` after the choices when ``with_usage``, vLLM's continuous_usage_stats, which
    GuideLLM asks for). The chunk is encoded once with markers for the text and the usage and split
    around them, so a token costs one string's JSON and three integers rather than three dicts and
    a whole document's JSON (about 0.3 us instead of 6-9 at 64 streams' tens of thousands of events
    a second). The first chat chunk (the role) and token ids take ``sse``."""

    def __init__(self, rid: str, chat: bool, created: int, model: str, with_usage: bool = False) -> None:
        chunk = envelope(rid, chat, created, model, [choice(chat, _TEXT_MARK, None, delta=True)], chunk=True)
        if with_usage:
            chunk["usage"] = _USAGE_MARK
        self.head, _, rest = sse(chunk).partition(_json_string(_TEXT_MARK).encode())
        self.mid, _, self.tail = rest.partition(_json_string(_USAGE_MARK).encode())
        self.with_usage = with_usage

    def text(self, text: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> bytes:
        if not self.with_usage:
            return self.head + _json_string(text).encode() + self.mid
        return b"".join((self.head, _json_string(text).encode(), self.mid,
                         b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}'
                         % (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens), self.tail))


def error_response(err: ApiError) -> web.Response:
    return web.Response(body=dumps(clipped(err).body()), status=err.status, content_type="application/json")


#: gRPC admission names proto fields; the OpenAI client sent these.
_PARAMS = {"prompt_text": "prompt", "prompt_token_ids": "prompt", "stopping.stop_token_ids": "stop_token_ids",
           "sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.top_k": "top_k"}


def openai_param(field: str, parsed: Parsed, tenant_param: str) -> str:
    """The request field an admission error is about, in the client's names."""
    base, bracket, rest = field.partition("[")
    if base == "tenant":
        return tenant_param
    if base == "stopping.max_new_tokens":
        return parsed.max_tokens_param
    if base == "sampling.logit_bias":  # a map: OpenAI names the entry by its key
        return "logit_bias." + rest.rstrip("]")
    if base.startswith("constraint"):
        return "response_format"
    return _PARAMS.get(base, base.removeprefix("sampling.")) + bracket + rest


class OpenAIServer:
    """The HTTP API for one engine; ``start`` binds it on the running loop."""

    def __init__(self, engine: EngineFace, hub: StreamHub, served_model_name: str = "",
                 metrics: Any = None, limits: ConnectionLimits | None = None,
                 watchdog: StepWatchdog | None = None) -> None:
        self.engine = engine
        self.limits = limits or ConnectionLimits()
        self.watchdog = watchdog
        self.gate = ConnectionGate(self.limits)
        self.hub = hub
        self.served_model_name = served_model_name
        self.metrics_registry = metrics
        self.created = 0
        self.port = 0
        self.runner: web.AppRunner | None = None
        self.max_body = max_body_bytes(engine.settings.max_seq_len)
        self.app = web.Application(client_max_size=self.max_body,
                                   middlewares=[self._errors])
        expect = expect_handler(self.max_body, self._refused)
        self.app.router.add_post("/v1/completions", self.completions, expect_handler=expect)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=expect)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/is_sleeping", self.is_sleeping)
        if metrics is not None:
            self.app.router.add_get("/metrics", self.metrics)

    async def start(self, host: str, port: int) -> int:
        """Binds and serves on the running loop; returns the port. OSError naming the address."""
        self.created = int(time.time())
        # handler_cancellation: a client that disconnects cancels its handler, which frees the slot.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=SHUTDOWN_SECONDS,
                                    **runner_options(self.limits, HandlerLog(lambda: self._count("invalid"))))
        await self.runner.setup()
        # The connection gate stands between the socket and aiohttp (``http_limits``).
        site = _GatedSite(self.runner, self.gate, host, port, backlog=BACKLOG)
        try:
            await site.start()
        except OSError as err:
            await self.runner.cleanup()
            raise OSError(f"cannot bind the HTTP port {host}:{port}: {err.strerror or err}") from None
        self.gate.start(asyncio.get_running_loop())
        server = site._server  # aiohttp keeps the asyncio server here; its socket knows an ephemeral port
        self.port = server.sockets[0].getsockname()[1] if server is not None and server.sockets else port
        return self.port

    async def stop(self) -> None:
        self.gate.stop()
        if self.runner is not None:
            await self.runner.cleanup()

    # --- plumbing --------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            log.debug("%s %s: %d %s", request.method, request.path, err.status, err.message[:200])
            return error_response(err)
        except web.HTTPException as err:  # unknown path (404), wrong method (405)
            if err.status < 400:
                raise
            kind = "not_found_error" if err.status == 404 else "invalid_request_error"
            return error_response(ApiError(err.status, f"{request.method} {request.path}: {err.reason}",
                                           type_=kind))

    def _count(self, outcome: str) -> None:
        self.engine.metrics.requests.labels(outcome).inc()

    def model_name(self) -> str:
        """The name clients send as ``model``: --served-model-name, else the model's public name."""
        info = self.engine.model_info()
        if info is None:
            raise ApiError(503, "the model is not loaded yet", type_="service_unavailable_error",
                           code="not_ready")
        return self.served_model_name or public_model_info(info).source

    def _refused(self, request: web.Request, err: ApiError) -> web.Response:
        """A request refused before its handler ran (``Expect``), counted as the handler would."""
        self._count("oversize" if err.status == 413 else "invalid")
        log.warning("HTTP %s from %s: %d %s", request.path, request.remote, err.status, err.message[:200],
                    extra=rate_key("http-body", str(request.remote)))
        return error_response(err)

    async def _body(self, request: web.Request) -> Any:
        """The body's JSON; an ApiError (counted, and logged once per client per interval) for a
        body that is encoded, too large, too slow or not JSON (``http_limits``)."""
        try:
            return parse_json(await read_body(request, self.max_body, self.limits.body_seconds))
        except ApiError as err:
            self._count("oversize" if err.status == 413 else "invalid")
            log.warning("HTTP %s from %s: %d %s", request.path, request.remote, err.status, err.message[:200],
                        extra=rate_key("http-body", str(request.remote)))
            raise

    # --- endpoints -------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        serving = ready(self.engine, self.watchdog)
        return web.Response(status=200 if serving else 503, text="ok\n" if serving else "not ready\n")

    async def is_sleeping(self, request: web.Request) -> web.Response:
        """Whether the worker sleeps (GraphControl Sleep), in vLLM's form: a router may tell a
        sleeping replica from a busy one; /health stays 200 for both."""
        sleeping = self.engine.lifecycle.state == pb.LIFECYCLE_STATE_SLEEPING
        return web.Response(body=dumps({"is_sleeping": sleeping}), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        # Off the loop: the split worker asks the engine core for its families.
        body = await asyncio.to_thread(generate_latest, self.metrics_registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        name = self.model_name()
        return web.Response(body=dumps(models_list(name, self.created, self.engine.settings.max_seq_len)),
                            content_type="application/json")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._body(request)
        tenant_header = request.headers.get(TENANT_HEADER)
        try:
            if (wrong := type_error(body)) is not None:
                raise wrong
            parsed = parse_chat(body, tenant_header) if chat else parse_completion(body, tenant_header)
        except ApiError:
            self._count("invalid")
            raise
        model = self.model_name()
        if parsed.model is not None and parsed.model != model:
            self._count("invalid")
            raise ApiError(404, f"the model {clipped_repr(parsed.model)} does not exist: this server serves {model!r}",
                           "model", "not_found_error", "model_not_found")
        engine = self.engine
        runs: list[_Run] = []
        rid = new_id(parsed.chat)  # one id for the response, whatever its number of choices
        try:
            admitted_request = await admitted(engine, parsed.request, parsed.fill_context)
            for index, choice_request in enumerate(choice_requests(admitted_request, parsed.choices.n)):
                stream = TokenStream()
                seq = engine.submit(choice_request, stream)
                runs.append(_Run(engine, seq, stream, parsed, choice_request, model, self.hub, index, rid))
        except AdmissionError as err:
            self._count("oversize" if isinstance(err, Oversize) else "invalid")
            param = openai_param(err.field, parsed, TENANT_HEADER if tenant_header is not None else "user")
            raise ApiError(400, f"{param}: {err.message}", param) from None
        except Exception as err:  # noqa: BLE001 - refused by the engine (or a bug): answered by the table
            for run in runs:  # the choices already submitted end with the refused one
                engine.cancel(run.seq)
            count_refusal(engine, err)
            raise engine_error(err) from None
        self.hub.open_streams += len(runs)
        try:
            if parsed.stream:
                return await _stream_runs(runs, request)
            return await _respond(runs)
        except BaseException:
            # Whatever ends the handler before the sequence ended (the client went away, the gate
            # cut off a client that stopped reading, the server is stopping, an error of this
            # process) frees its slot, unless a stop string already ended it (it then finishes as
            # a stop).
            outcome = "write_timeout" if getattr(request.protocol, "write_timed_out", False) else None
            for run in runs:
                if not run.ended and not run.matcher.stopped:
                    engine.cancel(run.seq, pb.FINISH_REASON_CANCELLED, outcome)
            raise
        finally:
            self.hub.open_streams -= len(runs)


def choice_requests(request: pb.GenerateRequest, n: int) -> list[pb.GenerateRequest]:
    """One engine request per choice; with a seed, choice ``i`` draws with ``seed + i`` (as vLLM
    seeds its parallel samples), so every choice is reproducible and they differ."""
    if n == 1:
        return [request]
    out = []
    for i in range(n):
        copy = pb.GenerateRequest()
        copy.CopyFrom(request)
        if request.sampling.HasField("seed"):
            copy.sampling.seed = (request.sampling.seed + i) % 2**64
        out.append(copy)
    return out


async def _respond(runs: list[_Run]) -> web.Response:
    """The whole response once every choice has ended."""
    bodies = await asyncio.gather(*(run.collect() for run in runs))
    first = runs[0]
    parsed = first.parsed
    body = envelope(first.rid, parsed.chat, parsed.created, first.model, list(bodies), chunk=False)
    body["usage"] = usage(first.prompt_tokens, sum(run.generated for run in runs))
    body["graphkeeper"] = ext = extension(first.completion)
    return web.Response(body=dumps(body), content_type="application/json",
                        headers={EXECUTION_HEADER: dumps(ext["execution"]).decode()})


async def _stream_runs(runs: list[_Run], request: web.Request) -> web.StreamResponse:
    """Server-sent events of every choice, interleaved as their tokens come. The headers go out
    with the first token, so a request the engine core refuses (a full queue) is still answered
    with its status rather than a broken stream."""
    firsts = [await run.next_delta() for run in runs]  # raises ApiError before anything is sent
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        await asyncio.gather(*(run.stream_to(response, first) for run, first in zip(runs, firsts, strict=True)))
    except ApiError as err:  # the stream already began: the error is its last event
        await response.write(sse(err.body()))
        await response.write(DONE)
        await response.write_eof()
        return response
    head = runs[0]
    parsed, chat = head.parsed, head.parsed.chat
    events = []
    for run in runs:
        final = envelope(run.rid, chat, parsed.created, run.model,
                         [choice(chat, "", run.finish(), delta=True, index=run.index)], chunk=True)
        if chat:
            final["choices"][0]["delta"] = {}
        final["graphkeeper"] = extension(run.completion)
        if parsed.continuous_usage:
            final["usage"] = run.usage()
        events.append(sse(final))
    if parsed.include_usage:
        tail = envelope(head.rid, chat, parsed.created, head.model, [], chunk=True)
        tail["usage"] = usage(head.prompt_tokens, sum(run.generated for run in runs))
        events.append(sse(tail))
    await response.write(b"".join((*events, DONE)))  # one send for the request's last events
    await response.write_eof()
    return response


def engine_error(err: BaseException) -> ApiError:
    """The OpenAI error object for an engine error: its row of the engine's errors table."""
    status = classify(err)
    return ApiError(status.http_status, error_message(err), type_=status.http_type, code=status.http_code)


class _Run:
    """One admitted request's tokens, turned into text, stop-string matched and answered."""

    def __init__(self, engine: EngineFace, seq: Any, stream: TokenStream, parsed: Parsed, request: pb.GenerateRequest,
                 model: str, hub: StreamHub, index: int = 0, rid: str = "") -> None:
        self.engine, self.seq, self.stream, self.parsed, self.hub = engine, seq, stream, parsed, hub
        self.index = index
        self.request = request
        self.model = model
        self.prompt_tokens = len(request.prompt_token_ids)
        tokenizer = engine.tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, list(request.prompt_token_ids)) if tokenizer else None
        self.matcher = StopMatcher(parsed.stop)
        self.rid = rid or new_id(parsed.chat)
        #: Plain text chunks pre-encoded, when they carry no per-chunk usage, token ids, log
        #: probabilities or choice index.
        self.events = TextEvents(self.rid, parsed.chat, parsed.created, model, parsed.continuous_usage) if (
            parsed.stream and self.detok is not None and _TEXT_MARK not in model and _USAGE_MARK not in model
            and parsed.choices.n == 1 and parsed.choices.logprobs is None) else None
        #: A completion's text offset in its log probabilities, and an echoed prompt's entries.
        self.offset = 0
        self.echo_entries: list | None = None
        self.generated = 0
        self.completion: pb.Completion | None = None
        self.ended = False
        self.first = True

    async def next_delta(self) -> tuple[str, list[int], list] | None:
        """The text, token ids and their log probabilities since the last call, or None once the
        request has ended.

        A stop string cancels the sequence at once (its slot returns) and the rest of the stream
        is waited for and dropped, so the engine's completion (the execution summary) still comes.
        """
        stream = self.stream
        while True:
            if self.ended:
                return None
            await stream.wake.wait()
            stream.wake.clear()
            text, tokens, logprobs = "", [], []
            if stream.tokens:
                tokens, stream.tokens = stream.tokens, []
                logprobs, stream.logprobs = stream.logprobs, []
                if self.echo_entries is None and stream.prompt_logprobs is not None:
                    self.echo_entries = echoed_entries(list(self.request.prompt_token_ids), stream.prompt_logprobs)
                if not self.matcher.stopped:
                    self.generated += len(tokens)
                    text = self.matcher.feed(self.detok.add(tokens)) if self.detok else ""
                    if self.matcher.stopped:  # a normal finish: counted as a stop, not a cancellation
                        self.engine.cancel(self.seq, pb.FINISH_REASON_STOP)
                else:
                    tokens, logprobs = [], []
            end = stream.end
            if isinstance(end, pb.Completion):
                self.ended, self.completion = True, end
                if not self.matcher.stopped:
                    self.generated = end.generated_tokens
                    if self.detok is not None:
                        text += self.matcher.feed(self.detok.flush())
                    text += self.matcher.flush()
            elif isinstance(end, BaseException):  # a failed step, or a refusal the engine core counted
                self.ended = True
                raise engine_error(end)
            if text or tokens or self.ended:
                return text, tokens, logprobs

    async def pace(self) -> None:
        """After a write, as the gRPC streams do: tokens that arrive meanwhile go out together."""
        if not self.ended and (gap := self.hub.flush_gap()):
            await self.stream.pause(gap)

    def _token_ids(self, tokens: list[int]) -> list[int] | None:
        return None if self.detok is not None else tokens

    def finish(self) -> str:
        return finish_reason(self.completion, self.matcher.stopped)

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.generated)

    def echoed(self) -> str:
        """The prompt's text, for ``echo`` (a token-id prompt is decoded)."""
        if not self.parsed.choices.echo:
            return ""
        if self.parsed.request.prompt_text:
            return self.parsed.request.prompt_text
        return self.detok.tokenizer.decode(list(self.request.prompt_token_ids)) if self.detok else ""

    def logprobs(self, entries: list) -> dict | None:
        """The choice's ``logprobs`` object for these tokens, when the request asked for them."""
        if self.parsed.choices.logprobs is None:
            return None
        tokenizer = self.engine.tokenizer
        text = tokenizer.token_text if tokenizer is not None else str
        entries = unpacked(entries)
        if self.parsed.chat:
            return chat_logprobs(entries, text)
        out = completion_logprobs(entries, text, self.offset)
        if out["tokens"]:
            self.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    async def collect(self) -> dict[str, Any]:
        """The whole choice, once the request has ended."""
        texts, ids, entries = [self.echoed()], [], []
        while (delta := await self.next_delta()) is not None:
            texts.append(delta[0])
            ids.extend(delta[1])
            entries.extend(delta[2])
            await self.pace()
        if self.parsed.choices.echo:
            entries[:0] = self.echo_entries or []
        return choice(self.parsed.chat, "".join(texts), self.finish(), delta=False, token_ids=self._token_ids(ids),
                      index=self.index, logprobs=self.logprobs(entries))

    async def stream_to(self, response: web.StreamResponse, first: tuple[str, list[int], list] | None) -> None:
        """This choice's chunks, from its first delta (already taken) to its end."""
        parsed, chat = self.parsed, self.parsed.chat
        delta = first
        if delta is not None and self.parsed.choices.echo:
            delta = (self.echoed() + delta[0], delta[1], [*(self.echo_entries or []), *delta[2]])
        while delta is not None:
            text, tokens, entries = delta
            last = self.ended
            if self.events is not None and text and not (chat and self.first):
                await response.write(self.events.text(text, self.prompt_tokens, self.generated))
            elif text or (tokens and self.detok is None) or (chat and self.first) or entries:
                chunk = envelope(self.rid, chat, parsed.created, self.model,
                                 [choice(chat, text, None, delta=True, role=self.first,
                                         token_ids=self._token_ids(tokens), index=self.index,
                                         logprobs=self.logprobs(entries))], chunk=True)
                self.first = False
                if parsed.continuous_usage:
                    chunk["usage"] = self.usage()
                await response.write(sse(chunk))
            if last:
                break
            await self.pace()
            delta = await self.next_delta()


class _GatedSite(web.TCPSite):
    """aiohttp's TCP site with the connection gate in front of its protocol factory."""

    def __init__(self, runner: web.AppRunner, gate: ConnectionGate, host: str, port: int, backlog: int) -> None:
        super().__init__(runner, host, port, backlog=backlog)
        self.gate = gate

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.gate.factory(handler_factory(self._runner.server)), self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
