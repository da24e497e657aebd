"""The OpenAI (and vLLM) sampling fields beyond temperature, top-p and top-k: ``n``, penalties,
``logit_bias``, ``min_p``, log probabilities, ``echo``, ``response_format`` (and vLLM's
``guided_json`` / ``structured_outputs``), read into a ``GenerateRequest``; and the log
probability objects of the responses. Pure, like ``openai_api``, which calls ``read_sampling``
once per request.

What stays refused, 400 naming the field: ``best_of`` other than ``n`` (vLLM v1 dropped it too),
``suffix``, and tool calling, which needs a chat template and a parser for the model's tool-call
format that this worker does not have.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.field_checks import clipped_repr
from graphkeeper.worker.engine import constraint_error
from graphkeeper.worker.plan import TokenLogprob

#: The fields this module reads (beside ``openai_api``'s own).
SAMPLING_FIELDS = ("n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                   "logit_bias", "logprobs", "top_logprobs", "echo", "response_format", "guided_json",
                   "structured_outputs", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                   "suffix")
#: Choices one request may ask for (each is a sequence of its own in the engine).
MAX_N = 16
#: OpenAI's limits on alternatives: 5 for completions, 20 for chat.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_LOGPROBS = 20


class SamplingError(ValueError):
    """A sampling field refused; ``openai_api`` turns it into its 400 error object (code
    ``unsupported_parameter`` when ``unsupported``: a valid request for what this server lacks)."""

    def __init__(self, param: str, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.param, self.message, self.unsupported = param, message, unsupported


@dataclass(frozen=True)
class Choices:
    """What the response layer needs beyond the engine's request."""

    n: int = 1
    #: Alternatives per token when log probabilities were asked for, else None.
    logprobs: int | None = None
    echo: bool = False


def read_sampling(body: dict, request: pb.GenerateRequest, chat: bool) -> Choices:
    """Reads the fields into ``request``; raises SamplingError naming the first one refused."""
    n = _int(body, "n", 1, MAX_N) or 1
    best_of = _int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise SamplingError("best_of", f"only best_of equal to n ({n}) is supported (vLLM v1 has no best_of either)",
                            unsupported=True)
    s = request.sampling
    for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                            ("min_p", 0.0, 1.0)):
        value = _number(body, name, low, high)
        if value is not None:
            setattr(s, name, value)
    repetition = _number(body, "repetition_penalty", 0.0, 100.0)
    if repetition is not None:
        if repetition <= 0:
            raise SamplingError("repetition_penalty", f"must be greater than 0, got {repetition}")
        s.repetition_penalty = repetition
    _logit_bias(body.get("logit_bias"), s)
    logprobs = _logprobs(body, chat)
    if logprobs is not None:
        s.logprobs = logprobs
    echo = not chat and _flag(body, "echo")
    if echo and logprobs is not None:  # the prompt's tokens get theirs too
        s.prompt_logprobs = logprobs
    if not chat and body.get("suffix"):
        raise SamplingError("suffix", "insertion (suffix) is not supported", unsupported=True)
    _refuse_tools(body)
    _constraint(body, request)
    return Choices(n=n, logprobs=logprobs, echo=echo)


def _int(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(name, f"must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise SamplingError(name, f"must be in [{low}, {high}], got {value}")
    return value


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingError(name, f"must be a number, got {type(value).__name__}")
    if isinstance(value, int) and abs(value) > 2**53 or not math.isfinite(value) or not low <= value <= high:
        raise SamplingError(name, f"must be in [{low:g}, {high:g}], got {clipped_repr(str(value))}")
    return float(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SamplingError(name, f"must be a boolean, got {type(value).__name__}")
    return value


def _logit_bias(value: Any, s: pb.SamplingParams) -> None:
    """OpenAI's map from token id (a JSON key, so a string) to a bias in [-100, 100]."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise SamplingError("logit_bias", f"must be an object of token id to bias, got {type(value).__name__}")
    if len(value) > 300:
        raise SamplingError("logit_bias", f"at most 300 entries, got {len(value)}")
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 10 and int(key) < 2**31):
            raise SamplingError("logit_bias", f"keys must be token ids, got {clipped_repr(str(key))}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise SamplingError(f"logit_bias.{key}", f"must be a number in [-100, 100], got {clipped_repr(str(bias))}")
        s.logit_bias[int(key)] = float(bias)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Completions: ``logprobs`` is the count of alternatives (0 to 5). Chat: ``logprobs`` is a
    boolean and ``top_logprobs`` the count (0 to 20), allowed only with it."""
    if not chat:
        value = body.get("logprobs")
        if value is None or value is False:
            return None
        return _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    wanted = _flag(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_CHAT_LOGPROBS)
    if top is not None and not wanted:
        raise SamplingError("top_logprobs", "requires logprobs to be true")
    return (top or 0) if wanted else None


def _refuse_tools(body: dict) -> None:
    for name in ("tools", "functions"):
        if body.get(name):
            raise SamplingError(name, "tool calling is not supported by this server (no tool-call parser for the "
                                      "model's chat template); describe the tools in a message, or use "
                                      "response_format json_schema for structured replies", unsupported=True)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise SamplingError(name, "tool calling is not supported by this server", unsupported=True)


def _constraint(body: dict, request: pb.GenerateRequest) -> None:
    """``response_format`` (OpenAI), or vLLM's ``guided_json`` / ``structured_outputs.json``."""
    schema, param = None, "response_format"
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise SamplingError("response_format", "must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                                   "{\"type\": \"json_schema\", \"json_schema\": {...}}")
        if fmt["type"] == "json_object":
            request.constraint.json_object = True
            return
        if fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
                raise SamplingError("response_format.json_schema", "must be an object with a \"schema\"")
            schema, param = spec.get("schema", {}), "response_format.json_schema.schema"
    for name in ("guided_json", "structured_outputs"):
        value = body.get(name)
        if value is None:
            continue
        if name == "structured_outputs":
            if not isinstance(value, dict) or set(value) - {"json"} or "json" not in value:
                raise SamplingError(name, "only {\"json\": <schema>} is supported")
            value, name = value["json"], "structured_outputs.json"
        if schema is not None:
            raise SamplingError(name, "set one of response_format, guided_json and structured_outputs")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise SamplingError(name, f"is not JSON: {err.msg}") from None
        schema, param = value, name
    if schema is None:
        return
    request.constraint.json_schema = json.dumps(schema)
    if error := constraint_error(request.constraint):
        raise SamplingError(param, error[1])


# --- responses -------------------------------------------------------------------------------


def chat_logprobs(entries: list[TokenLogprob], text: Any) -> dict[str, Any]:
    """Chat's ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
    ``text(id)`` is a token's text."""
    def item(token: int, logprob: float) -> dict[str, Any]:
        t = text(token)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8", "surrogatepass"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob | None], text: Any, offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs`` object: parallel lists of tokens, their log probabilities, their
    alternatives (a map of token text to log probability) and each token's offset in the text.
    An echoed prompt's first token has no log probability: its entry is ``(token, None)``."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(text(e[0]))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [None if e[1] is None else {text(t): v for t, v in e.top} for e in entries],
            "text_offset": offsets}


def echoed_entries(prompt: list[int], entries: list[TokenLogprob]) -> list:
    """An echoed prompt's entries: its first token without a log probability, then each computed one."""
    return [(prompt[0], None), *entries] if prompt else []
