"""Loads model weights from a Hugging Face style directory, a GGUF file, a built-in model or a
seeded random preset.

A directory holds ``config.json`` and ``*.safetensors`` (bf16, fp16 or fp32); a ``*.gguf`` file
holds the config, the (possibly block-quantized) weights and the tokenizer (``gguf_checkpoint``);
``builtin:<name>`` is a GGUF file shipped in an installed package (``catalog``). Nothing is ever
downloaded. ``random:<preset>[@seed]`` builds seeded random weights of a named shape, for tests
and benchmarks. Weight layout changes (fusing Q/K/V and gate/up) happen here, once.

Under tensor parallelism each rank loads only its shard (``tensor_parallel``): the rows of its
query/key/value heads and of its gate/up channels, the columns of the output and down
projections that match them, read straight from the checkpoint (a safetensors row range is one
read, a column range one read per row; a GGUF tensor is dequantized whole, one at a time, then
sliced). The embedding, the norms and the LM head are loaded whole on every rank.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from graphkeeper.proto.field_checks import clipped_repr
from graphkeeper.worker.model import gguf_checkpoint as gguf_ckpt
from graphkeeper.worker.model.config import PRESETS, ModelConfig
from graphkeeper.worker.model.llama import Transformer, rope_tables
from graphkeeper.worker.model.quantization import quantize_model
from graphkeeper.worker.model.sleep_memory import SleepableRegion
from graphkeeper.worker.model.source import (
    INDEX_FILE,
    ModelSourceError,
    filesystem_errors,
    gguf_errors,
    parse_random,
    read_hf_config,
    resolve_source,
    shown,
    weight_files,
)
from graphkeeper.worker.model.tensor_parallel import SINGLE, TensorParallel, shard_config, shard_range, tp_config_error

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INIT_STD = 0.02


@dataclass
class LoadedModel:
    """A model on its device. Under tensor parallelism, one rank's shard of it: ``config`` is then
    the RANK's shapes (``shard_config``: its heads, key/value heads and MLP channels), which is
    what the runner, the attention, the KV cache and the graph buffers are sized by, so that they
    need no tensor-parallel code of their own; ``full_config`` is the whole model's."""

    model: Transformer
    config: ModelConfig
    source: str
    revision: str
    dtype: torch.dtype
    device: torch.device
    quantization: str = "none"
    #: The sleepable region holding the weights (sleep mode on CUDA; None otherwise).
    weights_region: SleepableRegion | None = None
    #: This process's rank among the ranks holding the model (``SINGLE``: the whole model).
    tp: TensorParallel = SINGLE
    #: The whole model's config (``config`` when ``tp`` is ``SINGLE``; filled in when left None).
    full_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.full_config is None:
            self.full_config = self.config

    @property
    def parameter_count(self) -> int:
        """The parameters this process holds (under tensor parallelism: its shard, the replicated
        embedding, norms and LM head included)."""
        return sum(p.numel() for p in self.model.parameters())


def load_model(
    source: str, *, device: str | torch.device, dtype: str = "auto", max_positions: int,
    revision: str = "", quantization: str = "none", tp: TensorParallel = SINGLE,
) -> LoadedModel:
    """Builds the model for ``source`` on ``device`` (under ``tp``, this rank's shard of it);
    ``revision`` defaults to a content hash, the same on every rank.

    ``quantization`` ``fp8``/``fp8-tensor`` stores the decoder projections in float8 after loading;
    under ``tp`` each rank quantizes its own shard, so a per-channel scale is the scale of the
    rows the rank holds (column-parallel QKV and gate/up: exactly TP=1's scales of those rows;
    row-parallel output and down: the scale of the rank's columns of each row, applied to the
    rank's partial sum before the all-reduce).

    The embedding and the LM head are whole on every rank rather than split by vocabulary: it is
    the simplest layout; the head runs on the sampled rows only (one per sequence in a decode
    step), so its share of a step is small; and a vocabulary-parallel head would add a gather of
    the logits (or a distributed argmax/sampling) to every step. Splitting it is a possible later
    change for models whose vocabulary makes the head's memory matter.
    """
    device = torch.device(device)
    where = resolve_source(source)
    if gguf_ckpt.is_gguf(where):
        with filesystem_errors(source), gguf_errors(source):
            file = gguf_ckpt.open_gguf(Path(where))
            config = gguf_ckpt.read_config(file)
            torch_dtype = _pick_dtype(dtype, device, None)
            model = _empty_model(_rank_config(source, config, tp), max_positions, device, torch_dtype, tp)
            _load_gguf(model, config, file)
            revision = revision or digest_files([Path(where)], names=False)
    elif source.startswith("random:"):
        preset, seed = parse_random(source)
        config = PRESETS[preset]
        torch_dtype = _pick_dtype(dtype, device, None)
        model = _empty_model(_rank_config(source, config, tp), max_positions, device, torch_dtype, tp)
        _fill_random(model, seed, device, config)
        revision = revision or _hash_text(f"{source}|{seed}|{json.dumps(config.as_dict(), sort_keys=True)}")
    else:
        with filesystem_errors(source):
            path = Path(source)
            config, hf_dtype = read_hf_config(path)
            torch_dtype = _pick_dtype(dtype, device, hf_dtype)
            model = _empty_model(_rank_config(source, config, tp), max_positions, device, torch_dtype, tp)
            _load_safetensors(model, config, path)
            revision = revision or _hash_directory(path)
    model.eval().requires_grad_(False)
    quantize_model(model, quantization)
    return LoadedModel(model, model.config, source, revision, torch_dtype, device, quantization, tp=tp,
                       full_config=config)


def _rank_config(source: str, config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The shapes this rank holds, or a ModelSourceError saying why ``tp`` cannot split the model."""
    error = tp_config_error(config, tp.size)
    if error:
        raise ModelSourceError(f"{shown(source)}: {error}")
    return shard_config(config, tp.size)


def model_dtype(source: str, dtype: str, device: str | torch.device) -> torch.dtype:
    """The dtype ``load_model`` will serve ``source`` in (read from its config, no weights)."""
    device = torch.device(device)
    where = resolve_source(source)
    hf_dtype = None
    if not where.startswith("random:") and not gguf_ckpt.is_gguf(where):
        with filesystem_errors(source):
            hf_dtype = read_hf_config(Path(where))[1]
    return _pick_dtype(dtype, device, hf_dtype)


def _pick_dtype(dtype: str, device: torch.device, hf_dtype: str | None) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ModelSourceError(f"dtype {clipped_repr(dtype)} is not one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # CPU bf16 matmuls are slow and not what tests compare against
    return DTYPES.get(hf_dtype or "bfloat16", torch.bfloat16)


def _empty_model(config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> Transformer:
    """The module (``config``: the rank's shapes under ``tp``) with uninitialised parameters
    allocated once, directly in ``dtype`` on ``device``.

    Built on the meta device and cast there (free), so no float32 copy ever exists: the
    parameters take exactly the weights' size, which is what loading fills in place. Each is
    then allocated with ``torch.empty`` of its shape, which is what ``Module.to_empty`` does but
    without its ``empty_like`` of a meta tensor: that runs torch's Python reference op, whose
    first call imports sympy and torch.fx's symbolic shapes (0.7 s), needed only to compile.
    """
    with torch.device("meta"):
        model = Transformer(config, max_positions, tp).to(dtype)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)).requires_grad_(False)
    if config.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    cos, sin = rope_tables(config, max_positions)
    # In the model's dtype once, here: a step looks rows up without a conversion kernel.
    model.rope_cos = cos.to(device=device, dtype=dtype)
    model.rope_sin = sin.to(device=device, dtype=dtype)
    return model


@torch.no_grad()
def _fill_random(model: Transformer, seed: int, device: torch.device, config: ModelConfig | None = None) -> None:
    """Seeded normal weights (norms one). Under tensor parallelism every rank draws each whole
    tensor of the whole model (``config``) in the same order from the same generator, one tensor
    at a time, and keeps its part: the shards are exactly the one-rank model's weights, split."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tp, config = model.tp, config or model.config
    full_shapes = _full_shapes(config) if tp.enabled else {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif not tp.enabled:
            param.normal_(0.0, INIT_STD, generator=generator)
        else:
            full = torch.empty(full_shapes[name], dtype=param.dtype, device=device)
            param.copy_(rank_part(name, full.normal_(0.0, INIT_STD, generator=generator), config, tp))


def _full_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """Each parameter's shape in the one-rank model of ``config`` (built on the meta device)."""
    with torch.device("meta"):
        return {name: p.shape for name, p in Transformer(config, 1).named_parameters()}


def rank_part(name: str, full: Tensor, config: ModelConfig, tp: TensorParallel) -> Tensor:
    """Rank ``tp.rank``'s part of the one-rank model's parameter ``name`` (``full``; ``config`` is
    the whole model's): its query, key and value heads' rows of the fused QKV, its channels' rows
    of the fused gate/up, the matching columns of the output and down projections; anything else
    whole. A view where it can be (the fused weights' parts are concatenated)."""
    if name.endswith("attention.wqkv.weight"):
        q_size, kv_size = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        q, k, v = full.split([q_size, kv_size, kv_size])
        return torch.cat([q[shard_range(q_size, tp)], k[shard_range(kv_size, tp)], v[shard_range(kv_size, tp)]])
    if name.endswith("feed_forward.w13.weight"):
        gate, up = full.split(config.intermediate_size)
        rows = shard_range(config.intermediate_size, tp)
        return torch.cat([gate[rows], up[rows]])
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return full[:, shard_range(full.shape[1], tp)]
    return full


# --- safetensors, one tensor at a time -------------------------------------------------------
#
# The format is an 8-byte little-endian header length, a JSON header mapping each name to its
# dtype, shape and byte range, then the data. The loader reads each tensor's bytes with plain
# file reads straight into its parameter (or into a staging buffer of that one tensor when the
# dtype or the device differs) instead of memory-mapping whole files: mapped pages count
# towards the process's resident memory for as long as the file stays open, which would double
# the host peak while loading.

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor lives: its file, byte range, dtype and shape."""

    file: Path
    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, by checkpoint name, without reading their data."""
    try:
        with file.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelSourceError(f"{shown(file)}: not a safetensors file (too short)")
            size = int.from_bytes(raw, "little")
            if size > _MAX_HEADER_BYTES:
                raise ModelSourceError(f"{shown(file)}: safetensors header of {size} bytes is implausible")
            header = json.loads(f.read(size).decode("utf-8"))
        base = 8 + size
        out = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _ST_DTYPES:
                raise ModelSourceError(f"{shown(file)}: tensor {clipped_repr(name)} has unsupported dtype "
                                       f"{clipped_repr(str(meta['dtype']))}")
            start, end = meta["data_offsets"]
            out[name] = TensorEntry(file, base + start, base + end, _ST_DTYPES[meta["dtype"]], tuple(meta["shape"]))
        return out
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise ModelSourceError(f"{shown(file)}: unreadable safetensors header: {err!r}") from None


def checkpoint_index(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint by its name without the ``model.`` prefix (headers only)."""
    entries: dict[str, TensorEntry] = {}
    for file in weight_files(path):
        for key, entry in read_safetensors_header(file).items():
            entries[key.removeprefix("model.")] = entry
    return entries


class _TensorReader:
    """Reads checkpoint tensors into destination tensors, one at a time, files kept open."""

    def __init__(self, path: Path, entries: dict[str, TensorEntry]) -> None:
        self.path = path
        self.entries = entries
        self._files: dict[Path, object] = {}

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def entry(self, name: str, shape: tuple[int, ...]) -> TensorEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise ModelSourceError(f"{shown(self.path)}: tensor {clipped_repr(name)} missing from the checkpoint")
        if entry.shape != shape:
            raise ModelSourceError(f"{shown(self.path)}: tensor {clipped_repr(name)} has shape "
                                   f"{clipped_repr(str(list(entry.shape)))}, expected {list(shape)}")
        if entry.end - entry.start != math.prod(shape) * entry.dtype.itemsize:
            raise ModelSourceError(
                f"{shown(self.path)}: tensor {clipped_repr(name)} has a byte range that does not match its shape")
        return entry

    def read_into(self, name: str, dest: Tensor, part: Part | None = None) -> None:
        """Fills ``dest`` with the checkpoint tensor ``name``, or with its ``part`` (the rows or
        columns this rank holds: only those bytes are read), converting its dtype."""
        entry = self.entry(name, part.full_shape(dest.shape) if part else tuple(dest.shape))
        f = self._files.get(entry.file)
        if f is None:
            f = self._files[entry.file] = entry.file.open("rb", buffering=0)
        direct = dest.device.type == "cpu" and dest.dtype == entry.dtype and dest.is_contiguous()
        staging = dest if direct else torch.empty(tuple(dest.shape), dtype=entry.dtype)
        buffer = memoryview(staging.view(-1).view(torch.uint8).numpy())
        for start, into in part_byte_ranges(entry, part, len(buffer)):
            self._read_exactly(f, start, buffer[into], entry.file, name)
        if not direct:
            dest.copy_(staging)

    @staticmethod
    def _read_exactly(f, start: int, buffer: memoryview, file: Path, name: str) -> None:
        f.seek(start)
        done = 0
        while done < len(buffer):
            n = f.readinto(buffer[done:])
            if not n:
                raise ModelSourceError(f"{shown(file)}: truncated while reading {clipped_repr(name)}")
            done += n


@dataclass(frozen=True)
class Part:
    """This rank's part of a checkpoint tensor: dimension ``dim`` (0: rows, 1: columns) cut into
    ``tp.size`` equal parts, of which it holds part ``tp.rank``."""

    dim: int
    tp: TensorParallel

    def full_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """The whole tensor's shape, given the part's."""
        return tuple(n * self.tp.size if d == self.dim else n for d, n in enumerate(shape))

    def of(self, full: Tensor) -> Tensor:
        """The part of ``full`` (a view)."""
        return full.narrow(self.dim, shard_range(full.shape[self.dim], self.tp).start,
                           full.shape[self.dim] // self.tp.size)


def part_byte_ranges(entry: TensorEntry, part: Part | None, size: int) -> list[tuple[int, slice]]:
    """(file offset, destination byte slice) of each read that fills a part of ``size`` bytes:
    one for a whole tensor or a range of rows, one per row for a range of columns (pure)."""
    if part is None:
        return [(entry.start, slice(0, size))]
    rows = math.prod(entry.shape[:1]) if len(entry.shape) > 1 else 1
    row_bytes = (entry.end - entry.start) // rows
    if part.dim == 0:
        return [(entry.start + part.tp.rank * size, slice(0, size))]
    piece = row_bytes // part.tp.size  # this rank's columns of one row
    first = entry.start + part.tp.rank * piece
    return [(first + i * row_bytes, slice(i * piece, (i + 1) * piece)) for i in range(rows)]


@torch.no_grad()
def _load_safetensors(model: Transformer, config: ModelConfig, path: Path) -> None:
    """Fills every parameter in place; fused Q/K/V and gate/up rows are written slice by slice."""
    reader = _TensorReader(path, checkpoint_index(path))
    try:
        _fill_llama(model, config, reader.read_into)
    finally:
        reader.close()


@torch.no_grad()
def _load_gguf(model: Transformer, config: ModelConfig, file: gguf_ckpt.GGUFFile) -> None:
    """Fills every parameter from the GGUF tensors, dequantized to float32 and cast on copy (under
    tensor parallelism, dequantized whole, one tensor at a time, and this rank's part copied)."""
    names = gguf_ckpt.checkpoint_tensors(file)

    def read_into(name: str, dest: Tensor, part: Part | None = None) -> None:
        if name not in names:
            raise ModelSourceError(f"{shown(file.path)}: tensor for {clipped_repr(name)} missing from the GGUF file")
        array = gguf_ckpt.dequantized(file, names[name], config)
        expected = part.full_shape(dest.shape) if part else tuple(dest.shape)
        if tuple(array.shape) != expected:
            raise ModelSourceError(f"{shown(file.path)}: tensor {clipped_repr(names[name])} has shape "
                                   f"{list(array.shape)}, expected {list(expected)}")
        full = torch.from_numpy(np.require(array, requirements='W'))
        dest.copy_(part.of(full) if part else full)

    _fill_llama(model, config, read_into)


def _fill_llama(model: Transformer, config: ModelConfig, read_into: Callable[..., None]) -> None:
    """Fills every parameter through ``read_into(hf_name, dest, part=None)``; fused Q/K/V and
    gate/up rows are written slice by slice. One walk over the model for every checkpoint format.
    ``config`` is the whole model's; under tensor parallelism ``part`` names the rows (column-
    parallel QKV and gate/up) or columns (row-parallel output and down) this rank holds."""
    tp = model.tp
    rows, cols = (Part(0, tp), Part(1, tp)) if tp.enabled else (None, None)
    read_into("embed_tokens.weight", model.tok_embeddings.weight)
    read_into("norm.weight", model.norm.weight)
    if not config.tie_word_embeddings:
        read_into("lm_head.weight", model.output.weight)
    mine = model.config  # this rank's shapes
    q_size, kv_size = mine.n_heads * mine.head_dim, mine.n_kv_heads * mine.head_dim
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        q, k, v = layer.attention.wqkv.weight.split([q_size, kv_size, kv_size])
        for name, dest in zip("qkv", (q, k, v), strict=True):
            read_into(attn + f"{name}_proj.weight", dest, rows)
        read_into(attn + "o_proj.weight", layer.attention.wo.weight, cols)
        gate, up = layer.feed_forward.w13.weight.split(mine.intermediate_size)
        read_into(mlp + "gate_proj.weight", gate, rows)
        read_into(mlp + "up_proj.weight", up, rows)
        read_into(mlp + "down_proj.weight", layer.feed_forward.w2.weight, cols)
        read_into(p + "input_layernorm.weight", layer.attention_norm.weight)
        read_into(p + "post_attention_layernorm.weight", layer.ffn_norm.weight)


def _hash_text(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _hash_directory(path: Path) -> str:
    """A content hash of config.json and the weights: a changed file is a new revision."""
    index = [path / INDEX_FILE] if (path / INDEX_FILE).is_file() else []
    return digest_files([path / "config.json", *index, *weight_files(path)])


def digest_files(files: list[Path], names: bool = True) -> str:
    """sha256 over each file's name (unless ``names`` is false) and bytes, read through one reused
    1 MiB buffer (hashing adds nothing noticeable to the load's peak). A GGUF's revision is the
    digest of its bytes alone: a renamed file is the same model."""
    digest = hashlib.sha256()
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    for file in files:
        if names:
            digest.update(file.name.encode())
        with file.open("rb", buffering=0) as f:
            while n := f.readinto(buffer):
                digest.update(view[:n])
    return "sha256:" + digest.hexdigest()[:16]


def save_hf_directory(model: Transformer, path: Path) -> None:
    """Writes ``model`` as a Hugging Face Llama directory (unfused names), for tests and tools."""
    from safetensors.torch import save_file

    if model.tp.enabled:
        raise ValueError("save_hf_directory writes a whole model; this is one tensor-parallel rank's shard")
    config = model.config
    path.mkdir(parents=True, exist_ok=True)
    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": model.tok_embeddings.weight,
        "model.norm.weight": model.norm.weight,
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = model.output.weight
    q_size, kv_size = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.attention.wqkv.weight.split([q_size, kv_size, kv_size])
        gate, up = layer.feed_forward.w13.weight.split(config.intermediate_size)
        out |= {
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.attention.wo.weight,
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.feed_forward.w2.weight,
            p + "input_layernorm.weight": layer.attention_norm.weight,
            p + "post_attention_layernorm.weight": layer.ffn_norm.weight,
        }
    save_file({k: t.detach().contiguous().cpu() for k, t in out.items()}, str(path / "model.safetensors"))
    hf = config.to_hf() | {"torch_dtype": str(model.tok_embeddings.weight.dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(hf, indent=2))
