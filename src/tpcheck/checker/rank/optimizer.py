"""The optimizer stage.

0. What is stepped. In float32/float64, and with pure 16-bit parameters, each optimizer steps its
   module's own parameters. With a 16-bit dtype and master weights (the default: Megatron-Core's and
   torchtitan's recipe) each side keeps float32 masters: created from the module's 16-bit weights as
   loaded, given the module's grads upcast after the last micro-batch, stepped in float32 with
   float32 state, and rounded back into the module after the step (`Masters`).

1. The replay. The dense update rule (torch.optim, the dense side's hyperparameters) is applied to
   the TP side's own weights and gradients as they are just before the TP optimizer steps. SGD and
   AdamW are elementwise, so replaying them on a rank's local shards is exactly what the dense
   optimizer computes for those elements. The TP side's update must then equal the replay's bitwise
   (the same kernel sees the same inputs), and so must its optimizer state (exp_avg, exp_avg_sq,
   step). Nothing here is derived from the TP optimizer: a wrong lr, betas, eps, weight decay, a
   reset or missing state, a parameter left out on some rank, shows at the step where it first acts.

2. Against the dense model. After an adaptive optimizer step, how far the TP weights may be from the
   dense ones for reasons the grads already explain:

An adaptive optimizer amplifies small grad differences: AdamW steps by lr * m / (sqrt(v) + eps),
about lr * sign(grad) at first, so where a moment is near 0 (or near eps) a rounding-level
difference in the grads can move an element by up to 2 x lr, and it stays moved. The grads were
already checked against their bounds, and the replay has shown that the TP side applied the dense
rule to them. So each element may differ by (twice) the update difference the moments explain, lr *
|u_tp - u_dense|, with u from the dense hyperparameters and, for the TP side, the *replay's* moments
(the dense rule on the TP side's own grads), never the TP optimizer's own: a TP optimizer bug cannot
widen its own allowance. Per step (every step starts from the dense weights). Likewise the float64
side against the dense one, so that bounds are not inflated by the same effect. Only after adaptive
optimizer steps; the check then records the raw difference beside the one left unexplained
(`Check.raw_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tpcheck.checker.rank.training import UserOptimizer


class Masters:
    """The parameters one side's optimizer steps, by name: the module's own, or float32 masters.
    (The user's own TP optimizer is seen through the same few methods: checker/rank/training.py's
    `UserOptimizer`.)"""

    replay_after_step = False  # the replay's inputs are these parameters as they are before it

    def __init__(self, module: nn.Module, masters: bool, grad_of=None) -> None:
        self.module, self.masters = module, masters
        self.grad_of = grad_of  # the TP side's: where its framework keeps the gradients
        own = dict(module.named_parameters())
        self.params = (
            {n: nn.Parameter(p.detach().float().clone()) for n, p in own.items()}
            if masters
            else own
        )
        self._own = own

    @classmethod
    def of(cls, module: nn.Module, settings, grad_of=None) -> Masters:
        return cls(module, settings.uses_masters, grad_of)

    @property
    def owner(self):
        """What a TP-side optimizer factory is handed: the module itself, or (master weights) an
        object whose named_parameters() are the masters."""
        return self if self.masters else self.module

    def named_parameters(self):
        return iter(self.params.items())

    def parameters(self):
        return iter(self.params.values())

    def take_grads(self) -> None:
        """Masters: the module's accumulated grads, upcast to float32 (None stays None). With
        `grad_of` (gradients the TP framework keeps elsewhere than `.grad`: grad_source.py), those,
        handed to the masters, or to the module's own parameters as their `.grad` (in their dtype)
        when they are what is stepped."""
        if self.masters:
            for n, m in self.params.items():
                g = self._own[n].grad if self.grad_of is None else self.grad_of(self._own[n])
                m.grad = None if g is None else g.detach().float()
        elif self.grad_of is not None and self.grad_of.elsewhere:
            for p in self.params.values():
                g = self.grad_of(p)
                p.grad = None if g is None else g.detach().to(p.dtype, copy=True)

    def write_back(self) -> None:
        """Masters: the stepped float32 values, rounded into the module's parameters."""
        if self.masters:
            with torch.no_grad():
                for n, m in self.params.items():
                    self._own[n].copy_(m)

    def replay_inputs(self) -> tuple[dict, dict]:
        """What the replay of the dense rule starts from: these parameters and their grads."""
        return self.params, {n: p.grad for n, p in self.params.items()}

    def state_of(self, name: str, opt: torch.optim.Optimizer) -> dict:
        """`opt`'s state of parameter `name` (what it lacks is empty: nothing accumulated)."""
        return opt.state.get(self.params[name], {})

    def update_observable(self) -> bool:
        return True

    def check_copy_back(self, e, step: int) -> None:
        """Nothing: the masters are rounded into the module by `write_back`, here."""


class Replay:
    """The dense update rule on the TP side's own inputs: `run(values, grads)` copies each TP
    parameter and its gradient as the TP optimizer was handed them and steps `make_rule` (over
    (name, parameter) pairs) on the copies."""

    def __init__(self, tp_params: dict[str, torch.Tensor], make_rule) -> None:
        self.params = {n: nn.Parameter(p.detach().clone()) for n, p in tp_params.items()}
        self.before: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor | None] = {}
        self.opt = make_rule(list(self.params.items()))
        self.make_rule, self.tp_params = make_rule, tp_params

    def planted(self, name: str) -> tuple[Replay, int] | None:
        """The self-test's control of the replay itself: a second replay from no state (a first
        step's), on the inputs this replay was handed but with the gradient of `name` negated at
        its largest element (its update must then differ from the TP side's there: the rule moves
        it the other way), and the flat index of that element; None where the gradient is zero.
        The rule is made over every parameter, as for the replay: a user's rule may split them in
        groups (no weight decay on biases and norms) that one parameter alone would leave empty;
        only `name` gets a gradient, so only it is stepped."""
        grad = self.grads.get(name)
        if grad is None or not bool(grad.abs().max() > 0):
            return None
        moved = grad.detach().clone().reshape(-1)
        i = int(moved.abs().argmax())
        moved[i] = -moved[i]
        control = Replay(self.tp_params, self.make_rule)
        control.run({name: self.before[name]}, {name: moved.view_as(grad)})
        return control, i

    def run(self, values: dict[str, torch.Tensor], grads: dict) -> None:
        with torch.no_grad():
            for name, value in values.items():
                r, g = self.params[name], grads.get(name)
                r.copy_(value.detach())
                r.grad = None if g is None else g.detach().clone()
                self.grads[name] = r.grad
                self.before[name] = value.detach().clone()
        self.opt.step()

    def update(self, name: str) -> torch.Tensor:
        """The replay's update of `name`: after - before."""
        return self.params[name].detach() - self.before[name]

    def live_state(self, name: str) -> dict | None:
        """The replay's optimizer state of `name` itself (written in place by a restart), or
        None before the replay first stepped it."""
        return self.opt.state.get(self.params[name]) if name in self.params else None

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """The replay's optimizer state of `name` (tensors only), e.g. exp_avg, exp_avg_sq, step."""
        return {
            k: v
            for k, v in self.opt.state.get(self.params[name], {}).items()
            if isinstance(v, torch.Tensor)
        }


class AdaptiveSlack:
    """`apply` returns the tensors with every element that this step's update difference explains
    set to the reference value (both sides start every step from the dense weights:
    nothing accumulates)."""

    def __init__(
        self,
        dense_opt: torch.optim.Optimizer,
        replay: Replay,
        truth_opt: torch.optim.Optimizer | None,
    ) -> None:
        self.dense_opt, self.replay, self.truth_opt = dense_opt, replay, truth_opt

    def apply(
        self,
        name: str,
        placement,
        rank: int,
        world: int,
        tp_name: str,
        p,
        truth_p,
        tp_val,
        truth_val,
    ):
        """(tp_val, truth_val) relaxed by the update differences their moments explain; the TP
        side's moments are the replay's (dense rule on the TP side's own grads)."""
        hyper = next(g for g in self.dense_opt.param_groups if any(q is p for q in g["params"]))
        u_dense = adam_direction(self.dense_opt.state.get(p, {}), hyper)
        if u_dense is None:
            return tp_val, truth_val
        u_tp = adam_direction(self.replay.state(tp_name), hyper)
        if u_tp is not None:
            tp_val = self._relax(
                hyper,
                tp_val,
                placement.shard(p.detach(), rank, world),
                u_tp,
                placement.shard(u_dense, rank, world),
            )
        return tp_val, self.relax_truth(p, truth_p, truth_val)

    def relax_truth(self, p, truth_p, truth_val):
        """`truth_val` (the float64 truth's parameter after the step) relaxed toward the dense one
        by the update difference the two sides' moments explain."""
        if truth_val is None or truth_p is None or truth_p is p or self.truth_opt is None:
            return truth_val
        hyper = next(g for g in self.dense_opt.param_groups if any(q is p for q in g["params"]))
        u_dense = adam_direction(self.dense_opt.state.get(p, {}), hyper)
        u_truth = adam_direction(self.truth_opt.state.get(truth_p, {}), hyper)
        if u_dense is None or u_truth is None:
            return truth_val
        return self._relax(hyper, truth_val, p.detach(), u_truth, u_dense)

    @staticmethod
    def _relax(hyper, x, ref, u_x, u_ref):
        slack = 2.0 * hyper["lr"] * (u_x.double() - u_ref.double()).abs()
        return torch.where((x - ref).abs().double() <= slack, ref.to(x.dtype), x)


def adam_direction(state: dict, hyper: dict) -> torch.Tensor | None:
    """Adam's step direction m_hat / (sqrt(v_hat) + eps) from one side's moments, or None."""
    if "exp_avg" not in state or "exp_avg_sq" not in state:
        return None
    (b1, b2), eps, t = hyper["betas"], hyper["eps"], float(state["step"])
    m_hat = state["exp_avg"].double() / (1 - b1**t)
    v_hat = state["exp_avg_sq"].double() / (1 - b2**t)
    return m_hat / (v_hat.sqrt() + eps)


@dataclass(frozen=True, eq=False)
class Optimizers:
    """Each side's optimizer and what it steps, the replay and the adaptive allowance."""

    dense_master: Masters
    opt_dense: torch.optim.Optimizer
    tp_master: Masters | UserOptimizer
    opt_tp: object  # the TP side's optimizer: a torch optimizer, or the user's wrapper
    opt_truth: torch.optim.Optimizer | None
    replay: Replay
    slack: AdaptiveSlack | None
    # what a user's optimizer keeps out of sight: "state"/"update" -> parameter names
    unobserved: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # how the dense side follows the user's

    def all(self) -> list:
        return [o for o in (self.opt_dense, self.opt_tp, self.opt_truth) if o is not None]
