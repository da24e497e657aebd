"""What the engine refuses or fails with; the API layer maps each to a status code."""

from __future__ import annotations

import torch


class QueueFull(RuntimeError):
    """More requests wait than ``max_queue`` allows (RESOURCE_EXHAUSTED)."""


class NotServing(RuntimeError):
    """The worker is not READY or RECAPTURING, or it is shutting down (UNAVAILABLE)."""


class ReloadBusy(NotServing):
    """A model reload is already pending or running: retry once it ends (UNAVAILABLE, retryable,
    not the caller's bad input)."""


class CannotFit(ValueError):
    """A request whose prompt and max_new_tokens need more KV blocks than the whole cache has:
    it could never run, so it is refused at admission (INVALID_ARGUMENT)."""


class StalePolicy(RuntimeError):
    """A policy generation older than one this worker holds or was sent (FAILED_PRECONDITION)."""


class StepFailed(RuntimeError):
    """A step raised; the requests in it fail with this, the engine keeps serving (INTERNAL)."""


class InjectedFailure(RuntimeError):
    """Raised only by the fault injection that tests ask for."""


def device_broken(err: BaseException) -> bool:
    """CUDA errors other than out-of-memory leave the context unusable: the engine must stop."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return False
    text = str(err)
    return "CUDA error" in text or "cudaError" in text or "CUBLAS_STATUS" in text


def injected_failure(inject: tuple[int, bool] | None, prompt_tokens: list[int]) -> InjectedFailure | None:
    """The failure a test asked for when the step holds its token (fatal: as a broken device)."""
    if inject is None or inject[0] not in prompt_tokens:
        return None
    return InjectedFailure(f"CUDA error: injected device failure (token {inject[0]})" if inject[1]
                           else f"injected step failure (token {inject[0]})")
