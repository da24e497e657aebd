"""Loads model weights from a Hugging Face style directory or from a seeded random preset.

A directory holds ``config.json`` and ``*.safetensors`` (bf16, fp16 or fp32); nothing is ever
downloaded. ``random:<preset>[@seed]`` builds seeded random weights of a named shape, for tests
and benchmarks. Weight layout changes (fusing Q/K/V and gate/up) happen here, once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from graphkeeper.worker.config import PRESETS, ModelConfig
from graphkeeper.worker.model import Transformer, rope_tables

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SEED = 0
INIT_STD = 0.02


class ModelSourceError(ValueError):
    """The model source cannot be loaded (missing files, unknown preset, bad config)."""


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    source: str
    revision: str
    dtype: torch.dtype
    device: torch.device

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def load_model(
    source: str, *, device: str | torch.device, dtype: str = "auto", max_positions: int,
    revision: str = "",
) -> LoadedModel:
    """Builds the model for ``source`` on ``device``; ``revision`` defaults to a content hash."""
    device = torch.device(device)
    if source.startswith("random:"):
        preset, seed = _parse_random(source)
        config = PRESETS[preset]
        torch_dtype = _pick_dtype(dtype, device, None)
        model = _empty_model(config, max_positions, device, torch_dtype)
        _fill_random(model, seed, device)
        revision = revision or _hash_text(f"{source}|{seed}|{json.dumps(config.as_dict(), sort_keys=True)}")
    else:
        path = Path(source)
        config, hf_dtype = _read_config(path)
        torch_dtype = _pick_dtype(dtype, device, hf_dtype)
        model = _empty_model(config, max_positions, device, torch_dtype)
        _load_safetensors(model, config, path)
        revision = revision or _hash_directory(path)
    model.eval().requires_grad_(False)
    return LoadedModel(model, config, source, revision, torch_dtype, device)


def _parse_random(source: str) -> tuple[str, int]:
    spec = source.removeprefix("random:")
    preset, _, seed_text = spec.partition("@")
    if preset not in PRESETS:
        raise ModelSourceError(f"unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    try:
        seed = int(seed_text) if seed_text else DEFAULT_SEED
    except ValueError:
        raise ModelSourceError(f"seed {seed_text!r} in {source!r} is not an integer") from None
    return preset, seed


def _pick_dtype(dtype: str, device: torch.device, hf_dtype: str | None) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ModelSourceError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # CPU bf16 matmuls are slow and not what tests compare against
    return DTYPES.get(hf_dtype or "bfloat16", torch.bfloat16)


def _empty_model(config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config, max_positions)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    cos, sin = rope_tables(config, max_positions)
    model.rope_cos = cos.to(device)
    model.rope_sin = sin.to(device)
    return model


@torch.no_grad()
def _fill_random(model: Transformer, seed: int, device: torch.device) -> None:
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, INIT_STD, generator=generator)


def _read_config(path: Path) -> tuple[ModelConfig, str | None]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"{path}: no config.json (expected a Hugging Face style directory)")
    hf = json.loads(config_file.read_text())
    try:
        config = ModelConfig.from_hf(hf)
    except (KeyError, ValueError) as err:
        raise ModelSourceError(f"{config_file}: {err}") from None
    return config, hf.get("torch_dtype") or hf.get("dtype")


def _hf_tensors(path: Path) -> dict[str, Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"{path}: no *.safetensors files")
    tensors: dict[str, Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[key.removeprefix("model.")] = f.get_tensor(key)
    return tensors


@torch.no_grad()
def _load_safetensors(model: Transformer, config: ModelConfig, path: Path) -> None:
    hf = _hf_tensors(path)

    def take(name: str) -> Tensor:
        if name not in hf:
            raise ModelSourceError(f"{path}: tensor {name!r} missing from the checkpoint")
        return hf[name]

    model.tok_embeddings.weight.copy_(take("embed_tokens.weight"))
    model.norm.weight.copy_(take("norm.weight"))
    if not config.tie_word_embeddings:
        model.output.weight.copy_(take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = [take(attn + f"{n}_proj.weight") for n in "qkv"]
        layer.attention.wqkv.weight.copy_(torch.cat(qkv, dim=0))
        layer.attention.wo.weight.copy_(take(attn + "o_proj.weight"))
        w13 = [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]
        layer.feed_forward.w13.weight.copy_(torch.cat(w13, dim=0))
        layer.feed_forward.w2.weight.copy_(take(mlp + "down_proj.weight"))
        layer.attention_norm.weight.copy_(take(p + "input_layernorm.weight"))
        layer.ffn_norm.weight.copy_(take(p + "post_attention_layernorm.weight"))


def _hash_text(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _hash_directory(path: Path) -> str:
    """A content hash of config.json and the weights: a changed file is a new revision."""
    digest = hashlib.sha256()
    for file in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()[:16]


def save_hf_directory(model: Transformer, path: Path) -> None:
    """Writes ``model`` as a Hugging Face Llama directory (unfused names), for tests and tools."""
    from safetensors.torch import save_file

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
