"""The per-element bounds computed by rows (tolerance.py, measure.py) are the bounds of their
definition, bitwise: a plain per-element statement of docs/tolerances.md ("by magnitude") written
out here, element by element with masks, is compared with what the checker computes, on synthetic
tensors (outliers, zero rows, NaN, every dtype, shards of every placement kind) and on every
tensor a real case bounds (the checker's own functions wrapped while the case runs)."""

import dataclasses
import math

import pytest
import torch

from tpcheck.checker.rank import measure, tolerance
from tpcheck.plan import Fused, Placement, Replicate, Shard

BINS, OCTAVES, MIN_NUMEL, FACTOR = 6, 4, 64, 8.0  # the published constants, written out


def reference_bins(dense, truth, dtype, scale):
    """Bound.bins as documented: every element binned by its row's largest |dense|, a bin's bound
    over the elements of that bin and every smaller one."""
    d, t = dense.detach().double(), truth.detach().double()
    top = int(torch.frexp(d.abs().max()).exponent)
    mag = d.abs().amax(-1, keepdim=True).expand_as(d).reshape(-1)
    e = torch.frexp(mag).exponent.long()
    k = torch.div(top - e, OCTAVES, rounding_mode="floor").clamp(0, BINS - 1)
    k[mag == 0] = BINS - 1
    err = (d - t).abs().reshape(-1)
    if not bool(torch.isfinite(err).all()):
        return None
    eps = torch.finfo(dtype).eps
    out, last = [], None
    for b in range(BINS):
        held = k >= b  # bin b and every smaller one
        below = float(err[held].max()) if held.any() else 0.0
        largest = float(mag[held].max()) if held.any() else 0.0
        whole = float(err.max())
        if (int(held.sum()) >= MIN_NUMEL and largest > whole) or last is None:
            m = scale if last is None else largest
            last = (FACTOR * below + eps * m, below, eps * m, m)
        out.append(last)
    return tuple(out) if any(x != out[0] for x in out) else None


def reference_bin_errors(tp, ref, magnitude, top):
    """This rank's max |TP - reference| in each bin, element by element."""
    diff = (tp.detach().double() - ref.detach().double()).abs().reshape(-1)
    diff = torch.nan_to_num(diff, nan=math.inf)
    m = magnitude.detach().double().reshape(-1)
    k = torch.div(top - torch.frexp(m).exponent.long(), OCTAVES, rounding_mode="floor")
    k = k.clamp(0, BINS - 1)
    k[m == 0] = BINS - 1
    return tuple(float(diff[k == b].max()) if (k == b).any() else 0.0 for b in range(BINS))


def reference_dense_error(dense, truth):
    return float((dense.detach().double() - truth.detach().double()).abs().max())


@dataclasses.dataclass(frozen=True)
class Transposed(Placement):
    """A placement that moves elements across rows (a user's layout): the magnitude's shard then
    holds several values per row, and binning must go element by element."""

    def shard(self, dense, rank, world):
        return dense.transpose(-1, -2).contiguous() if dense.dim() > 1 else dense


def _tensors(seed: int, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp(3 * torch.randn(*shape[:-1], 1, generator=g, dtype=torch.float64))
    truth = torch.randn(*shape, generator=g, dtype=torch.float64) * rows
    if seed % 3 == 0:
        truth[..., 0] = 0.0  # rows whose largest element is elsewhere
    if seed % 4 == 0:
        truth.reshape(-1)[:7] = 0.0
    if seed % 5 == 0:
        truth.reshape(-1)[-1] = 1e4  # an outlier
    noise = torch.randn(*shape, generator=g, dtype=torch.float64) * 1e-3 * rows
    return truth.to(dtype), truth, (truth + noise).to(dtype)


SHAPES = [(64,), (4, 16), (3, 6, 8), (8, 64), (2, 3, 4, 32), (128,), (2, 320, 512)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bounds_and_bin_errors_are_the_per_element_definitions(dtype, shape):
    for seed in range(4):
        dense, truth, tp = _tensors(seed, shape, dtype)
        if seed == 1:
            tp.reshape(-1)[3] = float("nan")
        bound = tolerance.calibrated(dense, truth, dtype, 2)
        assert bound.bins == reference_bins(dense, truth, dtype, bound.scale)
        assert bound.ref_error == reference_dense_error(dense, truth)
        assert tolerance.dense_error(dense, truth) == reference_dense_error(dense, truth)
        top = tolerance.top_exponent(dense)
        placements = [Replicate(), Transposed()] + [
            Shard(d) for d in range(len(shape)) if shape[d] % 2 == 0
        ]
        if shape[0] % 4 == 0:
            placements.append(Fused(0, (2, 2), (shape[0] // 4,) * 2))
        for p in placements:
            for rank in range(2):
                magnitude = p.shard(tolerance.row_magnitude(dense), rank, 2)
                ref, mine = p.shard(dense, rank, 2), p.shard(tp, rank, 2)
                assert tolerance.bin_errors(mine, ref, magnitude, top) == reference_bin_errors(
                    mine, ref, magnitude, top
                ), (p, rank)


def test_a_row_shortcut_that_ignores_rows_of_several_values_is_caught(monkeypatch):
    """Checker mutant: binning by each row's first value even where a row holds several (a user's
    placement that moves elements across rows) differs from the definition."""
    dense, _, tp = _tensors(2, (8, 64), torch.float32)
    top = tolerance.top_exponent(dense)
    magnitude = Transposed().shard(tolerance.row_magnitude(dense), 0, 2)
    ref, mine = Transposed().shard(dense, 0, 2), Transposed().shard(tp, 0, 2)
    expected = reference_bin_errors(mine, ref, magnitude, top)
    assert tolerance.bin_errors(mine, ref, magnitude, top) == expected
    monkeypatch.setattr(tolerance, "_per_row", lambda m: m[..., :1].reshape(-1).double())
    assert tolerance.bin_errors(mine, ref, magnitude, top) != expected


def test_row_differences_in_passes_equal_one_piece():
    """measure.row_max_abs_diff over a tensor larger than a pass (several passes, rows split
    across none) is the one-piece float64 difference's row max, NaN rows included."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(700, 1000, generator=g)
    b = torch.randn(700, 1000, generator=g, dtype=torch.float64)
    a[5, 7] = float("nan")
    got = measure.row_max_abs_diff(a, b)
    want = (a.double() - b).abs().amax(-1)
    assert a.numel() > measure.CHUNK
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(
        got.nan_to_num(), want.nan_to_num()
    )


@pytest.mark.parametrize(
    ("block", "dtype", "binned_activations"),
    [("lm", "bfloat16", True), ("layer", "float16", False), ("lm", "float32", True)],
)
def test_every_bound_of_a_real_case_is_its_definition(
    monkeypatch, block, dtype, binned_activations
):
    """Every calibrated bound and every bin error a real case computes (in process, world 1), held
    to the per-element definitions as it is computed."""
    import tpcheck
    from tpcheck.checker.rank.engine import run_case_on_rank
    from tpcheck.checker.rank.ledger import CollectiveTap
    from tpcheck.checker.sync import Rendezvous
    from tpcheck.parallel.group import TPGroup
    from tpcheck.resolve import RESOLVER

    seen = {"bounds": 0, "binned": 0, "bin_errors": 0}
    calibrated, bin_errors = tolerance.calibrated, tolerance.bin_errors

    def checked_calibrated(dense, truth, dt, world):
        bound = calibrated(dense, truth, dt, world)
        if bound.kind == "calibrated":
            assert bound.ref_error == reference_dense_error(dense, truth)
            if truth.numel() >= MIN_NUMEL:
                assert bound.bins == reference_bins(dense, truth, dt, bound.scale)
                seen["binned"] += bound.bins is not None
            seen["bounds"] += 1
        return bound

    def checked_bin_errors(tp, ref, magnitude, top):
        got = bin_errors(tp, ref, magnitude, top)
        assert got == reference_bin_errors(tp, ref, magnitude, top)
        seen["bin_errors"] += 1
        return got

    monkeypatch.setattr(tolerance, "calibrated", checked_calibrated)
    monkeypatch.setattr(tolerance, "bin_errors", checked_bin_errors)
    spec = tpcheck.CaseSpec(
        block=block, preset="tiny", world_size=1, run=tpcheck.RunSettings(dtype=dtype, steps=2)
    )
    group = TPGroup(rank=0, world_size=1, tap=CollectiveTap(0))
    out = run_case_on_rank(RESOLVER.build(spec), group, Rendezvous(None, 0, 1, 60.0))
    assert out.status == "ok", out
    assert seen["bounds"] > 100 and seen["binned"] > 0, seen
    assert (seen["bin_errors"] > 0) == binned_activations, seen
