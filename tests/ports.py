"""Loopback ports for the processes the tests start (workers, stand-ins, the local cluster).

A port is found by binding port 0 and closing the socket, so the kernel may offer it again
before the process it was meant for binds it. Every port handed out is remembered for the
session and never handed out twice, so two of the tests' processes never share one.
"""

from __future__ import annotations

import socket

_HANDED_OUT: set[int] = set()


def free_port(span: int = 1) -> int:
    """A loopback port whose next ``span - 1`` ports are free too (etcd takes three), never one
    handed out before in this session."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span >= 65535 or _HANDED_OUT.intersection(range(base, base + span)):
            continue
        if all(_bindable(p) for p in range(base, base + span)):
            _HANDED_OUT.update(range(base, base + span))
            return base
    raise RuntimeError("no free loopback port")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
