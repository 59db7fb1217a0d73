"""Capture of intermediate tensors: each named module's forward output and the gradient flowing
into that output in backward. The dense side stores a copy of each (`Recorder`), the float64 side
the bound it calibrates against that copy (`Calibrating`); the TP side compares each one as it is
produced, so the checks come out in execution order (forward, then backward) and nothing is held
longer than one step. Every side's tensors are thus taken as they were produced: a model may go on
to work in place on a module's output (`h.mul_(s)`, `nn.ReLU(inplace=True)`, an in-place dropout) or
a backward on a gradient, and a stored reference would then be compared as changed, not as its
module produced it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

# (stage, module name, tensor) -> None; stage is "forward" (module output) or "backward" (its grad).
Sink = Callable[[str, str, torch.Tensor], None]


def named_modules(model: nn.Module):
    """(name, module) of every module `model` runs: its tree, or, for a model that runs modules
    outside its own tree (an adapter's wrapper), what its `capture_modules()` lists."""
    return model.capture_modules() if hasattr(model, "capture_modules") else model.named_modules()


def attach(
    model: nn.Module, names: set[str], sink: Sink, rename: dict[str, str] | None = None
) -> list:
    """Hook the modules of `model` named in `names` (a module under its `rename` name where it has
    one: a TP module named otherwise than its dense module), one module per name, the first in
    `named_modules` order (a wrapper before the module it wraps, whose forward a checkpoint wrapper
    runs again in backward); returns handles (call .remove() on each)."""
    rename = rename or {}
    handles, hooked = [], set()
    for name, module in named_modules(model):
        key = rename.get(name, name)
        if key in names and key not in hooked:
            hooked.add(key)
            handles.append(module.register_forward_hook(_hook(key, sink)))
    return handles


TENSOR = "a tensor"


def structure(output) -> str:
    """What a module returned, in words: "a tensor", "a tuple of 2", "a dict", ... (the capture
    compares a tuple's first element)."""
    if isinstance(output, torch.Tensor):
        return TENSOR
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)}"
    return f"a {type(output).__name__}"


def _hook(name: str, sink: Sink):
    note = getattr(sink, "note", None)  # a sink that wants to know what each module returned

    def hook(module, args, output):
        if note is not None:
            note(name, structure(output))
        out = output[0] if isinstance(output, tuple) else output
        if not isinstance(out, torch.Tensor) or out.is_complex():
            return  # complex outputs (rotary factors as complex numbers): no bound is defined
        if hasattr(out, "to_local"):  # a DTensor output (use_local_output=False): this rank's part
            out = out.to_local()
        sink("forward", name, out.detach())
        if out.requires_grad:
            out.register_hook(lambda grad: sink("backward", name, grad.detach()))

    return hook


class Recorder:
    """The dense side (and the float64 truth where it is the dense model): keeps a copy of each
    captured tensor, as its module produced it, until the TP side asks for it."""

    def __init__(self) -> None:
        self.tensors: dict[tuple[str, str], list[torch.Tensor]] = defaultdict(list)
        self.structures: dict[str, str] = {}  # what each module returned, first call

    def note(self, name: str, what: str) -> None:
        self.structures.setdefault(name, what)

    def __call__(self, stage: str, name: str, t: torch.Tensor) -> None:
        self.tensors[(stage, name)].append(snapshot(t))

    def take(self, stage: str, name: str) -> torch.Tensor | None:
        queue = self.tensors.get((stage, name))
        return queue.pop(0) if queue else None


class Calibrating(Recorder):
    """The float64 side: instead of a float64 copy of each captured tensor, what the comparison
    needs of it, computed as it is produced from it and the dense side's copy of the same capture
    (the dense pass runs first): `calibrate(dense, t)`, or a copy of `t` where that gives None or
    the two captures do not pair (another count or shape)."""

    def __init__(
        self, dense: Recorder, calibrate: Callable[[torch.Tensor, torch.Tensor], object | None]
    ) -> None:
        super().__init__()
        self.dense, self.calibrate = dense, calibrate

    def __call__(self, stage: str, name: str, t: torch.Tensor) -> None:
        key = (stage, name)
        # captures of this key so far: nothing is taken before the truth's pass ends
        i = len(self.tensors[key])
        queue = self.dense.tensors.get(key, [])
        dense = queue[i] if i < len(queue) else None
        kept = self.calibrate(dense, t) if dense is not None and dense.shape == t.shape else None
        self.tensors[key].append(snapshot(t) if kept is None else kept)


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """`t` as it is now, kept apart from the model: what
    the model does to `t` later does not change it."""
    return t.detach().clone()


def detach_all(handles: list) -> None:
    for h in handles:
        h.remove()
