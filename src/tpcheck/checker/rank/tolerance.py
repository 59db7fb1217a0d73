"""Tolerances with reasons.

Three kinds of comparison, each recorded with the bound it used and why:

* exact: bitwise equality. Used where no arithmetic separates the two tensors: TP weights loaded
  from the dense ones (pure indexing), copies of a replicated tensor on different ranks (the result
  of one all-reduce, or the same computation on the same inputs), and the TP optimizer's update and
  state against the dense rule replayed on the TP side's own weights and grads
  (checker/rank/optimizer.py).

* calibrated: the TP tensor against the dense model's tensor in the same dtype, with a bound tied to
  the dense model's own error against a float64 ground truth (the dense model in float64, rank 0
  only). Every step starts both sides and the truth from the same weights (checker/rank/engine.py),
  so that error is the rounding of this step's arithmetic:

      max |TP - dense| <= MAX_FACTOR * max |dense - truth| + FLOOR_ULPS * eps * max |truth|

  Why. A correct TP implementation computes the same sums in another order: each rank's partial sum
  is rounded, then the reduction rounds once per addition, and later layers carry those differences
  as they carry the dense model's own rounding. So |TP - truth| is of the order of |dense - truth|,
  and |TP - dense| <= |TP - truth| + |dense - truth|. How large the first term can get is measured,
  not guessed: over 2,000 random correct cases of every block, dtype, world size 1-8, SP on/off and
  1-3 micro-batches (benchmarks/bounds.py), (|TP - dense| - floor) / |dense - truth| stayed below
  5.9 on tensors of 64 elements or more, with no trend in the world size (each extra rank adds
  roundings of smaller partial sums). MAX_FACTOR = 8 leaves 1.4x room; widening it further costs
  bfloat16 detectability. Below SMALL_NUMEL = 64 elements (norm weights, biases, the loss) the max
  is a ratio of a handful of rounding errors, a heavy-tailed statistic (measured up to 6.1 over 16
  elements): SMALL_FACTOR = 16. The floor covers tensors the dense model happens to compute exactly
  (a scalar loss, an embedding lookup, an element whose AdamW update difference was explained away):
  1 ulp of the tensor's scale, 8 under SMALL_NUMEL elements. What this bound can
  see, per dtype and world size, is the detectability table in docs/tolerances.md.

* float64 as the working dtype has no higher-precision truth here, so the bound is
  `FP64_FLOOR_ULPS * eps * scale` (about 1e-10 relative): reduction-order noise in float64 is ~1e-16
  relative per operation, a fault is ~1e-1.

After an adaptive optimizer step the post-step weights also get the allowance of
checker/rank/optimizer.py (the update difference this step's grad difference explains
under the dense rule).

docs/tolerances.md has the derivation, the measured numbers and the detectability table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpcheck.checker.rank.loading import absmax, max_abs_diff

MAX_FACTOR = 8.0
SMALL_NUMEL, SMALL_FACTOR = 64, 16.0  # the max over a handful of elements is a noisier statistic
FLOOR_ULPS, SMALL_FLOOR_ULPS = 1, 8  # ulps of the scale; tensors under SMALL_NUMEL elements
FP64_FLOOR_ULPS = 2**20


def factor(world_size: int, numel: int = SMALL_NUMEL) -> float:
    """The calibrated bound's factor for a tensor of `numel` elements (world-independent: see the
    module docstring)."""
    return MAX_FACTOR if numel >= SMALL_NUMEL else SMALL_FACTOR


def eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


@dataclass(frozen=True)
class Bound:
    value: float | None
    kind: str  # "exact" | "calibrated" | "fp64"
    reason: str
    ref_error: float | None = None  # calibrated: max |dense - truth|
    floor: float | None = None  # calibrated: floor_ulps * eps * scale
    # calibrated: max |dense - truth| as the self-test measures it, apart from this bound's own
    # arithmetic (`dense_error`): what may excuse a control the bound does not flag (`blind_spot`)
    measured: float | None = None


EXACT = Bound(0.0, "exact", "bitwise: no arithmetic separates TP from the reference (layout only)")
PENDING = Bound(None, "calibrated", "from rank 0, which holds the float64 ground truth")
REPLICA = Bound(0.0, "exact", "bitwise: replicas come from one all-reduce or identical computation")


def calibrated(
    dense: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype, world_size: int
) -> Bound:
    """The bound for a TP tensor in `dtype` against the float64 `truth` (see module docstring)."""
    scale = absmax(truth)
    if dtype == torch.float64:
        value = FP64_FLOOR_ULPS * eps(dtype) * scale
        return Bound(value, "fp64", f"float64: {FP64_FLOOR_ULPS} ulps of scale {scale:.3g}")
    err_dense = float(max_abs_diff(dense, truth, torch.float64)) if truth.numel() else 0.0
    f = factor(world_size, truth.numel())
    ulps = FLOOR_ULPS if truth.numel() >= SMALL_NUMEL else SMALL_FLOOR_ULPS
    floor = ulps * eps(dtype) * scale
    return Bound(
        f * err_dense + floor,
        "calibrated",
        f"{f:g} x dense {str(dtype).removeprefix('torch.')} error vs float64 ({err_dense:.3g}) "
        f"+ {ulps} ulp(s) of scale {scale:.3g}",
        ref_error=err_dense,
        floor=floor,
    )


# The self-test's planted error, relative to the tensor's scale: the published detectability of each
# working dtype (docs/tolerances.md#detectability, the largest threshold over world sizes 2-8 of the
# calibrated "partial" row: the smallest error the checker claims to flag), for every tensor of a
# run in that dtype (float32 masters of a 16-bit run included: their differences come from 16-bit
# grads). float64 has no published row: 1e-8, fifty times its bound (2**20 ulps, ~2e-10 relative).
# A control shifted by this much must fail its check (compare.py), unless `blind_spot` excuses it.
CONTROL_RELATIVE = {
    torch.float64: 1e-8,
    torch.float32: 1e-5,
    torch.bfloat16: 0.2,
    torch.float16: 0.02,
}


def control_shift(dtype: torch.dtype, scale: float) -> float:
    """How far the self-test moves one element of a tensor whose largest magnitude is `scale`, in a
    run whose working dtype is `dtype`."""
    rel = CONTROL_RELATIVE.get(dtype, CONTROL_RELATIVE[torch.float32])
    return rel * scale if scale > 0 else 1.0


def dense_error(dense: torch.Tensor, truth: torch.Tensor) -> float:
    """max |dense - truth|, measured for the self-test by its own arithmetic (not `calibrated`'s):
    a bound whose dense error is misread cannot also excuse its controls."""
    if not truth.numel():
        return 0.0
    return float((dense.detach().double() - truth.detach().double()).abs().max())


def blind_spot(
    measured: float, scale: float, numel: int, dtype: torch.dtype, planted: float
) -> str | None:
    """Why a calibrated control of `planted` may go unflagged, or None (then it must be flagged):
    the published bound (module docstring: 8 or 16 x the dense error + 1 or 8 ulps of the scale),
    recomputed here from `measured` (`dense_error`), reaches half the planted error. An
    ill-conditioned tensor (an RMSNorm of a near-zero input in 16 bits) is honestly blind there; a
    bound that is wider than published, or a dense error misread, is not excused."""
    small = numel < SMALL_NUMEL
    published = (SMALL_FACTOR if small else MAX_FACTOR) * measured + (
        SMALL_FLOOR_ULPS if small else FLOOR_ULPS
    ) * eps(dtype) * scale
    if 2 * published < planted:
        return None
    return (
        f"the dense model's own error {measured:.3g} puts the published bound ({published:.3g}) "
        f"above half the planted {planted:.3g}"
    )
