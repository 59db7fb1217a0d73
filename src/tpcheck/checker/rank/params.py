"""The parameter stages, on this rank: the weights as loaded (`weights`, step 0); in every step,
every parameter's gradient (`grads`) and, after the optimizer step, what each optimizer stepped
(`optimizer`: the module's parameters, or the float32 masters under master weights), each against
the dense side's through the plan; and the TP optimizer's own state and update against the replay
of the dense rule on the TP side's inputs, bitwise.

A parameter applied on one rank only (`AppliedOnRank`) is compared there alone, zero elsewhere
(applied_on.py); one held on one rank only (`OnRank`) is compared there, and its absence on the
other ranks at the weights stage (`compare_weights`); after an adaptive step the optimizer's
allowance (`AdaptiveSlack`) takes out of the difference what the replay's moments explain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.applied_on import ALONE, not_applied_here, owner_bound
from tpcheck.checker.rank.measure import absmax
from tpcheck.errors import UsageError

if TYPE_CHECKING:
    from tpcheck.checker.rank.optimizer import Optimizers
    from tpcheck.checker.rank.sides import Sides


def compare_weights(s: Sides, loaded_by: str | None) -> None:
    """The weights stage (step 0): every TP parameter as loaded against the plan's shard of the
    dense one, bitwise (`loaded_by`: the user's loader, named in the reason); a parameter the plan
    holds on another rank only (`OnRank`) must be absent here."""
    plan, group = s.plan, s.group
    tp_params = dict(s.tp.named_parameters())
    reason = f"bitwise: the plan's shard, as loaded by {loaded_by}" if loaded_by else None
    for name, p in s.dense.named_parameters():
        placement, tp_name = plan.params[name], plan.tp_name(name)
        if not placement.held_on(group.rank, group.world_size):
            s.cmp.absent(CheckId("param", name), tp_name, tp_name in tp_params, placement)
            continue
        s.cmp.compare(
            "weights",
            0,
            CheckId("param", name),
            tp_params[tp_name].detach(),
            p.detach(),
            p.detach(),
            placement,
            exact=True,
            reason=reason,
            loaded_by=loaded_by,
        )


def compare_params(
    s: Sides,
    opts: Optimizers,
    step: int,
    stage: str,
    dense_params: dict,
    tp_params: dict,
    get,
    label: str | None = None,
    tp_get=None,
) -> None:
    """Every parameter's `get(p)` (its grad, or itself after the step) on the TP side against
    the dense side's; after the step these are what the optimizers stepped (float32 masters
    under master weights, compared with float32's bound). `label`: the checks' kind, by default
    `grad` at the grads stage and `param` after the step (`clipped`: the grads after the step's
    clipping, each side's own, against the dense side's clipped by the dense rule). `tp_get`: the
    TP side's own `get` where it differs (its gradients where its framework keeps them)."""
    tp_get = tp_get or get
    label = label or ("grad" if stage == "grads" else "param")
    slack = opts.slack if label == "param" else None
    plan, rank, world = s.plan, s.group.rank, s.group.world_size
    truth_params = dict(s.truth.named_parameters()) if s.truth is not None else {}
    for name, p in dense_params.items():
        tp_p = tp_params.get(plan.tp_name(name))
        tp_val, dense_val = tp_get(tp_p) if tp_p is not None else None, get(p)
        truth_p = truth_params.get(name)
        truth_val = get(truth_p) if truth_params else None
        owner = plan.params[name].applied_on
        sent = None
        if owner not in (None, 0) and dense_val is not None and s.truth is not s.dense:
            sent = owner_bound(
                s.cmp,
                s.rendezvous,
                slack,
                step,
                stage,
                name,
                owner,
                p,
                truth_p,
                dense_val,
                truth_val,
            )
        if sent is None and stage == "grads" and truth_val is not None:
            sent = s.twin.grad_bound(s.cmp, step, name, dense_val, truth_val.detach())
        if not plan.params[name].held_on(rank, world):
            continue  # held on another rank only: its absence here was checked with the weights
        if owner is not None and owner != rank:
            not_applied_here(s.cmp, s.dtype, step, stage, name, tp_val, dense_val, owner)
        elif tp_val is None or dense_val is None:
            if (tp_val is None) != (dense_val is None):
                _refuse_one_sided_grad(s, name, tp_val is None)
        else:
            args = (name, p, truth_p, tp_val.detach(), dense_val, truth_val, sent)
            _compare_one(s, opts, step, stage, label, *args)


def _compare_one(
    s: Sides, opts: Optimizers, step, stage, label, name, p, truth_p, tp_val, dense_val, truth_val,
    sent,
):  # fmt: skip
    """One parameter's value on this rank against the dense one (and, after an adaptive step, what
    the allowance leaves of the difference: `raw` keeps the whole of it)."""
    plan, group = s.plan, s.group
    truth_val = truth_val.detach() if truth_val is not None else None
    raw = tp_val
    owner = plan.params[name].applied_on
    placement = ALONE if owner is not None and stage != "weights" else plan.params[name]
    if label == "param" and opts.slack is not None:
        tp_val, truth_val = opts.slack.apply(
            name,
            plan.params[name],
            group.rank,
            group.world_size,
            plan.tp_name(name),
            p,
            truth_p,
            tp_val,
            truth_val,
        )
    extra = _update_floor(s, opts, stage, p) if label == "param" else None
    if sent is None and truth_val is not None and extra:
        sent = tolerance.plus_floor(
            s.cmp.calibrated(dense_val.detach(), truth_val, dense_val.dtype),
            extra,
            f"lr x {tolerance.floor_ulps(p.numel())} {s.settings.dtype} ulp(s) of the gradient's "
            "scale",
        )
    s.cmp.compare(
        stage,
        step,
        CheckId(label, name),
        tp_val,
        dense_val.detach(),
        truth_val,
        placement,
        dtype=dense_val.dtype,
        bound=sent,
        raw=raw if tp_val is not raw else None,
    )


def _update_floor(s: Sides, opts: Optimizers, stage: str, p) -> float | None:
    """The float32 masters after a plain (not adaptive) step of a 16-bit run may differ by what a
    rounding-level difference in their 16-bit gradients moves them: lr x the gradient check's floor
    (ulps of the working dtype at the gradient's scale). Their own calibration cannot see it: the
    dense masters' error is lr x the dense gradient's, which can be well under an ulp of the
    working dtype (one gradient element dominated by an outlier, measured: a 56-element norm
    weight one bfloat16 ulp off at tp 7). Adaptive steps have the allowance instead; an update
    bug is the replay's (bitwise), a gradient bug the grads stage's."""
    if stage != "optimizer" or opts.slack is not None or not opts.dense_master.masters:
        return None
    if p.grad is None:
        return None
    lr = next(g["lr"] for g in opts.opt_dense.param_groups if any(q is p for q in g["params"]))
    return tolerance.floor_ulps(p.numel()) * tolerance.eps(s.dtype) * lr * absmax(p.grad)


def _refuse_one_sided_grad(s: Sides, name: str, missing_on_tp: bool) -> None:
    """A parameter with a gradient on one side only: refused, naming the side that lacks it
    (and, for a replicated one missing on the TP side, the AppliedOnRank placement
    that may be meant)."""
    side_params = dict((s.tp if missing_on_tp else s.dense).named_parameters())
    pname = s.plan.tp_name(name) if missing_on_tp else name
    if pname in side_params and not side_params[pname].requires_grad:
        if missing_on_tp:  # frozen on every TP rank is followed (frozen.py): not on this one
            raise UsageError(
                f"parameter {pname!r} has requires_grad=False on rank {s.group.rank} of the TP "
                "side (frozen), while other ranks train it: freeze it on every rank or on none"
            )
        raise UsageError(
            f"parameter {pname!r} has requires_grad=False on the dense side (frozen), while the "
            "TP side trains it: freeze it on both sides or on neither; for inference-only TP "
            "code, check the forward alone (RunSettings(train=False), --forward-only)"
        )
    if missing_on_tp:
        hint = (
            "; if the TP module applies it on one rank only (a row-parallel bias added before "
            "the all-reduce), place it AppliedOnRank(r) in the plan, r the rank that applies it"
            if s.plan.params[name].replicated
            else "; is it used in the TP forward?"
        )
        where = (
            "; if a hook moves `.grad` elsewhere for your optimizer (an accumulator such as "
            "Megatron's main_grad), tell tpcheck where: Case(grad_of=...)"
            if s.case.grad_of is None
            else ""
        )
        read = f" (read from {s.grad_of.described()})" if s.grad_of.elsewhere else ""
        raise UsageError(
            f"parameter {name!r} got no gradient on rank {s.group.rank} of the TP side{read}, "
            f"but does on the dense side{hint}{where}"
        )
    raise UsageError(
        f"parameter {name!r} got a gradient on rank {s.group.rank} of the TP side but none "
        "on the dense side: is it used in the dense forward?"
    )


def compare_replay(s: Sides, opts: Optimizers, step: int) -> None:
    """The TP optimizer's state and update against the replay's, bitwise, parameter by
    parameter: the state first (a wrong moment is the cause, a wrong update its effect), tensors
    before the step count. State the TP optimizer lacks counts as zeros (nothing was accumulated);
    state a user's optimizer keeps where tpcheck cannot map it is "not observable" (a note, never
    zeros), and so is its update where its hidden masters cannot be known (training.py)."""
    plan, stepped, replay = s.plan, opts.tp_master, opts.replay
    for name in (n for n, _ in s.dense.named_parameters()):
        tp_name = plan.tp_name(name)
        placement = plan.params[name]
        held = placement.held_on(s.group.rank, s.group.world_size)
        if not held or replay.grads.get(tp_name) is None:
            continue  # not stepped here, or held on another rank only (OnRank)
        own = stepped.state_of(tp_name, opts.opt_tp)
        if own is None:
            if replay.state(tp_name):  # state the rule keeps, and the optimizer hides
                opts.unobserved.setdefault("state", {})[tp_name] = None
        else:
            _compare_state(s, replay, step, name, tp_name, own, placement)
        if not stepped.update_observable():
            opts.unobserved.setdefault("update", {})[tp_name] = None
            continue
        s.cmp.compare_local(
            "optimizer",
            step,
            CheckId("update", name),
            stepped.params[tp_name].detach() - replay.before[tp_name],
            replay.update(tp_name),
            placement,
            "bitwise: the dense update rule replayed on this rank's TP weights and grads",
            weights=replay.params[tp_name].detach(),
        )


def replay_control(s: Sides, opts: Optimizers, step: int) -> None:
    """At step 1 (every optimizer from no state), the control of the replay itself: the rule
    replayed on a planted gradient (`Replay.planted`) must make an update the bitwise check tells
    from the TP side's. A replay that hands back anything but the rule's own arithmetic on its
    inputs (the TP side's update, a copy of it) leaves it unflagged: verdict "error"."""
    if step != 1 or not opts.tp_master.update_observable():
        return
    for name, _ in reversed(list(s.dense.named_parameters())):
        tp_name, placement = s.plan.tp_name(name), s.plan.params[name]
        if not placement.held_on(s.group.rank, s.group.world_size):
            continue
        planted = opts.replay.planted(tp_name)
        if planted is None:
            continue
        control, i = planted
        mine = opts.tp_master.params[tp_name].detach() - opts.replay.before[tp_name]
        ref = control.update(tp_name)
        check = s.cmp.compare_local(
            "optimizer",
            step,
            CheckId("replay", name, control=True),
            mine,
            ref,
            placement,
            "bitwise: the dense update rule replayed on a planted gradient (the replay's control)",
        )
        lo = max(0, i - 4)  # its evidence: the elements around the planted one
        near = ref.reshape(-1)[lo : i + 4]
        s.cmp.evidence.keep(check, mine.reshape(-1)[lo : i + 4], near, near)
        return


def _compare_state(
    s: Sides, replay, step: int, name: str, tp_name: str, own: dict, placement
) -> None:
    for key, ref in sorted(replay.state(tp_name).items(), key=lambda kv: kv[1].dim() == 0):
        mine = own.get(key)
        if mine is None:
            mine = torch.zeros_like(ref)
        elif not isinstance(mine, torch.Tensor) or mine.shape != ref.shape:
            mine = torch.full_like(ref, float("nan"))  # misshapen state: never equal
        s.cmp.compare_local(
            "optimizer",
            step,
            CheckId("state", name, entry=key),
            mine.detach(),
            ref,
            placement,
            f"bitwise: the TP optimizer's {key} against the replay's",
            weights=replay.before[tp_name],
        )
