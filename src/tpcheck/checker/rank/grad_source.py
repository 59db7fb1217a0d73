"""Where the TP side's gradients are read: each parameter's `.grad`, or where the TP code's
framework keeps them for its optimizer.

Megatron's DistributedDataParallel gives each parameter a float32 `main_grad` (a view of its segment
of one contiguous grad buffer) and a hook that adds `.grad` into it once autograd has accumulated
it, then frees `.grad`; the optimizer steps on `main_grad`. `Case(grad_of=...)` names the place: the
attribute holding the gradient ("main_grad"), or a function `(parameter) -> its gradient or None`
(a segment of a flat buffer kept apart from the parameters). Without it, `main_grad` is found as
the optimizer state is: after the first backward, when a TP parameter has no `.grad` but a tensor
`main_grad` of its shape, every parameter's `main_grad` is read (its `.grad` where it has none), and
the report's notes say so. Decided once, after the first step's backward, and held to for the run.

What reads it: the grads stage (`grad:<param>`), tpcheck's TP-aware clipping and the clipped
gradients (`clipped:<param>`), the inference of a parameter applied on one rank, tpcheck's own
TP optimizer (the gradient handed to its masters, or to the parameter it steps) and the replay of
the rule where nothing was found inside the user's optimizer (a torch optimizer found inside is
replayed on the gradients it was handed, whatever it read them from). The clipping scales the
tensor read in place: the place must be the tensor the optimizer steps on, never a copy. Between
steps tpcheck zeroes it only where the optimizer is its own (`zero`); under the user's optimizer the
zeroing is the user's (their `zero_grad()`, or the module's `zero_grad_buffer()`: an accumulator
left unzeroed double-counts step 1's gradient at step 2, as it would in training).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tpcheck.errors import UsageError

MAIN_GRAD = "main_grad"


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    return p.grad


def _holds(p: torch.Tensor) -> bool:
    """Whether `p` has a tensor `main_grad` of its own shape."""
    g = getattr(p, MAIN_GRAD, None)
    return isinstance(g, torch.Tensor) and g.shape == p.shape


def _main_grad(p: torch.Tensor) -> torch.Tensor | None:
    return getattr(p, MAIN_GRAD) if _holds(p) else p.grad


class GradSource:
    """The TP side's gradient of a parameter (`self(p)`): `.grad` until `settle` decides, then
    where `Case.grad_of` says, or `main_grad` where it was found."""

    def __init__(self, grad_of: str | Callable | None = None) -> None:
        self.given = grad_of
        self.read: Callable[[torch.Tensor], torch.Tensor | None] = _grad
        self.settled = False
        self.found: list[str] = []  # parameters read from `main_grad`, found (no grad_of given)
        self.left: list[str] = []  # of those, the ones that also kept a `.grad`

    def __call__(self, p: torch.Tensor) -> torch.Tensor | None:
        return self.read(p)

    @property
    def elsewhere(self) -> bool:
        """Whether the gradients are read anywhere but `.grad`."""
        return self.read is not _grad

    def settle(self, tp: nn.Module) -> None:
        """After the first step's backward (once): where the gradients are read, and each one read
        checked to be a tensor of its parameter's shape."""
        if self.settled:
            return
        self.settled = True
        own = dict(tp.named_parameters())
        if isinstance(self.given, str):
            attr = self.given
            self.read = lambda p: getattr(p, attr, None)
        elif self.given is not None:
            self.read = self.given
        elif any(p.grad is None and _holds(p) for p in own.values()):
            self.read = _main_grad
            self.found = [n for n, p in own.items() if _holds(p)]
            self.left = [n for n in self.found if own[n].grad is not None]
        for name, p in own.items():
            g = self.read(p)
            if g is not None and (not isinstance(g, torch.Tensor) or g.shape != p.shape):
                raise UsageError(
                    f"the gradient of TP parameter {name!r} (shape {list(p.shape)}) read from "
                    f"{self.described()} is {_describe(g)}; expected a tensor of the parameter's "
                    "shape (or None: no gradient)"
                )

    def zero(self, tp: nn.Module) -> None:
        """Each gradient read elsewhere than `.grad`, zeroed in place (between steps, when the TP
        optimizer is tpcheck's own: no code of the user's zeroes it then)."""
        if not self.elsewhere:
            return
        with torch.no_grad():
            for p in tp.parameters():
                g = self.read(p)
                if g is not None and g is not p.grad:
                    g.zero_()

    def described(self) -> str:
        """Where the gradients are read, in words."""
        if isinstance(self.given, str):
            return f"`{self.given}` (your Case(grad_of={self.given!r}))"
        if self.given is not None:
            return "your Case(grad_of=...)"
        return "`main_grad`" if self.elsewhere else "`.grad`"

    def notes(self) -> list[str]:
        """The report's note (after "not checked: ") when `main_grad` was found, not named."""
        if not self.found:
            return []
        listed = ", ".join(self.found[:4]) + (", ..." if len(self.found) > 4 else "")
        left = (
            f"; {', '.join(self.left)} also kept a `.grad` (no hook moved it?)" if self.left else ""
        )
        return [
            "the gradients in `.grad`: your TP module keeps them in `main_grad` "
            f"({len(self.found)} parameter(s): {listed}), where tpcheck read them for the grad: "
            f"checks, the clipping and the replay (name it with Case(grad_of='main_grad')){left}"
        ]


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:80]
