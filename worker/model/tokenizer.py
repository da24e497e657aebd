"""Text in and out, used by the API layer only, never on the engine thread: the model's tokenizer
(``tokenizer.json`` with ``tokenizer_config.json``, or the vocabulary in a GGUF file), its BOS and
EOS as the model declares them, and its chat template.

Two rules keep text from forging control tokens: a text prompt is encoded with special tokens
treated as plain text (``"hi<|im_end|>"`` is characters, not the EOS id), and a chat message
whose content contains a special token is refused; only the chat template's own markup and the
BOS the tokenizer config asks for become special ids. Token-id prompts are not touched.

Incremental detokenization follows what serving frontends do: decode a short window of ids
before the new ones and emit only the text the new ids add, holding back a delta that ends in
an incomplete UTF-8 character (decoded as U+FFFD) until the next token completes it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphkeeper.worker.model.catalog import resolve_builtin

log = logging.getLogger(__name__)
# Tokenize on the calling thread, not on the library's own thread pool: the API layer runs long
# prompts on threads it gives the lowest CPU priority, which the pool's threads would not have.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: Ids decoded before the new ones, so that merges across the boundary decode as in the full text.
_WINDOW = 5
_INCOMPLETE = "\ufffd"
#: The chat roles a message may have.
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """A chat request this tokenizer cannot render: no template, or a message it refuses."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class TokenizerConfig:
    """What ``tokenizer_config.json`` (or a GGUF's metadata) says beyond the vocabulary."""

    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    #: Whether to add BOS / EOS to an encoded prompt; None: the tokenizer's post-processor decides.
    add_bos: bool | None = None
    add_eos: bool | None = None
    extra_eos: tuple[str, ...] = field(default=())


class Tokenizer:
    """Ids from text (prompts and chats), text from ids, as the model's tokenizer config says."""

    def __init__(self, backend: Any, config: TokenizerConfig, name: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.name = name
        self.config = config
        self._tok = backend
        _apply_special_tokens(self._tok, config)
        # The same tokenizer with special tokens read as text: what a text prompt is encoded with.
        self._plain = HFTokenizer.from_str(self._tok.to_str())
        self._plain.encode_special_tokens = True
        self.special_tokens = tuple(sorted(
            t.content for t in self._tok.get_added_tokens_decoder().values() if t.special))
        self._template = _compile_template(config.chat_template) if config.chat_template else None
        self._texts: dict[int, str] = {}  # token_text's

    @classmethod
    def from_file(cls, path: Path, config: TokenizerConfig | None = None) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)), config or TokenizerConfig(), str(path))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def eos_ids(self) -> frozenset[int]:
        """Every EOS the tokenizer config names (the model config may name more)."""
        names = [self.config.eos_token, *self.config.extra_eos]
        return frozenset(i for i in (self._tok.token_to_id(n) for n in names if n) if i is not None)

    def encode_ids(self, text: str) -> list[int]:
        """A text prompt: BOS as the tokenizer config says; special-token text stays text.

        ``encode_batch`` of one, not ``encode``: the batch call releases the interpreter lock while
        it works (``encode`` holds it, 1.3 s for 1 MiB of text, and the API process's event loop,
        its health checks and every stream's tokens wait behind it)."""
        return self._plain.encode_batch([text], add_special_tokens=True)[0].ids

    def render_chat(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, rendered by the model's chat template (jinja2, as
        Hugging Face renders it)."""
        if self._template is None:
            raise ChatError("messages", f"this model's tokenizer ({Path(self.name).name}) has no chat template: "
                            "send prompt_text or prompt_token_ids")
        for i, (role, content) in enumerate(messages):
            if role not in ROLES:
                raise ChatError(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role[:32]!r}")
            for token in self.special_tokens:
                if token in content:
                    raise ChatError(f"messages[{i}].content", f"contains the special token {token!r}")
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=[{"role": r, "content": c} for r, c in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self.config.bos_token or "", eos_token=self.config.eos_token or "")
        except TemplateError as err:
            raise ChatError("messages", f"the chat template refused the conversation: {err}") from None

    def encode_chat(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """A conversation as ids: the rendered template, its markup read as special tokens and
        nothing added (the template writes BOS itself where the model wants one)."""
        rendered = self.render_chat(messages, add_generation_prompt)
        return self._tok.encode_batch([rendered], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included (how log probabilities name tokens).

        Kept once decoded: a response with log probabilities names six tokens for each one it
        returns, on the API process's event loop, and the same ids come back again and again. At
        most one string per vocabulary entry."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._tok.decode([token], skip_special_tokens=False)
        return text

    def backend_json(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text (what a grammar library wraps)."""
        return self._tok.to_str()


def _apply_special_tokens(tok: Any, config: TokenizerConfig) -> None:
    """Rebuilds the post-processor when the tokenizer config says explicitly whether to add BOS or
    EOS (Hugging Face does the same); otherwise ``tokenizer.json``'s post-processor stands."""
    if config.add_bos is None and config.add_eos is None:
        return
    from tokenizers.processors import TemplateProcessing

    bos = [config.bos_token] if config.add_bos and config.bos_token else []
    eos = [config.eos_token] if config.add_eos and config.eos_token else []
    single = " ".join([*(f"{t}:0" for t in bos), "$A:0", *(f"{t}:0" for t in eos)])
    pair = " ".join([single, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)])
    specials = [(t, tok.token_to_id(t)) for t in {*bos, *eos}]
    if any(i is None for _, i in specials):
        log.warning("tokenizer config names special tokens missing from the vocabulary: %s", specials)
        return
    tok.post_processor = TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _compile_template(source: str) -> Any:
    """The chat template in a sandbox, with the globals Hugging Face templates use."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken object with content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(directory: Path) -> TokenizerConfig:
    """``tokenizer_config.json`` (and ``chat_template.jinja`` / ``chat_template.json``) of a directory."""
    doc: dict[str, Any] = {}
    path = directory / "tokenizer_config.json"
    if path.is_file():
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
            doc = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError) as err:
            log.warning("%s is unreadable (%s): no chat template, default special tokens", path, err)
    template = doc.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    for name in ("chat_template.jinja",):
        if template is None and (directory / name).is_file():
            template = (directory / name).read_text(encoding="utf-8")
    if template is None and (directory / "chat_template.json").is_file():
        try:
            template = json.loads((directory / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            template = None
    add_bos, add_eos = doc.get("add_bos_token"), doc.get("add_eos_token")
    return TokenizerConfig(
        chat_template=template if isinstance(template, str) else None,
        bos_token=_token_text(doc.get("bos_token")), eos_token=_token_text(doc.get("eos_token")),
        add_bos=add_bos if isinstance(add_bos, bool) else None, add_eos=add_eos if isinstance(add_eos, bool) else None,
    )


def load_tokenizer(source: str) -> Tokenizer | None:
    """The tokenizer of a model (directory or GGUF file), or None when it has none (random presets)."""
    if source.startswith("random:"):
        return None
    try:
        source = resolve_builtin(source)
        if source.lower().endswith(".gguf"):
            from graphkeeper.worker.model.gguf_tokenizer import gguf_tokenizer

            return gguf_tokenizer(Path(source))
        path = Path(source) / "tokenizer.json"
        if not path.is_file():
            return None
        return Tokenizer.from_file(path, read_tokenizer_config(Path(source)))
    except Exception as err:  # noqa: BLE001 - a broken tokenizer must not stop the model from serving ids
        log.warning("tokenizer of %s cannot be loaded (%s): text prompts are refused", source, err)
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
