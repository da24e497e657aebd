"""What the engine refuses or fails with, and how every front end answers each: one table.

``classify`` gives the one ``ErrorStatus`` row for an error: the gRPC status code, the HTTP status
and error body, and the ``graphkeeper_requests_total`` outcome it counts as. The gRPC server, the
OpenAI HTTP server and the engine-core process (which counts the refusals it makes for the API
process) all read this table, so a refusal is answered and counted the same way on every path.
The engine room imports no gRPC: the code is the name of a ``grpc.StatusCode`` member, which
the gRPC server looks up.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


class QueueFull(RuntimeError):
    """More requests wait than ``max_queue`` allows."""


class NotServing(RuntimeError):
    """The worker is not READY or RECAPTURING, or it is shutting down."""


class ReloadBusy(NotServing):
    """A model reload is already pending or running: retry once it ends (retryable, not the
    caller's bad input)."""


class ReloadUnsupported(RuntimeError):
    """A LoadModelRevision this worker cannot carry out at all (several tensor parallel ranks):
    FAILED_PRECONDITION with the reason; the worker serves on with the model it has."""


class SleepRefused(RuntimeError):
    """A Sleep this worker cannot carry out (a CPU device, no --enable-sleep-mode, not serving
    yet, asleep at another level): FAILED_PRECONDITION with the reason; the worker serves on."""


class SleepWithdrawn(RuntimeError):
    """A Sleep withdrawn by a Wake before it began (ABORTED: the caller's order was overtaken)."""


class CannotFit(ValueError):
    """A request whose prompt and max_new_tokens need more KV blocks than the whole cache has:
    it could never run, so it is refused at admission, as the caller's bad input."""


class InvalidTokens(ValueError):
    """A prompt with a token id outside the model's vocabulary. The API layers refuse those at
    admission; the engine checks again because one such id reaching the embedding on a GPU trips a
    device-side assert that leaves the CUDA context, and so the whole worker, unusable."""


class StalePolicy(RuntimeError):
    """A policy generation older than one this worker holds or was sent (FAILED_PRECONDITION)."""


class StepFailed(RuntimeError):
    """A step raised; the requests in it fail with this, the engine keeps serving."""


class InjectedFailure(RuntimeError):
    """Raised only by the fault injection that tests ask for."""


@dataclass(frozen=True)
class ErrorStatus:
    """How the front ends answer one kind of engine error, and what it counts as."""

    #: A ``grpc.StatusCode`` member's name.
    grpc_code: str
    http_status: int
    #: The label of ``graphkeeper_requests_total{outcome}`` a request refused with it counts under.
    outcome: str
    #: The OpenAI error object's ``type`` and ``code``.
    http_type: str
    http_code: str | None = None


#: Engine errors, most specific class first; the first row the error is an instance of answers it.
ERROR_STATUSES: tuple[tuple[type[Exception], ErrorStatus], ...] = (
    (QueueFull, ErrorStatus("RESOURCE_EXHAUSTED", 429, "queue_full", "rate_limit_error", "queue_full")),
    (CannotFit, ErrorStatus("INVALID_ARGUMENT", 400, "oversize", "invalid_request_error")),
    (InvalidTokens, ErrorStatus("INVALID_ARGUMENT", 400, "invalid", "invalid_request_error")),
    (NotServing, ErrorStatus("UNAVAILABLE", 503, "unavailable", "service_unavailable_error", "not_ready")),
    (StepFailed, ErrorStatus("INTERNAL", 500, "error", "server_error", "step_failed")),
)
#: Anything else (a bug, or an error that lost its class crossing the channel): the server's fault.
UNKNOWN_ERROR = ErrorStatus("INTERNAL", 500, "error", "server_error")


def classify(err: BaseException) -> ErrorStatus:
    """The answer to ``err``: its row of ``ERROR_STATUSES``, else ``UNKNOWN_ERROR``."""
    for cls, status in ERROR_STATUSES:
        if isinstance(err, cls):
            return status
    return UNKNOWN_ERROR


def error_message(err: BaseException) -> str:
    """What the client reads: an engine error's own text; an unknown one's class name as well,
    since its text alone may not say what went wrong."""
    if classify(err) is UNKNOWN_ERROR:
        return f"{type(err).__name__}: {err}"
    return str(err)


def device_broken(err: BaseException) -> bool:
    """CUDA errors other than out-of-memory leave the context unusable: the engine must stop.
    (Torch is looked up, not imported: the API process never imports it, and an error raised
    where torch is not loaded is no torch error.)"""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(err, torch.cuda.OutOfMemoryError):
        return False
    text = str(err)
    return "CUDA error" in text or "cudaError" in text or "CUBLAS_STATUS" in text


def injected_failure(inject: tuple[int, bool] | None, prompt_tokens: list[int]) -> InjectedFailure | None:
    """The failure a test asked for when the step holds its token (fatal: as a broken device)."""
    if inject is None or inject[0] not in prompt_tokens:
        return None
    return InjectedFailure(f"CUDA error: injected device failure (token {inject[0]})" if inject[1]
                           else f"injected step failure (token {inject[0]})")
