"""Model hyperparameters, with named presets for the shapes people actually run.

The field names follow gpt-fast; ``from_hf`` reads a Hugging Face ``config.json`` of a Llama-family
model so that a checkpoint directory and a ``random:<preset>`` source produce the same object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3 frequency scaling: factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings. Empty means plain RoPE.
    rope_scaling: dict[str, float] = field(default_factory=dict)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    eos_token_id: int = 0
    bos_token_id: int = 0
    #: Every id that ends a generation (config.json may list several: Llama 3 Instruct has three);
    #: empty means just ``eos_token_id``.
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            object.__setattr__(self, "eos_token_ids", (self.eos_token_id,))
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def to_hf(self) -> dict[str, Any]:
        """The equivalent ``config.json`` for ``transformers.LlamaConfig``."""
        hf: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.intermediate_size,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.bos_token_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
        if self.rope_scaling:
            scaling = {k: v for k, v in self.rope_scaling.items()}
            scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
            hf["rope_scaling"] = {"rope_type": "llama3", **scaling}
        return hf

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a Llama-family ``config.json``; refuses features this decoder does not have."""
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("config.json: attention or MLP biases are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported")
        scaling = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"config.json: rope scaling {rope_type!r} is not supported")
        theta = hf.get("rope_theta", scaling.get("rope_theta", 10000.0))
        llama3 = {}
        if rope_type == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            llama3 = {k: float(scaling[k]) for k in keys}
        eos = hf.get("eos_token_id", 0)
        n_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            intermediate_size=hf["intermediate_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=llama3,
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_id=eos[0] if isinstance(eos, list) else int(eos or 0),
            eos_token_ids=tuple(int(i) for i in eos) if isinstance(eos, list) else (),
            bos_token_id=int(hf.get("bos_token_id") or 0),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_LLAMA3_SCALING = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192.0,
}

PRESETS: dict[str, ModelConfig] = {
    # Small enough for CPU tests, with every feature on: GQA, Llama 3 scaling, untied head.
    "tiny": ModelConfig(
        vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
        rope_scaling=_LLAMA3_SCALING, max_position_embeddings=16384, eos_token_id=2, bos_token_id=1,
    ),
    # Llama 3.2 1B shape.
    "llama-1b": ModelConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
        intermediate_size=8192, rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
        tie_word_embeddings=True, eos_token_id=128001, bos_token_id=128000,
    ),
    # Llama 3.1 8B shape.
    "llama-8b": ModelConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        intermediate_size=14336, rope_scaling={**_LLAMA3_SCALING, "factor": 8.0},
        max_position_embeddings=131072, eos_token_id=128001, bos_token_id=128000,
    ),
}
