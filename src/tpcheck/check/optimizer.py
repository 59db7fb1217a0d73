"""The optimizer stage: after an adaptive optimizer step, how far the TP weights may be from the
dense ones for reasons the grads already explain.

An adaptive optimizer amplifies small grad differences: AdamW steps by lr * m / (sqrt(v) + eps),
about lr * sign(grad) at first, so where a moment is near 0 (or near eps) a rounding-level difference
in the grads can move an element by up to 2 x lr, and it stays moved. The grads were already checked
against their bounds; what the optimizer stage must show is that the TP side applied the same update
rule to them. So each element may differ by (twice) the update difference its own moments explain,
lr * |u_tp - u_dense| with u computed from each side's moments and the DENSE side's hyperparameters (a
different lr, betas, eps or weight decay on the TP side stays unexplained), accumulated over steps.
Likewise the float64 side against the dense one, so that bounds are not inflated by the same effect.
Only after adaptive optimizer steps.
"""
from __future__ import annotations

import torch


class AdaptiveSlack:
    """Per (side, parameter) slack accumulated over steps; `relax` returns the tensor with every
    element the slack explains set to the reference value."""

    def __init__(self, dense_opt: torch.optim.Optimizer, tp_opt: torch.optim.Optimizer,
                 truth_opt: torch.optim.Optimizer | None) -> None:
        self.dense_opt, self.tp_opt, self.truth_opt = dense_opt, tp_opt, truth_opt
        self.slack: dict[tuple[str, str], torch.Tensor] = {}

    def apply(self, name: str, placement, rank: int, world: int, tp_p, p, truth_p, tp_val, truth_val):
        """(tp_val, truth_val) relaxed by the update differences their moments explain."""
        hyper = next(g for g in self.dense_opt.param_groups if any(q is p for q in g["params"]))
        u_dense = adam_direction(self.dense_opt.state.get(p, {}), hyper)
        if u_dense is None:
            return tp_val, truth_val
        u_tp = adam_direction(self.tp_opt.state.get(tp_p, {}), hyper)
        if u_tp is not None:
            tp_val = self._relax(("tp", name), hyper, tp_val, placement.shard(p.detach(), rank, world), u_tp,
                                 placement.shard(u_dense, rank, world))
        if truth_val is not None and truth_p is not None and truth_p is not p and self.truth_opt is not None:
            u_truth = adam_direction(self.truth_opt.state.get(truth_p, {}), hyper)
            if u_truth is not None:
                truth_val = self._relax(("truth", name), hyper, truth_val, p.detach(), u_truth, u_dense)
        return tp_val, truth_val

    def _relax(self, key, hyper, x, ref, u_x, u_ref):
        slack = self.slack.setdefault(key, torch.zeros_like(x, dtype=torch.float64))
        slack += 2.0 * hyper["lr"] * (u_x.double() - u_ref.double()).abs()
        return torch.where((x - ref).abs().double() <= slack, ref.to(x.dtype), x)


def adam_direction(state: dict, hyper: dict) -> torch.Tensor | None:
    """Adam's step direction m_hat / (sqrt(v_hat) + eps) from one side's moments, or None."""
    if "exp_avg" not in state or "exp_avg_sq" not in state:
        return None
    (b1, b2), eps, t = hyper["betas"], hyper["eps"], float(state["step"])
    m_hat = state["exp_avg"].double() / (1 - b1**t)
    v_hat = state["exp_avg_sq"].double() / (1 - b2**t)
    return m_hat / (v_hat.sqrt() + eps)
