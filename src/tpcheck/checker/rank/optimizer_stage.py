"""The optimizers of one case on one rank, and the optimizer stage of a step.

`Optimizers` is what each side's optimizer steps (the modules' own parameters, or their float32
masters; the user's TP optimizer, seen through it: training.py), the three optimizers over the
case's rule, the replay of the rule on the TP side's inputs and the allowance after adaptive steps
(optimizer.py), and what a user's optimizer keeps out of sight. Built once over the `Sides`
(`build`), never for a case checked forward only.

The stage (`stage`), after the step's gradients were compared: clipping (training.py), the grads
handed to what each optimizer steps, the replay of the dense rule on the TP side's own weights and
grads, the float64 truth restarted from the dense side's weights and state, the three optimizer
steps, the masters written back, then the update and state against the replay, what each optimizer
stepped against the dense side's, and the user's copy back into the module.

Around every step: the gradients zeroed (`zero_grads`: the TP framework's accumulators too, by the
user's code or, under tpcheck's own TP optimizer, by tpcheck) and, after the first, the TP side (its
weights, masters and optimizer state) and the truth restarted from the dense side's (`restart_tp`,
`restart_truth`). Beside the replay, the stage is held to the dense side: every clipped gradient
(`clip`), every optimizer state entry (moments.py), every stepped parameter (params.py); and at step
1 the replay itself is put to a control (params.py's `replay_control`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from tpcheck.checker.rank import moments, training
from tpcheck.checker.rank.loading import restart_in_place
from tpcheck.checker.rank.optimizer import AdaptiveSlack, Masters, Optimizers, Replay
from tpcheck.checker.rank.params import compare_params, compare_replay, replay_control

if TYPE_CHECKING:
    from tpcheck.checker.rank.sides import Sides


def build(s: Sides) -> Optimizers:
    """The optimizers over the case's rule: the dense side's over its masters, the TP side's (the
    user's `tp_optimizer`, a fault's, or the rule), the truth's, the replay and the allowance. A
    user's torch optimizer is followed where the rule leaves a choice to the implementation: the
    16-bit weights stepped directly (no masters on the dense side either) and the kernels it picked
    (`fused`, `foreach`: the rule, its replay and the truth run them too), each said in a note."""
    case, group, settings = s.case, s.group, s.settings
    notes: list[str] = []
    opt_tp = tp_master = None
    uses_masters = settings.uses_masters
    if case.tp_optimizer is not None:
        held = held_by_framework(s.tp)
        opt_tp = case.tp_optimizer(held() if held else s.tp, group)
        tp_master = training.UserOptimizer(s.tp, opt_tp, s.grad_of, refresh=held)
        if uses_masters and tp_master.steps_module_weights():
            uses_masters = False  # the dense side steps its 16-bit weights as the TP side does
            notes.append(training.no_masters_note(opt_tp, settings.dtype))
    dense_master = Masters(s.dense, uses_masters)
    opt_dense = case.make_rule(settings, dense_master.named_parameters())
    picked = training.implementation(tp_master.inner if tp_master else [], opt_dense)
    if picked:
        notes.append(training.implementation_note(opt_dense, picked))

    def rule(named_params) -> torch.optim.Optimizer:
        return training.follow(case.make_rule(settings, named_params), picked)

    training.follow(opt_dense, picked)
    if tp_master is not None:
        training.check_masters(tp_master, dense_master, settings)
    else:
        tp_master = Masters.of(s.tp, settings, s.grad_of)
        opt_tp = (
            case.inject.tp_optimizer(tp_master.owner, group, settings.make_optimizer)
            if case.inject.tp_optimizer is not None
            else rule(tp_master.named_parameters())
        )
    opt_truth = rule(s.truth.named_parameters()) if s.has_truth else None
    replay = Replay(tp_master.params, rule)
    adaptive = "betas" in opt_dense.defaults
    s.cmp.masters = uses_masters
    return Optimizers(
        dense_master=dense_master,
        opt_dense=opt_dense,
        tp_master=tp_master,
        opt_tp=opt_tp,
        opt_truth=opt_truth,
        replay=replay,
        slack=AdaptiveSlack(opt_dense, replay, opt_truth) if adaptive else None,
        notes=notes,
    )


def held_by_framework(tp):
    """The TP module as its framework holds it, for the user's optimizer as for the user's
    clipping (DTensor parameters stay DTensors: adapters/dtensor.py `as_held`, which each call
    also hands this step's gradients), or None: the module as tpcheck steps it."""
    return getattr(tp, "as_held", None)


def stage(s: Sides, opts: Optimizers, step: int) -> None:
    """The optimizer stage of `step` (module docstring)."""
    # rounding.py: never a bound from the float64 run's other path; the bounds' reasons say so
    if s.has_truth and s.twin.stand_in_grads(s.truth, step):
        s.cmp.truth_from = "the float64 step from the rounding twin's gradients"
    try:
        _stage(s, opts, step)
    finally:
        s.cmp.truth_from = None


def _stage(s: Sides, opts: Optimizers, step: int) -> None:
    clip(s, opts, step)
    opts.dense_master.take_grads()
    opts.tp_master.take_grads()
    # the dense rule on the TP side's own weights and grads (as the user's optimizer was handed
    # them: after its step)
    if not opts.tp_master.replay_after_step:
        opts.replay.run(*opts.tp_master.replay_inputs())
    restart_truth(s, opts, opts.dense_master.params.items(), opts.opt_dense)
    for opt in opts.all():
        with s.tap.tp_phase("optimizer") if opt is opts.opt_tp else contextlib.nullcontext():
            opt.step()
    if opts.tp_master.replay_after_step:
        opts.replay.run(*opts.tp_master.replay_inputs())
    opts.dense_master.write_back()
    opts.tp_master.write_back()
    s.sync(f"optimizer step {step}")
    compare_replay(s, opts, step)
    replay_control(s, opts, step)
    moments.compare_moments(s, opts, step)
    dense = opts.dense_master.params
    compare_params(s, opts, step, "optimizer", dense, opts.tp_master.params, _stepped(s, opts))
    opts.tp_master.check_copy_back(s, step)


def _stepped(s: Sides, opts: Optimizers):
    """What of each dense stepped tensor the TP side's is held to after the step: the dense master
    itself where the TP side's are masters too (or neither side keeps any), else the dense module's
    weight, the dense master rounded into it: a user's optimizer whose masters tpcheck cannot see
    (kept in a dict) shows only its module's 16-bit weights, compared in that dtype with its bound,
    never with a float32 master's."""
    if not opts.dense_master.masters or opts.tp_master.masters:
        return lambda p: p
    module = dict(s.dense.named_parameters())
    rounded = {id(m): module[n] for n, m in opts.dense_master.params.items()}
    return lambda p: rounded.get(id(p), p)


def clip(s: Sides, opts: Optimizers, step: int) -> None:
    """The step's clipping (training.py: each side's own, the two total norms compared), then
    every parameter's clipped gradient on the TP side against the dense side's clipped by the
    dense rule (`clipped:<parameter>`): the norm alone cannot see a clipping that scales some
    gradients and not others. Each such check keeps, for the diagnosis, the factor the TP
    clipping scaled each parameter's gradient by and the dense side's."""
    if s.settings.clip_grad_norm is None:
        return
    before = training.tp_grads(s)
    coef = training.clip_grads(s, step)
    dense, tp = dict(s.dense.named_parameters()), dict(s.tp.named_parameters())
    compare_params(
        s, opts, step, "optimizer", dense, tp, lambda p: p.grad, label="clipped", tp_get=s.grad_of
    )
    if coef is not None:  # the diagnosis's numbers (a stand-in clipping may return none)
        training.keep_clip_scales(s, step, before, coef)


def zero_grads(s: Sides, opts: Optimizers) -> None:
    """Before every step, as a training loop zeroes: each optimizer's `zero_grad()` (the user's
    own on the TP side), each module's, and the TP module's `zero_grad_buffer()` where it has one
    (Megatron's DistributedDataParallel: the buffer its `main_grad`s live in). Gradients the TP
    framework keeps elsewhere than `.grad` (grad_source.py) are zeroed by tpcheck only under its
    own TP optimizer; under the user's, an accumulator nothing zeroes is the user's bug."""
    for opt in opts.all():
        training.zero_grad(opt)
    # under master weights the optimizers hold the masters
    for model in (s.dense, s.tp, s.truth):
        if model is not None:
            model.zero_grad(set_to_none=True)
    zero_buffer = getattr(s.tp, "zero_grad_buffer", None)
    if callable(zero_buffer):
        zero_buffer()
    if not isinstance(opts.tp_master, training.UserOptimizer):
        s.grad_of.zero(s.tp)


def restart_tp(s: Sides, opts: Optimizers) -> None:
    """Every step after the first starts the TP side from the dense side's weights (and
    masters), written into its parameters in place through the plan (loading.py's
    `restart_in_place`; never through the user's `load_tp`, which loads once): each step is then
    checked from the same weights, so its forward, grads and update are held to the rounding of
    that step's own arithmetic. Nothing is lost: the previous step's update was compared with
    the dense rule element by element (the replay) and the weights with the dense ones. The TP
    optimizer's state (and the replay's) restarts from the dense optimizer's (moments.py's
    `restart_state`). Anything the TP module keeps besides its parameters (caches derived from
    the weights, buffers) is not touched: stale as in training, where nothing rebuilds it."""
    restart_in_place(s.tp, s.dense, s.plan, s.group)
    if opts.tp_master.masters:
        source = opts.dense_master if opts.dense_master.masters else s.dense
        training.restart_masters(opts.tp_master, source, s.plan, s.group)
    moments.restart_state(s, opts)


def restart_truth(
    s: Sides, opts: Optimizers, dense_params, dense_opt: torch.optim.Optimizer | None = None
) -> None:
    """The float64 truth restarts from the dense side at every step: its weights (before the
    forward: the weights the dense module computes with; before the optimizer step: what the
    dense optimizer steps, and that optimizer's state, in float64). So the dense side's distance
    to the truth is the rounding of this step's arithmetic only, never the dense trajectory's
    own drift (16-bit weights cannot follow lr-sized updates exactly: without the restart the
    reference's "error" after one step is of the order of the update itself, and every bound
    after it is vacuous)."""
    if opts.opt_truth is None:
        return
    truth = dict(s.truth.named_parameters())
    with torch.no_grad():
        for name, p in dense_params:
            t = truth[name]
            t.copy_(p.detach().double())
            if dense_opt is not None and (state := dense_opt.state.get(p)):
                opts.opt_truth.state[t] = {k: _in_float64(v, t.dtype) for k, v in state.items()}


def _in_float64(value, dtype: torch.dtype = torch.float64):
    """An optimizer state entry for the float64 truth: moment tensors in float64 (in `dtype`: the
    truth parameter's, float32 for a module the case keeps so), the rest (a scalar step tensor, a
    number) copied as they are."""
    if not torch.is_tensor(value):
        return value
    return (
        value.detach().clone().to(dtype)
        if value.is_floating_point() and value.dim()
        else value.clone()
    )
