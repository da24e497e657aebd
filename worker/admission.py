"""Admission: checks a Generate request before it may take a place in the queue.

Pure, so every rejection is testable without a model. Each error names the request field, and
the gRPC layer turns it into INVALID_ARGUMENT; the worker keeps serving everyone else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import valid_tenant

MAX_TEMPERATURE = 100.0
MAX_STOP_IDS = 64


class AdmissionError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_seq_len: int


def validate_request(req: pb.GenerateRequest, limits: Limits) -> None:
    """Raises AdmissionError naming the first invalid field."""
    prompt = req.prompt_token_ids
    if not prompt:
        raise AdmissionError("prompt_token_ids", "must not be empty")
    for i, token in enumerate(prompt):
        if not 0 <= token < limits.vocab_size:
            raise AdmissionError(
                f"prompt_token_ids[{i}]", f"token id {token} is outside the vocabulary [0, {limits.vocab_size})"
            )
    max_new = req.stopping.max_new_tokens
    if max_new < 1:
        raise AdmissionError("stopping.max_new_tokens", f"must be at least 1, got {max_new}")
    if len(prompt) + max_new > limits.max_seq_len:
        raise AdmissionError(
            "stopping.max_new_tokens",
            f"prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new}) exceeds the context of "
            f"{limits.max_seq_len} tokens",
        )
    if len(req.stopping.stop_token_ids) > MAX_STOP_IDS:
        raise AdmissionError("stopping.stop_token_ids", f"at most {MAX_STOP_IDS} stop ids")
    for i, token in enumerate(req.stopping.stop_token_ids):
        if not 0 <= token < limits.vocab_size:
            raise AdmissionError(f"stopping.stop_token_ids[{i}]", f"token id {token} is outside the vocabulary")
    _validate_sampling(req.sampling)
    if not valid_tenant(req.tenant):
        raise AdmissionError(
            "tenant", f"{req.tenant!r} is not a DNS-1123 label ([a-z0-9-], at most 63 characters)"
        )


def _validate_sampling(s: pb.SamplingParams) -> None:
    if not math.isfinite(s.temperature) or not 0.0 <= s.temperature <= MAX_TEMPERATURE:
        raise AdmissionError("sampling.temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {s.temperature}")
    if not math.isfinite(s.top_p) or not 0.0 <= s.top_p <= 1.0:
        raise AdmissionError("sampling.top_p", f"must be in (0, 1] (0 means 1), got {s.top_p}")
    if s.top_k < 0:
        raise AdmissionError("sampling.top_k", f"must not be negative, got {s.top_k}")
