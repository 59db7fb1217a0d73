"""Moving tensors between the dense and TP sides through the plan, and small tensor helpers (the
measures of a comparison, max |a - b| and max |t|, are in measure.py)."""

from __future__ import annotations

import torch
from torch import nn

from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Plan


def load_from_dense(tp: nn.Module, dense: nn.Module, plan: Plan, group: TPGroup) -> None:
    """Fill every TP parameter this rank holds with the plan's shard of its dense parameter,
    checking shapes (a parameter the plan holds on another rank only, `OnRank`, is left as it is:
    its absence here is checked at the weights stage). (A fault's `Injection.load_plan` stands for a
    TP implementation that loads its weights its own way: the engine passes it here, while the
    checks still use `Case.plan`.)"""
    tp_params = check_names(tp, dense, plan, group)
    with torch.no_grad():
        for name, p in dense.named_parameters():
            tp_name, placement = plan.tp_name(name), plan.params[name]
            if not placement.held_on(group.rank, group.world_size):
                continue
            local = placement.shard(p.detach(), group.rank, group.world_size)
            if tuple(local.shape) != tuple(tp_params[tp_name].shape):
                raise UsageError(
                    f"parameter {tp_name!r} on rank {group.rank}: the plan ({placement}) "
                    f"gives a shard of shape {list(local.shape)} but the TP module holds "
                    f"{list(tp_params[tp_name].shape)}"
                )
            tp_params[tp_name].copy_(local)


def restart_in_place(tp: nn.Module, dense: nn.Module, plan: Plan, group: TPGroup) -> None:
    """The restart of the TP module before every step after the first: the dense weights written
    into its existing parameters, in place, through the plan as known (written, or inferred:
    `plan.tp_name` and each placement's shard), as an optimizer step writes them. Never through the
    user's `load_tp` (called once, before the optimizers are built, and checked at the weights
    stage): whatever the loader derived from the weights (a pre-cast or transposed copy, packed
    weights, FP8 scales) is then exactly as stale as in training, and shows at the first step that
    reads it. A TP parameter the plan does not place is refused, naming it: a parameter skipped
    here would keep its own trajectory, unchecked."""
    placed = {plan.tp_name(n) for n in plan.params}
    unplaced = sorted(n for n, _ in tp.named_parameters() if n not in placed)
    if unplaced:
        raise UsageError(
            f"TP parameter(s) {unplaced} have no placement in the plan: tpcheck restarts the TP "
            "module at every step after the first by writing the dense weights into its "
            "parameters through the plan, and cannot write these; name each like its dense "
            "parameter, or map it with Case(tp_names={dense name: TP name}) (a written plan: "
            "Plan(tp_names=...)), and place that dense parameter in the plan"
        )
    load_from_dense(tp, dense, plan, group)


def check_names(
    tp: nn.Module, dense: nn.Module, plan: Plan, group: TPGroup | None = None
) -> dict[str, nn.Parameter]:
    """The TP module's parameters by name, each the image of one dense parameter under
    `plan.tp_name`; every one the plan holds on this rank (`group`'s; all of them without one) must
    be there. One the plan holds on another rank only (`OnRank`) may be there too: the weights stage
    then fails it, naming the rank."""
    tp_params = dict(tp.named_parameters())
    rank, world = (group.rank, group.world_size) if group is not None else (None, 1)
    expected = {plan.tp_name(n) for n, _ in dense.named_parameters()}
    unplanned = sorted(set(tp_params) - expected)
    if unplanned:
        raise UsageError(
            f"TP module has parameter(s) {unplanned} that map to no dense parameter; "
            "name them like the dense ones or add plan.tp_names entries"
        )
    held = {
        plan.tp_name(n)
        for n, _ in dense.named_parameters()
        if rank is None or plan.params[n].held_on(rank, world)
    }
    missing = sorted(held - set(tp_params))
    if missing:
        where = f" on rank {rank}" if rank is not None and world > 1 else ""
        raise UsageError(
            f"TP module has no parameter(s) {missing}{where} for the dense parameters of those "
            f"names; TP parameters are {sorted(tp_params)} (a parameter created on one rank only, "
            "None elsewhere: place it OnRank(r) in the plan)"
        )
    return tp_params


def leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    t = t.detach().clone()
    return t.requires_grad_(requires_grad and t.is_floating_point())


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of `t` for one side: in `dtype` if floating (else its own dtype), never `t` itself, so
    a model or loss that works in place on its input changes its own copy only, not the batch the
    other sides take theirs from."""
    return t.to(dtype, copy=True) if t.is_floating_point() else t.clone()


def map_tensors(fn, obj):
    """`fn` applied to every tensor of a target that may be a tensor or a dict/list/tuple of them
    (labels and masks beside each other); anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj
