"""Bytes that do not decode as the method's request are INVALID_ARGUMENT, not INTERNAL,
on a real gRPC server (sync and grpc.aio), for unary and streaming methods alike."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.worker.serving.wire import Undecodable, tolerant, tolerant_deserializer

GENERATE = "/graphkeeper.worker.v1.InferenceWorker/Generate"
STATUS = "/graphkeeper.worker.v1.GraphControl/GetGraphStatus"
BAD = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, length far past the end


class Inference(pb_grpc.InferenceWorkerServicer):
    def Generate(self, request, context):  # noqa: N802
        yield pb.GenerateResponse(completion=pb.Completion(request_id=request.request_id))


class Control(pb_grpc.GraphControlServicer):
    def GetGraphStatus(self, request, context):  # noqa: N802
        return pb.GraphStatus(policy_uid="ok")


class AioInference(pb_grpc.InferenceWorkerServicer):
    async def Generate(self, request, context):  # noqa: N802
        yield pb.GenerateResponse(completion=pb.Completion(request_id=request.request_id))


class AioControl(pb_grpc.GraphControlServicer):
    async def GetGraphStatus(self, request, context):  # noqa: N802
        return pb.GraphStatus(policy_uid="ok")


def test_tolerant_deserializer():
    parse = tolerant_deserializer(pb.GenerateRequest.FromString)
    assert parse(pb.GenerateRequest(request_id="r").SerializeToString()).request_id == "r"
    bad = parse(BAD)
    assert isinstance(bad, Undecodable) and "GenerateRequest" in bad.message


@pytest.fixture
def sync_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_InferenceWorkerServicer_to_server(Inference(), tolerant(server))
    pb_grpc.add_GraphControlServicer_to_server(Control(), tolerant(server))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_sync_server(sync_server):
    with grpc.insecure_channel(sync_server) as channel:
        for call, method in ((channel.unary_stream, GENERATE), (channel.unary_unary, STATUS)):
            with pytest.raises(grpc.RpcError) as err:
                result = call(method)(BAD, timeout=10)
                list(result) if method == GENERATE else result
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("request: ")
        good = pb.GenerateRequest(request_id="abc").SerializeToString()
        [raw] = list(channel.unary_stream(GENERATE)(good, timeout=10))
        assert pb.GenerateResponse.FromString(raw).completion.request_id == "abc"
        assert pb_grpc.GraphControlStub(channel).GetGraphStatus(pb.GetGraphStatusRequest()).policy_uid == "ok"


def test_aio_server():
    async def scenario() -> None:
        server = grpc.aio.server()
        pb_grpc.add_InferenceWorkerServicer_to_server(AioInference(), tolerant(server))
        pb_grpc.add_GraphControlServicer_to_server(AioControl(), tolerant(server))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in channel.unary_stream(GENERATE)(BAD, timeout=10):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await channel.unary_unary(STATUS)(BAD, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                good = pb.GenerateRequest(request_id="abc").SerializeToString()
                raws = [r async for r in channel.unary_stream(GENERATE)(good, timeout=10)]
                assert pb.GenerateResponse.FromString(raws[0]).completion.request_id == "abc"
                status = await pb_grpc.GraphControlStub(channel).GetGraphStatus(pb.GetGraphStatusRequest())
                assert status.policy_uid == "ok"
        finally:
            await server.stop(None)

    asyncio.run(scenario())
