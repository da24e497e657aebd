"""The OpenAI-compatible API's rules, as pure functions: a JSON body becomes a ``GenerateRequest``
(or an ``ApiError`` naming the field), and the engine's tokens become OpenAI's response objects.

Pure, so every refusal and every response shape is testable without a model or a socket; the
HTTP server (``http_server``) only moves bytes. The request then goes through the same admission
as a gRPC request (``grpc_server.admitted``).

What the worker does not do is refused, never ignored, and every refusal is a 400 naming the
field (``unsupported``: OpenAI's ``invalid_request_error`` with code ``unsupported_parameter``;
never a 5xx, which the SDKs retry), as is a field no OpenAI-compatible server knows, so a
client's typo or a feature it relies on is never silently dropped. Fields that change nothing
the model computes (``store``, ``metadata``, ``user``, the ``developer`` role, ...) are accepted
(``openai_fields``); the sampling fields (``n``, penalties, ``logit_bias``, ``min_p``, log
probabilities, ``echo``, structured output) and their refusals are ``openai_sampling``'s.
``null`` is read as "not set", as OpenAI does.

Extensions, as vLLM names them: ``top_k``, ``ignore_eos``, ``stop_token_ids``; the tenant for the
per-tenant graph toggle comes from the ``X-Graphkeeper-Tenant`` header or else a label made from
``user`` (``openai_fields.tenant_from_user``); the final response (the last stream chunk when
streaming) carries the request's graph execution summary as ``graphkeeper.execution``.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.field_checks import clipped_repr
from graphkeeper.worker.serving.openai_fields import (
    NEUTRAL_CHAT_FIELDS,
    NEUTRAL_FIELDS,
    FieldTypeError,
    chat_role,
    check_neutral,
    tenant_from_user,
)
from graphkeeper.worker.serving.openai_sampling import SAMPLING_FIELDS, Choices, SamplingError, read_sampling

TENANT_HEADER = "X-Graphkeeper-Tenant"
#: The non-streaming response's header with the compact JSON of the execution summary.
EXECUTION_HEADER = "X-Graphkeeper-Execution"
#: OpenAI's default ``max_tokens`` for /v1/completions; chat defaults to what the context leaves.
DEFAULT_COMPLETION_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256

_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "stream_options", "stop",
           "stop_token_ids", "seed", "user", "ignore_eos", *SAMPLING_FIELDS)
COMPLETION_FIELDS = frozenset((*_COMMON, "prompt")) | NEUTRAL_FIELDS
CHAT_FIELDS = frozenset((*_COMMON, "messages", "max_completion_tokens")) | NEUTRAL_CHAT_FIELDS
MESSAGE_FIELDS = frozenset(("role", "content", "name"))
FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "stop"}


class ApiError(Exception):
    """A refusal as OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


def unsupported(param: str, message: str) -> ApiError:
    """A request for what this server does not do: 400 naming the field, as OpenAI refuses a
    parameter a model does not support (a 5xx would be retried by the SDKs, reaching the worker
    three times for one call)."""
    return ApiError(400, f"{param}: {message}", param, code="unsupported_parameter")


@dataclass
class Parsed:
    """A request body read: the engine's request and what only the API layer acts on."""

    request: pb.GenerateRequest
    model: str | None
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    #: No output length was asked for: the context left after the prompt is the limit.
    fill_context: bool = False
    chat: bool = False
    #: ``stream_options.continuous_usage_stats`` (vLLM's): every chunk carries the usage so far.
    continuous_usage: bool = False
    #: The field that set the output length, for errors about it (``max_tokens`` or ``max_completion_tokens``).
    max_tokens_param: str = "max_tokens"
    #: ``n``, log probabilities and ``echo`` (``openai_sampling``).
    choices: Choices = field(default_factory=Choices)
    created: int = field(default_factory=lambda: int(time.time()))


# --- typed getters: each names the field it refuses -------------------------------------------


def _bool(body: dict, key: str, default: bool = False, name: str = "") -> bool:
    """``body[key]`` as a boolean; errors name ``name`` (default: the key)."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name or key, f"must be a boolean, got {_type(value)}")
    return value


def _int(body: dict, name: str, limit: int = 2**31 - 1) -> int | None:
    """An integer field, at most ``limit`` in magnitude (the engine's fields are 32-bit)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer, got {_type(value)}")
    if abs(value) > limit:
        raise invalid(name, f"must be at most {limit} in magnitude")
    return value


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"must be a number, got {_type(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise invalid(name, "is out of range") from None


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise invalid(name, f"must be a string, got {_type(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON \ud800 escape
        raise invalid(name, "is not valid Unicode (a lone surrogate)") from None
    return value


def _type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


# --- requests ----------------------------------------------------------------------------------


def _check_fields(body: Any, known: frozenset[str]) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type(body)}")
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise invalid(unknown[0], f"unknown field {clipped_repr(unknown[0])} (this server knows: "
                      f"{', '.join(sorted(known))})")
    try:
        check_neutral(body)
    except FieldTypeError as err:
        raise invalid(err.param, err.message) from None


def _read_sampling(body: dict, request: pb.GenerateRequest, chat: bool) -> Choices:
    """``openai_sampling``'s fields, its refusals as 400 naming the field."""
    try:
        return read_sampling(body, request, chat)
    except SamplingError as err:
        raise (unsupported if err.unsupported else invalid)(err.param, err.message) from None


def _common(body: dict, request: pb.GenerateRequest, tenant_header: str | None) -> tuple[
        str | None, bool, tuple[bool, bool], tuple[str, ...]]:
    """The fields both endpoints share, into ``request``: (model, stream, (include_usage,
    continuous_usage_stats), stop strings)."""
    model = body.get("model")
    if model is not None:
        model = _str(model, "model")
    temperature = _number(body, "temperature")
    request.sampling.temperature = 1.0 if temperature is None else temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise invalid("top_p", f"must be in (0, 1], got {top_p}")
        request.sampling.top_p = top_p
    top_k = _int(body, "top_k")
    if top_k is not None:
        if top_k < -1:
            raise invalid("top_k", f"must be -1 (off), 0 (off) or positive, got {top_k}")
        request.sampling.top_k = max(0, top_k)
    seed = _int(body, "seed", 2**64 - 1)
    if seed is not None:
        request.sampling.seed = seed & (2**64 - 1)
    request.stopping.ignore_eos = _bool(body, "ignore_eos")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise invalid("stop_token_ids", f"must be an array of token ids, got {_type(stop_ids)}")
        for i, token in enumerate(stop_ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**31:
                raise invalid(f"stop_token_ids[{i}]", f"must be a token id, got {clipped_repr(str(token))}")
        request.stopping.stop_token_ids.extend(stop_ids)
    stop = _stop_strings(body.get("stop"))
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options", f"must be an object, got {_type(options)}")
        if not stream:
            raise invalid("stream_options", "is only allowed when stream is true")
        for key in options:
            if key not in ("include_usage", "continuous_usage_stats"):
                raise invalid(f"stream_options.{key}", "unknown field")
        include_usage = _bool(options, "include_usage", name="stream_options.include_usage")
        continuous = _bool(options, "continuous_usage_stats", name="stream_options.continuous_usage_stats")
    request.tenant = _tenant(body, tenant_header)
    return model, stream, (include_usage, continuous), stop


def _tenant(body: dict, tenant_header: str | None) -> str:
    """The header as sent (admission checks it is a label, naming the header), else ``user``
    made a label."""
    if tenant_header is not None:
        return _str(tenant_header, TENANT_HEADER)
    user = body.get("user")
    return "" if user is None else tenant_from_user(_str(user, "user"))


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list):
        raise invalid("stop", f"must be a string or an array of strings, got {_type(value)}")
    if len(values) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(values)}")
    out = []
    for i, s in enumerate(values):
        name = "stop" if isinstance(value, str) else f"stop[{i}]"
        s = _str(s, name)
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            raise invalid(name, f"must be 1 to {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        out.append(s)
    return tuple(out)


def _max_tokens(body: dict, names: tuple[str, ...]) -> tuple[int | None, str]:
    """The output length the client asked for, and the field it used (the first of ``names`` set)."""
    for name in names:
        value = _int(body, name)
        if value is not None:
            if value < 1:
                raise invalid(name, f"must be at least 1, got {value}")
            return value, name
    return None, names[0]


def parse_completion(body: Any, tenant_header: str | None = None) -> Parsed:
    """``POST /v1/completions``: a prompt as text or token ids (a batch of one is accepted)."""
    _check_fields(body, COMPLETION_FIELDS)
    request = pb.GenerateRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "must not be empty")
        request.prompt_text = _str(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < 2**31 for t in prompt):
            bad = next(i for i, t in enumerate(prompt) if not 0 <= t < 2**31)
            raise invalid(f"prompt[{bad}]", f"token id {clipped_repr(str(prompt[bad]))} is not a token id")
        request.prompt_token_ids.extend(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise unsupported("prompt", f"a batch of {len(prompt)} prompts is not supported (send one per request)")
    elif prompt is None:
        raise invalid("prompt", "is required")
    else:
        raise invalid("prompt", "must be a string, an array of token ids or a batch of one of them")
    model, stream, (include_usage, continuous), stop = _common(body, request, tenant_header)
    choices = _read_sampling(body, request, chat=False)
    max_tokens, param = _max_tokens(body, ("max_tokens",))
    request.stopping.max_new_tokens = DEFAULT_COMPLETION_TOKENS if max_tokens is None else max_tokens
    return Parsed(request, model, stream, include_usage, stop, continuous_usage=continuous, max_tokens_param=param,
                  choices=choices)


def parse_chat(body: Any, tenant_header: str | None = None) -> Parsed:
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""
    _check_fields(body, CHAT_FIELDS)
    request = pb.GenerateRequest()
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty array of messages")
    for i, message in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(name, f"must be an object, got {_type(message)}")
        for key in message:
            if key not in MESSAGE_FIELDS:
                if key in ("tool_calls", "tool_call_id", "function_call"):
                    raise unsupported(f"{name}.{key}", "tool calling is not supported")
                raise invalid(f"{name}.{key}", "unknown field")
        role = message.get("role")
        if role is None:
            raise invalid(f"{name}.role", "is required")
        if message.get("name") is not None:
            _str(message["name"], f"{name}.name")
        request.messages.append(pb.ChatMessage(role=chat_role(_str(role, f"{name}.role")),
                                               content=_content(message.get("content"), f"{name}.content")))
    model, stream, (include_usage, continuous), stop = _common(body, request, tenant_header)
    choices = _read_sampling(body, request, chat=True)
    max_tokens, param = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    request.stopping.max_new_tokens = max_tokens or 1
    return Parsed(request, model, stream, include_usage, stop, fill_context=max_tokens is None, chat=True,
                  continuous_usage=continuous, max_tokens_param=param, choices=choices)


def _content(value: Any, name: str) -> str:
    """A message's text: a string, or an array of text parts (images and audio are refused)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _str(value, name)
    if not isinstance(value, list):
        raise invalid(name, f"must be a string or an array of content parts, got {_type(value)}")
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise invalid(f"{name}[{i}]", f"must be an object, got {_type(part)}")
        if part.get("type") != "text":
            raise unsupported(f"{name}[{i}].type", f"only text parts are supported, got "
                              f"{clipped_repr(str(part.get('type')))}")
        texts.append(_str(part.get("text"), f"{name}[{i}].text"))
    return "".join(texts)


# --- stop strings ------------------------------------------------------------------------------


class StopMatcher:
    """Text-level stop strings over a stream of text deltas, as vLLM matches them: the output ends
    before the first stop string (which is not returned), and text that could still become a stop
    string is held back until it cannot."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """The text that may be sent now; after a match ``stopped`` is set and nothing more is sent."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self.pending + delta
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.pending = True, ""
            return text[:cut]
        keep = min(self.hold, len(text))
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The held-back tail when the stream ends without a match."""
        rest, self.pending = ("" if self.stopped else self.pending), ""
        return rest


# --- responses ---------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def finish_reason(completion: pb.Completion | None, stopped_by_string: bool) -> str:
    if stopped_by_string or completion is None:
        return "stop"
    return FINISH.get(completion.finish_reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def extension(completion: pb.Completion | None) -> dict[str, Any]:
    """The ``graphkeeper`` field: how the engine's steps ran this request (the gRPC Completion's
    execution summary, in proto3 JSON), its time to first token and total time."""
    if completion is None:  # no summary arrived (every end the engine reports carries one)
        return {"execution": None}
    return {"execution": MessageToDict(completion.execution, preserving_proto_field_name=True),
            "time_to_first_token_seconds": completion.time_to_first_token_seconds,
            "total_seconds": completion.total_seconds, "request_id": completion.request_id}


def choice(chat: bool, text: str, finish: str | None, *, delta: bool, role: bool = False,
           token_ids: list[int] | None = None, index: int = 0, logprobs: dict | None = None) -> dict[str, Any]:
    """One choice of a response (``delta`` for a stream chunk); ``token_ids`` only for a model
    without a tokenizer, whose text is empty."""
    if chat:
        body: dict[str, Any] = {"role": "assistant", "content": text} if role or not delta else {"content": text}
        out: dict[str, Any] = {"index": index, ("delta" if delta else "message"): body, "logprobs": logprobs,
                               "finish_reason": finish}
    else:
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def envelope(rid: str, chat: bool, created: int, model: str, choices: list[dict], *, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}


def models_list(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "graphkeeper", "max_model_len": max_model_len}]}
