"""Admission: checks a request before it may take a place in the queue or reach the engine.

Pure, so every rejection is testable without a model. Each error names the request field, and
the gRPC layer turns it into INVALID_ARGUMENT; the worker keeps serving everyone else. Every
string is bounded before anything else looks at it, and a refused value is echoed clipped
(``clipped_repr``), never whole: error details travel back to the caller and into the logs.
"""

from __future__ import annotations

import math

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.field_checks import FieldError, check_string, clipped_repr, utf8_len
from graphkeeper.proto.policy import valid_tenant
from graphkeeper.worker.engine import Limits
from graphkeeper.worker.serving.sampling_checks import logits_errors

MAX_TEMPERATURE = 100.0
MAX_STOP_IDS = 64
#: Client-chosen trace ids: a UUID is 36 bytes, a W3C trace id 32 hex digits.
MAX_REQUEST_ID_BYTES = 128
#: A text prompt is tokenized on the worker; more than this is refused before tokenization.
MAX_PROMPT_TEXT_BYTES = 1 << 20
#: Messages in one chat request.
MAX_MESSAGES = 256
#: A chat message's role (the template decides which roles it knows; these are the usual ones).
ROLES = ("system", "user", "assistant", "tool")
#: A model revision is a label value and a status field: a content hash, a git sha, a tag.
MAX_REVISION_BYTES = 128
#: A model source is a directory path (PATH_MAX on Linux) or ``random:<preset>[@seed]``.
MAX_SOURCE_BYTES = 4096


#: Room for every field but the prompt in a request's bytes (request id, tenant, stop ids, sampling).
REQUEST_OVERHEAD_BYTES = 64 << 10


def max_request_bytes(max_seq_len: int) -> int:
    """The largest GenerateRequest that could be valid on a worker with ``max_seq_len``: the
    inference port refuses bigger messages before parsing them (RESOURCE_EXHAUSTED), so a hostile
    prompt costs at most a parse of this many bytes. A token id takes at most 5 bytes (a varint of
    a non-negative int32); a text prompt at most MAX_PROMPT_TEXT_BYTES."""
    return max(MAX_PROMPT_TEXT_BYTES, 5 * max_seq_len) + REQUEST_OVERHEAD_BYTES


class AdmissionError(FieldError):
    """A request refused before it reaches the engine."""


class Oversize(AdmissionError):
    """A request refused for its size: a prompt that cannot fit the context, or text past the cap.

    Counted apart (``requests_total{outcome="oversize"}``): a flood of these is an attack or a
    misconfigured client, and each was refused before anything was copied or tokenized.
    """


def validate_request(req: pb.GenerateRequest, limits: Limits) -> None:
    """Raises AdmissionError naming the first invalid field.

    Cheap checks come first (sizes before per-element loops), so a hostile request is refused
    in time proportional to the limits, not to its own size.
    """
    check_string("request_id", req.request_id, MAX_REQUEST_ID_BYTES, AdmissionError)
    if not valid_tenant(req.tenant):
        raise AdmissionError(
            "tenant", f"{clipped_repr(req.tenant)} is not a DNS-1123 label ([a-z0-9-], at most 63 characters)"
        )
    _validate_prompt_source(req, limits)
    max_new = req.stopping.max_new_tokens
    if max_new < 1:
        raise AdmissionError("stopping.max_new_tokens", f"must be at least 1, got {max_new}")
    if req.prompt_token_ids:
        validate_prompt_length(len(req.prompt_token_ids), max_new, limits)  # len() copies nothing
        for i, token in enumerate(req.prompt_token_ids):
            if not 0 <= token < limits.vocab_size:
                raise AdmissionError(
                    f"prompt_token_ids[{i}]", f"token id {token} is outside the vocabulary [0, {limits.vocab_size})"
                )
    elif req.messages:  # the template adds tokens: the contents' bytes still bound the count below
        validate_text_length("".join(m.content for m in req.messages), max_new, limits, "messages")
    else:
        # The text's token count is known only after tokenization; its byte length bounds it below.
        validate_text_length(req.prompt_text, max_new, limits)
    if len(req.stopping.stop_token_ids) > MAX_STOP_IDS:
        raise AdmissionError("stopping.stop_token_ids", f"at most {MAX_STOP_IDS} stop ids")
    for i, token in enumerate(req.stopping.stop_token_ids):
        if not 0 <= token < limits.vocab_size:
            raise AdmissionError(f"stopping.stop_token_ids[{i}]", f"token id {token} is outside the vocabulary")
    _validate_sampling(req.sampling)
    if error := logits_errors(req, limits):
        raise AdmissionError(*error)


def _validate_prompt_source(req: pb.GenerateRequest, limits: Limits) -> None:
    """Exactly one of ``prompt_token_ids``, ``prompt_text`` and ``messages``; text only where a
    tokenizer exists, messages only where it has a chat template."""
    has_ids, has_text, has_chat = bool(req.prompt_token_ids), bool(req.prompt_text), bool(req.messages)
    if has_ids + has_text + has_chat > 1:
        field = "messages" if has_chat else "prompt_text"
        raise AdmissionError(field, "set exactly one of prompt_token_ids, prompt_text and messages")
    if not has_ids and not has_text and not has_chat:
        raise AdmissionError("prompt_token_ids", "must not be empty (or set prompt_text or messages)")
    if has_chat:
        _validate_messages(req.messages, limits)
    if has_text:
        text = req.prompt_text
        # A character is at most 4 bytes: the character count refuses most of them without encoding.
        size = len(text) if len(text) > MAX_PROMPT_TEXT_BYTES else utf8_len(text)
        if size > MAX_PROMPT_TEXT_BYTES:
            raise Oversize("prompt_text", f"at most {MAX_PROMPT_TEXT_BYTES} bytes, got {size}")
        if not limits.text_prompts:
            raise AdmissionError(
                "prompt_text", "this model has no tokenizer (tokenizer.json): send prompt_token_ids"
            )


def _validate_messages(messages, limits: Limits) -> None:
    """A bounded conversation of known roles, for a model whose tokenizer has a chat template."""
    if len(messages) > MAX_MESSAGES:
        raise AdmissionError("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    total = 0
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise AdmissionError(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got "
                                 f"{clipped_repr(message.role)}")
        total += utf8_len(message.content)
        if total > MAX_PROMPT_TEXT_BYTES:
            raise Oversize("messages", f"at most {MAX_PROMPT_TEXT_BYTES} bytes of content in all")
    if not limits.chat:
        raise AdmissionError("messages", "this model's tokenizer has no chat template: send prompt_text or "
                             "prompt_token_ids")


def validate_prompt_length(prompt_tokens: int, max_new_tokens: int, limits: Limits,
                           prompt_field: str = "prompt_token_ids") -> None:
    """The prompt plus the tokens to generate must fit the context. A prompt that leaves no room
    for a single new token is the prompt's fault (``prompt_field``), whatever max_new_tokens says.

    Called again by the engine after it tokenizes a ``prompt_text``, when the count is known.
    """
    if prompt_tokens >= limits.max_seq_len:
        raise Oversize(prompt_field, f"{prompt_tokens} tokens leave no room for a new token in the context of "
                       f"{limits.max_seq_len} tokens")
    if prompt_tokens + max_new_tokens > limits.max_seq_len:
        raise Oversize(
            "stopping.max_new_tokens",
            f"prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the context of "
            f"{limits.max_seq_len} tokens",
        )


def validate_text_length(text: str, max_new_tokens: int, limits: Limits, field: str = "prompt_text") -> None:
    """Refuses a text prompt that cannot fit the context, from its byte length alone.

    ``B`` bytes make at least ``ceil(B / max_token_bytes)`` tokens (no token stands for more
    bytes than the tokenizer's longest), so this never refuses a prompt that would fit, and it
    is what bounds the text a request may make the worker tokenize.
    """
    validate_prompt_length(1, max_new_tokens, limits)  # max_new_tokens alone leaves no room
    if limits.max_token_bytes <= 0:
        return  # the tokenizer is not measured: the count is checked after tokenizing
    least = max(1, -(-utf8_len(text) // limits.max_token_bytes))
    if least + max_new_tokens > limits.max_seq_len:
        raise Oversize(
            field,
            f"{utf8_len(text)} bytes of text make at least {least} tokens, which with max_new_tokens "
            f"({max_new_tokens}) exceeds the context of {limits.max_seq_len} tokens",
        )


def validate_tokenized(ids: list[int], max_new_tokens: int, limits: Limits, field: str = "prompt_text") -> None:
    """A tokenized ``prompt_text`` (or ``messages``) checked as token ids; errors name ``field``,
    the field the client sent."""
    if len(ids) + max_new_tokens > limits.max_seq_len:
        raise Oversize(
            field,
            f"tokenizes to {len(ids)} tokens, which with max_new_tokens ({max_new_tokens}) exceeds the context "
            f"of {limits.max_seq_len} tokens",
        )
    if not ids:
        raise AdmissionError(field, "tokenizes to no tokens")
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise AdmissionError(
            field, f"the tokenizer made id {bad}, outside the model's vocabulary [0, {limits.vocab_size})")


def _validate_sampling(s: pb.SamplingParams) -> None:
    if not math.isfinite(s.temperature) or not 0.0 <= s.temperature <= MAX_TEMPERATURE:
        raise AdmissionError("sampling.temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {s.temperature}")
    if not math.isfinite(s.top_p) or not 0.0 <= s.top_p <= 1.0:
        raise AdmissionError("sampling.top_p", f"must be in (0, 1] (0 means 1), got {s.top_p}")
    if s.top_k < 0:
        raise AdmissionError("sampling.top_k", f"must not be negative, got {s.top_k}")


def validate_reload_request(req: pb.LoadModelRevisionRequest) -> None:
    """Raises AdmissionError naming ``source`` or ``revision`` when a reload request is malformed.

    Only the shape is checked here (pure, no filesystem): the server then applies the
    ``--model-root`` restriction and the loader finds out whether the source really loads.
    """
    if not req.source:
        raise AdmissionError("source", "must name a directory or random:<preset>[@seed]")
    check_string("source", req.source, MAX_SOURCE_BYTES, AdmissionError)
    check_string("revision", req.revision, MAX_REVISION_BYTES, AdmissionError)
