"""The metrics port: ``/metrics`` (Prometheus), ``/healthz`` (the engine thread lives) and
``/readyz`` (the worker serves inference).

One asyncio loop in one daemon thread serves every connection, so a client that opens
connections and never finishes its request costs a socket and a few hundred bytes, never a
thread: a thread per connection (``ThreadingHTTPServer``) let 300 half-open connections start
300 threads in the worker. Each connection gets ``timeout`` seconds to send its request head
and to take the answer; at most ``max_connections`` are open at once, and when a new one
arrives at the cap the oldest one still waiting for its request head is dropped at once, so a
flood of idle connections cannot lock the kubelet's probes or Prometheus out.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from graphkeeper.proto.enums import lifecycle_name
from graphkeeper.worker.engine import EngineFace, StepWatchdog, ready
from graphkeeper.worker.serving.limits import METRICS_MAX_CONNECTIONS

MAX_CONNECTIONS = METRICS_MAX_CONNECTIONS
TIMEOUT_SECONDS = 5.0
#: A request head longer than this is refused (Prometheus sends a few hundred bytes).
MAX_HEAD_BYTES = 8192
PATHS = ("/metrics", "/healthz", "/readyz")
#: Paths answered on a worker thread: a scrape asks the engine core (up to its timeout).
SLOW_PATHS = frozenset({"/metrics"})
TEXT = "text/plain; charset=utf-8"
@dataclass(frozen=True)
class Request:
    method: str
    path: str


def parse_request_head(head: bytes) -> Request | None:
    """The method and path (query string dropped) of an HTTP/1.x request head; None if malformed."""
    line = head.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return None
    try:
        method, target = parts[0].decode("ascii"), parts[1].decode("ascii")
    except UnicodeDecodeError:
        return None
    if not target.startswith("/"):
        return None
    return Request(method, urlsplit(target).path)


def route(request: Request | None) -> tuple[int, str | None]:
    """(status, endpoint): exact paths only, so ``/metricsX`` is 404, not the metrics page."""
    if request is None:
        return 400, None
    if request.path not in PATHS:
        return 404, None
    if request.method not in ("GET", "HEAD"):
        return 405, None
    return 200, request.path


def render_response(status: int, body: bytes, content_type: str, head_only: bool = False) -> bytes:
    header = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
              f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("ascii")
    return header if head_only else header + body


def engine_endpoints(engine: EngineFace, registry: Any = None,
                     watchdog: StepWatchdog | None = None) -> dict[str, Callable[[], tuple[int, bytes, str]]]:
    """The answer of each path for this engine: (status, body, content type). ``registry``: what
    ``/metrics`` exports (anything with ``collect()``), the engine's own registry by default;
    ``watchdog``: the step loop's, which ``/readyz`` and ``/healthz`` consult."""

    def metrics() -> tuple[int, bytes, str]:
        return 200, generate_latest(registry if registry is not None else engine.metrics.registry), CONTENT_TYPE_LATEST

    def healthz() -> tuple[int, bytes, str]:
        if not engine.alive():
            return 503, b"engine stopped\n", TEXT
        if watchdog is not None and watchdog.wedged():
            return 503, f"engine stalled for {watchdog.stall_seconds_now():.0f} s\n".encode(), TEXT
        return 200, b"ok\n", TEXT

    def readyz() -> tuple[int, bytes, str]:
        state = lifecycle_name(engine.lifecycle.state)
        if watchdog is not None and watchdog.stalled:
            return 503, f"{state}, engine stalled for {watchdog.stall_seconds_now():.0f} s\n".encode(), TEXT
        return 200 if ready(engine, None) else 503, f"{state}\n".encode(), TEXT

    return {"/metrics": metrics, "/healthz": healthz, "/readyz": readyz}


class MetricsServer:
    """The probe and metrics HTTP server on its own loop thread."""

    def __init__(self, endpoints: dict[str, Callable[[], tuple[int, bytes, str]]], host: str, port: int, *,
                 max_connections: int = MAX_CONNECTIONS, timeout: float = TIMEOUT_SECONDS) -> None:
        self.endpoints = endpoints
        self.host, self.port = host, port
        self.max_connections = max_connections
        self.timeout = timeout
        #: Open connections still waiting for their request head, oldest first (dicts keep order).
        self._waiting: dict[asyncio.StreamWriter, float] = {}
        self._open = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)

    @property
    def open_connections(self) -> int:
        return self._open

    def start(self) -> int:
        """Binds and serves; returns the bound port. Raises OSError when the port cannot be bound."""
        self.thread.start()
        self._started.wait()
        if self._error is not None:
            raise OSError(f"cannot bind the metrics port {self.host}:{self.port}: {self._error}") from self._error
        return self.port

    def stop(self, timeout: float = 5.0) -> None:
        """Stops serving and waits (up to ``timeout``) for the thread to end its open connections."""
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self.thread.join(timeout)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            self._server = loop.run_until_complete(asyncio.start_server(
                self._serve, self.host, self.port, limit=MAX_HEAD_BYTES, backlog=128))
        except OSError as err:
            self._error = err
            self._started.set()
            return
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        try:
            loop.run_forever()
        finally:
            _end_tasks(loop)

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        """At the cap, the connection that has waited longest for its request head gives way."""
        if self._open >= self.max_connections and self._waiting:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.transport.abort()
        self._open += 1
        self._waiting[writer] = time.monotonic()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self.max_connections and not self._waiting:
            writer.transport.abort()  # every slot is busy answering: no one to evict
            return
        self._admit(writer)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout)
            self._waiting.pop(writer, None)
            request = parse_request_head(head)
            status, endpoint = route(request)
            if endpoint is None:
                body, content_type = f"{HTTPStatus(status).phrase.lower()}\n".encode(), TEXT
            elif endpoint in SLOW_PATHS:  # may wait on the engine core: never on this loop, which answers probes
                status, body, content_type = await asyncio.get_running_loop().run_in_executor(
                    None, self.endpoints[endpoint])
            else:
                status, body, content_type = self.endpoints[endpoint]()
            writer.write(render_response(status, body, content_type, request is not None and request.method == "HEAD"))
            await asyncio.wait_for(writer.drain(), self.timeout)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError):
            pass  # slow, malformed or gone: the connection is closed below either way
        finally:
            self._waiting.pop(writer, None)
            self._open -= 1
            writer.close()


def _end_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancels the connections still open when the loop stopped and closes the loop, so no
    handler is left pending for the garbage collector to finish on a closed loop."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:  # gather() of nothing would look for a current loop, and this thread has none
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.close()


def serve_http(engine: EngineFace, host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
               timeout: float = TIMEOUT_SECONDS, registry: Any = None,
               watchdog: StepWatchdog | None = None) -> MetricsServer:
    """Starts the metrics and probe server in a daemon thread and returns it (OSError if unbound)."""
    server = MetricsServer(engine_endpoints(engine, registry, watchdog), host, port,
                           max_connections=max_connections, timeout=timeout)
    server.start()
    return server
