"""The GraphControl client when a channel is closed under a call (a pod went, and ``prune`` or a
failed read closed its channel): the call fails as an unreachable worker, never as a silent
cancellation that would end the task awaiting it (a departed worker's probe, a status stream)."""

from __future__ import annotations

import asyncio

import pytest
from fakes.fake_worker import FakeWorkerServer, FakeWorkerState  # tests/fakes, not shipped

from graphkeeper.operator.workerclient import ErrorKind, GraphControlClient, WorkerError


def test_a_stream_whose_channel_is_closed_fails_as_unreachable_and_a_real_cancel_still_cancels():
    async def scenario():
        server = await FakeWorkerServer(FakeWorkerState()).start()
        client = GraphControlClient(timeout=2)
        try:
            stream = client.watch_status(server.target, heartbeat=100)
            assert (await stream.__anext__()).state == 5
            closing = asyncio.create_task(asyncio.sleep(0.1))
            closing.add_done_callback(lambda _: asyncio.ensure_future(client.forget(server.target)))
            with pytest.raises(WorkerError) as err:
                await stream.__anext__()
            assert err.value.kind is ErrorKind.UNREACHABLE
            read = asyncio.create_task(client.get_status(server.target))
            await asyncio.sleep(0)
            read.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read
            assert (await client.get_status(server.target)).state == 5, "a fresh channel next time"
        finally:
            await client.close()
            await server.stop()

    asyncio.run(scenario())
