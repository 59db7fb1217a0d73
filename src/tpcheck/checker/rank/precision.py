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

Accumulators likewise, once the models are built (`KeepFloat64.factories`): a tensor the code under
test makes in a lower floating dtype (`torch.zeros(1, dtype=torch.float)`, as Megatron's gradient
norm does for its fp32 accumulation, `torch.tensor([x], dtype=torch.float32)`, `zeros_like(...,
dtype=...)`) is made in float64, so that what is summed into it in place is not rounded to float32
on one side only: the TP clipping's norm accumulated so in a bfloat16 run's float64 run was 1.1e-8
off the dense one against a bound of 2.3e-10 ("a structural bug"), for code that only asked for at
least float32. Not while the models are built (a module kept in float32 stays so: it is a choice of
storage, and the float64 run says it cannot run it), and never for tpcheck's own tensors.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from tpcheck.checker.sourcelines import caller, frame_kind

LOWER = (torch.float32, torch.float16, torch.bfloat16)
NAMED_CASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}
# the factories whose lower floating `dtype=` is kept float64 once the models are built (no random
# ones: a draw in another dtype is another draw)
FACTORIES = frozenset(
    {
        torch.zeros,
        torch.ones,
        torch.empty,
        torch.full,
        torch.tensor,
        torch.zeros_like,
        torch.ones_like,
        torch.empty_like,
        torch.full_like,
    }
)


def _float64(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float64


def _keep(value):
    """A dtype argument: float64 where it names a lower floating dtype."""
    return torch.float64 if value in LOWER else value


def _code_under_test(frame) -> bool:
    """Whether the call at `frame` comes from the code under test (sourcelines.py's `caller`)."""
    frame = caller(frame)
    return frame is not None and frame_kind(frame.f_code.co_filename) == "user"


class KeepFloat64(TorchFunctionMode):
    """Casts of float64 tensors to lower floating dtypes keep float64; with `factories`, so do
    the code under test's tensors made in a lower floating dtype (the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.factories = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if args and _float64(args[0]):
            if func in NAMED_CASTS:
                return args[0]
            if func in (torch.Tensor.to, torch.Tensor.type):
                args = (args[0], *(_keep(a) for a in args[1:]))
            if "dtype" in kwargs:
                kwargs["dtype"] = _keep(kwargs["dtype"])
        elif (
            self.factories
            and func in FACTORIES
            and kwargs.get("dtype") in LOWER
            and _code_under_test(sys._getframe(1))
        ):
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


@contextlib.contextmanager
def keep_float64(active: bool) -> Iterator[KeepFloat64 | None]:
    """While active, casts of float64 tensors to a lower floating dtype keep float64; the mode
    is yielded (None when inactive) for its `factories` to be turned on once the models are
    built."""
    if not active:
        yield None
        return
    mode = KeepFloat64()
    with mode:
        yield mode
