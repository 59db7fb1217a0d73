"""Moving tensors between the dense and TP sides through the plan, and small tensor helpers."""

from __future__ import annotations

import math

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


# Elements per pass of `max_abs_diff` over a large CPU tensor: the difference goes through one
# buffer of this size (2 MiB in float64), reused, instead of a temporary as large as the tensor,
# whose fresh pages cost more than the arithmetic (a 1024 x 4096 difference: ~50 ms in passes,
# ~230 ms in one piece).
CHUNK = 1 << 18


def absmax(t: torch.Tensor) -> float:
    """max |t| in one pass without a temporary (NaN if `t` holds a NaN; 0.0 when empty)."""
    if not t.numel():
        return 0.0
    if t.is_complex():  # a complex buffer (a RoPE cache): its real and imaginary parts
        t = torch.view_as_real(t.detach().resolve_conj())
    t = t.detach() if t.is_floating_point() else t.detach().double()
    lo, hi = torch.aminmax(t)
    return float(torch.maximum(-lo, hi))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """max |a - b| with both sides in `dtype` (a 0-dim tensor; NaN if a difference is NaN), computed
    in passes of `CHUNK` elements on the CPU: the same element-wise arithmetic, no
    full-size temporaries."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    # the subtraction computes in `dtype` by itself
    # (float32 - float64, say), or after converting the sides
    put = (
        (lambda t: t) if torch.promote_types(a.dtype, b.dtype) == dtype else (lambda t: t.to(dtype))
    )
    n = a.numel()
    if n <= CHUNK or a.device.type != "cpu":
        return (put(a) - put(b)).abs_().amax()  # amax, like maximum, propagates NaN
    buf = torch.empty(CHUNK, dtype=dtype)
    best = torch.zeros((), dtype=dtype)
    for i in range(0, n, CHUNK):
        part = buf[: min(CHUNK, n - i)]
        torch.sub(put(a[i : i + CHUNK]), put(b[i : i + CHUNK]), out=part)
        torch.maximum(best, part.abs_().amax(), out=best)
    return best


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise UsageError(
            f"TP tensor of shape {list(a.shape)} cannot be compared with the plan's shard "
            f"{list(b.shape)}: the plan or the TP module's layout is wrong"
        )
    if a.numel() == 0:
        return 0.0
    # a complex buffer (a RoPE cache): compared by its real and imaginary parts
    if a.is_complex() or b.is_complex():
        a, b = (torch.view_as_real(t.resolve_conj().contiguous()) for t in (a, b))
    # float32 or float64 as they are (the seed's metric is a float32 difference); half types in
    # float32, where they are exact. A NaN anywhere makes the difference infinite.
    d = max_abs_diff(
        a, b, torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    )
    return float(d) if not torch.isnan(d) else math.inf


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
