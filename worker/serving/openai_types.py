"""The JSON types OpenAI's API gives the request fields this server accepts only at their neutral
value (``echo``, ``parallel_tool_calls``, ``suffix``, ...): a value of the wrong type is a 400
naming the field, never read as "not set" (``"echo": {}`` and ``"parallel_tool_calls": NaN`` were
accepted silently). Checked before the request rules of ``openai_api`` read the body; ``null`` is
"not set" as everywhere. Only fields whose type OpenAI's API fixes for both endpoints are here.
"""

from __future__ import annotations

from typing import Any

from graphkeeper.worker.serving.openai_api import ApiError

#: field -> (the JSON type's name, the Python types json.loads gives it)
FIELD_TYPES: dict[str, tuple[str, tuple[type, ...]]] = {
    "echo": ("a boolean", (bool,)),
    "parallel_tool_calls": ("a boolean", (bool,)),
    "store": ("a boolean", (bool,)),
    "suffix": ("a string", (str,)),
    "service_tier": ("a string", (str,)),
    "logit_bias": ("an object", (dict,)),
    "metadata": ("an object", (dict,)),
    "response_format": ("an object", (dict,)),
    "tools": ("an array", (list,)),
    "functions": ("an array", (list,)),
    "top_logprobs": ("an integer", (int,)),
}


def type_error(body: Any) -> ApiError | None:
    """A 400 for the first field of ``FIELD_TYPES`` in ``body`` whose value has another type."""
    if not isinstance(body, dict):
        return None  # the request rules refuse a body that is not an object
    for name, (expected, types) in FIELD_TYPES.items():
        value = body.get(name)
        if value is None:
            continue
        wrong = not isinstance(value, types) or (types == (int,) and isinstance(value, bool))
        if wrong:
            return ApiError(400, f"{name}: must be {expected}, got {type(value).__name__}", name)
    return None
