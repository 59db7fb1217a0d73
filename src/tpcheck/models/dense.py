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
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = nq // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # [s, b, nq, d]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, nq, s, d]
    scores = (q @ k.transpose(-1, -2)) * d**-0.5  # [b, nq, s, s]
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    if dropout is not None:
        probs = dropout(probs)
    return (probs @ v).permute(2, 0, 1, 3).reshape(s, b, nq * d)  # [s, b, nq * d]


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
    embedding weight and `head` has no parameter."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed = Embedding(cfg.vocab, cfg.hidden, dtype)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(DenseLayer(cfg, dtype) for _ in range(cfg.layers))
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
