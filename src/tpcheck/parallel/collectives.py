"""Megatron-style autograd collectives, in three tiers.

Tier 1, private tensor helpers (`_reduce`, `_split_last`, `_gather_last`, ...): plain functions on
tensors, no autograd. Tier 2, private `torch.autograd.Function`s pairing a forward helper with its
adjoint in backward. Tier 3, public wrappers, whose docstrings state the pair.

Layouts: activations are sequence-first `[s, b, h]` (Megatron's convention). "TP region" collectives
act on the last (hidden) dim; "sequence-parallel" ones on dim 0 (the sequence).

Every collective goes through `TPGroup.collective`, so it is recorded in the ledger with its phase
and site, and can be intercepted by a fault injector. With world_size 1 each one is the identity
and nothing is recorded (as Megatron skips them).
"""

from __future__ import annotations

import torch

from tpcheck.parallel.group import TPGroup

# ---------------------------------------------------------------- tier 1: tensor helpers


def _reduce(x: torch.Tensor, group: TPGroup, site: str, phase: str) -> torch.Tensor:
    if group.world_size == 1:
        return x
    return group.collective("all_reduce", x, site=site, phase=phase)


def _split_last(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Keep this rank's contiguous block of the last dim (no communication)."""
    if group.world_size == 1:
        return x
    n = x.shape[-1]
    if n % group.world_size:
        raise ValueError(f"last dim {n} does not divide by TP world size {group.world_size}")
    return x.chunk(group.world_size, dim=-1)[group.rank].contiguous()


def _gather_last(x: torch.Tensor, group: TPGroup, site: str, phase: str) -> torch.Tensor:
    if group.world_size == 1:
        return x
    x_front = x.movedim(-1, 0)  # [h/tp, ...]
    out_front = group.collective("all_gather", x_front, site=site, phase=phase)  # [h, ...]
    return out_front.movedim(0, -1).contiguous()


def _split_first(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Keep this rank's contiguous block of dim 0 (the sequence)."""
    if group.world_size == 1:
        return x
    n = x.shape[0]
    if n % group.world_size:
        raise ValueError(f"sequence length {n} does not divide by TP world size {group.world_size}")
    return x.chunk(group.world_size, dim=0)[group.rank].contiguous()


def _gather_first(x: torch.Tensor, group: TPGroup, site: str, phase: str) -> torch.Tensor:
    if group.world_size == 1:
        return x
    return group.collective("all_gather", x, site=site, phase=phase)


def _reduce_scatter_first(x: torch.Tensor, group: TPGroup, site: str, phase: str) -> torch.Tensor:
    if group.world_size == 1:
        return x
    return group.collective("reduce_scatter", x, site=site, phase=phase)


# ---------------------------------------------------------------- tier 2: autograd functions


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group, ctx.site, "backward"), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        return _reduce(x, group, site, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group, ctx.site, "backward"), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group = group
        return _gather_last(x, group, site, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group, ctx.site, "backward"), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return _gather_first(x, group, site, "forward")

    @staticmethod
    def backward(ctx, grad):
        # The consumer of the gathered tensor is TP-parallel: each rank holds a partial gradient
        # of the full sequence, so sum them and keep this rank's sequence block.
        return _reduce_scatter_first(grad, ctx.group, ctx.site, "backward"), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return _reduce_scatter_first(x, group, site, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group, ctx.site, "backward"), None, None


# ---------------------------------------------------------------- tier 3: public wrappers


def copy_to_tp_region(x: torch.Tensor, group: TPGroup, site: str = "copy_to_tp") -> torch.Tensor:
    """forward: identity; backward: all-reduce (sum the
    partial input grads of a column-parallel layer)."""
    return _CopyToTP.apply(x, group, site)


def reduce_from_tp_region(
    x: torch.Tensor, group: TPGroup, site: str = "reduce_from_tp"
) -> torch.Tensor:
    """forward: all-reduce (sum the partial outputs of a row-parallel layer); backward: identity."""
    return _ReduceFromTP.apply(x, group, site)


def scatter_to_tp_region(
    x: torch.Tensor, group: TPGroup, site: str = "scatter_to_tp"
) -> torch.Tensor:
    """forward: split the last dim, keep this rank's block; backward: all-gather the last dim."""
    return _ScatterToTP.apply(x, group, site)


def gather_from_tp_region(
    x: torch.Tensor, group: TPGroup, site: str = "gather_from_tp"
) -> torch.Tensor:
    """forward: all-gather the last dim; backward: split the last dim."""
    return _GatherFromTP.apply(x, group, site)


def scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: TPGroup, site: str = "scatter_to_sp"
) -> torch.Tensor:
    """forward: split dim 0 (sequence), keep this rank's block; backward: all-gather dim 0."""
    return _ScatterToSP.apply(x, group, site)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: TPGroup, site: str = "gather_from_sp"
) -> torch.Tensor:
    """forward: all-gather dim 0 (sequence); backward: reduce-scatter dim 0."""
    return _GatherFromSP.apply(x, group, site)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: TPGroup, site: str = "reduce_scatter_to_sp"
) -> torch.Tensor:
    """forward: reduce-scatter dim 0 (sum partials, keep this
    rank's sequence block); backward: all-gather dim 0."""
    return _ReduceScatterToSP.apply(x, group, site)


def all_reduce_grad_(param: torch.nn.Parameter, group: TPGroup, site: str) -> None:
    """Optimizer phase, no autograd: sum `param.grad` over the group in place (replicated params
    whose grads are partial, e.g. norm weights under sequence parallelism)."""
    if param.grad is not None:
        param.grad.copy_(_reduce(param.grad, group, site, "optimizer"))
