"""GGUF checkpoints of the Llama architecture: config, weights and tokenizer from one file.

A GGUF file (llama.cpp's format) holds key/value metadata (the hyperparameters, the vocabulary,
merges, special token ids, the chat template) and the tensors, some block-quantized. The ``gguf``
library reads both; its reference dequantizers turn Q4_0/Q4_1/Q8_0 blocks back into float32
exactly as llama.cpp defines them, and the weights are then cast to the serving dtype. Nothing is
kept quantized: the decoder runs on the dequantized weights.

Two layout differences from a Hugging Face checkpoint are undone here, once:
- GGUF stores each matrix with its dimensions reversed (``ne0`` is the input dimension); the
  reader's arrays are already (rows, columns) in PyTorch's order.
- llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` from Hugging Face's
  rotate-half RoPE layout into interleaved pairs; this decoder uses rotate-half, so the rows are
  permuted back (the inverse of ``convert_hf_to_gguf.py``'s ``permute``).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphkeeper.proto.field_checks import clipped_repr
from graphkeeper.worker.model.config import ModelConfig

#: Tensor types this loader dequantizes (the ones small Llama GGUFs use); others are refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
SUFFIX = ".gguf"


class GGUFError(ValueError):
    """The file is not a GGUF checkpoint this decoder can serve (the message says why)."""


def is_gguf(source: str) -> bool:
    """Whether ``source`` names a GGUF file (by its suffix; the content is checked on reading)."""
    return source.lower().endswith(SUFFIX)


@dataclass
class GGUFFile:
    """An opened GGUF file: its metadata by key and its tensors by name (each with its
    ``tensor_type`` and its ``data``, memory-mapped)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
        return self.metadata[key]


def open_gguf(path: Path) -> GGUFFile:
    """Reads the header, the metadata and the tensor index (the data stays mapped, unread).

    The header is read directly (``gguf_header``: 0.13 s for the built-in model, where the ``gguf``
    library's reader takes 2.1 s to make views of a vocabulary's arrays); a file that reader does
    not take goes to the library's, which says what is wrong with it. Both worker processes read
    the file more than once (config, tokenizer, and in the engine core the weights): the last file
    opened is kept, keyed by its identity.
    """
    try:
        stat = path.stat()
    except OSError as err:
        raise GGUFError(f"{path.name}: {err.strerror or type(err).__name__}") from None
    return _open_cached(path, stat.st_mtime_ns, stat.st_size, stat.st_ino)


@functools.lru_cache(maxsize=1)
def _open_cached(path: Path, mtime_ns: int, size: int, inode: int) -> GGUFFile:
    import gguf

    from graphkeeper.worker.model.gguf_header import read_header

    header = read_header(path)
    if header is not None:
        mapped = np.memmap(path, mode="r")
        return GGUFFile(path, header.metadata, {name: MappedTensor(mapped, header, name) for name in header.tensors})
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, struct.error, OSError) as err:
        why = f"{type(err).__name__}: {clipped_repr(str(err))}"
        raise GGUFError(f"{path.name}: not a readable GGUF file ({why})") from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as err:
            raise GGUFError(f"{path.name}: metadata key {key!r} is unreadable: {err}") from None
    tensors = {t.name: t for t in reader.tensors}
    return GGUFFile(path, metadata, tensors)


class MappedTensor:
    """A tensor of a file ``gguf_header`` read: its type, and its data mapped as the library's
    reader maps it (made when first asked for)."""

    def __init__(self, mapped: np.ndarray, header: Any, name: str) -> None:
        self.mapped, self.header, self.name = mapped, header, name

    @property
    def tensor_type(self) -> Any:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(self.header.tensors[self.name].type_id)

    @property
    def data(self) -> np.ndarray:
        from graphkeeper.worker.model.gguf_header import tensor_data

        return tensor_data(self.mapped, self.header, self.name)


def read_config(file: GGUFFile) -> ModelConfig:
    """The decoder's hyperparameters from the ``llama.*`` metadata; refuses other architectures."""
    arch = file.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{file.path.name}: architecture {clipped_repr(str(arch))} is not supported "
                        "(this decoder serves general.architecture 'llama')")
    scaling = file.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", "") or "rope_freqs.weight" in file.tensors:
        raise GGUFError(f"{file.path.name}: RoPE scaling ({scaling}) is not supported for GGUF checkpoints")
    dim = int(file.require("llama.embedding_length"))
    n_heads = int(file.require("llama.attention.head_count"))
    vocab = file.get("llama.vocab_size") or len(file.require("tokenizer.ggml.tokens"))
    eos = file.get("tokenizer.ggml.eos_token_id")
    also_eos = [file.get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    bos = file.get("tokenizer.ggml.bos_token_id")
    try:
        return ModelConfig(
            vocab_size=int(vocab), dim=dim, n_layers=int(file.require("llama.block_count")),
            n_heads=n_heads, n_kv_heads=int(file.get("llama.attention.head_count_kv") or n_heads),
            intermediate_size=int(file.require("llama.feed_forward_length")),
            head_dim=int(file.get("llama.rope.dimension_count") or dim // n_heads),
            norm_eps=float(file.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(file.get("llama.rope.freq_base", 10000.0)),
            max_position_embeddings=int(file.get("llama.context_length", 2048)),
            tie_word_embeddings="output.weight" not in file.tensors,
            eos_token_id=int(eos) if eos is not None else 0,
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in (eos, *also_eos) if i is not None)),
            bos_token_id=int(bos) if bos is not None else 0,
        )
    except ValueError as err:
        raise GGUFError(f"{file.path.name}: {err}") from None


def hf_name(name: str) -> str | None:
    """The Hugging Face checkpoint name (without ``model.``) of a GGUF tensor, or None if unused."""
    fixed = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    if not name.startswith("blk."):
        return None
    _, layer, rest = name.split(".", 2)
    parts = {
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    return f"layers.{layer}.{parts[rest]}" if rest in parts else None


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of RoPE pairs in Q/K rows (back to rotate-half order)."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, -1).swapaxes(1, 2).reshape(rows, -1)


def dequantized(file: GGUFFile, name: str, config: ModelConfig) -> np.ndarray:
    """The tensor ``name`` as float32 (rows, columns), in Hugging Face's layout."""
    from gguf.quants import dequantize

    tensor = file.tensors[name]
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFError(f"{file.path.name}: tensor {name!r} is {kind}; supported: {', '.join(SUPPORTED_TYPES)}")
    try:
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except (ValueError, IndexError, TypeError) as err:  # a truncated mapping or a bad block count
        raise GGUFError(f"{file.path.name}: tensor {name!r} is unreadable ({err})") from None
    if name.endswith("attn_q.weight"):
        array = unpermute_rope_rows(array, config.n_heads)
    elif name.endswith("attn_k.weight"):
        array = unpermute_rope_rows(array, config.n_kv_heads)
    return array


def checkpoint_tensors(file: GGUFFile) -> dict[str, str]:
    """Hugging Face name -> GGUF name for every tensor the decoder reads."""
    out = {}
    for name in file.tensors:
        hf = hf_name(name)
        if hf is not None:
            out[hf] = name
    return out

