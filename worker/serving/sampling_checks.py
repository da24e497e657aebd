"""Admission's checks of the logits parameters (penalties, min-p, logit bias, log probabilities)
and of the output constraint, for both front ends: each refusal names the proto field, which the
OpenAI layer renames to the field its client sent."""

from __future__ import annotations

import math

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Limits, constraint_error

#: vLLM's default ``max_logprobs``; OpenAI allows 20 alternatives for chat.
MAX_LOGPROBS = 20
#: OpenAI's cap on logit_bias entries.
MAX_LOGIT_BIAS = 300
MAX_REPETITION_PENALTY = 100.0


def logits_errors(req: pb.GenerateRequest, limits: Limits) -> tuple[str, str] | None:
    """(field, why) for the first logits parameter out of range, else None. Pure."""
    s = req.sampling
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not math.isfinite(value) or not -2.0 <= value <= 2.0:
            return f"sampling.{name}", f"must be in [-2, 2], got {value}"
    rep = s.repetition_penalty
    if not math.isfinite(rep) or not 0.0 <= rep <= MAX_REPETITION_PENALTY:
        return "sampling.repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] (0 means 1), got {rep}"
    if not math.isfinite(s.min_p) or not 0.0 <= s.min_p <= 1.0:
        return "sampling.min_p", f"must be in [0, 1], got {s.min_p}"
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        return "sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(s.logit_bias)}"
    for token, bias in s.logit_bias.items():
        if not 0 <= token < limits.vocab_size:
            return f"sampling.logit_bias[{token}]", f"token id {token} is outside [0, {limits.vocab_size})"
        if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
            return f"sampling.logit_bias[{token}]", f"must be in [-100, 100], got {bias}"
    for name in ("logprobs", "prompt_logprobs"):
        if s.HasField(name) and not 0 <= getattr(s, name) <= MAX_LOGPROBS:
            return f"sampling.{name}", f"must be in [0, {MAX_LOGPROBS}], got {getattr(s, name)}"
    if req.HasField("constraint") and req.constraint.WhichOneof("kind") is not None:
        if not limits.text_prompts:
            return "constraint", "structured output needs the model's tokenizer (tokenizer.json)"
        return constraint_error(req.constraint)
    return None
