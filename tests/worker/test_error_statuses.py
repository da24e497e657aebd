"""The engine's errors table: every engine error gets one answer, the same on the gRPC port, the
HTTP port and in the engine-core process, and anything else a defined fallback."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from graphkeeper.worker.engine.errors import (
    ERROR_STATUSES,
    UNKNOWN_ERROR,
    CannotFit,
    InjectedFailure,
    InvalidTokens,
    NotServing,
    QueueFull,
    ReloadBusy,
    StepFailed,
    classify,
    error_message,
)
from graphkeeper.worker.engine.ipc import ErrorBox
from graphkeeper.worker.metrics import OUTCOMES, WorkerMetrics
from graphkeeper.worker.serving.http_server import engine_error
from graphkeeper.worker.serving.streams import count_refusal

#: Today's answers, written out: gRPC code, HTTP status, outcome, OpenAI type and code.
EXPECTED = {
    QueueFull: ("RESOURCE_EXHAUSTED", 429, "queue_full", "rate_limit_error", "queue_full"),
    CannotFit: ("INVALID_ARGUMENT", 400, "oversize", "invalid_request_error", None),
    InvalidTokens: ("INVALID_ARGUMENT", 400, "invalid", "invalid_request_error", None),
    NotServing: ("UNAVAILABLE", 503, "unavailable", "service_unavailable_error", "not_ready"),
    StepFailed: ("INTERNAL", 500, "error", "server_error", "step_failed"),
}


def _row(err: BaseException) -> tuple:
    s = classify(err)
    return s.grpc_code, s.http_status, s.outcome, s.http_type, s.http_code


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_each_engine_error_has_its_answer(cls):
    assert _row(cls("why")) == EXPECTED[cls]


def test_a_subclass_is_answered_as_its_parent():
    assert classify(ReloadBusy("a reload is pending")) is classify(NotServing("x"))


@pytest.mark.parametrize("err", [RuntimeError("boom"), ValueError("bad"), InjectedFailure("injected"), KeyError("k")],
                         ids=lambda e: type(e).__name__)
def test_anything_else_is_an_internal_error_named_by_its_class(err):
    assert classify(err) is UNKNOWN_ERROR
    assert _row(err) == ("INTERNAL", 500, "error", "server_error", None)
    assert error_message(err).startswith(f"{type(err).__name__}: ")


def test_an_engine_error_reads_as_its_own_text():
    assert error_message(QueueFull("queue is full (4 requests waiting)")) == "queue is full (4 requests waiting)"


def test_every_row_names_a_grpc_code_an_outcome_and_an_error_status():
    for _, status in (*ERROR_STATUSES, (None, UNKNOWN_ERROR)):
        assert grpc.StatusCode[status.grpc_code]  # a KeyError names a code gRPC does not have
        assert status.outcome in OUTCOMES
        assert 400 <= status.http_status < 600


def test_an_error_that_crossed_the_channel_keeps_its_answer():
    """The engine core sends its refusals to the API process as an ErrorBox; the rebuilt error
    must land on the same row, or the two processes would answer one refusal two ways."""
    for cls in EXPECTED:
        assert classify(ErrorBox.of(cls("why")).rebuild()) is classify(cls("why"))


def test_the_http_answer_is_the_tables_row():
    err = engine_error(CannotFit("prompt (70 tokens) plus max_new_tokens (9) needs 5 KV blocks"))
    assert (err.status, err.type, err.code) == (400, "invalid_request_error", None)
    assert err.message.startswith("prompt (70 tokens)")
    err = engine_error(RuntimeError("boom"))
    assert (err.status, err.type, err.message) == (500, "server_error", "RuntimeError: boom")


def test_a_refusal_counts_under_its_outcome_and_an_unknown_error_is_logged(caplog):
    engine = SimpleNamespace(metrics=WorkerMetrics())
    count_refusal(engine, CannotFit("too long for the cache"))
    count_refusal(engine, ReloadBusy("a reload is pending"))
    assert "on its way into the engine" not in caplog.text
    count_refusal(engine, RuntimeError("a bug"))
    counted = {o: engine.metrics.requests.labels(o)._value.get() for o in ("oversize", "unavailable", "error")}
    assert counted == {"oversize": 1, "unavailable": 1, "error": 1}
    assert "on its way into the engine" in caplog.text and "RuntimeError: a bug" in caplog.text
