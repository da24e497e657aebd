"""The operator's gRPC client for the workers' ``GraphControl`` service.

It owns one channel per worker address and turns gRPC failures into a ``WorkerError`` whose
``kind`` says what the operator should conclude: the worker is unreachable, it rejected the
policy, it already holds a newer generation, or something else went wrong. Every call has a
deadline, so a hung worker costs one deadline, never a stuck reconcile.

GraphControl calls go to the worker's control port and carry ``authorization: Bearer <token>``
when the operator has a token (``--control-token-file``); the token file is read again when it
changes, so a rotated Secret needs no restart.
"""

from __future__ import annotations

import asyncio
import enum
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc

# A restarted worker listens again within seconds; gRPC's default reconnect backoff (up to two
# minutes) would hide it from the operator for far longer than that.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
)


class ErrorKind(enum.StrEnum):
    UNREACHABLE = "Unreachable"
    REJECTED = "Rejected"
    STALE = "Stale"
    ERROR = "Error"


_KIND_BY_CODE = {
    grpc.StatusCode.UNAVAILABLE: ErrorKind.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.UNREACHABLE,
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.REJECTED,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorKind.STALE,
}


class WorkerError(Exception):
    """A GraphControl call that failed; ``kind`` is what it means for the policy."""

    def __init__(self, kind: ErrorKind, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code


class TokenFile:
    """The bearer token from a file, re-read when the file changes (a rotated Secret)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None
        self._stamp: tuple[int, int] | None = None
        self._token = ""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        if self.path is None:
            return ()
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                self._token = self.path.read_text().strip()
                self._stamp = stamp
        except OSError:
            pass  # keep the last token read; the call fails UNAUTHENTICATED if it is wrong
        return (("authorization", f"Bearer {self._token}"),) if self._token else ()


def _cancelled_here() -> bool:
    """Whether the running task itself is being cancelled (not just a gRPC call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class GraphControlClient:
    """Calls ``GraphControl`` on workers by ``host:port``; channels are cached per address.

    ``timeout`` is the deadline of every control call (status reads and pushes); a model reload
    blocks on the worker until the new revision serves, so it gets ``load_timeout`` and callers
    run it in the background.
    """

    def __init__(self, timeout: float = 5.0, load_timeout: float = 300.0,
                 token_file: str = "") -> None:
        self.timeout = timeout
        self.load_timeout = load_timeout
        self.token = TokenFile(token_file)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.GraphControlStub] = {}

    def _stub(self, target: str) -> pb_grpc.GraphControlStub:
        stub = self._stubs.get(target)
        if stub is None:
            channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
            self._channels[target] = channel
            stub = self._stubs[target] = pb_grpc.GraphControlStub(channel)
        return stub

    async def _call(self, target: str, method: str, request: object, timeout: float) -> object:
        try:
            return await getattr(self._stub(target), method)(
                request, timeout=timeout, metadata=self.token.metadata())
        except grpc.aio.UsageError as err:  # its channel was closed before it started (the pod went)
            await self.forget(target)
            raise WorkerError(ErrorKind.UNREACHABLE, f"{method}: {err}") from None
        except asyncio.CancelledError:
            if _cancelled_here():
                raise
            # grpc cancels the calls in flight on a channel that is closed (``forget``, ``prune``):
            # to the caller that is a worker it cannot reach, never a silent end of its task.
            raise WorkerError(ErrorKind.UNREACHABLE, f"{method}: its channel was closed") from None
        except grpc.aio.AioRpcError as err:
            kind = _KIND_BY_CODE.get(err.code(), ErrorKind.ERROR)
            if kind is ErrorKind.UNREACHABLE:
                # A fresh channel next time: the old one may sit in reconnect backoff.
                await self.forget(target)
            detail = err.details() or err.code().name
            raise WorkerError(kind, f"{method}: {err.code().name}: {detail}", err.code()) from None

    async def get_status(self, target: str) -> pb.GraphStatus:
        return await self._call(target, "GetGraphStatus", pb.GetGraphStatusRequest(), self.timeout)

    async def watch_status(self, target: str, heartbeat: float) -> AsyncIterator[pb.GraphStatus]:
        """The worker's WatchGraphStatus stream: its status now and on every change. Raises a
        ``WorkerError`` when the stream breaks, ends, or stays silent past two heartbeats (a worker
        that cannot send is as good as gone); UNIMPLEMENTED (an older worker) is kind ERROR with
        that code, so the caller polls it instead."""
        request = pb.WatchGraphStatusRequest(heartbeat_seconds=max(1, round(heartbeat)))
        silent = 2 * heartbeat + self.timeout
        try:
            call = self._stub(target).WatchGraphStatus(request, metadata=self.token.metadata())
        except grpc.aio.UsageError as err:
            await self.forget(target)
            raise WorkerError(ErrorKind.UNREACHABLE, f"WatchGraphStatus: {err}") from None
        try:
            while True:
                async with asyncio.timeout(silent):
                    status = await call.read()
                if status is grpc.aio.EOF:
                    raise WorkerError(ErrorKind.UNREACHABLE, "WatchGraphStatus: the worker ended the stream")
                yield status
        except grpc.aio.AioRpcError as err:
            kind = _KIND_BY_CODE.get(err.code(), ErrorKind.ERROR)
            if kind is ErrorKind.UNREACHABLE:
                await self.forget(target)
            detail = err.details() or err.code().name
            raise WorkerError(kind, f"WatchGraphStatus: {err.code().name}: {detail}", err.code()) from None
        except TimeoutError:
            raise WorkerError(ErrorKind.UNREACHABLE, f"WatchGraphStatus: nothing for {silent:g}s") from None
        except grpc.aio.UsageError as err:
            raise WorkerError(ErrorKind.UNREACHABLE, f"WatchGraphStatus: {err}") from None
        except asyncio.CancelledError:
            if _cancelled_here():
                raise
            raise WorkerError(ErrorKind.UNREACHABLE, "WatchGraphStatus: its channel was closed") from None
        finally:
            call.cancel()

    async def apply_policy(
        self, target: str, policy: pb.GraphPolicy
    ) -> pb.ApplyGraphPolicyResponse:
        request = pb.ApplyGraphPolicyRequest(policy=policy)
        # The worker answers once the policy is pending; the recapture is observed afterwards.
        return await self._call(target, "ApplyGraphPolicy", request, self.timeout)

    async def load_model_revision(
        self, target: str, source: str, revision: str
    ) -> pb.LoadModelRevisionResponse:
        request = pb.LoadModelRevisionRequest(source=source, revision=revision)
        return await self._call(target, "LoadModelRevision", request, self.load_timeout)

    async def model_info(self, target: str) -> pb.GetModelInfoResponse:
        """The worker's model (``target`` is the inference port: InferenceWorker lives there)."""
        self._stub(target)  # opens the channel if needed
        stub = pb_grpc.InferenceWorkerStub(self._channels[target])
        try:
            return await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as err:
            kind = _KIND_BY_CODE.get(err.code(), ErrorKind.ERROR)
            raise WorkerError(kind, f"GetModelInfo: {err.code().name}: {err.details()}") from None

    async def forget(self, target: str) -> None:
        """Closes the channel to ``target`` (a worker that went away or moved)."""
        self._stubs.pop(target, None)
        channel = self._channels.pop(target, None)
        if channel is not None:
            await channel.close()

    async def prune(self, keep: Callable[[str], bool]) -> None:
        """Closes channels to addresses no selected worker has any more (``keep`` says which stay)."""
        for target in [t for t in self._channels if not keep(t)]:
            await self.forget(target)

    async def close(self) -> None:
        for target in list(self._channels):
            await self.forget(target)
