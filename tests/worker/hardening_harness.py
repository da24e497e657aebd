"""Helpers the hardening tests need beyond worker_harness (which the lead owns), kept apart so
both can change without stepping on each other."""

from __future__ import annotations

import os

import grpc
from worker_harness import CONTROL_SERVICE, Worker


def channel_for(worker: Worker, method: str) -> grpc.Channel:
    """The channel a raw (undecoded) call to ``method`` travels on.

    GraphControl moves to its own port with a bearer token; when the harness exposes that
    channel (``Worker.control_channel``, carrying the token) raw control calls use it, so the
    bytes reach the method's decoder instead of stopping at authentication.
    """
    if method.startswith(f"/{CONTROL_SERVICE}/"):
        control = getattr(worker, "control_channel", None)
        if control is not None:
            return control
    return worker.channel


def raw_call(worker: Worker, method: str, payload: bytes, *, streaming: bool, timeout: float) -> object:
    """Sends ``payload`` as the serialized request of ``method``: bytes in, bytes (or a list) out."""
    channel = channel_for(worker, method)
    if streaming:
        return list(channel.unary_stream(method)(payload, timeout=timeout))
    return channel.unary_unary(method)(payload, timeout=timeout)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) process ``pid`` has used so far, from /proc.

    What a refusal costs is measured as work, not wall time: another process on a busy machine
    slows the wall clock, never this count.
    """
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5), after pid and comm
    return (utime + stime) / os.sysconf("SC_CLK_TCK")
