"""The two measures every comparison takes: max |a - b| of a TP tensor and its reference
(`maxdiff`, in passes of `CHUNK` elements: no full-size temporaries) and max |t| of a tensor
(`absmax`, the scale a bound and a control are sized by)."""

from __future__ import annotations

import math

import torch

from tpcheck.errors import UsageError

# Elements per pass of `max_abs_diff` over a large CPU tensor: the difference goes through one
# buffer of this size (2 MiB in float64), reused, instead of a temporary as large as the tensor,
# whose fresh pages cost more than the arithmetic (a 1024 x 4096 difference: ~50 ms in passes,
# ~230 ms in one piece).
CHUNK = 1 << 18


def absmax(t: torch.Tensor) -> float:
    """max |t| in one pass without a temporary (NaN if `t` holds a NaN; 0.0 when empty)."""
    if not t.numel():
        return 0.0
    if t.is_complex():  # a complex buffer (a RoPE cache): its real and imaginary parts
        t = torch.view_as_real(t.detach().resolve_conj())
    t = t.detach() if t.is_floating_point() else t.detach().double()
    lo, hi = torch.aminmax(t)
    return float(torch.maximum(-lo, hi))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """max |a - b| with both sides in `dtype` (a 0-dim tensor; NaN if a difference is NaN), computed
    in passes of `CHUNK` elements on the CPU: the same element-wise arithmetic, no
    full-size temporaries."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    # the subtraction computes in `dtype` by itself
    # (float32 - float64, say), or after converting the sides
    put = (
        (lambda t: t) if torch.promote_types(a.dtype, b.dtype) == dtype else (lambda t: t.to(dtype))
    )
    n = a.numel()
    if n <= CHUNK or a.device.type != "cpu":
        return (put(a) - put(b)).abs_().amax()  # amax, like maximum, propagates NaN
    buf = torch.empty(CHUNK, dtype=dtype)
    best = torch.zeros((), dtype=dtype)
    for i in range(0, n, CHUNK):
        part = buf[: min(CHUNK, n - i)]
        torch.sub(put(a[i : i + CHUNK]), put(b[i : i + CHUNK]), out=part)
        torch.maximum(best, part.abs_().amax(), out=best)
    return best


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise UsageError(
            f"TP tensor of shape {list(a.shape)} cannot be compared with the plan's shard "
            f"{list(b.shape)}: the plan or the TP module's layout is wrong"
        )
    if a.numel() == 0:
        return 0.0
    # a complex buffer (a RoPE cache): compared by its real and imaginary parts
    if a.is_complex() or b.is_complex():
        a, b = (torch.view_as_real(t.resolve_conj().contiguous()) for t in (a, b))
    # float32 or float64 as they are (the seed's metric is a float32 difference); half types in
    # float32, where they are exact. A NaN anywhere makes the difference infinite.
    d = max_abs_diff(
        a, b, torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    )
    return float(d) if not torch.isnan(d) else math.inf


def row_max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """max |a - b| of each row (the last dimension) of two tensors of one shape, flattened to one
    float64 value per row, the difference taken in float64 (NaN in a row that holds one). On the
    CPU in passes of about `CHUNK` elements through one reused buffer, as `max_abs_diff`."""
    a, b = a.detach(), b.detach()
    if a.is_complex() or b.is_complex():  # as `Tensor.double` reads them: the real parts
        a, b = a.double(), b.double()
    width = a.shape[-1] if a.dim() else 1
    a, b = a.reshape(-1, width), b.reshape(-1, width)
    rows = a.shape[0]
    if a.numel() <= CHUNK or a.device.type != "cpu":
        # the subtraction promotes a float64 side's partner to float64, exactly
        return torch.sub(a if b.dtype == torch.float64 else a.double(), b).abs_().amax(-1)
    out = torch.empty(rows, dtype=torch.float64)
    step = max(1, CHUNK // max(width, 1))
    buf = torch.empty(step * width, dtype=torch.float64)
    for i in range(0, rows, step):
        n = min(step, rows - i)
        part = buf[: n * width].view(n, width).copy_(a[i : i + n])
        torch.amax(part.sub_(b[i : i + n]).abs_(), -1, out=out[i : i + n])
    return out
