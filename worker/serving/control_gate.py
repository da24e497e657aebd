"""The control port's front door: a connection cap per client address, with eviction, that gRPC
does not have.

GraphControl's clients are the operator (a connection or two per replica) and ``graphkeeper
status``. gRPC can cap a port's connections but cannot keep one for them: 256 idle connections
filled the control port until the idle limit closed them, and meanwhile the operator's calls got
``UNAVAILABLE``. So the control port's gRPC server listens only on a Unix socket in a private
directory, and this gate listens on the control address and relays bytes to it:

- one client address holds at most ``CONTROL_MAX_CONNECTIONS_PER_PEER`` connections; past that
  its own least recently active connection is closed for the new one, so a flood from one
  address churns only itself;
- the port holds at most ``CONTROL_MAX_CONNECTIONS``; past that the least recently active
  connection of anyone is closed for the new one, so a new client is always let in, and an
  idle connection is the first to go (activity: bytes either way, the server's keepalive pings
  of a connection with a call in flight included).

The gRPC server's own limits (handshake timeout, idle limit, maximum age, keepalive enforcement:
``grpc_limits``) still apply behind the gate: when it closes a connection the gate closes the
client's. Bytes are relayed as they come, with flow control both ways (a side that cannot keep
up pauses reading from the other). The bearer token is checked by gRPC as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from graphkeeper.worker.log_limits import rate_key
from graphkeeper.worker.serving.limits import CONTROL_MAX_CONNECTIONS, CONTROL_MAX_CONNECTIONS_PER_PEER

log = logging.getLogger(__name__)
BACKLOG = 1024


@dataclass(eq=False)
class Relay:
    """One client connection and its connection to the gRPC server's socket."""

    peer: str
    client: asyncio.Transport
    last_active: float
    server: asyncio.Transport | None = None
    #: Bytes from the client before the server's side was connected.
    pending: list[bytes] = field(default_factory=list)
    closed: bool = False


def to_evict(relays: list[Relay], peer: str, per_peer: int, cap: int) -> Relay | None:
    """The connection a new one from ``peer`` replaces (pure): the peer's least recently active
    when it holds its share, else anyone's when the port is full, else none."""
    own = [r for r in relays if r.peer == peer]
    if len(own) >= per_peer:
        return min(own, key=lambda r: r.last_active)
    if len(relays) >= cap:
        return min(relays, key=lambda r: r.last_active)
    return None


class ControlGate:
    """Listens on the control address and relays each admitted connection to ``upstream_path``."""

    def __init__(self, host: str, port: int, max_connections: int = CONTROL_MAX_CONNECTIONS,
                 max_per_peer: int = CONTROL_MAX_CONNECTIONS_PER_PEER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.clock = clock
        self.dir = tempfile.mkdtemp(prefix="graphkeeper-control-")  # 0700: only this user reaches it
        self.upstream_path = os.path.join(self.dir, "grpc.sock")
        self.relays: dict[Relay, None] = {}
        self.per_peer: Counter[str] = Counter()
        self.evicted = 0
        self._server: asyncio.base_events.Server | None = None
        self._connecting: set[asyncio.Task] = set()
        try:
            self.sock = _listen(host, port)
        except OSError:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.port = self.sock.getsockname()[1]

    @property
    def upstream_target(self) -> str:
        """The address the gRPC server binds (``add_insecure_port``)."""
        return f"unix:{self.upstream_path}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ClientSide(self), sock=self.sock, backlog=BACKLOG)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for relay in list(self.relays):
            self.close(relay, abort=True)
        self.discard()

    def discard(self) -> None:
        """Closes the listening socket and removes the private directory (also when never started)."""
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def admit(self, peer: str, client: asyncio.Transport) -> Relay:
        """A new client connection, after closing the one it replaces (``to_evict``)."""
        victim = to_evict(list(self.relays), peer, self.max_per_peer, self.max_connections)
        if victim is not None:
            self.evicted += 1
            log.warning("control port: closed the least recently active connection from %s for a new one from %s",
                        victim.peer, peer, extra=rate_key("control-evicted", peer))
            self.close(victim, abort=True)
        relay = Relay(peer, client, self.clock())
        self.relays[relay] = None
        self.per_peer[peer] += 1
        task = asyncio.get_running_loop().create_task(self._connect(relay))
        self._connecting.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._connecting.discard)
        return relay

    async def _connect(self, relay: Relay) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_unix_connection(lambda: _ServerSide(self, relay), self.upstream_path)
        except OSError as err:
            log.warning("control port: cannot reach the gRPC server: %s", err, extra=rate_key("control-upstream"))
            self.close(relay, abort=True)
            return
        if relay.closed:
            transport.abort()
            return
        relay.server = transport
        for chunk in relay.pending:
            transport.write(chunk)
        relay.pending.clear()
        relay.client.resume_reading()

    def close(self, relay: Relay, abort: bool = False) -> None:
        """Ends both sides of ``relay`` (once); ``abort`` drops what is buffered."""
        if relay.closed:
            return
        relay.closed = True
        del self.relays[relay]
        self.per_peer[relay.peer] -= 1
        if self.per_peer[relay.peer] <= 0:
            del self.per_peer[relay.peer]
        for transport in (relay.client, relay.server):
            if transport is not None:
                transport.abort() if abort else transport.close()


class _ClientSide(asyncio.Protocol):
    def __init__(self, gate: ControlGate) -> None:
        self.gate = gate
        self.relay: Relay | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        transport.pause_reading()  # until the server's side is connected
        self.relay = self.gate.admit(peer, transport)

    def data_received(self, data: bytes) -> None:
        relay = self.relay
        if relay is None or relay.closed:
            return
        relay.last_active = self.gate.clock()
        if relay.server is None:
            relay.pending.append(data)
        else:
            relay.server.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.relay is not None:
            self.gate.close(self.relay)

    def pause_writing(self) -> None:  # the client does not keep up: stop reading the server
        if self.relay is not None and self.relay.server is not None:
            self.relay.server.pause_reading()

    def resume_writing(self) -> None:
        if self.relay is not None and self.relay.server is not None and not self.relay.closed:
            self.relay.server.resume_reading()


class _ServerSide(asyncio.Protocol):
    def __init__(self, gate: ControlGate, relay: Relay) -> None:
        self.gate = gate
        self.relay = relay

    def data_received(self, data: bytes) -> None:
        if not self.relay.closed:
            self.relay.last_active = self.gate.clock()
            self.relay.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.close(self.relay)

    def pause_writing(self) -> None:  # the server does not keep up: stop reading the client
        self.relay.client.pause_reading()

    def resume_writing(self) -> None:
        if not self.relay.closed:
            self.relay.client.resume_reading()


def _listen(host: str, port: int) -> socket.socket:
    """The control address's listening socket, bound now so that a port in use fails at once
    (OSError naming the address)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as err:
        with contextlib.suppress(UnboundLocalError):
            sock.close()
        raise OSError(f"cannot bind {host}:{port}: {err.strerror or err}") from None
    return sock
