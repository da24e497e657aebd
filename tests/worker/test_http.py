"""The metrics port serves exact paths only, holds a bounded number of connections, and times out
half-open connections so they hold neither threads nor slots. Real sockets throughout; the last tests
run against a real worker process and count its threads from /proc."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest
from worker_harness import Worker

from graphkeeper.worker.serving.metrics_server import MetricsServer, Request, parse_request_head, route

TIMEOUT = 0.5
#: The server's thread ends its connections when it stops; an exception there fails the test.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


def endpoints() -> dict:
    return {
        "/metrics": lambda: (200, b"graphkeeper_up 1\n", "text/plain"),
        "/healthz": lambda: (200, b"ok\n", "text/plain"),
        "/readyz": lambda: (503, b"LOADING\n", "text/plain"),
    }


@pytest.fixture
def server():
    s = MetricsServer(endpoints(), "127.0.0.1", 0, max_connections=8, timeout=TIMEOUT)
    s.start()
    yield s
    s.stop()


def get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def half_open(port: int, payload: bytes = b"GET /metr") -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    if payload:
        conn.sendall(payload)
    return conn


def closed_by_server(conn: socket.socket, wait: float = 0.0) -> bool:
    """True when the server has closed (EOF or reset) this connection within ``wait`` seconds."""
    conn.settimeout(wait or 0.001)
    try:
        return conn.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (TimeoutError, BlockingIOError):
        return False


def test_route_is_exact():
    assert route(Request("GET", "/metrics")) == (200, "/metrics")
    assert route(Request("GET", "/metricsX"))[0] == 404
    assert route(Request("GET", "/healthz/")) == (404, None)
    assert route(Request("POST", "/metrics"))[0] == 405
    assert route(None)[0] == 400
    assert parse_request_head(b"GET /readyz?verbose=1 HTTP/1.1\r\n\r\n") == Request("GET", "/readyz")
    assert parse_request_head(b"GET http://evil/metrics HTTP/1.1\r\n\r\n") is None
    assert parse_request_head(b"\xff\xfe garbage\r\n\r\n") is None


def test_paths_over_sockets(server):
    assert get(server.port, "/metrics") == (200, b"graphkeeper_up 1\n")
    assert get(server.port, "/metrics?name[]=x") == (200, b"graphkeeper_up 1\n")
    assert get(server.port, "/metricsX")[0] == 404
    assert get(server.port, "/healthzzz")[0] == 404
    assert get(server.port, "/readyz") == (503, b"LOADING\n")
    assert get(server.port, "/metrics", "DELETE")[0] == 405
    assert get(server.port, "/metrics", "HEAD") == (200, b"")


def test_oversized_head_is_dropped(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
        conn.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n")
        assert closed_by_server(conn, wait=2)
    assert get(server.port, "/healthz")[0] == 200


def test_half_open_connections_time_out(server):
    idle = [half_open(server.port, b""), half_open(server.port)]
    time.sleep(0.1)
    assert not any(closed_by_server(c) for c in idle)
    assert all(closed_by_server(c, wait=TIMEOUT + 2) for c in idle)
    assert server.open_connections == 0
    for c in idle:
        c.close()


def test_connection_cap_evicts_the_oldest_idle_connection(server):
    idle = [half_open(server.port) for _ in range(8)]
    time.sleep(0.1)
    assert server.open_connections == 8
    # At the cap a scrape still gets in: the oldest idle connection gives way, the others stay.
    assert get(server.port, "/metrics")[0] == 200
    assert closed_by_server(idle[0], wait=1)
    assert not any(closed_by_server(c) for c in idle[1:])
    assert server.open_connections <= 8
    for c in idle:
        c.close()


# --- against a real worker ----------------------------------------------------------------------


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_worker_survives_300_half_open_connections(worker: Worker):
    port = int(worker.metrics_url.rsplit(":", 1)[1])
    assert worker.http_get("/metrics")[0] == 200
    before = threads_of(worker.proc.pid)
    conns = [half_open(port, b"" if i % 2 else b"GET /metrics HTTP/1.1\r\nHost") for i in range(300)]
    time.sleep(0.5)
    assert threads_of(worker.proc.pid) <= before + 2, "half-open connections started threads"
    started = time.monotonic()
    with urllib.request.urlopen(worker.metrics_url + "/metrics", timeout=10) as resp:
        assert resp.status == 200 and b"graphkeeper_requests_total" in resp.read()
    assert worker.http_get("/healthz") == (200, "ok\n")
    assert worker.http_get("/metricsX")[0] == 404
    # Every half-open connection is gone once the server's timeout (5 s) has passed.
    deadline = started + 10
    still_open = [c for c in conns if not closed_by_server(c, wait=max(0.01, deadline - time.monotonic()))]
    assert not still_open, f"{len(still_open)} half-open connections outlived the timeout"
    assert threads_of(worker.proc.pid) <= before + 2
    for c in conns:
        c.close()
