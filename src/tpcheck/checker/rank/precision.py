"""A float64 run computes in float64 throughout: `keep_float64`.

Model code casts on its own: HuggingFace's RMSNorm computes `hidden_states.to(torch.float32)`,
attention takes `softmax(..., dtype=torch.float32)`, a loss `logits.float()`. Meant as "at least
float32" for 16-bit training, in a float64 run those casts round the float64 tensors to float32:
the dense model (there the truth) and the TP model then differ by float32 rounding wherever TP
reorders a sum inside such a region (norm statistics all-reduced in float32), about 1e-7 relative,
far over the float64 bound of `FP64_FLOOR_ULPS` ulps (about 2e-10, tolerance.py). So while a
float64 run runs, every cast of a float64 tensor to a lower floating dtype keeps float64 instead,
on both sides alike: the cast's intent (at least that precision) holds, and the bound is sound.

What is kept: `Tensor.to(dtype)` / `.to(device, dtype)` / `.to(dtype=...)`, `.float()`, `.half()`,
`.bfloat16()`, `.type(dtype)` and the `dtype=` of any torch call whose first argument is a float64
tensor (`softmax(x, dim, dtype=torch.float32)`, `sum(dtype=...)`). Casts of other tensors (integer
masks, float32 buffers) are untouched. The mode is per thread: code that autograd runs on another
thread (CUDA backward) is not covered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

LOWER = (torch.float32, torch.float16, torch.bfloat16)
NAMED_CASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


def _float64(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float64


def _keep(value):
    """A dtype argument: float64 where it names a lower floating dtype."""
    return torch.float64 if value in LOWER else value


class KeepFloat64(TorchFunctionMode):
    """Casts of float64 tensors to lower floating dtypes keep float64 (the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if args and _float64(args[0]):
            if func in NAMED_CASTS:
                return args[0]
            if func in (torch.Tensor.to, torch.Tensor.type):
                args = (args[0], *(_keep(a) for a in args[1:]))
            if "dtype" in kwargs:
                kwargs["dtype"] = _keep(kwargs["dtype"])
        return func(*args, **kwargs)


@contextlib.contextmanager
def keep_float64(active: bool) -> Iterator[None]:
    """While active, casts of float64 tensors to a lower floating dtype keep float64."""
    if not active:
        yield
        return
    with KeepFloat64():
        yield
