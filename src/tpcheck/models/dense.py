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


def init_gate_up(weight: torch.Tensor, g: torch.Generator, hidden: int, ffn: int, layout: str) -> None:
    """Draw the gate/up weight as the seed does ([2, ffn, hidden] order) whatever the stored layout."""
    w = torch.randn(2, ffn, hidden, generator=g) / hidden**0.5
    with torch.no_grad():
        weight.copy_(w if layout == "stacked" else w.reshape(2 * ffn, hidden))


class SwiGLU(nn.Module):
    """silu(x @ W_gate^T) * (x @ W_up^T). weight: [2, ffn, hidden] ("stacked") or [gate; up] =
    [2*ffn, hidden] ("concat")."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        shape = (2, cfg.ffn, cfg.hidden) if cfg.gate_up_layout == "stacked" else (2 * cfg.ffn, cfg.hidden)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype))

    def reset_parameters(self, g: torch.Generator) -> None:
        init_gate_up(self.weight, g, self.cfg.hidden, self.cfg.ffn, self.cfg.gate_up_layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_gate, w_up = self.weight.unbind(0) if self.weight.dim() == 3 else self.weight.chunk(2, dim=0)
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
    """The seed's block: x + down(SwiGLU(RMSNorm(x))), bias on the down projection."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden, cfg.eps, dtype)
        self.gate_up = SwiGLU(cfg, dtype)
        self.down = Linear(cfg.ffn, cfg.hidden, bias=True, dtype=dtype)

    def reset_parameters(self, g: torch.Generator) -> None:
        self.norm.reset_parameters(g)
        self.gate_up.reset_parameters(g)
        self.down.reset_parameters(g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.gate_up(self.norm(x)))  # [s, b, h]
