"""Structured output: a request's ``OutputConstraint`` (a JSON Schema, or any JSON object)
compiled by llguidance into a grammar, and one matcher per sequence that says which tokens may
come next.

llguidance, not xgrammar: its wheel is one abi3 build (the same file serves Python 3.11 here and
3.12 on the GPU image), it depends on nothing (xgrammar pins torch, transformers, triton and
pydantic ranges of its own, which would have to agree with ``constraints.txt``), it computes a
mask in tens of microseconds without precompiling the vocabulary per grammar, and vLLM and
SGLang both ship it as a structured-output backend.

The grammar is checked (``constraint_error``) before a request is admitted, so a bad schema is a
400 naming the field, never a failed step. The matcher is built once per sequence from the
model's tokenizer (wrapped once per tokenizer, which takes about a second for a large vocabulary).
"""

from __future__ import annotations

import json
import threading
from typing import Any

from graphkeeper.proto import worker_pb2 as pb

#: A schema longer than this is refused (the grammar's size grows with it).
MAX_SCHEMA_BYTES = 64 << 10


def grammar_for(constraint: pb.OutputConstraint) -> str:
    """The llguidance grammar for a constraint; raises ValueError for a schema that is not JSON."""
    import llguidance

    if constraint.WhichOneof("kind") == "json_object":
        schema: Any = {"type": "object"}
    else:
        schema = json.loads(constraint.json_schema)
    # whitespace_flexible off: compact JSON, so a small model cannot spend its tokens on spaces.
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def constraint_error(constraint: pb.OutputConstraint) -> tuple[str, str] | None:
    """(field, why) when the constraint cannot be enforced, else None. Pure apart from llguidance."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    try:
        import llguidance
    except ImportError:  # an install without it (pyproject requires it): refused, never a failed step
        return "constraint", "structured output is not available on this worker (llguidance is not installed)"
    if kind == "json_object":
        return None if constraint.json_object else ("constraint.json_object", "must be true when set")
    text = constraint.json_schema
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        return "constraint.json_schema", f"at most {MAX_SCHEMA_BYTES} bytes"
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        return "constraint.json_schema", f"is not JSON: {err.msg}"
    if not isinstance(schema, dict | bool):
        return "constraint.json_schema", "must be a JSON object (a schema)"
    try:
        grammar = grammar_for(constraint)
    except (ValueError, TypeError) as err:
        return "constraint.json_schema", str(err)[:300]
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return ("constraint.json_schema", f"cannot be enforced: {error[:300]}") if error else None


class Grammars:
    """Matchers for one model's tokenizer; thread-safe (requests arrive on API threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wrapped: tuple[Any, Any] | None = None  # (our tokenizer, its llguidance tokenizer)

    def matcher(self, constraint: pb.OutputConstraint, tokenizer: Any, vocab_size: int, eos_id: int) -> Any:
        """A fresh matcher at the start of the output; ValueError when the model has no tokenizer."""
        import llguidance

        if tokenizer is None:
            raise ValueError("constraint: structured output needs the model's tokenizer")
        with self._lock:
            if self._wrapped is None or self._wrapped[0] is not tokenizer:
                wrapped = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=eos_id)
                self._wrapped = (tokenizer, wrapped)
            lltok = self._wrapped[1]
        matcher = llguidance.LLMatcher(lltok, grammar_for(constraint), log_level=0)
        if matcher.is_error():
            raise ValueError(f"constraint: {matcher.get_error()[:300]}")
        return matcher
