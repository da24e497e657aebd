"""Input refused one field at a time, with a message people can read.

``FieldError`` names the field it refuses and leads its message with it; the helpers below build
such messages safely. The policy model (``policy.py``), the worker's admission of requests and its
flags and model paths all refuse input this way.
"""

from __future__ import annotations

#: How much of a refused value an error message repeats (the rest is elided).
ECHO_CHARS = 64


class FieldError(ValueError):
    """Input refused because of one field; ``field`` names it and leads the message."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def clipped_repr(value: str, limit: int = ECHO_CHARS) -> str:
    """``repr`` of at most ``limit`` characters of ``value``, with an ellipsis when cut.

    Error messages travel back to the caller, into logs and into the operator's status: a
    refused megabyte-long string must not be echoed whole, and ``repr`` keeps control
    characters from forging log lines.
    """
    if len(value) <= limit:
        return repr(value)
    return repr(value[:limit]) + f"... ({len(value)} characters)"


def utf8_len(value: str) -> int:
    """The length of ``value`` on the wire (proto strings are UTF-8)."""
    return len(value.encode("utf-8", "surrogatepass"))


def check_string(field: str, value: str, max_bytes: int, error: type[ValueError]) -> None:
    """Raises ``error(field, message)`` when ``value`` exceeds ``max_bytes`` or holds control characters."""
    size = utf8_len(value)
    if size > max_bytes:
        raise error(field, f"at most {max_bytes} bytes, got {size}: {clipped_repr(value)}")
    if any(ch < " " or ch == "\x7f" for ch in value):
        raise error(field, f"must not contain control characters: {clipped_repr(value)}")
