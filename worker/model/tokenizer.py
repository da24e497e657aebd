"""Text in and out: the model directory's ``tokenizer.json`` (the ``tokenizers`` library), used by
the API layer only, never on the engine thread.

Incremental detokenization follows what serving frontends do: decode a short window of ids
before the new ones and emit only the text the new ids add, holding back a delta that ends in
an incomplete UTF-8 character (decoded as U+FFFD) until the next token completes it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
# Tokenize on the calling thread, not on the library's own thread pool: the API layer runs long
# prompts on threads it gives the lowest CPU priority, which the pool's threads would not have.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: Ids decoded before the new ones, so that merges across the boundary decode as in the full text.
_WINDOW = 5
_INCOMPLETE = "\ufffd"


class Tokenizer:
    """A thin wrapper: ids from text, text from ids, without special tokens added."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.path = path
        self._tok = HFTokenizer.from_file(str(path))

    def encode_ids(self, text: str) -> list[int]:
        """``encode_batch`` of one, not ``encode``: the batch call releases the interpreter lock while
        it works (``encode`` holds it, 1.3 s for 1 MiB of text, and the API process's event loop,
        its health checks and every stream's tokens wait behind it)."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(source: str) -> Tokenizer | None:
    """The tokenizer of a model directory, or None when it has none (or for random presets)."""
    if source.startswith("random:"):
        return None
    path = Path(source) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer(path)
    except Exception as err:  # noqa: BLE001 - a broken tokenizer must not stop the model from serving ids
        log.warning("tokenizer %s cannot be loaded (%s): text prompts are refused", path, err)
        return None


class IncrementalDetokenizer:
    """Turns a stream of new ids into text deltas whose concatenation is the decoded output."""

    def __init__(self, tokenizer: Tokenizer | None, prompt: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt[-_WINDOW:])
        self.prefix = 0  # start of the window decoded for context
        self.read = len(self.ids)  # ids before this are already emitted as text

    def add(self, new_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(new_ids)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith(_INCOMPLETE):
            return ""  # nothing new yet, or a character still incomplete: wait for more ids
        self._advance()
        return text[len(before):]

    def flush(self) -> str:
        """Whatever is still held back when the stream ends (an incomplete character included)."""
        if self.tokenizer is None or self.read >= len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self._advance()
        return text[len(before):]

    def _advance(self) -> None:
        """Keeps the window bounded: only the last few emitted ids stay as context."""
        self.read = len(self.ids)
        self.prefix = max(0, self.read - _WINDOW)
        if self.prefix > 64:  # drop ids no window will read again
            del self.ids[: self.prefix]
            self.read -= self.prefix
            self.prefix = 0
