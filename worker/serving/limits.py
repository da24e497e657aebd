"""What a client may hold of the API process: connections, time and file descriptors, once.

One ``ConnectionLimits`` (the worker's flags) sizes both front ends (``grpc_limits`` turns it into
gRPC server options, ``http_limits`` enforces it on the OpenAI HTTP port) and the process's file
descriptor limit (``fd_plan``), so a flood of idle sockets meets a connection cap long before it
meets the descriptor limit: when the descriptors ran out first, every port failed at once and
asyncio logged each refused ``accept()``.

The rules are pure (nothing opens a socket), so they test without a worker; ``apply_fd_limit``
alone sets the process's limit.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Connections each port holds at once. An idle connection costs the API process about 12 KB
#: (3,000 held 37 MB): 4,096 on each public port is 100 MB at worst, and far more than a
#: gateway or a fleet of clients needs.
MAX_CONNECTIONS = 4096
#: One peer address's share of the HTTP port: a gateway pools far fewer, an attacker from one
#: address cannot take the whole port.
MAX_CONNECTIONS_PER_PEER = 1024
#: The control port serves the operator (a connection or two per replica) and ``graphkeeper
#: status`` only; its gate (``control_gate``) holds this many, and this many from one address,
#: closing the least recently active connection for a new one.
CONTROL_MAX_CONNECTIONS = 64
CONTROL_MAX_CONNECTIONS_PER_PEER = 8
#: The cap of the gRPC server behind the control gate: far above the gate's, since a connection
#: the gate has closed counts for gRPC until its poller sees it go (with twice the gate's cap, a
#: burst of evictions made gRPC refuse the connections that replaced them).
CONTROL_UPSTREAM_MAX_CONNECTIONS = 1024
#: Descriptors a control connection takes: the client's, and the gate's relay to the gRPC
#: server's Unix socket at both ends.
CONTROL_FDS_PER_CONNECTION = 3
#: The metrics port's cap (its server evicts the longest-waiting connection at the cap).
METRICS_MAX_CONNECTIONS = 256
#: Descriptors the process needs besides its connections: the model's files, pipes to the
#: engine core, the tokenizer, Python's own.
BASE_FDS = 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """Caps and timeouts of the inference ports (gRPC and OpenAI HTTP)."""

    #: Connections each public port (gRPC inference, HTTP) holds at once.
    max_connections: int = MAX_CONNECTIONS
    #: Connections one peer address may hold on the HTTP port.
    max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER
    #: A connection with no request in flight for this long is closed (gRPC: GOAWAY; HTTP:
    #: the keep-alive timeout, and a socket that never sent a byte).
    idle_seconds: float = 60.0
    #: From a connection's first byte (or the end of its last request) to a complete request
    #: head (HTTP) or HTTP/2 handshake (gRPC); past it the connection is closed (slowloris).
    header_seconds: float = 10.0
    #: A request body must arrive within this (HTTP: 408 past it).
    body_seconds: float = 30.0
    #: HTTP: a response its client takes no bytes of for this long (its socket buffers full: a
    #: stream nobody reads) is cut off, its request cancelled and its connection closed.
    write_seconds: float = 30.0
    #: gRPC: a connection is asked to go away after this long (a client reconnects, and a
    #: long-lived one cannot pin memory or a peer's share forever); streams get a grace period.
    max_age_seconds: float = 1800.0
    age_grace_seconds: float = 300.0


def limits_errors(limits: ConnectionLimits) -> list[str]:
    """One line per flag that cannot work (empty when all is well)."""
    errors = []
    if limits.max_connections < 1:
        errors.append(f"--max-connections must be at least 1, got {limits.max_connections}")
    if limits.max_connections_per_peer < 1:
        errors.append(f"--max-connections-per-peer must be at least 1, got {limits.max_connections_per_peer}")
    for flag, value in (("--connection-idle-seconds", limits.idle_seconds),
                        ("--header-timeout", limits.header_seconds), ("--body-timeout", limits.body_seconds),
                        ("--write-timeout", limits.write_seconds)):
        if not value > 0 or value != value or value == float("inf"):
            errors.append(f"{flag} must be a positive number of seconds, got {value}")
    return errors


def fds_needed(limits: ConnectionLimits, http: bool) -> int:
    """Descriptors the API process needs when every port is at its cap."""
    ports = limits.max_connections + CONTROL_FDS_PER_CONNECTION * CONTROL_MAX_CONNECTIONS + METRICS_MAX_CONNECTIONS
    return BASE_FDS + ports + (limits.max_connections if http else 0)


def fd_plan(limits: ConnectionLimits, http: bool, soft: int, hard: int) -> tuple[int, ConnectionLimits]:
    """(the soft RLIMIT_NOFILE to set, the limits to serve with).

    The soft limit is raised to what the caps need, as far as the hard limit allows; where the
    hard limit is lower, the public ports' caps shrink so that the caps, not the descriptors,
    are what a flood meets first.
    """
    need = fds_needed(limits, http)
    if need <= hard:
        return max(soft, need), limits
    spare = hard - BASE_FDS - CONTROL_FDS_PER_CONNECTION * CONTROL_MAX_CONNECTIONS - METRICS_MAX_CONNECTIONS
    each = max(16, spare // (2 if http else 1))
    shrunk = ConnectionLimits(**{**limits.__dict__, "max_connections": each,
                                 "max_connections_per_peer": min(limits.max_connections_per_peer, each)})
    return hard, shrunk


def limits_from_args(args: Any) -> ConnectionLimits:
    """The worker's connection flags (defaults where a caller's namespace lacks one)."""
    d = ConnectionLimits()
    total = getattr(args, "max_connections", d.max_connections)
    return ConnectionLimits(
        max_connections=total,  # one peer's share is never more than the whole port
        max_connections_per_peer=min(total, getattr(args, "max_connections_per_peer", d.max_connections_per_peer)),
        idle_seconds=getattr(args, "connection_idle_seconds", d.idle_seconds),
        header_seconds=getattr(args, "header_timeout", d.header_seconds),
        body_seconds=getattr(args, "body_timeout", d.body_seconds),
        write_seconds=getattr(args, "write_timeout", d.write_seconds))


def apply_fd_limit(limits: ConnectionLimits, http: bool) -> ConnectionLimits:
    """Raises this process's descriptor limit to what the caps need (``fd_plan``); returns the
    limits to serve with, shrunk where the hard limit is too low (and says so)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_n = hard if hard != resource.RLIM_INFINITY else 1 << 20
    want, served = fd_plan(limits, http, soft, hard_n)
    if want != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if served != limits:
        log.warning("the descriptor limit (%d) is below what --max-connections %d needs (%d): serving %d "
                    "connections per port", hard_n, limits.max_connections, fds_needed(limits, http),
                    served.max_connections)
    return served
