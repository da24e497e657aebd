"""A compact Llama-family decoder: RMSNorm, RoPE with Llama 3 scaling, grouped-query attention,
SwiGLU MLP, tied or untied embeddings.

The model is plain data flow over a flat batch of tokens (``[T]`` ids and positions, any mix of
sequences). Attention is not computed here: the caller passes an ``attend(layer, q, k, v)``
function, because how keys and values reach the cache and which tokens see which is the
serving engine's business. The forward pass is written as pieces between attention calls
(``first_piece``, ``middle_piece``, ``last_piece``) so that PIECEWISE graphs can record exactly
those pieces and nothing is written twice. The pieces are pure functions of tensors, weights
included (``make_pieces``), so that one ``torch.compile`` of each serves every layer and batch
size; the residual add is fused with the RMSNorm that follows it.

Under tensor parallelism (``tensor_parallel``) the module is built with one rank's shapes
(``shard_config``): the pieces run on the rank's heads and channels, and the partial sums of the
output and down projections are all-reduced inside the pieces, before their residual adds, so a
piece stays one pure function whether it runs eagerly, compiled or recorded in a CUDA graph.
With one rank the pieces hold no collective at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphkeeper.worker.kernels import choice, norm_kernel, row_kernel
from graphkeeper.worker.model.config import ModelConfig
from graphkeeper.worker.model.tensor_parallel import SINGLE, TensorParallel, all_reduce

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
        return choice.rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """A bias-free projection whose weight is bf16/fp16/fp32, or fp8 with a ``scale`` (per output
    channel or per tensor); ``choice.linear`` computes it either way."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.register_buffer("scale", None)

    def forward(self, x: Tensor) -> Tensor:
        return choice.linear(x, self.weight, self.scale)


class Attention(nn.Module):
    """Projections around attention; Q, K and V live fused in one matrix (fused at load time)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = Linear(config.dim, qkv_out)
        self.wo = Linear(config.n_heads * config.head_dim, config.dim)


class FeedForward(nn.Module):
    """SwiGLU; gate and up projections fused in ``w13`` at load time."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w13 = Linear(config.dim, 2 * config.intermediate_size)
        self.w2 = Linear(config.intermediate_size, config.dim)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def tail_weights(self) -> tuple[Tensor | None, ...]:
        """What finishing this layer after attention reads: wo, the MLP's norm, w13, w2."""
        a, f = self.attention, self.feed_forward
        return (a.wo.weight, a.wo.scale, self.ffn_norm.weight, f.w13.weight, f.w13.scale, f.w2.weight, f.w2.scale)

    def head_weights(self) -> tuple[Tensor | None, ...]:
        """What preparing this layer's attention reads: its norm and the fused QKV projection."""
        return (self.attention_norm.weight, self.attention.wqkv.weight, self.attention.wqkv.scale)


@dataclass(frozen=True)
class PieceFunctions:
    """The three step functions between attention calls, over tensors only (weights included)."""

    first: Callable[..., tuple[Tensor, ...]]
    middle: Callable[..., tuple[Tensor, ...]]
    last: Callable[..., Tensor]


def make_pieces(config: ModelConfig, add_rms_norm: Callable = norm_kernel.reference,
                tp: TensorParallel = SINGLE) -> PieceFunctions:
    """The step's pieces for ``config`` (one rank's shapes under ``tp``) as pure functions;
    ``add_rms_norm`` is the fused kernel, or the plain ops that Inductor fuses when the pieces are
    compiled. Under ``tp`` the row-parallel projections' partial sums are all-reduced before the
    residual add (``reduced``); with one rank ``reduced`` is the projection alone."""
    n_heads, n_kv, head_dim = config.n_heads, config.n_kv_heads, config.head_dim
    eps, inter = config.norm_eps, config.intermediate_size

    def reduced(x: Tensor, w: Tensor, s: Tensor | None) -> Tensor:
        out = choice.linear(x, w, s)
        return all_reduce(out, tp) if tp.enabled else out

    def qkv(x: Tensor, cos: Tensor, sin: Tensor, wqkv: Tensor, wqkv_s: Tensor | None) -> tuple[Tensor, ...]:
        heads = choice.linear(x, wqkv, wqkv_s).view(x.shape[0], n_heads + 2 * n_kv, head_dim)
        qk = apply_rope(heads[:, : n_heads + n_kv], cos, sin)
        return qk[:, :n_heads], qk[:, n_heads:], heads[:, n_heads + n_kv:]

    def finish(h: Tensor, attn_out: Tensor, wo, wo_s, ffn_norm, w13, w13_s, w2, w2_s,
               next_norm) -> tuple[Tensor, Tensor]:
        """Layer tail: residual+norm, SwiGLU MLP, residual+norm with the next norm's weight."""
        h, x = add_rms_norm(h, reduced(attn_out, wo, wo_s), ffn_norm, eps)
        gate, up = choice.linear(x, w13, w13_s).split(inter, dim=-1)
        return add_rms_norm(h, reduced(F.silu(gate) * up, w2, w2_s), next_norm, eps)

    def first(tokens: Tensor, cos: Tensor, sin: Tensor, embedding: Tensor, norm: Tensor, wqkv: Tensor,
              wqkv_s: Tensor | None) -> tuple[Tensor, ...]:
        h = F.embedding(tokens, embedding)
        return (h, *qkv(choice.rms_norm(h, norm, eps), cos, sin, wqkv, wqkv_s))

    def middle(h: Tensor, attn_out: Tensor, cos: Tensor, sin: Tensor, wo, wo_s, ffn_norm, w13, w13_s, w2, w2_s,
               norm, wqkv, wqkv_s) -> tuple[Tensor, ...]:
        h, x = finish(h, attn_out, wo, wo_s, ffn_norm, w13, w13_s, w2, w2_s, norm)
        return (h, *qkv(x, cos, sin, wqkv, wqkv_s))

    def last(h: Tensor, attn_out: Tensor, wo, wo_s, ffn_norm, w13, w13_s, w2, w2_s, final_norm) -> Tensor:
        return finish(h, attn_out, wo, wo_s, ffn_norm, w13, w13_s, w2, w2_s, final_norm)[1]

    return PieceFunctions(first, middle, last)


def make_row_pieces(config: ModelConfig, tp: TensorParallel = SINGLE) -> PieceFunctions:
    """The same pieces for a one-token step, as four fused projections per layer
    (``row_kernel``): norm+QKV+RoPE, output projection+residual, norm+gate/up+SiLU, down
    projection+residual. Same arguments and results as ``make_pieces``'s. Under ``tp`` the
    residual cannot be fused into a row-parallel projection (it must be added once, after the
    all-reduce), so those two projections run plain and the add follows the all-reduce."""
    n_heads, n_kv, head_dim, eps = config.n_heads, config.n_kv_heads, config.head_dim, config.norm_eps
    rotated = (n_heads + n_kv) * head_dim
    row = row_kernel.row_linear

    def qkv(h: Tensor, cos: Tensor, sin: Tensor, norm: Tensor, wqkv: Tensor, wqkv_s: Tensor | None):
        heads = row(h, wqkv, wqkv_s, norm=norm, eps=eps, rope=(cos, sin, rotated, head_dim))
        heads = heads.view(1, n_heads + 2 * n_kv, head_dim)
        return heads[:, :n_heads], heads[:, n_heads: n_heads + n_kv], heads[:, n_heads + n_kv:]

    def finish(h: Tensor, attn_out: Tensor, wo, wo_s, ffn_norm, w13, w13_s, w2, w2_s) -> Tensor:
        if tp.enabled:
            h = h + all_reduce(row(attn_out, wo, wo_s), tp)
            return h + all_reduce(row(row(h, w13, w13_s, norm=ffn_norm, eps=eps, glu=True), w2, w2_s), tp)
        h = row(attn_out, wo, wo_s, residual=h)
        return row(row(h, w13, w13_s, norm=ffn_norm, eps=eps, glu=True), w2, w2_s, residual=h)

    def first(tokens: Tensor, cos: Tensor, sin: Tensor, embedding: Tensor, norm: Tensor, wqkv: Tensor,
              wqkv_s: Tensor | None) -> tuple[Tensor, ...]:
        h = F.embedding(tokens, embedding)
        return (h, *qkv(h, cos, sin, norm, wqkv, wqkv_s))

    def middle(h: Tensor, attn_out: Tensor, cos: Tensor, sin: Tensor, wo, wo_s, ffn_norm, w13, w13_s, w2, w2_s,
               norm, wqkv, wqkv_s) -> tuple[Tensor, ...]:
        h = finish(h, attn_out, wo, wo_s, ffn_norm, w13, w13_s, w2, w2_s)
        return (h, *qkv(h, cos, sin, norm, wqkv, wqkv_s))

    def last(h: Tensor, attn_out: Tensor, wo, wo_s, ffn_norm, w13, w13_s, w2, w2_s, final_norm) -> Tensor:
        return norm_kernel.rms_norm(finish(h, attn_out, wo, wo_s, ffn_norm, w13, w13_s, w2, w2_s), final_norm, eps)

    return PieceFunctions(first, middle, last)


def row_pieces_fit(config: ModelConfig, dtype: torch.dtype) -> bool:
    """Whether ``make_row_pieces`` runs this model in ``dtype``: every reduction fits one tile."""
    reductions = (config.dim, config.n_heads * config.head_dim, config.intermediate_size)
    return config.head_dim % 2 == 0 and all(row_kernel.supports(k, dtype) for k in reductions)


class Transformer(nn.Module):
    """The decoder; under ``tp``, one rank's shard of it: ``config`` is then the rank's shapes
    (``shard_config``), and the embedding, norms and LM head are whole on every rank."""

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        # Parameters and RoPE tables are left uninitialised here, as ``Linear``'s are: the model is
        # built on the meta device and the loader fills them all (``loader._empty_model``).
        # Computing on the meta device (an init's ``normal_``, ``rope_tables``' arithmetic) goes
        # through torch's reference ops, which import torch._dynamo (1 s) that a step without
        # compilation never needs.
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim,
                                           _weight=torch.empty(config.vocab_size, config.dim))
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = Linear(config.dim, config.vocab_size)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(max_positions, config.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, config.head_dim), persistent=False)
        self.use_pieces(make_pieces(config, tp=tp), "torch")

    def use_pieces(self, pieces: PieceFunctions, kernels: str, row_pieces: PieceFunctions | None = None) -> None:
        """Installs the step functions (plain, fused kernels, or compiled) and, optionally, the
        one-token step's (``make_row_pieces``); ``kernels`` names them."""
        self.pieces = pieces
        self.row_pieces = row_pieces
        self.kernels = kernels

    def _for(self, rows: int) -> PieceFunctions:
        """The pieces a step of ``rows`` tokens runs (decided by shape, so a graph recorded at a
        size replays what an eager step of that size runs)."""
        return self.row_pieces if rows == 1 and self.row_pieces is not None else self.pieces

    # The pieces between attention calls. Each returns the residual stream and the next
    # layer's q, k, v; PIECEWISE graphs record each piece for a padded token count.

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token cos and signed sin, looked up once per step (or once per piece)."""
        dtype = self.tok_embeddings.weight.dtype
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    def first_piece(self, tokens: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
        pieces = self._for(tokens.shape[0])
        return pieces.first(tokens, cos, sin, self.tok_embeddings.weight, *self.layers[0].head_weights())

    def middle_piece(self, layer: int, h: Tensor, attn_out: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
        """Finishes ``layer - 1`` and prepares attention for ``layer``."""
        return self._for(h.shape[0]).middle(h, attn_out, cos, sin, *self.layers[layer - 1].tail_weights(),
                                  *self.layers[layer].head_weights())

    def last_piece(self, h: Tensor, attn_out: Tensor) -> Tensor:
        """Finishes the last layer and applies the final norm; returns hidden states."""
        return self._for(h.shape[0]).last(h, attn_out, *self.layers[-1].tail_weights(), self.norm.weight)

    def forward(self, tokens: Tensor, positions: Tensor, attend: AttendFn) -> Tensor:
        """Hidden states ``[T, dim]`` after the final norm, for a flat batch of tokens."""
        cos, sin = self.rope(positions)
        h, q, k, v = self.first_piece(tokens, cos, sin)
        for layer in range(1, self.config.n_layers):
            h, q, k, v = self.middle_piece(layer, h, attend(layer - 1, q, k, v), cos, sin)
        return self.last_piece(h, attend(self.config.n_layers - 1, q, k, v))

    def head(self, hidden: Tensor) -> Tensor:
        """The LM head's logits in the model's dtype (what ``sampling.sample`` takes)."""
        return self.output(hidden)

    def logits(self, hidden: Tensor) -> Tensor:
        """Float32 logits for the rows of ``hidden`` that need a next token."""
        return self.head(hidden).float()
