"""Column- and row-parallel linear layers (Megatron style), usable on their own.

ColumnParallelLinear: dense weight [out, in]; rank r holds rows r*out/tp .. (r+1)*out/tp, i.e.
`Shard(0)` of the weight (and of the bias). Input replicated (or sequence-sharded under sequence
parallelism), output sharded on the last dim.

RowParallelLinear: dense weight [out, in]; rank r holds columns r*in/tp .. (r+1)*in/tp, i.e.
`Shard(1)`. Input sharded on the last dim, output partial sums, all-reduced (or reduce-scattered
along the sequence under sequence parallelism). The bias is replicated and added once, *after* the
reduction: adding it before would count it tp times.

Parameters whose gradient is partial on each rank (replicated parameters that only see a sequence
shard under sequence parallelism) carry `param.partial_grad = True`; `finalize_grads` all-reduces
them in the optimizer phase, before the optimizer step (Megatron's finalize_model_grads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck.errors import UsageError
from tpcheck.parallel.collectives import (
    all_reduce_grad_,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
)
from tpcheck.parallel.group import TPGroup


def divide(n: int, world: int, what: str) -> int:
    if n % world:
        raise UsageError(
            f"{what} = {n} does not divide by TP world size {world}; "
            f"choose a world size that divides {n}"
        )
    return n // world


class ParallelModule(nn.Module):
    """Base of layers that issue collectives. `site` names them in the ledger and for fault
    injection; `label_sites` sets it to the module's qualified name."""

    site: str = ""

    def __init__(self, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.site = type(self).__name__


def label_sites(root: nn.Module) -> None:
    for name, module in root.named_modules():
        if isinstance(module, ParallelModule):
            module.site = name or type(module).__name__


def mark_partial_grad(param: nn.Parameter) -> nn.Parameter:
    param.partial_grad = True
    return param


def finalize_grads(module: nn.Module, group: TPGroup) -> None:
    """Optimizer phase: all-reduce the grads of every parameter marked `partial_grad`."""
    for name, param in module.named_parameters():
        if getattr(param, "partial_grad", False):
            all_reduce_grad_(param, group, site=name)


class ColumnParallelLinear(ParallelModule):
    """y_local = x @ W_r^T + b_r: weight [out/tp, in], `Shard(0)` of the dense [out, in].

    Collectives: forward identity (or all-gather the sequence under SP); backward all-reduce of the
    input grad (or reduce-scatter under SP). `gather_output` all-gathers the last dim of the output.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: TPGroup,
        *,
        bias: bool = False,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        self.out_local = divide(
            out_features, group.world_size, "output features of a column-parallel layer"
        )
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.out_local, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=in_features**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x_full = gather_from_sequence_parallel_region(x, self.group, self.site)  # [s, b, in]
        else:
            x_full = copy_to_tp_region(x, self.group, self.site)  # [s, b, in]
        y_local = F.linear(x_full, self.weight, self.bias)  # [s, b, out/tp]
        if self.gather_output:
            return gather_from_tp_region(y_local, self.group, self.site)  # [s, b, out]
        return y_local


class RowParallelLinear(ParallelModule):
    """y = sum_r x_r @ W_r^T + b: weight [out, in/tp], `Shard(1)` of the dense [out, in]; bias [out]
    replicated and added after the reduction.

    Collectives: forward all-reduce of the partial outputs (reduce-scatter along the sequence under
    SP); backward identity (all-gather under SP).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: TPGroup,
        *,
        bias: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        self.in_local = divide(
            in_features, group.world_size, "input features of a row-parallel layer"
        )
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        if self.bias is not None and sequence_parallel:
            mark_partial_grad(self.bias)  # each rank sees only its sequence shard
        nn.init.normal_(self.weight, std=in_features**-0.5)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x_local, self.weight)  # [s, b, out], a partial sum on each rank
        if self.sequence_parallel:
            # [s/tp, b, out]
            out = reduce_scatter_to_sequence_parallel_region(partial, self.group, self.site)
        else:
            out = reduce_from_tp_region(partial, self.group, self.site)  # [s, b, out]
        return out + self.bias if self.bias is not None else out
