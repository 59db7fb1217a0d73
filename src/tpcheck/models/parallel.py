"""TP twins of the dense blocks. Parameter and submodule names match the dense ones, so the plan
maps them one to one and captured activations line up."""
from __future__ import annotations

import torch

from tpcheck.models.config import ModelConfig
from tpcheck.models.dense import RMSNorm, swiglu
from tpcheck.parallel.collectives import copy_to_tp_region, gather_from_sequence_parallel_region
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.layers import ParallelModule, RowParallelLinear, divide, label_sites, mark_partial_grad

__all__ = ["ParallelSwiGLU", "ParallelMLP"]


class ParallelSwiGLU(ParallelModule):
    """Column-parallel gate/up: rank r holds gate rows and up rows r*ffn/tp .. (r+1)*ffn/tp.
    weight: [2, ffn/tp, hidden] ("stacked") or [gate_r; up_r] = [2*ffn/tp, hidden] ("concat").
    Input replicated (or sequence-sharded under SP); output [s, b, ffn/tp]."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, *, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(group)
        ffn_local = divide(cfg.ffn, group.world_size, "FFN width")
        shape = (2, ffn_local, cfg.hidden) if cfg.gate_up_layout == "stacked" else (2 * ffn_local, cfg.hidden)
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x_full = gather_from_sequence_parallel_region(x, self.group, self.site)  # [s, b, h]
        else:
            x_full = copy_to_tp_region(x, self.group, self.site)  # [s, b, h]
        w = self.weight
        w_gate, w_up = w.unbind(0) if w.dim() == 3 else w.chunk(2, dim=0)  # [ffn/tp, h] each
        return swiglu(x_full, w_gate, w_up)  # [s, b, ffn/tp]


class ParallelMLP(ParallelModule):
    """x + down(SwiGLU(RMSNorm(x))) with gate/up column-parallel and down row-parallel.

    forward: 1 all-reduce (down); backward: 1 all-reduce (input grad of gate/up). Under sequence
    parallelism x is [s/tp, b, h]: all-gather before gate/up, reduce-scatter after down, and the norm
    weight and down bias grads are all-reduced in the optimizer phase (`finalize_grads`).
    """

    def __init__(self, cfg: ModelConfig, group: TPGroup, *, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(group)
        self.norm = RMSNorm(cfg.hidden, cfg.eps, dtype)
        if sequence_parallel:
            mark_partial_grad(self.norm.weight)
        self.gate_up = ParallelSwiGLU(cfg, group, sequence_parallel=sequence_parallel, dtype=dtype)
        self.down = RowParallelLinear(cfg.ffn, cfg.hidden, group, bias=True,
                                      sequence_parallel=sequence_parallel, dtype=dtype)
        label_sites(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.gate_up(self.norm(x)))  # [s, b, h] (or [s/tp, b, h] under SP)
