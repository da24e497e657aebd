"""OpenAI request fields that change nothing the model computes, and the tenant a request runs as.

OpenAI and vLLM define fields that a client may send to any server without asking for different
output: ``store`` and ``metadata`` (OpenAI keeps the completion for its dashboard),
``service_tier``, ``safety_identifier``, ``prompt_cache_key``, ``parallel_tool_calls`` and
``user``. Refusing them breaks clients that set them everywhere (the SDKs' own examples do), so
they are accepted, type-checked (a wrong type is still 400 naming the field) and otherwise left
alone. OpenAI's ``developer`` role is its newer name for ``system``, and is read as one.

The tenant (whose graphs the policy's per-tenant toggle governs) is the ``X-Graphkeeper-Tenant``
header when sent, a DNS-1123 label as policies name tenants; otherwise it is derived from
``user``, which OpenAI lets be any string (often an e-mail address or a hashed id): a valid
request is never refused for its ``user``. ``tenant_from_user`` is the mapping, pure and
deterministic, so a policy author can write the tenant a user becomes.

Pure functions: ``openai_api`` calls them while it reads a body.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from graphkeeper.proto.field_checks import clipped_repr

#: Accepted on both endpoints (the legacy completions API defines ``user`` too).
NEUTRAL_FIELDS = frozenset(("user",))
#: Accepted on /v1/chat/completions.
NEUTRAL_CHAT_FIELDS = frozenset(("user", "store", "metadata", "service_tier", "safety_identifier",
                                 "prompt_cache_key", "parallel_tool_calls"))
#: OpenAI's bounds on ``metadata``: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: OpenAI's service tiers (they choose a price and a latency, never the output).
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
#: Roles read as another: OpenAI's ``developer`` messages are system messages.
ROLE_ALIASES = {"developer": "system"}
#: A tenant is a DNS-1123 label: at most 63 characters.
MAX_TENANT_CHARS = 63
_HASH_CHARS = 8
_NOT_LABEL = re.compile(r"[^a-z0-9]+")


class FieldTypeError(ValueError):
    """A neutral field of the wrong type or size: ``param`` names it (the caller answers 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


def check_neutral(body: dict[str, Any]) -> None:
    """Type-checks the neutral fields ``body`` sets (``null`` is not set); the caller refused
    the fields its endpoint does not know first."""
    for name in sorted(NEUTRAL_CHAT_FIELDS & body.keys()):
        value = body[name]
        if value is None:
            continue
        if name in ("store", "parallel_tool_calls"):
            if not isinstance(value, bool):
                raise FieldTypeError(name, f"must be a boolean, got {type(value).__name__}")
        elif name == "metadata":
            _check_metadata(value)
        elif name == "service_tier":
            if value not in SERVICE_TIERS:
                raise FieldTypeError(name, f"must be one of {', '.join(SERVICE_TIERS)}, got "
                                     f"{clipped_repr(str(value))}")
        elif not isinstance(value, str):  # user, safety_identifier, prompt_cache_key
            raise FieldTypeError(name, f"must be a string, got {type(value).__name__}")


def _check_metadata(value: Any) -> None:
    if not isinstance(value, dict):
        raise FieldTypeError("metadata", f"must be an object of strings, got {type(value).__name__}")
    if len(value) > MAX_METADATA_PAIRS:
        raise FieldTypeError("metadata", f"at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise FieldTypeError("metadata", f"keys are at most {MAX_METADATA_KEY_CHARS} characters, got "
                                 f"{clipped_repr(key)}")
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE_CHARS:
            raise FieldTypeError(f"metadata.{key}", f"must be a string of at most {MAX_METADATA_VALUE_CHARS} "
                                 "characters")


def chat_role(role: str) -> str:
    """The role the chat template and admission see (``developer`` is ``system``)."""
    return ROLE_ALIASES.get(role, role)


def tenant_from_user(user: str) -> str:
    """The tenant a request's ``user`` stands for, as a DNS-1123 label (pure, deterministic).

    Lowercased; each run of characters other than ``a-z`` and ``0-9`` becomes one ``-``; a
    leading or trailing ``-`` is dropped (``"Alice@Example.com"`` is ``alice-example-com``). One
    longer than 63 characters keeps its first 54 and a hash of the whole ``user`` (so long ids
    that share a beginning stay apart). Nothing left (``""``, ``"@@"``) is the default tenant.
    """
    label = _NOT_LABEL.sub("-", user.lower()).strip("-")
    if len(label) <= MAX_TENANT_CHARS:
        return label
    digest = hashlib.blake2b(user.encode("utf-8"), digest_size=_HASH_CHARS // 2).hexdigest()
    return label[:MAX_TENANT_CHARS - _HASH_CHARS - 1].rstrip("-") + "-" + digest
