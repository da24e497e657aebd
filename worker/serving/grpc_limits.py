"""The gRPC ports' connection limits, as server options (``grpc.aio.server(options=...)``).

What a client may hold of a gRPC port, enforced by gRPC's own transport (no byte passes through
Python for it):

- a cap on the connections the port holds at once (past it a new one is closed at once);
- a handshake timeout: a socket that has not finished the HTTP/2 preface in ``header_seconds``
  is closed (a silent TCP socket held a slot for gRPC's default of two minutes);
- an idle limit: a connection with no call in flight for ``idle_seconds`` gets GOAWAY, so idle
  connections cannot hold the cap for good (before, nothing ever evicted one);
- a maximum age (with a grace period for the calls in flight), so no connection lives forever;
- keepalive enforcement: a client pinging more often than every ``MIN_PING_SECONDS`` without a
  call in flight gets GOAWAY after ``PING_STRIKES`` such pings, and the server itself pings a
  connection with calls in flight to find dead peers.

gRPC has no per-peer connection cap; the kubelet's probes therefore do not use these ports at
all (they ask the metrics port's ``/readyz``, whose server evicts the longest-waiting connection
at its cap: docs/serving.md, "Connection limits"), and the control port's server listens behind
a gate that has one (``control_gate``).
"""

from __future__ import annotations

from graphkeeper.proto import SERVER_OPTIONS
from graphkeeper.worker.serving.limits import ConnectionLimits

#: A client may ping this often without a call in flight before it is struck.
MIN_PING_SECONDS = 10.0
PING_STRIKES = 2
#: The server pings a connection with calls in flight this often, and drops it when no answer
#: comes within the timeout (a peer that vanished without a FIN).
KEEPALIVE_SECONDS = 60.0
KEEPALIVE_TIMEOUT_SECONDS = 20.0


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def server_options(limits: ConnectionLimits, max_connections: int) -> tuple[tuple[str, int], ...]:
    """The options of a gRPC server holding at most ``max_connections`` connections."""
    return (
        *SERVER_OPTIONS,
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", _ms(limits.header_seconds)),
        ("grpc.max_connection_idle_ms", _ms(limits.idle_seconds)),
        ("grpc.max_connection_age_ms", _ms(limits.max_age_seconds)),
        ("grpc.max_connection_age_grace_ms", _ms(limits.age_grace_seconds)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", _ms(MIN_PING_SECONDS)),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(MIN_PING_SECONDS)),
        ("grpc.http2.max_ping_strikes", PING_STRIKES),
        ("grpc.keepalive_time_ms", _ms(KEEPALIVE_SECONDS)),
        ("grpc.keepalive_timeout_ms", _ms(KEEPALIVE_TIMEOUT_SECONDS)),
    )
