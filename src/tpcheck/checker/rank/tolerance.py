"""Tolerances with reasons.

Three kinds of comparison, each recorded with the bound it used and why:

* exact: bitwise equality. Used where no arithmetic separates the two tensors: TP weights loaded
  from the dense ones (pure indexing), copies of a replicated tensor on different ranks (the result
  of one all-reduce, or the same computation on the same inputs), and the TP optimizer's update and
  state against the dense rule replayed on the TP side's own weights and grads
  (checker/rank/optimizer.py).

* calibrated: the TP tensor against the dense model's tensor in the same dtype, with a bound tied to
  the dense model's own error against a float64 ground truth (the dense model in float64, rank 0
  only). Every step starts both sides and the truth from the same weights
  (checker/rank/optimizer_stage.py), so that error is the rounding of this step's arithmetic:

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

* by magnitude: one element of a tensor far larger than the rest (the "massive activations" of an
  LLM's residual stream, an outlier input) would set the max above for every element. So a tensor of
  SMALL_NUMEL elements or more is judged per magnitude bin. An element's magnitude is the largest
  |dense| of its row (the last dimension: a token's hidden vector, a weight's output row): the
  rounding an element carries comes from the terms that made it, and those scale with its row (an
  element near zero in a row that holds an outlier carries the outlier's rounding). Rows are binned
  by that magnitude, BIN_OCTAVES octaves a bin below the tensor's largest, MAGNITUDE_BINS bins, the
  last holding every smaller row; the elements of a bin are held to the bound above computed over
  every element of magnitude up to the bin's (its bin and all smaller ones), the floor an ulp of
  the largest of them; a bin of fewer than MIN_BIN_NUMEL elements, or whose rows are no larger than
  the whole tensor's largest dense error (noise: a value zero in exact arithmetic carries the
  rounding of the terms around it, not its own), takes the next larger bin's bound. The top
  bin's bound is the whole tensor's, so no bin's is wider; an outlier widens only its own row's.
  A tensor of one row (a bias, a norm weight, the loss) is judged whole. Only activations and
  their gradients (BY_MAGNITUDE_STAGES) are binned: there a row is a token, computed from that
  token's terms. A parameter's gradient sums over every token and TP all-reduces it from partial
  sums (GQA's KV heads: one partial per rank's query heads), each rounded at its own size, which
  the row's magnitude does not bound: binned, correct cases failed (measured: 2 in 2,000, a
  replicated KV head's gradient rows 16x below the tensor's largest, 12x the dense error there).
  Measured like the rest (docs/tolerances.md).

* float64 as the working dtype has no higher-precision truth here, so the bound is
  `FP64_FLOOR_ULPS * eps * scale` (about 1e-10 relative): reduction-order noise in float64 is ~1e-16
  relative per operation, a fault is ~1e-1.

After an adaptive optimizer step the post-step weights also get the allowance of
checker/rank/optimizer.py (the update difference this step's grad difference explains
under the dense rule).

docs/tolerances.md has the derivation, the measured numbers and the detectability table.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from tpcheck.checker.rank.measure import absmax, max_abs_diff, row_max_abs_diff


@dataclass(frozen=True)
class Constant:
    """One published constant of the bound: its name in this module, its value, what it is."""

    name: str
    value: int | float
    meaning: str


# The bound's published constants, in one place, as data: the module's names below are read from
# it, and docs/tolerances.md#the-bounds-constants is generated from it (published.py), a test
# holding the page to it.
BOUND_CONSTANTS = (
    Constant("MAX_FACTOR", 8.0, "F, the factor on the dense error: SMALL_NUMEL elements or more"),
    Constant("SMALL_FACTOR", 16.0, "F under SMALL_NUMEL elements (the max of a few is noisier)"),
    Constant("SMALL_NUMEL", 64, "elements from which MAX_FACTOR, FLOOR_ULPS and the bins apply"),
    Constant("FLOOR_ULPS", 1, "k, the floor in ulps of the scale: SMALL_NUMEL elements or more"),
    Constant("SMALL_FLOOR_ULPS", 8, "k under SMALL_NUMEL elements"),
    Constant("FP64_FLOOR_ULPS", 2**20, "a float64 run's whole bound, in ulps of the scale"),
    Constant("MAGNITUDE_BINS", 6, "magnitude bins of a tensor, the last holding every smaller row"),
    Constant("BIN_OCTAVES", 4, "octaves of row magnitude per bin, below the tensor's largest"),
    Constant("MIN_BIN_NUMEL", 64, "elements a bin needs (with those below it) for its own bound"),
)
_PUBLISHED = {c.name: c.value for c in BOUND_CONSTANTS}
MAX_FACTOR = _PUBLISHED["MAX_FACTOR"]
SMALL_NUMEL, SMALL_FACTOR = _PUBLISHED["SMALL_NUMEL"], _PUBLISHED["SMALL_FACTOR"]
FLOOR_ULPS, SMALL_FLOOR_ULPS = _PUBLISHED["FLOOR_ULPS"], _PUBLISHED["SMALL_FLOOR_ULPS"]
FP64_FLOOR_ULPS = _PUBLISHED["FP64_FLOOR_ULPS"]
MAGNITUDE_BINS, BIN_OCTAVES = _PUBLISHED["MAGNITUDE_BINS"], _PUBLISHED["BIN_OCTAVES"]
MIN_BIN_NUMEL = _PUBLISHED["MIN_BIN_NUMEL"]
# the stages whose tensors are judged by magnitude: activations and their gradients, whose rows are
# tokens (see the module docstring for why not parameter gradients and weights)
BY_MAGNITUDE_STAGES = ("forward", "backward")


def factor(world_size: int, numel: int = SMALL_NUMEL) -> float:
    """The calibrated bound's factor for a tensor of `numel` elements (world-independent: see the
    module docstring)."""
    return MAX_FACTOR if numel >= SMALL_NUMEL else SMALL_FACTOR


def floor_ulps(numel: int) -> int:
    """The calibrated bound's floor, in ulps of the scale, for a tensor of `numel` elements."""
    return FLOOR_ULPS if numel >= SMALL_NUMEL else SMALL_FLOOR_ULPS


def eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


@dataclass(frozen=True)
class Bound:
    value: float | None
    kind: str  # "exact" | "calibrated" | "fp64"
    reason: str
    ref_error: float | None = None  # calibrated: max |dense - truth|
    floor: float | None = None  # calibrated: floor_ulps * eps * scale
    # by magnitude (calibrated, SMALL_NUMEL elements or more): per bin of magnitude, the largest
    # first, (bound, ref_error, floor, magnitude: the largest row magnitude the bin's bound covers);
    # None where every bin's is the whole tensor's
    bins: tuple[tuple[float, float, float, float], ...] | None = None
    scale: float | None = None  # calibrated: max |truth|
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
    # by row where the bins want it (a tensor's max is its rows' max), else in one measure
    rows = row_max_abs_diff(dense, truth) if truth.numel() >= SMALL_NUMEL else None
    if rows is not None:
        err_dense = float(rows.max())
    else:
        err_dense = float(max_abs_diff(dense, truth, torch.float64)) if truth.numel() else 0.0
    f = factor(world_size, truth.numel())
    ulps = floor_ulps(truth.numel())
    floor = ulps * eps(dtype) * scale
    return Bound(
        f * err_dense + floor,
        "calibrated",
        f"{f:g} x dense {str(dtype).removeprefix('torch.')} error vs float64 ({err_dense:.3g}) "
        f"+ {ulps} ulp(s) of scale {scale:.3g}",
        ref_error=err_dense,
        floor=floor,
        bins=_by_magnitude(dense, rows, dtype, scale) if rows is not None else None,
        scale=scale,
    )


def plus_floor(bound: Bound, extra: float, why: str) -> Bound:
    """`bound` with `extra` added to its floor (and to every magnitude bin's), `why` in its
    reason."""
    bins = bound.bins and tuple((b + extra, r, f + extra, m) for b, r, f, m in bound.bins)
    return dataclasses.replace(
        bound,
        value=bound.value + extra,
        floor=(bound.floor or 0.0) + extra,
        bins=bins,
        reason=f"{bound.reason} + {why} ({extra:.3g})",
    )


def top_exponent(dense: torch.Tensor) -> int:
    """The binary exponent of the tensor's largest magnitude (frexp's: |x| < 2**e), which every
    rank computes alike from the dense tensor it holds; it places the bins."""
    return math.frexp(absmax(dense))[1]  # C's frexp, as torch.frexp (0 for 0, inf and NaN)


def row_magnitudes(dense: torch.Tensor) -> torch.Tensor:
    """`row_magnitude` with one value per row (flat, float64): what the bins are made of."""
    return row_magnitude(dense)[..., 0].reshape(-1) if dense.dim() else row_magnitude(dense)


def in_one_bin(magnitudes: torch.Tensor, top: int) -> bool:
    """Whether every row of `magnitudes` (`row_magnitudes`) falls in the top bin (`magnitude_bin`
    0: within BIN_OCTAVES octaves of 2**top, none zero): the tensor is then judged whole, its bins
    all the whole tensor's bound. Every rank decides it alike, from the dense tensor."""
    smallest = float(magnitudes.min())
    return smallest > 0 and top - math.frexp(smallest)[1] < BIN_OCTAVES


def row_magnitude(dense: torch.Tensor) -> torch.Tensor:
    """Each element's magnitude for the bins: the largest |dense| of its row (last dimension), in
    float64, in the dense layout (a rank shards it through its placement, as the reference)."""
    a = dense.detach()
    if a.is_complex() or not a.dim():
        a = a.double().abs()
        return a.amax(-1, keepdim=True).expand_as(a) if a.dim() else a
    # |x| and max are exact in any floating dtype: the float64 conversion once per row
    return a.abs().amax(-1, keepdim=True).double().expand(a.shape)


def _per_row(magnitude: torch.Tensor) -> torch.Tensor | None:
    """`magnitude`'s one value per row (last dimension), flattened, where each row holds a single
    value (`row_magnitude`, or a rank's shard of it); None where a row holds several. Binning then
    takes one element per row: the bin of every element of a row is its row's."""
    m = magnitude.detach()
    if not m.dim() or not m.shape[-1]:
        return None
    first = m[..., :1]
    if m.stride(-1) != 0 and not bool((m == first).all()):
        return None
    return first.reshape(-1).double()


def magnitude_bin(magnitude: torch.Tensor, top: int) -> torch.Tensor:
    """The bin of each element of `magnitude` (flattened; `row_magnitude`'s, or a rank's shard of
    it): 0 for the largest (within BIN_OCTAVES octaves of 2**top), MAGNITUDE_BINS - 1 for the
    smallest and for 0."""
    m = magnitude.detach().reshape(-1).double()
    e = torch.frexp(m).exponent.long()
    k = torch.div(top - e, BIN_OCTAVES, rounding_mode="floor").clamp_(0, MAGNITUDE_BINS - 1)
    return k.masked_fill_(m == 0, MAGNITUDE_BINS - 1)


def per_bin_max(diff: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """max of `diff` (flat, float64, non-negative) over the elements of each bin (0 where none)."""
    out = torch.zeros(MAGNITUDE_BINS, dtype=torch.float64)
    return out.scatter_reduce_(0, bins, diff, reduce="amax", include_self=True)


def _by_magnitude(dense, err, dtype, scale: float):
    """Bound.bins: the calibrated bound per bin of magnitude (see the module docstring), `err` the
    dense error of each row (`row_max_abs_diff`); None where every bin would get the whole
    tensor's."""
    top = top_exponent(dense)
    # one entry per row: its magnitude, its largest error, its bin (every element of a row is in
    # its row's bin, so a bin's max over rows is its max over elements)
    magnitude = row_magnitudes(dense)
    if in_one_bin(magnitude, top) or not bool(torch.isfinite(err).all()):
        return None  # every row in the top bin: every bin's bound is the whole tensor's
    bins = magnitude_bin(magnitude, top)

    def cumulative(per_bin):  # bin k and every smaller one
        return per_bin.flip(0).cummax(0).values.flip(0)

    below = cumulative(per_bin_max(err, bins))
    largest = cumulative(per_bin_max(magnitude, bins))
    row = dense.shape[-1]
    count = (torch.bincount(bins, minlength=MAGNITUDE_BINS) * row).flip(0).cumsum(0).flip(0)
    out, last = [], None
    for k in range(MAGNITUDE_BINS):
        # a bin of its own: enough elements, and rows larger than the tensor's largest rounding
        # error (rows below it are noise, not values: a gradient that is zero in exact arithmetic
        # is the rounding carried in from elsewhere, as large on the TP side as the tensor's)
        own = int(count[k]) >= MIN_BIN_NUMEL and float(largest[k]) > float(below[0])
        if own or last is None:
            # the floor: an ulp of the largest element judged (the whole tensor's scale at the top)
            m = scale if last is None else float(largest[k])
            floor = FLOOR_ULPS * eps(dtype) * m
            last = (MAX_FACTOR * float(below[k]) + floor, float(below[k]), floor, m)
        out.append(last)
    return tuple(out) if any(b != out[0] for b in out) else None


def bin_errors(
    tp_local: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, top: int
) -> tuple:
    """This rank's max |TP - reference| per bin, `magnitude` being the shard of the dense tensor's
    `row_magnitude` that `ref` is of (the bins placed as rank 0 placed them for its bounds)."""
    if (rows := _per_row(magnitude)) is not None:  # a row's largest difference, binned by row
        diff = row_max_abs_diff(tp_local.reshape(magnitude.shape), ref.reshape(magnitude.shape))
        bins = magnitude_bin(rows, top)
    else:
        diff = (tp_local.detach().reshape(-1).double() - ref.detach().reshape(-1).double()).abs_()
        bins = magnitude_bin(magnitude, top)
    return tuple(per_bin_max(torch.nan_to_num(diff, nan=math.inf), bins).tolist())


def worst_bin(errors: tuple, bins: tuple) -> int:
    """The bin whose error is the largest share of its bound (an error over a zero bound first)."""

    def share(k: int) -> float:
        e, b = errors[k], bins[k][0]
        return e / b if b > 0 else (math.inf if e > 0 else 0.0)

    return max(range(len(bins)), key=share)


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
    d, t = dense.detach().reshape(-1), truth.detach().reshape(-1)
    if t.dtype != torch.float64 or d.is_complex() or t.is_complex():
        d, t = d.double(), t.double()
    # in float64 (the subtraction promotes `dense`), in slices of 2**18 elements: no temporary as
    # large as the tensor
    if len(t) <= 2**18:
        return float(torch.sub(t, d).abs_().max())  # NaN where a difference is
    worst = [
        torch.sub(t[i : i + 2**18], d[i : i + 2**18]).abs_().max() for i in range(0, len(t), 2**18)
    ]
    return float(torch.stack(worst).max())


# What may excuse a control that was not flagged (`blind_spot`), frozen here apart from the bound's
# constants above and never read from them: the published bound
# (docs/tolerances.md#the-bounds-constants) as a multiple of the dense model's own error and of the
# dtype's resolution at the tensor's scale. A bound made wider than published, by its constants or
# by its code, is then not also an excuse for its controls; tests/docs/test_tolerance_constants.py
# holds these to the published values.
BLIND_SPOT_FACTOR = {"large": 8.0, "small": 16.0}  # x the dense error the self-test measured
BLIND_SPOT_ULPS = {"large": 1, "small": 8}  # x eps(dtype) x the tensor's scale
BLIND_SPOT_SMALL_NUMEL = 64  # "small": fewer elements than this


def blind_spot(
    measured: float, scale: float, numel: int, dtype: torch.dtype, planted: float
) -> str | None:
    """Why a calibrated control of `planted` may go unflagged, or None (then it must be flagged):
    half the planted error is within what the published bound allows this tensor, computed here
    from the self-test's own measures and constants (`measured`: `dense_error`; BLIND_SPOT_*), not
    from the bound's: an ill-conditioned tensor (an RMSNorm of a near-zero input in 16 bits) is
    honestly blind there; a bound wider than published, by its constants or its code, or a dense
    error misread, is not excused."""
    size = "small" if numel < BLIND_SPOT_SMALL_NUMEL else "large"
    resolution = float(torch.finfo(dtype).eps) * scale
    published = BLIND_SPOT_FACTOR[size] * measured + BLIND_SPOT_ULPS[size] * resolution
    if 2 * published < planted:
        return None
    return (
        f"the dense model's own error {measured:.3g} puts the published bound ({published:.3g}) "
        f"above half the planted {planted:.3g}"
    )
