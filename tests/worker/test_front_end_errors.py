"""Both front ends answer an engine error from the one errors table, whether the engine refuses at
submit (the in-process engine) or ends the stream with it (the engine core in its own process):
a request the cache cannot fit is INVALID_ARGUMENT and 400 on both paths, anything unknown a
defined INTERNAL and 500. A stand-in engine, so no model runs."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import CannotFit, EngineSettings, Limits, QueueFull
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.serving.grpc_server import InferenceServicer
from graphkeeper.worker.serving.http_server import OpenAIServer
from graphkeeper.worker.serving.streams import StreamHub

ERRORS = [pytest.param(err, code, status, outcome, id=type(err).__name__) for err, code, status, outcome in (
    (CannotFit("prompt (3 tokens) plus max_new_tokens (4) needs 9 KV blocks"), "INVALID_ARGUMENT", 400, "oversize"),
    (QueueFull("queue is full (1 requests waiting)"), "RESOURCE_EXHAUSTED", 429, "queue_full"),
    (RuntimeError("a bug"), "INTERNAL", 500, "error"),
)]


class StandInEngine:
    """Serves a model in name only: ``submit`` raises ``err`` (``at_submit``), or ends the stream
    with it at once, as the engine core's refusal arrives."""

    def __init__(self, err: Exception, at_submit: bool) -> None:
        self.err, self.at_submit = err, at_submit
        self.settings = EngineSettings(model="random:tiny", max_seq_len=64)
        self.metrics = WorkerMetrics()
        self.tokenizer = None
        self.cancelled: list[Any] = []

    def limits(self) -> Limits:
        return Limits(vocab_size=100, max_seq_len=64)

    def model_info(self) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(source="random:tiny")

    def submit(self, req: pb.GenerateRequest, stream: Any) -> int:
        if self.at_submit:
            raise self.err
        stream.end = self.err
        stream.wake.set()
        return 7

    def cancel(self, handle: int, reason: int = pb.FINISH_REASON_CANCELLED) -> None:
        self.cancelled.append(handle)

    def counted(self, outcome: str) -> float:
        return self.metrics.requests.labels(outcome)._value.get()


class Aborted(Exception):
    pass


class Context:
    """The part of a gRPC servicer context Generate uses on a refusal."""

    code: grpc.StatusCode | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted

    # A call refused before it began ends with its status set, without raising (grpc_server._refuse).
    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def write(self, message: Any) -> None:
        raise AssertionError(f"wrote {message} for a refused request")


async def _grpc_code(engine: StandInEngine) -> grpc.StatusCode | None:
    context = Context()
    request = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], stopping=pb.StoppingCriteria(max_new_tokens=4))
    with contextlib.suppress(Aborted):  # refused on the stream: aborted; at submit: the code set
        await InferenceServicer(engine).Generate(request, context)
    return context.code


async def _http(engine: StandInEngine, stream: bool) -> tuple[int, dict]:
    server = OpenAIServer(engine, StreamHub(asyncio.get_running_loop()))
    async with TestClient(TestServer(server.app)) as client:
        response = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": stream})
        return response.status, await response.json()


@pytest.mark.parametrize("at_submit", [True, False], ids=["at-submit", "on-the-stream"])
@pytest.mark.parametrize(("err", "code", "status", "outcome"), ERRORS)
def test_grpc_answers_from_the_table(err, code, status, outcome, at_submit):
    engine = StandInEngine(err, at_submit)
    assert asyncio.run(_grpc_code(engine)) == grpc.StatusCode[code]
    # A refusal at submit is counted here; one on the stream was counted by the engine core.
    assert engine.counted(outcome) == (1 if at_submit else 0)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "sse"])
@pytest.mark.parametrize("at_submit", [True, False], ids=["at-submit", "on-the-stream"])
@pytest.mark.parametrize(("err", "code", "status", "outcome"), ERRORS)
def test_http_answers_from_the_table(err, code, status, outcome, at_submit, stream):
    engine = StandInEngine(err, at_submit)
    got, body = asyncio.run(_http(engine, stream))
    assert got == status and body["error"]["message"].endswith(str(err)), body
    assert engine.counted(outcome) == (1 if at_submit else 0)
