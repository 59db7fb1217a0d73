"""The checker's two reductions, `max_abs_diff` (every error: max |TP - dense|, max |dense -
float64|) and `absmax` (every scale), against numpy's one-piece arithmetic: large CPU tensors go
through in passes of `CHUNK` elements, so a difference planted in the first, a middle or the last
(partial) pass must come out as it is, and a NaN or an infinity anywhere must make
the error infinite."""

import math

import numpy as np
import pytest
import torch

from tpcheck.checker.rank.measure import CHUNK, absmax, max_abs_diff, maxdiff
from tpcheck.checker.rank.tolerance import calibrated

SIZES = (1, 5, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _pair(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g, dtype=torch.float64)
    return a.to(dtype), (a + 1e-3 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)


def _numpy_maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in the dtype maxdiff documents: float64 if either side is, else float32."""
    wide = np.float64 if torch.float64 in (a.dtype, b.dtype) else np.float32
    d = np.abs(a.double().numpy().astype(wide) - b.double().numpy().astype(wide))
    return float(d.max())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_maxdiff_is_the_one_piece_maximum(n, dtype):
    a, b = _pair(n, dtype, n)
    assert maxdiff(a, b) == _numpy_maxdiff(a, b)
    assert absmax(a) == float(np.abs(a.double().numpy()).max())


@pytest.mark.parametrize("n", SIZES[2:])
def test_a_difference_in_any_pass_is_found(n):
    """The largest difference planted at the first element, in the middle and at the very last one
    (the last, partial pass): each is the error reported, exactly."""
    a = torch.zeros(n)
    for pos in (0, n // 2, n - 1):
        b = a.clone()
        b[pos] = 0.75
        assert maxdiff(a, b) == 0.75, pos
        assert absmax(b) == 0.75


@pytest.mark.parametrize("n", SIZES[1:])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_anywhere_is_an_infinite_error(n, bad):
    a, b = _pair(n, torch.float32, 7)
    for pos in (0, n // 2, n - 1):
        c = b.clone()
        c[pos] = bad
        assert maxdiff(a, c) == math.inf, (pos, bad)
        assert maxdiff(c, c) == math.inf  # NaN - NaN and inf - inf are NaN: never equal
        got = absmax(c)
        assert math.isnan(got) if math.isnan(bad) else got == math.inf


def test_half_types_are_compared_in_float32():
    """bfloat16 - bfloat16 would round the difference;
    maxdiff subtracts in float32, where it is exact."""
    a = torch.tensor([1.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0 + 2.0**-7], dtype=torch.bfloat16)
    assert maxdiff(a, b) == 2.0**-7
    big = torch.full((CHUNK + 3,), 256.0, dtype=torch.bfloat16)
    other = big.clone()
    other[-1] = 258.0
    assert maxdiff(big, other) == 2.0


def test_float32_against_float64_in_float64():
    """The calibrated bound's dense error: a float32 tensor
    against its float64 truth, over several passes."""
    g = torch.Generator().manual_seed(3)
    truth = torch.randn(2 * CHUNK + 11, generator=g, dtype=torch.float64)
    dense = truth.float()
    want = float(np.abs(dense.double().numpy() - truth.numpy()).max())
    assert float(max_abs_diff(dense, truth, torch.float64)) == want > 0
    b = calibrated(dense, truth, torch.float32, 2)
    assert b.ref_error == want
    assert b.value == pytest.approx(
        8 * want + 2.0**-23 * float(np.abs(truth.numpy()).max()), rel=1e-12
    )
