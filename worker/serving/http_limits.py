"""What a client may hold of the OpenAI HTTP port, and how a body is read: the limits aiohttp
does not enforce by itself.

- ``ConnectionGate`` wraps aiohttp's protocol factory: at most ``max_connections`` connections
  and ``max_connections_per_peer`` from one address. At the cap a new connection evicts the one
  that has been idle (no request in flight) longest, so idle sockets cannot lock out a new client;
  when every connection is busy, or the peer holds its share, the new one is closed at once. A
  request head that has not arrived whole ``header_seconds`` after its first byte is cut off
  (slowloris); a socket that never sends a byte, or a kept-alive one with no next request, is
  closed after ``idle_seconds`` by aiohttp's keep-alive timeout (``runner_options``). A response
  its client takes no bytes of for ``write_seconds`` (the transport's writing paused and what
  the client has not taken not shrinking: a stream nobody reads, whose handler would wait in
  ``drain`` for good while its sequence holds a slot and KV blocks) is cut off: the connection
  is closed, which cancels the handler and so the request, counted as ``write_timeout``.
  Checked by the same sweep, so a write costs nothing more than it did.
- ``read_body`` refuses a ``Content-Encoding`` (no OpenAI client compresses a request, and a
  1 MB gzip body of 1 GiB cost 15-30 MB each), a body over the size limit from its header, and a
  body that does not arrive within ``body_seconds``.
- ``expect_handler`` answers ``Expect: 100-continue`` with 413 when the announced body is over
  the limit, and 100 only when it could be read.
- ``parse_json`` turns the bytes into JSON or a 400 naming the body: never a 500 (an integer of
  5,000 digits raised ``ValueError``), ``NaN`` and ``Infinity`` refused as the JSON they are not.
- ``OpenAIRequestHandler`` answers what aiohttp answers by itself (a request it cannot parse)
  with OpenAI's JSON error object rather than plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import struct
import termios
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from graphkeeper.worker.log_limits import rate_key
from graphkeeper.worker.serving.limits import ConnectionLimits
from graphkeeper.worker.serving.openai_api import ApiError

log = logging.getLogger(__name__)
#: How often the gate looks for request heads past their deadline.
SWEEP_SECONDS = 0.5
#: Digits of the longest integer a request may hold (token ids and counts fit in 10).
MAX_INT_DIGITS = 64
#: The longest ``param`` and message an error echoes (a 3 MiB unknown key was echoed twice).
MAX_PARAM_CHARS = 128
MAX_MESSAGE_CHARS = 2048


# --- connections -----------------------------------------------------------------------------


@dataclass(eq=False)
class Connection:
    """One accepted connection as the gate sees it."""

    peer: str
    transport: asyncio.Transport
    handler: Any  # aiohttp's RequestHandler
    #: When the bytes of a request head began arriving (None: none pending).
    head_since: float | None = None
    #: Since when the transport's writing has been paused (its buffer full) with the client
    #: taking none of it (None: not paused).
    paused_since: float | None = None
    #: What the client had not taken (``unsent_bytes``) when last looked at while paused.
    paused_buffer: int = 0

    @property
    def busy(self) -> bool:
        """A request is being handled (or parsed and about to be): never evicted."""
        return bool(self.handler._request_in_progress or self.handler._messages)


def admission(open_count: int, peer_count: int, limits: ConnectionLimits, evictable: bool) -> str:
    """``admit``, ``evict`` (admit after closing the idlest connection) or ``refuse``."""
    if peer_count >= limits.max_connections_per_peer:
        return "refuse"
    if open_count < limits.max_connections:
        return "admit"
    return "evict" if evictable else "refuse"


def head_overdue(conn: Connection, now: float, header_seconds: float) -> bool:
    return conn.head_since is not None and not conn.busy and now - conn.head_since > header_seconds


def unsent_bytes(transport: asyncio.Transport) -> int:
    """Bytes of the response its client has not taken: the transport's buffer and the socket's
    send queue (sent but not acknowledged, or not sent yet). The socket's queue is what shrinks
    when a slow client reads a little: the transport's buffer moves only once the socket has room
    for a good share of it again."""
    buffered = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            buffered += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return buffered


def write_overdue(conn: Connection, now: float, write_seconds: float, buffered: int) -> bool:
    """The client has taken none of the response for ``write_seconds``: asyncio paused the
    transport's writing (its buffer past the high-water mark) and since then what the client has
    not taken (``unsent_bytes``, now ``buffered``) has not shrunk. A client that reads, however
    slowly, restarts the clock."""
    if conn.paused_since is None:
        return False
    if buffered < conn.paused_buffer:
        conn.paused_since = now
    conn.paused_buffer = buffered
    return now - conn.paused_since > write_seconds


@dataclass
class GateCounts:
    """What the gate refused, for the attack bench and the tests (read through ``/metrics``
    would need new families; the log says it, rate-limited)."""

    refused: int = 0
    evicted: int = 0
    slow_heads: int = 0
    slow_readers: int = 0


class ConnectionGate:
    """The HTTP port's connection cap, per-peer cap, eviction and request-head deadline."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        #: Open connections, oldest first (dicts keep insertion order).
        self.open: dict[Connection, None] = {}
        self.per_peer: Counter[str] = Counter()
        self.counts = GateCounts()
        self._sweeper: asyncio.TimerHandle | None = None

    def factory(self, make_handler: Callable[[], Any]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory to serve with: aiohttp's, behind the gate."""
        return lambda: _GatedProtocol(self, make_handler)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweeper = loop.call_later(SWEEP_SECONDS, self._sweep, loop)

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def admit(self, peer: str, transport: asyncio.Transport, handler: Any) -> Connection | None:
        full = len(self.open) >= self.limits.max_connections
        idlest = next((c for c in self.open if not c.busy), None) if full else None  # oldest first
        verdict = admission(len(self.open), self.per_peer[peer], self.limits, idlest is not None)
        if verdict == "refuse":
            self.counts.refused += 1
            log.warning("HTTP: refused a connection from %s (%d open, %d from it)", peer, len(self.open),
                        self.per_peer[peer], extra=rate_key("http-refused"))
            return None
        if verdict == "evict" and idlest is not None:
            self.counts.evicted += 1
            self._drop(idlest)
        conn = Connection(peer, transport, handler)
        self.open[conn] = None
        self.per_peer[peer] += 1
        return conn

    def received(self, conn: Connection, completed_head: bool) -> None:
        """Bytes arrived: a request head's clock starts at its first byte and stops when it is whole."""
        if completed_head or conn.busy:
            conn.head_since = None
        elif conn.head_since is None:
            conn.head_since = self.clock()

    def writing(self, conn: Connection, paused: bool) -> None:
        """The transport paused (its buffer full) or resumed writing to the client."""
        if not paused:
            conn.paused_since = None
        elif conn.paused_since is None:
            conn.paused_since, conn.paused_buffer = self.clock(), unsent_bytes(conn.transport)

    def release(self, conn: Connection) -> None:
        if conn in self.open:
            del self.open[conn]
            self.per_peer[conn.peer] -= 1
            if self.per_peer[conn.peer] <= 0:
                del self.per_peer[conn.peer]

    def _drop(self, conn: Connection) -> None:
        self.release(conn)
        conn.transport.abort()

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = self.clock()
        late = [c for c in self.open if head_overdue(c, now, self.limits.header_seconds)]
        for conn in late:
            self.counts.slow_heads += 1
            self._drop(conn)
        if late:
            log.warning("HTTP: closed %d connection(s) whose request head did not arrive within %.0f s",
                        len(late), self.limits.header_seconds, extra=rate_key("http-slow-head"))
        stuck = [c for c in self.open if c.paused_since is not None
                 and write_overdue(c, now, self.limits.write_seconds, unsent_bytes(c.transport))]
        for conn in stuck:
            self.counts.slow_readers += 1
            conn.handler.write_timed_out = True  # the request counts as write_timeout, not cancelled
            self._drop(conn)
        if stuck:
            log.warning("HTTP: closed %d connection(s) whose client took none of its response for %.0f s",
                        len(stuck), self.limits.write_seconds, extra=rate_key("http-slow-reader"))
        self._sweeper = loop.call_later(SWEEP_SECONDS, self._sweep, loop)


class _GatedProtocol(asyncio.Protocol):
    """aiohttp's request handler behind the gate: every callback passes through once admitted."""

    def __init__(self, gate: ConnectionGate, make_handler: Callable[[], Any]) -> None:
        self.gate = gate
        self.make_handler = make_handler
        self.conn: Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        handler = self.make_handler()
        self.conn = self.gate.admit(peer, transport, handler)
        if self.conn is None:
            transport.abort()
            return
        handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is None:
            return
        before = conn.handler._request_count
        conn.handler.data_received(data)
        self.gate.received(conn, conn.handler._request_count != before)

    def eof_received(self) -> bool | None:
        return self.conn.handler.eof_received() if self.conn is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            self.gate.release(conn)
            conn.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.gate.writing(self.conn, paused=True)
            self.conn.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.gate.writing(self.conn, paused=False)
            self.conn.handler.resume_writing()


def runner_options(limits: ConnectionLimits, logger: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:
    """aiohttp request handler options: nothing is inflated (``read_body`` refuses an encoding),
    idle connections close after ``idle_seconds``, and its error log is ours (counted, rate-limited)."""
    return {"auto_decompress": False, "keepalive_timeout": limits.idle_seconds, "logger": logger}


# --- bodies ----------------------------------------------------------------------------------


def encoding_error(headers: Any) -> ApiError | None:
    """A 400 for a request body with a ``Content-Encoding`` (identity excepted)."""
    encoding = headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    return ApiError(400, f"the request body is {clip(encoding, 32)}-encoded: this server reads uncompressed "
                    "bodies only (send it without Content-Encoding)", "Content-Encoding",
                    code="unsupported_content_encoding")


def too_large(max_body: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {max_body} bytes", code="body_too_large")


async def read_body(request: web.Request, max_body: int, timeout: float) -> bytes:
    """The raw body, or ApiError: an encoding (400), over ``max_body`` (413), too slow (408)."""
    if (err := encoding_error(request.headers)) is not None:
        raise err
    if request.content_length is not None and request.content_length > max_body:
        raise too_large(max_body)  # refused from its header, before a byte of it is read
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except web.HTTPRequestEntityTooLarge:
        raise too_large(max_body) from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="body_timeout") from None
    except HttpProcessingError as err:  # a broken chunked framing, a body cut short
        raise ApiError(400, f"the request body is not valid HTTP/1.1: {clip(' '.join(err.message.split()), 200)}",
                       code="malformed_http") from None


def expect_handler(max_body: int, refused: Callable[[web.Request, ApiError], web.Response]):
    """aiohttp's ``expect_handler`` for the POST routes: 100 Continue only for a body that would be
    read; a refusal (its response from ``refused``, which counts it) otherwise."""

    async def handle(request: web.Request) -> web.StreamResponse | None:
        if request.headers.get("Expect", "").lower() != "100-continue":
            return refused(request, ApiError(417, "Expect: only 100-continue is understood", "Expect"))
        err = encoding_error(request.headers)
        if err is None and request.content_length is not None and request.content_length > max_body:
            err = too_large(max_body)
        if err is not None:
            return refused(request, err)
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's own handler: the body has not begun
        return None

    return handle


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


class _NotJson:
    """Where the body held ``NaN``, ``Infinity`` or ``-Infinity`` (Python's JSON reads them; JSON
    has no such numbers): kept as a marker so the refusal can name the field that held it."""

    def __init__(self, name: str) -> None:
        self.name = name


def _marker_path(value: Any, path: str = "") -> tuple[str, str] | None:
    """(the field's path, the constant) of the first ``_NotJson`` in ``value``, if any."""
    if isinstance(value, _NotJson):
        return path, value.name
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        sub = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
        if (found := _marker_path(item, sub)) is not None:
            return found
    return None


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 ApiError naming what is wrong with it (never another error):
    ``NaN`` or ``Infinity`` is refused naming the field that held it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not UTF-8 ({err.reason} at byte {err.start})") from None
    try:
        value = json.loads(text, parse_int=_bounded_int, parse_constant=_NotJson)
    except json.JSONDecodeError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err.msg} at line {err.lineno} column "
                       f"{err.colno}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON here: it nests too deeply") from None
    except ValueError as err:
        raise ApiError(400, f"the request body is not valid JSON here: {clip(str(err), 200)}") from None
    if (found := _marker_path(value)) is not None:
        field, name = found
        param = clip(field, MAX_PARAM_CHARS) or None
        raise ApiError(400, f"{param or 'the request body'}: {name} is not a JSON number (the request body "
                       "must be JSON)", param)
    return value


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def clipped(err: ApiError) -> ApiError:
    """``err`` with its ``param`` and message no longer than an error should echo."""
    if (err.param is None or len(err.param) <= MAX_PARAM_CHARS) and len(err.message) <= MAX_MESSAGE_CHARS:
        return err
    param = None if err.param is None else clip(err.param, MAX_PARAM_CHARS)
    return ApiError(err.status, clip(err.message, MAX_MESSAGE_CHARS), param, err.type, err.code)


# --- what aiohttp answers by itself ----------------------------------------------------------


def handler_error(status: int, exc: BaseException | None, message: str | None) -> ApiError:
    """The OpenAI error for what aiohttp's request handler answers itself (pure): a request whose
    bytes are not HTTP/1.1 (a request line, a header or the body's framing: 400 naming what), a
    handler that timed out (504), anything else (500)."""
    if isinstance(exc, HttpProcessingError):
        what = clip(" ".join(str(exc.message or message or "malformed").split()), 200)
        code = exc.code if 400 <= (exc.code or 0) < 500 else 400
        return ApiError(code, f"the request is not valid HTTP/1.1: {what}", code="malformed_http")
    if status == 504:
        return ApiError(504, "the request timed out", type_="server_error", code="timeout")
    if 400 <= status < 500:
        return ApiError(status, clip(message or "the request could not be read", 200))
    return ApiError(500, "internal error: the server failed to answer this request", type_="server_error")


class OpenAIRequestHandler(RequestHandler):
    """aiohttp's request handler, answering what never reaches a route (a request line or header
    it cannot parse, a body whose chunked framing is broken, an error no middleware caught) with
    OpenAI's JSON error object instead of a plain-text page. A middleware never sees a request that
    did not parse (aio-libs/aiohttp#3287): ``handle_error`` is where aiohttp's handler answers
    each of these, so it is overridden here (aiohttp is pinned, ``constraints.txt``).

    ``write_timed_out`` is set by the connection gate when it closes the connection because the
    client took no bytes of its response for ``write_seconds`` (the request is then counted as
    ``write_timeout``)."""

    __slots__ = ("write_timed_out",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.write_timed_out = False

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # aiohttp's own logs it (``HandlerLog`` counts a parse failure) and refuses once a
        # response has begun; its plain-text answer is replaced.
        super().handle_error(request, status, exc, message)
        err = handler_error(status, exc, message)
        response = web.Response(body=json.dumps(err.body()).encode(), status=err.status,
                                content_type="application/json")
        response.force_close()
        return response


def handler_factory(server: web.Server) -> Callable[[], OpenAIRequestHandler]:
    """What makes each connection's handler: aiohttp's ``Server`` would, with its own options."""
    return lambda: OpenAIRequestHandler(server, loop=server._loop, **server._kwargs)


# --- aiohttp's own error log -----------------------------------------------------------------


class HandlerLog(logging.LoggerAdapter):
    """The logger aiohttp's request handler reports with: a request it could not parse (a bad
    request line or header; aiohttp answers it 400) is counted (``on_parse_failure``) and logged
    once per client per interval; anything else it reports is logged rate-limited as well."""

    def __init__(self, on_parse_failure: Callable[[], None], logger: logging.Logger | None = None) -> None:
        super().__init__(logger or logging.getLogger("graphkeeper.worker.http"), {})
        self.on_parse_failure = on_parse_failure

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        err = exc_info if isinstance(exc_info, BaseException) else None
        peer = str(args[0]) if args else "?"
        if isinstance(err, HttpProcessingError):
            self.on_parse_failure()
            self.logger.warning("HTTP: unparseable request from %s: %s", peer, clip(str(err), 200),
                                extra=rate_key("http-unparseable", peer))
            return
        self.logger.error(msg, *args, exc_info=exc_info, extra=rate_key("http-error", peer), **kwargs)
