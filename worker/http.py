"""The metrics port: ``/metrics`` (Prometheus), ``/healthz`` (the engine thread lives) and
``/readyz`` (the worker serves inference)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from graphkeeper.worker.engine import Engine
from graphkeeper.worker.lifecycle import state_name


def serve_http(engine: Engine, host: str, port: int) -> ThreadingHTTPServer:
    """Starts the metrics and probe server in a daemon thread and returns it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.startswith("/metrics"):
                self._send(200, generate_latest(engine.metrics.registry), CONTENT_TYPE_LATEST)
            elif self.path.startswith("/healthz"):
                alive = engine.thread.is_alive() and engine.failed is None
                self._send(200 if alive else 503, b"ok\n" if alive else b"engine stopped\n")
            elif self.path.startswith("/readyz"):
                ready = engine.lifecycle.serving
                self._send(200 if ready else 503, f"{state_name(engine.lifecycle.state)}\n".encode())
            else:
                self._send(404, b"not found\n")

        def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # scrapes every few seconds: keep logs quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
