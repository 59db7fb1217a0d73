"""Dense reference blocks, written plainly: no parallel code here.

Each module has `reset_parameters(generator)` so that a dense model and, through the plan, its TP
twin start from the same weights. Activations are `[seq, batch, hidden]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck.models.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * scale * weight


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))

    def reset_parameters(self, g: torch.Generator) -> None:
        with torch.no_grad():
            self.weight.copy_(1.0 + 0.05 * torch.randn(self.weight.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def init_gate_up(
    weight: torch.Tensor, g: torch.Generator, hidden: int, ffn: int, layout: str
) -> None:
    """Draw the gate/up weight as the seed does ([2,
    ffn, hidden] order) whatever the stored layout."""
    w = torch.randn(2, ffn, hidden, generator=g) / hidden**0.5
    with torch.no_grad():
        weight.copy_(w if layout == "stacked" else w.reshape(2 * ffn, hidden))


class SwiGLU(nn.Module):
    """silu(x @ W_gate^T) * (x @ W_up^T). weight: [2, ffn, hidden] ("stacked") or [gate; up] =
    [2*ffn, hidden] ("concat")."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        shape = (
            (2, cfg.ffn, cfg.hidden)
            if cfg.gate_up_layout == "stacked"
            else (2 * cfg.ffn, cfg.hidden)
        )
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype))

    def reset_parameters(self, g: torch.Generator) -> None:
        init_gate_up(self.weight, g, self.cfg.hidden, self.cfg.ffn, self.cfg.gate_up_layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_gate, w_up = (
            self.weight.unbind(0) if self.weight.dim() == 3 else self.weight.chunk(2, dim=0)
        )
        return swiglu(x, w_gate, w_up)  # [s, b, ffn]


class Linear(nn.Linear):
    """nn.Linear with a seeded init: weight ~ N(0, 1/in), bias ~ 0.01 N(0, 1)."""

    def reset_parameters(self, g: torch.Generator | None = None) -> None:
        if g is None:  # called by nn.Linear.__init__; real values come from a generator later
            return
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=g) / self.in_features**0.5)
            if self.bias is not None:
                self.bias.copy_(0.01 * torch.randn(self.bias.shape, generator=g))


class DenseMLP(nn.Module):
    """The seed's block: x + dropout(down(SwiGLU(RMSNorm(x)))), bias on the down projection (dropout
    p = `cfg.dropout`, 0 by default)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden, cfg.eps, dtype)
        self.gate_up = SwiGLU(cfg, dtype)
        self.down = Linear(cfg.ffn, cfg.hidden, bias=True, dtype=dtype)
        self.dropout = nn.Dropout(cfg.dropout)

    def reset_parameters(self, g: torch.Generator) -> None:
        self.norm.reset_parameters(g)
        self.gate_up.reset_parameters(g)
        self.down.reset_parameters(g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down(self.gate_up(self.norm(x))))  # [s, b, h]


# ------------------------------------------------------------ attention, transformer layer, tiny LM


def rope_tables(
    seq: int, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[s, 1, 1, d]` for rotate-half RoPE, computed in float64 then cast, so every
    model (dense, TP, float64 truth) rotates by the same angles."""
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    )  # [d/2]
    # [s, d/2]
    angles = torch.arange(seq, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[s, b, n, d]`: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_at(
    start: int, s: int, head_dim: int, theta: float, dtype: torch.dtype, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[s, 1, 1, d]` of positions start .. start + s - 1 (a decode pass's tokens)."""
    cos, sin = rope_tables(start + s, head_dim, theta, dtype, device)
    return cos[start:], sin[start:]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int = 0,
    dropout: nn.Module | None = None,
) -> torch.Tensor:
    """Causal softmax attention, plain math, RoPE already applied. q `[s, b, nq, d]` holds positions
    start .. start + s - 1; k and v `[start + s, b, nkv, d]` every position from 0 (a KV cache's
    prefix, then the new ones): query i sees keys 0 .. start + i. Query head j uses kv head
    j // (nq // nkv) (grouped-query attention). Returns `[s, b, nq * d]`. `dropout` acts on the
    attention probabilities `[b, nq, s, start + s]`."""
    s, b, nq, d = q.shape
    t = k.shape[0]
    group = nq // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # [t, b, nq, d]
    q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [b, nq, s or t, d]
    scores = (q @ k.transpose(-1, -2)) * d**-0.5  # [b, nq, s, t]
    future = torch.ones(s, t, dtype=torch.bool, device=q.device).triu(start + 1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    if dropout is not None:
        probs = dropout(probs)
    return (probs @ v).permute(2, 0, 1, 3).reshape(s, b, nq * d)  # [s, b, nq * d]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: float,
    dropout: nn.Module | None = None,
) -> torch.Tensor:
    """RoPE + causal softmax attention, plain math. q `[s, b, nq, d]`, k and v `[s, b, nkv, d]`;
    query head j uses kv head j // (nq // nkv) (grouped-query attention). Returns `[s, b, nq * d]`.
    Positions are 0..s-1: the caller passes the whole sequence. `dropout` acts on the attention
    probabilities `[b, nq, s, s]`."""
    s, b, nq, d = q.shape
    cos, sin = rope_tables(s, d, theta, q.dtype, q.device)
    return attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, 0, dropout)


class DenseAttention(nn.Module):
    """x + dropout(o(attention(RoPE(qkv(RMSNorm(x)))))), the attention probabilities through
    `attn_dropout` (p = `cfg.attention_dropout`), the output through `dropout` (p = `cfg.dropout`).
    qkv.weight is the fused [q; k; v] = [(heads + 2 * kv_heads) * head_dim, hidden], each part
    head-major; o has no bias."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.norm = RMSNorm(cfg.hidden, cfg.eps, dtype)
        self.qkv = Linear(
            cfg.hidden, (cfg.heads + 2 * cfg.num_kv_heads) * d, bias=False, dtype=dtype
        )
        self.o = Linear(cfg.heads * d, cfg.hidden, bias=False, dtype=dtype)
        self.attn_dropout = nn.Dropout(cfg.attention_dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    def reset_parameters(self, g: torch.Generator) -> None:
        self.norm.reset_parameters(g)
        self.qkv.reset_parameters(g)
        self.o.reset_parameters(g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, d = self.cfg, self.cfg.head_dim
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).split(
            [cfg.heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], -1
        )
        ctx = causal_attention(
            q.view(s, b, -1, d),
            k.view(s, b, -1, d),
            v.view(s, b, -1, d),
            cfg.rope_theta,
            self.attn_dropout,
        )
        return x + self.dropout(self.o(ctx))  # [s, b, h]


class DenseLayer(nn.Module):
    """A pre-norm transformer layer: the attention block, then the SwiGLU MLP block (each with its
    residual)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.attention = DenseAttention(cfg, dtype)
        self.mlp = DenseMLP(cfg, dtype)

    def reset_parameters(self, g: torch.Generator) -> None:
        self.attention.reset_parameters(g)
        self.mlp.reset_parameters(g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attention(x))  # [s, b, h]


class Embedding(nn.Module):
    """tokens `[s, b]` -> `[s, b, h]`; weight `[V, h]` ~ N(0, 1/h)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype))

    def reset_parameters(self, g: torch.Generator) -> None:
        with torch.no_grad():
            self.weight.copy_(
                torch.randn(self.weight.shape, generator=g) / self.weight.shape[1] ** 0.5
            )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class LMHead(Linear):
    """logits `[s, b, V]` = x @ W^T, W `[V, h]`, no
    bias (forward takes `x`, like the other blocks)."""

    def __init__(self, hidden: int, vocab: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden, vocab, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class DenseLM(nn.Module):
    """tokens `[s, b]` -> logits `[s, b, V]`: embedding (then dropout, p = `cfg.dropout`), `layers`
    transformer layers, final RMSNorm, LM head (no bias). With `tie_embeddings` the head is the
    embedding weight and `head` has no parameter. `layer()` builds each layer (DenseLayer)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None, layer=None) -> None:
        super().__init__()
        self.embed = Embedding(cfg.vocab, cfg.hidden, dtype)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        layer = layer or (lambda: DenseLayer(cfg, dtype))
        self.layers = nn.ModuleList(layer() for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps, dtype)
        self.head = None if cfg.tie_embeddings else LMHead(cfg.hidden, cfg.vocab, dtype)

    def reset_parameters(self, g: torch.Generator) -> None:
        for m in [self.embed, *self.layers, self.norm] + (
            [self.head] if self.head is not None else []
        ):
            m.reset_parameters(g)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_dropout(self.embed(tokens))  # [s, b, h]
        for layer in self.layers:
            x = layer(x)
        if self.head is None:  # tied: the embedding weight is the head
            return F.linear(self.norm(x), self.embed.weight)  # [s, b, V]
        return self.head(self.norm(x))  # [s, b, V]


# ------------------------------------------------------------ incremental decoding with a KV cache


class KVCache(nn.Module):
    """Keys and values of every position decoded so far, in the module's buffers (Meta's llama,
    gpt-fast): `cache_k`, `cache_v` `[length, batch, kv_heads, d]`, filled in place at the position
    of each call's first token."""

    def __init__(
        self, length: int, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        shape = (length, batch, kv_heads, head_dim)
        self.register_buffer("cache_k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape, dtype=dtype), persistent=False)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """k, v `[s, b, kv, d]` of positions start .. start + s - 1."""
        s, b = k.shape[:2]
        if start + s > self.cache_k.shape[0] or b > self.cache_k.shape[1]:
            raise ValueError(
                f"KV cache of {self.cache_k.shape[0]} positions x {self.cache_k.shape[1]} "
                f"sequences: cannot hold positions {start}..{start + s - 1} of {b} sequences"
            )
        self.cache_k[start : start + s, :b] = k
        self.cache_v[start : start + s, :b] = v

    def keys_values(
        self, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached prefix (positions 0 .. start - 1), then this call's own keys and values:
        `[start + s, b, kv, d]` each."""
        b = k.shape[1]
        return (
            torch.cat([self.cache_k[:start, :b], k]),
            torch.cat([self.cache_v[:start, :b], v]),
        )


def cached_attention(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cache: KVCache,
    start: int,
    theta: float,
    dropout: nn.Module | None = None,
) -> torch.Tensor:
    """RoPE at positions start .., the new keys and values written to `cache`, attention over the
    cached prefix and the new ones. q `[s, b, nq, d]`, k and v `[s, b, nkv, d]`; returns
    `[s, b, nq * d]`."""
    q, k, v = qkv
    cos, sin = rope_at(start, q.shape[0], q.shape[-1], theta, q.dtype, q.device)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache.write(k, v, start)
    keys, values = cache.keys_values(k, v, start)
    return attend(q, keys, values, start, dropout)


class DenseCachedAttention(DenseAttention):
    """DenseAttention that decodes: forward(x, start) with x `[s, b, h]` the tokens at positions
    start .. start + s - 1 (a prompt from 0, then one token per decode pass), keys and values kept
    in `cache` (a KVCache of `cache_len` positions x `cfg.batch` sequences)."""

    def __init__(self, cfg: ModelConfig, cache_len: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(cfg, dtype)
        self.cache = KVCache(cache_len, cfg.batch, cfg.num_kv_heads, cfg.head_dim, dtype)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        cfg, d = self.cfg, self.cfg.head_dim
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).split(
            [cfg.heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], -1
        )
        qkv = (q.view(s, b, -1, d), k.view(s, b, -1, d), v.view(s, b, -1, d))
        ctx = cached_attention(qkv, self.cache, start, cfg.rope_theta, self.attn_dropout)
        return x + self.dropout(self.o(ctx))  # [s, b, h]


class DenseDecodeLayer(nn.Module):
    """DenseLayer with the cached attention: forward(x, start)."""

    def __init__(self, cfg: ModelConfig, cache_len: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.attention = DenseCachedAttention(cfg, cache_len, dtype)
        self.mlp = DenseMLP(cfg, dtype)

    def reset_parameters(self, g: torch.Generator) -> None:
        self.attention.reset_parameters(g)
        self.mlp.reset_parameters(g)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self.mlp(self.attention(x, start))  # [s, b, h]


def decode_forward(model, tokens: torch.Tensor, start_pos) -> torch.Tensor:
    """The decoder's forward, dense or TP: tokens `[b, s]` (batch-first, as inference code takes
    them) at positions start_pos .. -> logits `[b, s, V]` (or `[b, s, V/tp]`); inside, the residual
    stream is `[s, b, h]` as in every other block."""
    start = int(start_pos)
    x = model.embed_dropout(model.embed(tokens.t()))  # [s, b, h]
    for layer in model.layers:
        x = layer(x, start)
    if model.head is None:  # tied (dense): the embedding weight is the head
        logits = F.linear(model.norm(x), model.embed.weight)
    else:
        logits = model.head_logits(model.norm(x))
    return logits.transpose(0, 1)  # [b, s, V]


class DenseDecoder(DenseLM):
    """DenseLM that decodes through a KV cache in its buffers (Meta's llama layout):
    forward(tokens `[b, s]`, start_pos) -> logits `[b, s, V]`; a prompt at start_pos 0, then one
    token per call. `cache_len` positions of `cfg.batch` sequences."""

    def __init__(self, cfg: ModelConfig, cache_len: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(cfg, dtype, layer=lambda: DenseDecodeLayer(cfg, cache_len, dtype))

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)

    def forward(self, tokens: torch.Tensor, start_pos) -> torch.Tensor:
        return decode_forward(self, tokens, start_pos)
