"""Tolerances with reasons.

Three kinds of comparison, each recorded with the bound it used and why:

* exact: bitwise equality. Used where no arithmetic separates the two tensors: TP weights loaded
  from the dense ones (pure indexing), and copies of a replicated tensor on different ranks (the
  result of one all-reduce, or the same computation on the same inputs).

* calibrated: the TP tensor is compared with the dense model's tensor in the same dtype, and the
  bound is tied to the dense model's own error against a float64 ground truth (the dense model run
  in float64, on rank 0 only):

      max|TP - dense| <= factor(world) * err_dense + floor_ulps * eps(dtype) * scale

  where err_dense = max|dense_dtype - truth|, scale = max|truth|. A correct TP implementation only
  reorders sums (partials per rank, then a cross-rank reduction, each rounded in the working dtype),
  so it lands as far from the truth as the dense model does, and |TP - dense| <= |TP - truth| +
  |dense - truth| is of the order of err_dense. factor = 4 + 2 * world_size allows one extra rounding
  of each rank's partial sum plus the reduction, with room for the max over a small tensor being a
  noisy statistic (measured: correct blocks stay below 0.5 of the bound in random sweeps); the floor
  covers tensors (a scalar loss) where the dense result happens to round exactly to the truth. Faults
  move values by orders of magnitude more (a missing reduction is an O(1) relative error).

* after an adaptive optimizer step (AdamW), each element may also differ by 2 * lr * |u_tp - u_dense|,
  u = m_hat / (sqrt(v_hat) + eps) from each side's own moments (see RankRun._adaptive_slack): AdamW
  turns rounding-level grad differences into up to 2 * lr where a moment is near 0, so this stage
  checks that the same update rule was applied to grads already checked.

* float64 as the working dtype has no higher-precision truth here, so the bound is
  `FP64_FLOOR_ULPS * eps * scale` (about 1e-10 relative): reduction-order noise in float64 is ~1e-16
  relative per operation, a fault is ~1e-1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tpcheck.check.loading import maxdiff

if TYPE_CHECKING:
    from tpcheck.parallel.group import TPGroup
    from tpcheck.plan import Placement

FLOOR_ULPS = 2
FP64_FLOOR_ULPS = 2**20


def factor(world_size: int) -> float:
    return 4.0 + 2.0 * world_size


def eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


@dataclass(frozen=True)
class Bound:
    value: float | None
    kind: str  # "exact" | "calibrated" | "fp64"
    reason: str


EXACT = Bound(0.0, "exact", "bitwise: no arithmetic separates TP from the reference (layout only)")
PENDING = Bound(None, "calibrated", "from rank 0, which holds the float64 ground truth")
REPLICA = Bound(0.0, "exact", "bitwise: replicas come from one all-reduce or identical computation")


def calibrated(dense: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype, world_size: int) -> Bound:
    """The bound for a TP tensor in `dtype` against the float64 `truth` (see module docstring)."""
    scale = float(truth.abs().max()) if truth.numel() else 0.0
    if dtype == torch.float64:
        value = FP64_FLOOR_ULPS * eps(dtype) * scale
        return Bound(value, "fp64", f"float64: {FP64_FLOOR_ULPS} ulps of scale {scale:.3g}")
    err_dense = float((dense.double() - truth).abs().max()) if truth.numel() else 0.0
    f = factor(world_size)
    floor = FLOOR_ULPS * eps(dtype) * scale
    return Bound(f * err_dense + floor, "calibrated",
                 f"{f:g} x dense {str(dtype).removeprefix('torch.')} error vs float64 ({err_dense:.3g}) "
                 f"+ {FLOOR_ULPS} ulps of scale {scale:.3g}")


def self_test(check, tp_out: torch.Tensor, dense_out: torch.Tensor, placement: Placement,
              group: TPGroup) -> dict:
    """The control run on every check (as Megatron's grad-match test does): a copy of the TP output
    with one element moved by twice the bound must be flagged by the same comparison, and the bound
    must be tight enough to see a 50% error (a missing reduction leaves each rank a partial sum, O(1)
    off). A checker that cannot fail is caught here. Measured: fp32 bounds are ~1e-6 relative,
    bf16 up to ~0.3 for the tiny LM's logits at tp 4 (the dense bf16 model's own error there)."""
    ref = placement.shard(dense_out, group.rank, group.world_size)
    scale = float(dense_out.abs().max()) if dense_out.numel() else 0.0
    bumped = tp_out.clone()
    flat = bumped.view(-1)
    i = int(flat.abs().argmax())
    flat[i] = flat[i] + 2 * check.bound + eps(tp_out.dtype) * max(abs(float(flat[i])), 1e-30)
    diff = maxdiff(bumped, ref)
    relative_bound = check.bound / scale if scale else math.inf
    return {"tensor": check.name, "bound": check.bound, "perturbed_error": diff,
            "flagged": bool(diff > check.bound), "relative_bound": relative_bound,
            "sensitive": bool(relative_bound < 0.5)}
