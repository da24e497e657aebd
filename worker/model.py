"""A compact Llama-family decoder: RMSNorm, RoPE with Llama 3 scaling, grouped-query attention,
SwiGLU MLP, tied or untied embeddings.

The model is plain data flow over a flat batch of tokens (``[T]`` ids and positions, any mix of
sequences). Attention is not computed here: the caller passes an ``attend(layer, q, k, v)``
function, because how keys and values reach the cache and which tokens see which is the
serving engine's business. The forward pass is written as pieces between attention calls
(``first_piece``, ``middle_piece``, ``last_piece``) so that PIECEWISE graphs can record exactly
those pieces and nothing is written twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphkeeper.worker.config import ModelConfig

#: attend(layer_index, q [T, n_heads, head_dim], k [T, n_kv, head_dim], v) -> [T, n_heads * head_dim]
AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse RoPE frequencies, with Llama 3 scaling when the config asks for it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables ``[max_positions, head_dim]`` in float32.

    HF's half-rotation is ``x * cos + cat(-x2, x1) * sin``; with the sign folded into the first
    half of ``sin`` it becomes ``x * cos + roll(x, d/2) * sin_signed``: three kernels, not five.
    """
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    half = sin.shape[-1] // 2
    return emb.cos(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotates ``x [T, heads, head_dim]`` by per-token ``cos``/``sin_signed`` ``[T, head_dim]``."""
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos[:, None, :], rolled, sin_signed[:, None, :])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    """Projections around attention; Q, K and V live fused in one matrix (fused at load time)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv_out, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q ``[T, heads, d]``, k and v ``[T, kv_heads, d]``; q and k are rotated together."""
        heads = self.wqkv(x).view(x.shape[0], self.n_heads + 2 * self.n_kv, self.head_dim)
        qk = apply_rope(heads[:, : self.n_heads + self.n_kv], cos, sin)
        return qk[:, : self.n_heads], qk[:, self.n_heads :], heads[:, self.n_heads + self.n_kv :]


class FeedForward(nn.Module):
    """SwiGLU; gate and up projections fused in ``w13`` at load time."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.w13 = nn.Linear(config.dim, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.intermediate, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def before_attention(self, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.attention.qkv(self.attention_norm(h), cos, sin)

    def after_attention(self, h: Tensor, attn_out: Tensor) -> Tensor:
        h = h + self.attention.wo(attn_out)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(config, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # The pieces between attention calls. Each returns the residual stream and the next
    # layer's q, k, v; PIECEWISE graphs record each piece for a padded token count.

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token cos and signed sin, looked up once per step (or once per piece)."""
        dtype = self.tok_embeddings.weight.dtype
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    def first_piece(self, tokens: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
        h = self.tok_embeddings(tokens)
        return (h, *self.layers[0].before_attention(h, cos, sin))

    def middle_piece(self, layer: int, h: Tensor, attn_out: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
        """Finishes ``layer - 1`` and prepares attention for ``layer``."""
        h = self.layers[layer - 1].after_attention(h, attn_out)
        return (h, *self.layers[layer].before_attention(h, cos, sin))

    def last_piece(self, h: Tensor, attn_out: Tensor) -> Tensor:
        """Finishes the last layer and applies the final norm; returns hidden states."""
        return self.norm(self.layers[-1].after_attention(h, attn_out))

    def forward(self, tokens: Tensor, positions: Tensor, attend: AttendFn) -> Tensor:
        """Hidden states ``[T, dim]`` after the final norm, for a flat batch of tokens."""
        cos, sin = self.rope(positions)
        h, q, k, v = self.first_piece(tokens, cos, sin)
        for layer in range(1, self.config.n_layers):
            h, q, k, v = self.middle_piece(layer, h, attend(layer - 1, q, k, v), cos, sin)
        return self.last_piece(h, attend(self.config.n_layers - 1, q, k, v))

    def logits(self, hidden: Tensor) -> Tensor:
        """Float32 logits for the rows of ``hidden`` that need a next token."""
        return self.output(hidden).float()
