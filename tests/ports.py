"""Loopback ports for the processes the tests and the benchmarks start (workers, stand-ins, the
local cluster); ``bench/`` imports this module too.

A port is drawn below Linux's ephemeral range (32768-60999 by default), from which the kernel
takes the local end of every outgoing connection: a port drawn from that range (as binding port 0
does) can become some connection's local end between its handing out and its process binding it,
a few seconds later once the process has imported torch, and the process then fails to start
("address already in use"). A drawn port is checked free (bindable) first, and every port handed
out is remembered for the session and never handed out twice, so two of the tests' processes never
share one. The local scripts' fixed ports lie in the same range; a cluster of theirs that is up
holds them, and the check passes them by.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: The draw's range: above the privileged ports and the kubelet's, below the ephemeral range.
LOW, HIGH = 12000, 32768
_HANDED_OUT: set[int] = set()
_DRAW = random.Random()  # its own generator: a test that seeds the global one draws no fixed ports


def ephemeral_low() -> int:
    """The first port of the machine's ephemeral range (Linux's default 32768 where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(span: int = 1) -> int:
    """A free loopback port whose next ``span - 1`` ports are free too (etcd takes three), below
    the ephemeral range, never one handed out before in this session."""
    high = min(HIGH, ephemeral_low())
    for _ in range(200):
        base = _DRAW.randrange(LOW, high - span + 1)
        wanted = range(base, base + span)
        if _HANDED_OUT.intersection(wanted) or not all(_bindable(p) for p in wanted):
            continue
        _HANDED_OUT.update(wanted)
        return base
    raise RuntimeError(f"no free loopback port in {LOW}-{high}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
