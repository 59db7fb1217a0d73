"""`tpcheck.checker.rank.tolerance` on synthetic tensors, without processes: the calibrated bound
equals the formula of docs/tolerances.md (computed here independently), does not depend on the world
size, keeps an ulp floor, and on a matmul split in two it accepts the reordered sum while
rejecting a 1% fault."""

import math

import numpy as np
import pytest
import torch

from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.tolerance import EXACT, REPLICA, calibrated

# Machine epsilons written out, not taken from the
# module, so that the formula is checked independently.
EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float64: 2.0**-52}


def expected_bound(dense: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> float:
    """F * err_dense + k * eps(dtype) * scale: F = 8 and k = 1 ulp for 64 elements or more, F = 16
    and k = 8 ulps below (docs/tolerances.md), written out here, not taken from the module."""
    d, t = dense.double().numpy(), truth.numpy()
    err_dense = float(np.abs(d - t).max())
    scale = float(np.abs(t).max())
    f, k = (8.0, 1) if t.size >= 64 else (16.0, 8)
    return f * err_dense + k * EPS[dtype] * scale


def _pair(dtype: torch.dtype, seed: int, shape=(16, 24)) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 truth and the same values rounded to
    `dtype` (the dense model's error is the rounding)."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(shape, generator=g, dtype=torch.float64) * 3.0
    return truth.to(dtype), truth


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 24), (64,), (63,), (4, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_calibrated_value_is_the_documented_formula(dtype, shape, seed):
    dense, truth = _pair(dtype, seed, shape)
    b = calibrated(dense, truth, dtype, 2)
    assert b.kind == "calibrated"
    assert b.value == pytest.approx(expected_bound(dense, truth, dtype), rel=1e-12)
    assert b.value == pytest.approx(
        b.ref_error * (8 if truth.numel() >= 64 else 16) + b.floor, rel=1e-12
    )
    # Sanity of the synthetic data: the rounding error is really there and of the dtype's order.
    err = float((dense.double() - truth).abs().max())
    assert 0 < err <= EPS[dtype] * float(truth.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_does_not_depend_on_the_world_size(dtype):
    """Measured: the factor a correct case needs shows no
    trend with the world size (docs/tolerances.md)."""
    dense, truth = _pair(dtype, 3)
    values = {calibrated(dense, truth, dtype, w).value for w in (1, 2, 4, 8)}
    assert len(values) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_equal_to_truth_keeps_the_ulp_floor(dtype):
    # Values exactly representable in bf16 (and so in
    # fp32): the dense error is 0, only the floor remains.
    truth = torch.tensor([[0.5, -4.0], [1.25, 3.0]], dtype=torch.float64)
    dense = truth.to(dtype)
    b = calibrated(dense, truth, dtype, 2)
    # 4 elements: 8 ulps of the scale
    assert b.value == pytest.approx(8 * EPS[dtype] * 4.0, rel=1e-12)
    assert b.value > 0 and b.ref_error == 0


def test_reason_names_dtype_and_numbers():
    dense, truth = _pair(torch.bfloat16, 5)
    b = calibrated(dense, truth, torch.bfloat16, 2)
    err = float((dense.double() - truth).abs().max())
    scale = float(truth.abs().max())
    assert "bfloat16" in b.reason
    assert "8 x" in b.reason  # 384 elements
    assert f"{err:.3g}" in b.reason
    assert f"{scale:.3g}" in b.reason
    assert "1 ulp(s)" in b.reason


def test_float64_uses_the_fp64_floor():
    truth = torch.tensor([[1.0, -7.5], [2.0, 0.25]], dtype=torch.float64)
    dense = truth + 1e-3  # the dense error is ignored in float64: there is no finer truth
    b = calibrated(dense, truth, torch.float64, 4)
    assert b.kind == "fp64"
    assert b.value == pytest.approx(tolerance.FP64_FLOOR_ULPS * EPS[torch.float64] * 7.5, rel=1e-12)
    assert "float64" in b.reason and "7.5" in b.reason
    # About 1e-10 relative, as the docstring says: far
    # above fp64 reordering noise, far below a fault.
    assert 1e-11 < b.value / 7.5 < 1e-9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_zero_size_tensor_gives_a_finite_bound(dtype):
    truth = torch.empty(0, 8, dtype=torch.float64)
    b = calibrated(truth.to(dtype), truth, dtype, 2)
    assert b.value is not None and math.isfinite(b.value)
    assert b.value == 0.0


def test_exact_bounds_are_zero():
    assert EXACT.value == 0 and EXACT.kind == "exact"
    assert REPLICA.value == 0 and REPLICA.kind == "exact"


def _chunked(a: torch.Tensor, b: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """a @ b accumulated chunk by chunk in float32: another kernel's summation order."""
    acc = torch.zeros(a.shape[0], b.shape[1])
    for s in range(0, a.shape[1], chunk):
        acc = acc + a[:, s : s + chunk] @ b[s : s + chunk]
    return acc


@pytest.mark.parametrize("seed", range(5))
def test_matmul_split_in_two_is_accepted_and_a_one_percent_fault_is_not(seed):
    """A row-parallel matmul at tp 2, simulated: the inner dimension is split in two, each half is a
    float32 matmul (one rank's partial), and the partials are summed in float32 (the all-reduce).

    Why the correct result passes: it only reorders the float32 sum. Its distance from the float64
    truth is of the order of the dense float32 model's own (err_dense, a few ulps of the outputs),
    so |TP - dense| <= |TP - truth| + |dense - truth| ~ 2 err_dense, well inside 8 x err_dense plus
    the 1-ulp floor. (Some BLAS block the inner dim so that the plain split is bitwise equal to the
    dense matmul; the chunk-accumulated variant always reorders, so the check is never vacuous.)

    Why the fault fails: scaling one partial by 1.01 moves each output by 1% of that partial, i.e.
    ~1e-2 relative, while the float32 bound is ~1e-6 relative: thousands of bounds apart."""
    g = torch.Generator().manual_seed(100 + seed)
    m, k, n = 32, 256, 48
    a = torch.randn(m, k, generator=g)
    b = torch.randn(k, n, generator=g)
    dense = a @ b
    truth = a.double() @ b.double()
    bound = calibrated(dense, truth, torch.float32, 2).value

    h = k // 2
    p0, p1 = a[:, :h] @ b[:h], a[:, h:] @ b[h:]
    tp_ok = p0 + p1
    tp_reordered = _chunked(a[:, :h], b[:h]) + _chunked(a[:, h:], b[h:])
    tp_bad = p0 * 1.01 + p1

    assert float((tp_ok - dense).abs().max()) <= bound
    reordered = float((tp_reordered - dense).abs().max())
    # really different from dense, yet well inside (docstring: < 0.5)
    assert 0 < reordered <= 0.5 * bound
    assert float((tp_bad - dense).abs().max()) > 100 * bound  # not a near miss: far outside
    # The bound is tight in relative terms (fp32: ~1e-6
    # of the output scale), so a 1% fault is visible.
    assert bound / float(truth.abs().max()) < 1e-5
    # And a missing reduction (a rank keeps its own partial) is an O(1) error, a fortiori outside.
    assert float((p0 - dense).abs().max()) > 1e4 * bound


# ------------------------------------------------------------------ by magnitude (an outlier)


def _with_outlier(dtype, seed, outlier=1e3, shape=(16, 24)):
    """A rounded/float64 pair of O(1) values with one element `outlier` (row 3)."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(shape, generator=g, dtype=torch.float64)
    truth[3, 5] = outlier
    return truth.to(dtype), truth


def _errors(tp, dense):
    """This rank's errors per bin of a replicated tensor (the dense layout)."""
    top = tolerance.top_exponent(dense)
    return tolerance.bin_errors(tp, dense, tolerance.row_magnitude(dense), top)


def _judged(errors, bound):
    """The parent's judgement of a binned check, as result.judge makes it."""
    from tpcheck.checker.checkid import CheckId
    from tpcheck.checker.payload import Check
    from tpcheck.checker.verdict.result import judge

    c = Check(
        stage="forward",
        step=1,
        id=CheckId("act", "x"),
        rank=0,
        error=max(errors),
        diff_vs_dense=max(errors),
        bound=bound.value,
        kind="calibrated",
        reason="",
        passed=None,
    )
    c.bin_errors, c.bins = errors, bound.bins
    return judge(c), c


def test_an_element_is_as_large_as_its_rows_largest():
    x = torch.tensor([[1.0, -1000.0, 0.0], [0.5, 0.25, -0.125]])
    assert tolerance.row_magnitude(x).tolist() == [[1000.0] * 3, [0.5] * 3]
    assert tolerance.row_magnitude(torch.tensor(-3.0)).item() == 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_outlier_widens_only_its_own_rows_bin(dtype):
    """The top bin's bound is the whole-tensor formula; the rows of O(1) values are held to a
    bound set by the rows of their own magnitude, ~1000x tighter than the outlier row's."""
    dense, truth = _with_outlier(dtype, 0)
    b = calibrated(dense, truth, dtype, 2)
    assert b.bins is not None and len(b.bins) == tolerance.MAGNITUDE_BINS
    assert b.bins[0][0] == pytest.approx(expected_bound(dense, truth, dtype), rel=1e-12)
    top = tolerance.top_exponent(dense)
    rows = tolerance.magnitude_bin(tolerance.row_magnitude(dense), top).reshape(dense.shape)
    assert (rows[3] == 0).all() and (rows[torch.arange(16) != 3] > 0).all()
    k = int(rows[0, 0])
    bound_k, ref_k, floor_k, magnitude_k = b.bins[k]
    assert magnitude_k >= float(dense[0].double().abs().max())
    others = (dense.double() - truth).abs()[torch.arange(16) != 3]
    assert ref_k <= float(others.max()) and bound_k < b.bins[0][0] / 50  # ~90x here
    # bounds never grow toward smaller bins, and none is wider than the whole tensor's
    values = [x[0] for x in b.bins]
    assert values == sorted(values, reverse=True)


def test_an_error_on_the_rows_without_the_outlier_is_flagged():
    """TP off by 0.5 on every element outside the outlier's row: the whole-tensor bound (wide from
    the outlier) passes it, the bins do not; 0.5 on the outlier's row itself passes (its elements
    carry the outlier's rounding)."""
    dtype = torch.bfloat16
    dense, truth = _with_outlier(dtype, 1)
    b = calibrated(dense, truth, dtype, 2)
    tp = dense.clone()
    tp[torch.arange(16) != 3] += 0.5
    errors = _errors(tp, dense)
    assert max(errors) <= b.value  # what a whole-tensor bound says: within
    passed, c = _judged(errors, b)
    assert not passed and c.magnitude is not None and c.error == pytest.approx(0.5, rel=0.05)
    on_outlier_row = dense.clone()
    on_outlier_row[3] += 0.5
    assert _judged(_errors(on_outlier_row, dense), b)[0]


def test_bins_need_64_elements_else_they_take_a_larger_bins_bound():
    """Fewer than MIN_BIN_NUMEL elements at and below a bin: the bound of the first larger bin
    that has them (the max over a handful of errors is too noisy to bound with)."""
    dtype = torch.float32
    g = torch.Generator().manual_seed(2)
    truth = torch.randn(64, 8, generator=g, dtype=torch.float64)
    truth[:2] *= 1e-6  # two tiny rows (16 elements): alone in their bin
    truth[2:34] *= 1e-2  # 32 small rows (256 elements): a bin of their own
    dense = truth.to(dtype)
    b = calibrated(dense, truth, dtype, 2)
    top = tolerance.top_exponent(dense)
    bins = tolerance.magnitude_bin(tolerance.row_magnitude(dense), top)
    k_tiny = int(bins[0])
    count = torch.bincount(bins, minlength=tolerance.MAGNITUDE_BINS)
    enough = [k for k in range(tolerance.MAGNITUDE_BINS) if count[k:].sum() >= 64]
    first_enough = max(enough)
    assert k_tiny > first_enough > 0
    assert b.bins[k_tiny] == b.bins[first_enough] != b.bins[0]


def test_small_tensors_one_row_and_float64_are_judged_whole():
    dense, truth = _pair(torch.bfloat16, 4, (63,))
    assert calibrated(dense, truth, torch.bfloat16, 2).bins is None
    one_row = torch.randn(1, 128, dtype=torch.float64)
    one_row[0, 5] = 1e3
    assert calibrated(one_row.bfloat16(), one_row, torch.bfloat16, 2).bins is None
    big = torch.randn(8, 16, dtype=torch.float64)
    assert calibrated(big, big, torch.float64, 2).bins is None


def test_uniform_rows_need_no_bins():
    """Every row's largest element in the top bin: no bins, the whole-tensor bound."""
    truth = torch.full((16, 8), 1.5, dtype=torch.float64) + torch.rand(16, 8, dtype=torch.float64)
    assert calibrated(truth.float(), truth, torch.float32, 2).bins is None


def test_a_bin_with_an_error_over_a_zero_bound_is_the_worst():
    bins = ((1.0, 0.1, 0.2, 4.0), (0.0, 0.0, 0.0, 1.0))
    assert tolerance.worst_bin((0.9, 1e-30), bins) == 1
    assert tolerance.worst_bin((0.9, 0.0), bins) == 0


def test_rows_within_the_tensors_rounding_noise_take_a_larger_bins_bound():
    """Rows zero in exact arithmetic (a gradient no path reaches, up to rounding) are noise: their
    TP values carry rounding from the terms around them, not their own, so they never get a bound
    of their own size; rows above the noise still do."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(5)
    truth = torch.randn(32, 16, generator=g, dtype=torch.float64)
    truth[:8] = 1e-12 * torch.randn(8, 16, generator=g, dtype=torch.float64)  # noise rows
    truth[8:24] *= 1e-2  # real rows, 100x below the rest
    dense = truth.to(dtype)
    b = calibrated(dense, truth, dtype, 2)
    top = tolerance.top_exponent(dense)
    rows = tolerance.magnitude_bin(tolerance.row_magnitude(dense), top).reshape(dense.shape)
    noise, small = int(rows[0, 0]), int(rows[8:24].max())  # the smallest bin of real rows
    assert noise > small > 0
    assert b.bins[noise] == b.bins[small] and b.bins[small][0] < b.bins[0][0] / 20
