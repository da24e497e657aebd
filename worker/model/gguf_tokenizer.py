"""The tokenizer a GGUF file carries, rebuilt as a ``tokenizers`` tokenizer.

GGUF stores a byte-level BPE vocabulary (``tokenizer.ggml.model`` ``gpt2``) as three arrays (tokens,
their types, merges) plus the special token ids, whether to add BOS/EOS, and the chat template.
The pre-tokenizer follows llama.cpp's name for it (``tokenizer.ggml.pre``): ``smollm`` splits
digits one by one before the byte-level split, as SmolLM's own tokenizer does; other names get
the plain GPT-2 byte-level split. SentencePiece vocabularies (``llama``) are refused, by name.
"""

from __future__ import annotations

from pathlib import Path

from graphkeeper.worker.model.gguf_checkpoint import GGUFError, GGUFFile, open_gguf
from graphkeeper.worker.model.tokenizer import Tokenizer, TokenizerConfig

#: llama.cpp's token types: 3 is a control token (special), 4 a user-defined one.
CONTROL, USER_DEFINED = 3, 4
DIGIT_SPLIT_PRE = ("smollm",)


def gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of the GGUF file at ``path``."""
    return tokenizer_from(open_gguf(path))


def tokenizer_from(file: GGUFFile) -> Tokenizer:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = file.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{file.path.name}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is)")
    tokens: list[str] = list(file.require("tokenizer.ggml.tokens"))
    types = list(file.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in file.require("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if file.get("tokenizer.ggml.pre") in DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=(types[i] == CONTROL), normalized=False)
             for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)

    def name(key: str) -> str | None:
        index = file.get(key)
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    config = TokenizerConfig(
        chat_template=file.get("tokenizer.chat_template"),
        bos_token=name("tokenizer.ggml.bos_token_id"), eos_token=name("tokenizer.ggml.eos_token_id"),
        add_bos=bool(file.get("tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(file.get("tokenizer.ggml.add_eos_token", False)),
        extra_eos=tuple(t for t in (name("tokenizer.ggml.eot_token_id"), name("tokenizer.ggml.eom_token_id")) if t),
    )
    return Tokenizer(tok, config, str(file.path))
