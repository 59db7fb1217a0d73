"""The TP optimizer's state against the dense side's: the yardstick of the optimizer stage.

The replay (optimizer.py) holds the TP optimizer bitwise to the dense rule run on the TP side's own
weights and gradients: precise, but blind to anything wrong in those inputs (a clipping that left
some gradients unscaled feeds the replay the same wrong gradients). So the state every optimizer
keeps (Adam's `exp_avg`, `exp_avg_sq`, SGD's `momentum_buffer`) is also compared with the dense
optimizer's, element by element through the plan (`moment:<parameter>.<entry>`), under the
calibrated bound of the dense state against the float64 truth's (whose optimizer restarts from the
dense state before each step: optimizer_stage.py's `restart_truth`).

For that comparison to measure one step's arithmetic, every step after the first restarts the TP
optimizer's state, and the replay's, from the dense optimizer's state (`restart_state`), as the TP
weights restart from the dense weights: a TP state wrong at step k was caught at step k (against
the dense state and, bitwise, against the replay), and step k + 1 is then checked from the dense
state. A TP optimizer that drops, resets or re-creates its state is still seen: what it holds after
the step is not what the rule makes of the restarted state.

The bound. The dense state's error against the truth's is this step's gradient error times the
rule's coefficients, which the calibrated bound (tolerance.py) takes as it takes any tensor's. Its
floor is the dtype's ulp at the state's own scale; the gradients' check also allowed an ulp of the
working dtype at the gradient's scale where the dense gradient happens to be exact, and a linear
entry carries that difference times the rule's coefficient: `(1 - beta1) g_floor` for Adam's
`exp_avg` (`g_floor` for a momentum buffer; the rest of the gradient's bound is the dense error,
which the entry's own calibration carries element by element). A squared entry (`exp_avg_sq`,
`max_exp_avg_sq`) weighs a gradient difference by `2 |g|` at its own element, so the dense error,
small where |g| is, says nothing of a TP difference where |g| is large: it carries the gradient
check's whole bound `B_g` (the dense gradient against the truth's, calibrated, floor included),
`(1 - beta2) (2 |g| B_g + B_g^2)`, |g| the largest dense clipped gradient. (With the floor alone, a
correct float16 layer at tp 2 had one `exp_avg_sq` element at 1.14 times its bound in the 2,000-case
sweep.) Those terms come from the dense gradient and the truth's, never from the TP side.

Not compared here: the step count (a number the replay holds bitwise), a parameter applied on one
rank only (AppliedOnRank: the replay and the weights check it there), a state entry whose shape is
no shard of the parameter's (kept elsewhere by the user's optimizer: not observable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.measure import absmax, max_abs_diff

if TYPE_CHECKING:
    from tpcheck.checker.rank.optimizer import Optimizers
    from tpcheck.checker.rank.sides import Sides


def _checked(s: Sides, name: str) -> bool:
    """Whether this rank compares (and restarts) the state of dense parameter `name`."""
    placement = s.plan.params[name]
    return placement.applied_on is None and placement.held_on(s.group.rank, s.group.world_size)


def _dense_state(opts: Optimizers, p) -> dict[str, torch.Tensor]:
    """The dense optimizer's state of `p`: its tensors of `p`'s shape (the entries a shard has)."""
    state = opts.opt_dense.state.get(p, {})
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() and v.shape == p.shape}


def restart_state(s: Sides, opts: Optimizers) -> None:
    """The TP optimizer's state and the replay's restart from the plan's shard of the dense
    optimizer's state (module docstring), written in place where they hold a tensor of the
    shard's shape; the step count is the dense one's."""
    rank, world = s.group.rank, s.group.world_size
    for name, p in opts.dense_master.params.items():
        dense = opts.opt_dense.state.get(p)
        if not dense or not _checked(s, name):
            continue
        placement, tp_name = s.plan.params[name], s.plan.tp_name(name)
        targets = [opts.tp_master.state_of(tp_name, opts.opt_tp), opts.replay.live_state(tp_name)]
        with torch.no_grad():
            for target in (t for t in targets if t):
                for key, value in dense.items():
                    mine = target.get(key)
                    if not torch.is_tensor(value) or not torch.is_tensor(mine):
                        continue
                    full = value.dim() and value.shape == p.shape
                    src = placement.shard(value, rank, world) if full else value
                    if mine.shape == src.shape:
                        mine.copy_(src.to(mine.dtype))


def compare_moments(s: Sides, opts: Optimizers, step: int) -> None:
    """Each optimizer state entry of every parameter on the TP side against the dense side's
    (module docstring); state the TP optimizer lacks counts as zeros, state it keeps out of
    sight (a user's optimizer nothing maps) is a note of compare_replay's."""
    truth = dict(s.truth.named_parameters()) if s.truth is not None else {}
    for name, p in opts.dense_master.params.items():
        if not _checked(s, name) or p.grad is None:
            continue
        tp_name, placement = s.plan.tp_name(name), s.plan.params[name]
        own = opts.tp_master.state_of(tp_name, opts.opt_tp)
        if own is None:
            continue  # not observable (training.py's UserOptimizer)
        truth_state = _truth_state(s, opts, name, p, truth)
        g_floor, g_bound = _grad_floor(s, p), _grad_bound(s, p, truth.get(name))
        for key, dense in sorted(_dense_state(opts, p).items()):
            ref = placement.shard(dense, s.group.rank, s.group.world_size)
            mine = own.get(key)
            if not torch.is_tensor(mine):
                mine = torch.zeros_like(ref)
            elif mine.shape != ref.shape:
                mine = torch.full_like(ref, float("nan"))  # misshapen state: never equal
            t = truth_state.get(key)
            bound = None
            if t is not None:
                extra = _entry_floor(key, g_floor, g_bound, absmax(p.grad), _hyper(opts, p))
                bound = tolerance.plus_floor(
                    s.cmp.calibrated(dense.detach(), t.detach(), dense.dtype),
                    extra,
                    f"the gradient check's allowance ({s.settings.dtype}) carried into {key}",
                )
            s.cmp.compare(
                "optimizer",
                step,
                CheckId("moment", name, entry=key),
                mine.detach().to(dense.dtype),
                dense.detach(),
                None if t is None else t.detach(),
                placement,
                dtype=dense.dtype,
                bound=bound,
            )


def _truth_state(s: Sides, opts: Optimizers, name: str, p, truth: dict) -> dict:
    """The float64 truth's optimizer state of `name` (the dense side's own in a float64 run, where
    the dense model is the truth; nothing on the ranks that hold no truth)."""
    if s.truth is s.dense:
        return opts.opt_dense.state.get(p, {})
    if opts.opt_truth is None or name not in truth:
        return {}
    return opts.opt_truth.state.get(truth[name], {})


def _grad_floor(s: Sides, p) -> float:
    """The gradient check's floor in the working dtype at the dense clipped gradient's scale."""
    return tolerance.floor_ulps(p.numel()) * tolerance.eps(s.dtype) * absmax(p.grad)


def _grad_bound(s: Sides, p, t) -> float:
    """The gradient check's bound for `p` at this step (`B_g`, module docstring): the dense
    clipped gradient against the truth parameter `t`'s, calibrated in the working dtype; where no
    truth gradient is held, its floor at the dense gradient's scale."""
    if t is None or t.grad is None or t.grad.shape != p.grad.shape:
        return _grad_floor(s, p)
    # the calibrated bound's whole-tensor value (tolerance.calibrated), without its bins
    err = float(max_abs_diff(p.grad.detach(), t.grad.detach(), torch.float64))
    return tolerance.factor(s.group.world_size, p.numel()) * err + _grad_floor(s, p)


def _hyper(opts: Optimizers, p) -> dict:
    return next(g for g in opts.opt_dense.param_groups if any(q is p for q in g["params"]))


def _entry_floor(key: str, g_floor: float, g_bound: float, g_max: float, hyper: dict) -> float:
    """What the TP gradient's allowed difference moves state entry `key` by in one step, beyond the
    entry's own calibration (module docstring): Adam's `exp_avg` by (1 - beta1) g_floor, a
    momentum buffer by g_floor, a squared entry by (1 - beta2) (2 |g| g_bound + g_bound^2)."""
    b1, b2 = hyper.get("betas", (0.0, 0.0))
    if key.endswith("_sq"):
        return (1.0 - b2) * (2.0 * g_max * g_bound + g_bound**2)
    return (1.0 - b1) * g_floor if key == "exp_avg" else g_floor
