"""Discrete decisions under the checker: each one taken by the dense side and replayed, where the TP
side's differs only by rounding, as dropout masks are replayed (masks.py).

A top-k router (a mixture of experts), an argmax or a sort turns values into indices: a correct TP
model whose router logits differ from the dense ones by one rounding picks another expert at a
near-tie, and everything after it differs by a whole expert. Per forward (a `DecisionBook`):

* the dense side records each decision call (`torch.topk`, `torch.sort`, `torch.argsort`,
  `torch.argmax`/`argmin`, `torch.max`/`min` over a dim, and their `Tensor` methods), in call
  order: its input's values and the indices it chose;
* the float64 truth (rank 0) takes the dense side's indices in place of its own (its values
  gathered from its own input at them), so that its distance to the dense side stays the
  rounding of the arithmetic, and records its inputs;
* before the TP forward, rank 0 sends every rank the rounding margin of each decision (`share`):
  twice the calibrated bound of the decision's input (tolerance.py: `MAX_FACTOR` x the dense
  side's error against float64 + a floor), twice because a flip needs the two competing values to
  move towards each other;
* the TP side's k-th decision call is held to the dense side's k-th: where it picked the same
  indices, nothing changes. Where it picked others, the margin of the flip is the gap between the
  competing values (the one the dense side picked and the one the TP side picked, at every
  position where they differ) measured on the dense side's input in float64. Within the rounding
  margin, the dense indices are substituted (values gathered from the TP side's own input at
  them, so gradients flow as before) and the report carries the note "a routing decision flipped
  at a near-tie (margin m)"; beyond it the TP side keeps its own decision and the check
  `routing:<module>.<call>#<n>` fails (diagnosis `routing`).

Why the dense input and not the truth measures the gap: every rank must substitute the same way or
the replicas diverge, and only rank 0 holds the truth, while every rank runs the dense model on the
same weights and batch. The truth still sets the margin (shared before the forward); the gap on
the dense side is within the dense side's own error of the truth's.

What is not replayed: a decision whose TP input has another shape than the dense one (a TP router
that takes a top-k of each rank's shard of the logits, then gathers), or another kind of call at
the same place in call order: the TP side's decision stands, the report says so, and its effect is
checked through the values downstream. Calls from tpcheck's own code (its comparisons during the
forward) are not decisions of the model and pass through.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.capture import named_modules
from tpcheck.errors import UsageError

FLIPPED = "a routing decision flipped at a near-tie"
BEYOND = "a routing decision differs beyond rounding"


# ---------------------------------------------------------------- the intercepted calls, normalized


@dataclass
class Call:
    """One decision call: its input, the dim it decides over (`flat`: over the flattened input),
    whether its indices lack that dim (`squeezed`), whether it returns values with them."""

    kind: str
    x: torch.Tensor
    dim: int
    squeezed: bool = False
    flat: bool = False
    values: bool = True
    unordered: bool = False  # topk(sorted=False): the order of the chosen indices is not a decision
    largest: bool = True

    def indices(self, out) -> torch.Tensor:
        """The chosen indices of `out`, with the decided dim present (for gather)."""
        idx = out.indices if self.values else out
        if self.flat:
            return idx.reshape(1)
        return idx.unsqueeze(self.dim) if self.squeezed else idx

    def source(self) -> torch.Tensor:
        return self.x.reshape(-1) if self.flat else self.x

    def rebuild(self, out, idx: torch.Tensor):
        """`out` with `idx` (gather form) as its indices: values gathered from this side's own
        input."""
        shaped = idx.reshape(()) if self.flat else idx.squeeze(self.dim) if self.squeezed else idx
        if not self.values:
            return shaped
        values = self.source().gather(self.dim, idx)
        values = values.squeeze(self.dim) if self.squeezed else values
        return type(out)((values, shaped))


def _topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    return Call("topk", input, dim, unordered=not sorted, largest=largest)


def _sort(input, dim=-1, descending=False, stable=False, *, out=None):
    return Call("sort", input, dim)


def _argsort(input, dim=-1, descending=False, stable=False):
    return Call("argsort", input, dim, values=False)


def _arg(kind):
    def bind(input, dim=None, keepdim=False, *, out=None):
        if dim is None:
            return Call(kind, input, 0, flat=True, values=False)
        return Call(kind, input, dim, squeezed=not keepdim, values=False)

    return bind


def _extreme(kind):
    def bind(input, dim=None, keepdim=False, *, out=None):
        if dim is None or isinstance(dim, torch.Tensor):  # max(x) or max(x, other): no decision
            return None
        return Call(kind, input, dim, squeezed=not keepdim)

    return bind


_CALLS = {}
for _name, _bind in (
    ("topk", _topk),
    ("sort", _sort),
    ("argsort", _argsort),
    ("argmax", _arg("argmax")),
    ("argmin", _arg("argmin")),
    ("max", _extreme("max")),
    ("min", _extreme("min")),
):
    _CALLS[getattr(torch, _name)] = _bind
    _CALLS[getattr(torch.Tensor, _name)] = _bind


def _parse(func, args, kwargs) -> Call | None:
    bind = _CALLS.get(func)
    if bind is None or "out" in kwargs:
        return None
    try:
        call = bind(*args, **kwargs)
    except TypeError:  # a signature we do not read: the call as it is
        return None
    if call is None or not isinstance(call.x, torch.Tensor) or not call.x.is_floating_point():
        return None
    if hasattr(call.x, "to_local") or call.x.numel() == 0:
        return None  # a DTensor decides on its own layout: not replayed
    call.dim = call.dim % max(call.source().dim(), 1)
    return call


def _from_checker() -> bool:
    """Whether the intercepted call comes from tpcheck's own checker code (a comparison run by a
    capture hook during the forward), not from the model."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("torch"):
            return module.startswith("tpcheck.checker")
        frame = frame.f_back
    return False


# ------------------------------------------------------------------ what one forward decided


@dataclass
class Decision:
    """The dense side's k-th decision: where (`label`), the call, its input (float64, CPU) and the
    indices it chose (gather form)."""

    label: str
    kind: str
    x: torch.Tensor
    idx: torch.Tensor


@dataclass
class Judged:
    """The TP side's k-th decision against the dense side's: the gap of its flips (0: none), the
    margin it was held to, the rows that flipped, and whether the dense decision was substituted."""

    label: str
    seq: int
    gap: float
    margin: float
    rows: int
    of_rows: int
    substituted: bool


@dataclass
class DecisionBook:
    """The decisions of one forward: taken by the dense side, replayed by the truth, judged and
    (at a near-tie) replaced on the TP side."""

    dense: list[Decision] = field(default_factory=list)
    truth: list[torch.Tensor] = field(default_factory=list)
    margins: list[float] | None = None
    judged: list[Judged] = field(default_factory=list)
    unreplayed: list[str] = field(default_factory=list)

    def mode(self, role: str, model: nn.Module, next_seq=None) -> _DecisionMode:
        return _DecisionMode(self, role, model, next_seq)

    def share(self, rendezvous, dtype: torch.dtype, world: int, rank: int) -> None:
        """Rank 0's rounding margin of each dense decision, sent to every rank (through the store,
        not a collective) before the TP forward: every rank judges its flips against the same
        margins. Only where the dense side decided (the same on every rank)."""
        if not self.dense:
            return
        mine = json.dumps(self.rounding_margins(dtype, world)) if rank == 0 else ""
        said = rendezvous.exchange("decisions", mine, label="the routing decisions' margins")
        self.margins = json.loads(said[0])

    def rounding_margins(self, dtype: torch.dtype, world: int) -> list[float]:
        """Twice the calibrated bound of each decision's input (on rank 0, which holds the truth;
        in a float64 run the dense side is the truth), over its finite elements: an input masked
        with -inf (a router's second choice, PhiMoE's sparsemixer) holds the same -inf on both
        sides there, which is no rounding."""
        out = []
        for k, d in enumerate(self.dense):
            truth = self.truth[k] if k < len(self.truth) else d.x
            assert dtype == torch.float64 or k < len(self.truth), "no float64 input to calibrate"
            finite = torch.isfinite(d.x) & torch.isfinite(truth)
            x, t = d.x[finite], truth[finite]
            out.append(2 * tolerance.calibrated(x, t, dtype, world).value if x.numel() else 0.0)
        return out


def flip_gap(call: Call, x_dense: torch.Tensor, dense_idx, tp_idx) -> tuple[float, int]:
    """(the largest gap between competing values where the two decisions differ, measured on the
    dense input in float64; the number of rows that differ). Without a decided order
    (topk(sorted=False)) each side's indices are put in the dense values' order first."""
    tp_idx = tp_idx.to(dense_idx.device)
    if call.unordered:
        dense_idx, tp_idx = _ordered(x_dense, dense_idx, call), _ordered(x_dense, tp_idx, call)
    differ = dense_idx != tp_idx
    if not bool(differ.any()):
        return 0.0, 0
    gap = (x_dense.gather(call.dim, dense_idx) - x_dense.gather(call.dim, tp_idx)).abs()
    rows = differ.movedim(call.dim, -1).reshape(-1, differ.shape[call.dim]).any(-1)
    return float(gap[differ].max()), int(rows.sum())


def _ordered(x: torch.Tensor, idx: torch.Tensor, call: Call) -> torch.Tensor:
    order = x.gather(call.dim, idx).argsort(dim=call.dim, descending=call.largest, stable=True)
    return idx.gather(call.dim, order)


# ------------------------------------------------------------------ the three roles


class _DecisionMode(TorchFunctionMode):
    def __init__(self, book: DecisionBook, role: str, model: nn.Module, next_seq=None) -> None:
        super().__init__()
        self.book, self.role, self.next_seq = book, role, next_seq
        self.names = {id(m): name or "(model)" for name, m in named_modules(model)}
        self.stack: list[str] = []
        self.counts: dict[tuple[str, str], int] = {}
        self.k = 0

    def __enter__(self):
        self.handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._leave, always_call=True),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def _enter(self, module, args):
        if id(module) in self.names:
            self.stack.append(self.names[id(module)])

    def _leave(self, module, args, output):
        if self.stack and self.stack[-1] == self.names.get(id(module)):
            self.stack.pop()

    def _label(self, kind: str) -> str:
        where = self.stack[-1] if self.stack else "(model)"
        n = self.counts[(where, kind)] = self.counts.get((where, kind), 0) + 1
        return f"{where}.{kind}#{n}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = _parse(func, args, kwargs) if func in _CALLS else None
        if call is None or _from_checker():
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        label, k = self._label(call.kind), self.k
        self.k += 1
        idx = call.indices(out).detach().cpu()
        if self.role == "tp":
            dense = self.book.dense[k] if k < len(self.book.dense) else None
            return self._tp(call, out, label, dense, idx, self.book.margins[k] if dense else 0.0)
        x = call.source().detach().double().cpu()
        if self.role == "draw":
            self.book.dense.append(Decision(label, call.kind, x, idx))
            return out
        dense = self.book.dense[k] if k < len(self.book.dense) else None
        if dense is None or dense.kind != call.kind or dense.x.shape != x.shape:
            raise UsageError(
                "the float64 copy of the dense model took other decisions (top-k, argmax, "
                f"sort) than the dense model at {label} (a model whose forward depends on its "
                "dtype): tpcheck cannot replay them"
            )
        self.book.truth.append(x)  # the truth's replay
        return call.rebuild(out, dense.idx.to(_device(out)))

    def _tp(self, call: Call, out, label: str, dense: Decision | None, idx, margin: float):
        """The TP side's decision against the dense side's (see the module docstring)."""
        if dense is None or dense.kind != call.kind or dense.x.shape != call.source().shape:
            self.book.unreplayed.append(label)
            return out
        gap, rows = flip_gap(call, dense.x, dense.idx, idx)
        of_rows = dense.idx.numel() // max(dense.idx.shape[call.dim], 1)
        within = rows > 0 and gap <= margin
        self.book.judged.append(
            Judged(label, self.next_seq(), gap, margin, rows, of_rows, substituted=within)
        )
        return call.rebuild(out, dense.idx.to(_device(out))) if within else out


def _device(out) -> torch.device:
    return (out if isinstance(out, torch.Tensor) else out.indices).device
