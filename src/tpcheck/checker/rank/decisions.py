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
* before the TP forward, rank 0 sends every rank what each decision is held to (`share`), all of
  it measured on the scores that decide, at that step, by the dense side against the float64
  truth, never by the TP side (a TP-side bias must not buy its own allowance): the rounding margin
  of a flip, FLIP_FACTOR x the dense side's largest error of the decision's input + 1 ulp of its
  scale (float64 runs: FP64_FLOOR_ULPS ulps for that error); and the yardstick of a per-index
  offset (below);
* the TP side's k-th decision call is held to the dense side's k-th: where it picked the same
  indices, nothing changes. Where it picked others, the margin of the flip is the gap between the
  competing values (the one the dense side picked and the one the TP side picked, at every
  position where they differ) measured on the dense side's input in float64. Within the rounding
  margin, the dense indices are substituted (values gathered from the TP side's own input at
  them, so gradients flow as before) and the report carries the note "a routing decision flipped
  at a near-tie (margin m)"; beyond it the TP side keeps its own decision and the check
  `routing:<module>.<call>#<n>` fails (diagnosis `routing`);
* a flip within the margin is rounding only if nothing systematic moves the scores: the TP side's
  input minus the dense side's, averaged over the rows for each index of the decided dim and taken
  from the median index's average (a shift of every score decides nothing), must stay within
  BIAS_FACTOR yardsticks, the yardstick being the dense side's largest error of the input (+ 1 ulp
  of its root mean square) over the square root of its distinct rows: rounding averages out over
  rows, a constant added to one expert's logits does not (over fewer than MIN_ROWS distinct rows,
  a greedy decode's argmax, a mean is as wide as one rounding: no offset test). (Not the dense
  side's own per-index offset against float64: its weights are rounded from float64's, which
  offsets each index systematically, while the TP side computes with the dense side's very
  weights.) Beyond it the check fails as `decision_bias` where the offset explains what differs
  (the flips within the margin, or what is left once the offsets are out within half of it),
  naming the index and how many flips went its way; its flips are no near-ties (no note), but the
  dense decision is replayed so that what follows stays comparable and the bias is the failure
  named.

Why FLIP_FACTOR = 8: a flip needs the TP-vs-dense difference of the two competing scores to exceed
their gap. Over 1,350 forwards of correct top-1 and top-2 routers (bfloat16, float16, float32; tp 1,
2 and 4; 30 seeds each) that difference stayed below 7.4 x the dense error (median 2.1), and over
7,560 judged decisions (the same routers, 60 seeds, forward-only and training) no flip's gap passed
2.8 x it (0.35 of the margin). Why BIAS_FACTOR = 4: over those 7,560 decisions the per-index offset
stayed below 1.4 yardsticks (0.35 of the bound, median 0.2 yardstick); a +0.2 bias on one expert's
bfloat16 logits (dense error ~0.07, 64 rows) reads at least 2.3 x the bound (median 28 x over the
three biased routers of tests/checker/rank/case_files/moe_top2.py in bfloat16, float16, float32).
The old allowance, twice the calibrated bound of the input (16 x the dense error + 2 ulps of the
scale), was ~1.5 logits there against a median gap of 1.4 between the 2nd and 3rd logit; the
margin is now ~0.75.

The self-test (once per step on each rank, `controls`): a flip planted in the row where it is
largest (the first decided index replaced by the one farthest from it) must exceed the margin, and
an offset of CONTROL_RATIO yardsticks planted on one index must exceed the offset bound. Both sizes
come from the dense error measured apart (`tolerance.dense_error`) with their own constant, so a
margin or a bound widened (a mutant) leaves them unflagged: "error". A planted flip smaller than
CONTROL_RATIO x that error (a decision over values within rounding of one another) is a blind spot,
named and skipped.

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
import math
import sys
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.capture import named_modules
from tpcheck.checker.rank.measure import absmax
from tpcheck.errors import UsageError

FLIPPED = "a routing decision flipped at a near-tie"
BEYOND = "a routing decision differs beyond rounding"
DECISION_BIAS = "decision_bias"  # the check's kind (and diagnosis) of a per-index offset
# the rounding margin of a flip: FLIP_FACTOR x the dense error of the decision's input + 1 ulp of
# its scale; a per-index offset beyond BIAS_FACTOR yardsticks is a bias (module docstring: why 8)
FLIP_FACTOR, BIAS_FACTOR = 8.0, 4.0
# the self-test's planted flip and offset, in dense errors (yardsticks): its own constant, twice
# the factors above, so that a margin or bound widened cannot excuse its control
CONTROL_RATIO = 16.0
# the fewest distinct rows whose mean says anything of a per-index offset: over fewer, a mean is
# as wide as one rounding, which the margin already judges (no offset test)
MIN_ROWS = 8


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
    dim: int = -1
    dtype: torch.dtype = torch.float64  # the dtype the model decided in (its masks' extremes)


@dataclass
class Judged:
    """The TP side's k-th decision against the dense side's: the gap of its flips (0: none), the
    margin it was held to, the rows that flipped, and whether the dense decision was substituted;
    the largest per-index offset of its input (`offset`, at index `at`, `signed`), the bound it was
    held to and the flipped rows whose TP side picked that index first (`toward`); and, for the
    first decision of a forward, the self-test's `controls`: (kind, planted error, bound, blind
    spot or None) each."""

    label: str
    seq: int
    gap: float
    margin: float
    rows: int
    of_rows: int
    substituted: bool
    offset: float = 0.0
    offset_bound: float = math.inf
    at: int = 0
    signed: float = 0.0
    toward: int = 0
    left: float = 0.0  # the largest difference of the inputs left once each index's offset is out
    controls: list[tuple[str, float, float, str | None]] = field(default_factory=list)

    @property
    def biased(self) -> bool:
        return self.offset > self.offset_bound

    @property
    def passed(self) -> bool:
        return self.gap <= self.margin and not self.biased

    @property
    def kind(self) -> str:
        """The check's kind: DECISION_BIAS where the offset is beyond its bound and explains what
        differs (the flips within the margin, or what is left once it is taken out within half
        the margin, a score's share of it); else "routing" (the scores differ beyond rounding
        everywhere: a router on a rank's shard of the hidden state)."""
        explains = self.gap <= self.margin or self.left <= self.margin / 2
        return DECISION_BIAS if self.biased and explains else "routing"

    def reason(self) -> str:
        """The check's reason: the flips against the margin, or the offset against its bound."""
        if self.kind == DECISION_BIAS:
            return (
                f"index {self.at} of the TP side's scores is offset by {self.signed:+.3g} from the "
                f"median index's, on average over {self.of_rows} row(s): beyond "
                f"{self.offset_bound:.3g} ({BIAS_FACTOR:g} x the dense side's largest error of "
                "these scores over the square root of the rows, what rounding averages to): a "
                f"systematic bias before the decision; {self.rows} row(s) flipped, {self.toward} "
                f"to index {self.at}"
            )
        if self.rows == 0:
            return f"the TP side decided as the dense side ({self.of_rows} row(s))"
        return (
            f"{self.rows} of {self.of_rows} row(s) flipped at a gap of {self.gap:.3g} "
            + ("within" if self.gap <= self.margin else "beyond")
            + f" the rounding margin {self.margin:.3g} ({FLIP_FACTOR:g} x the dense error of its "
            "input + 1 ulp)"
        )


@dataclass
class DecisionBook:
    """The decisions of one forward: taken by the dense side, replayed by the truth, judged and
    (at a near-tie) replaced on the TP side."""

    dense: list[Decision] = field(default_factory=list)
    truth: list[torch.Tensor] = field(default_factory=list)
    margins: list[float] | None = None
    # per decision: the bound of a per-index offset (BIAS_FACTOR yardsticks), and the self-test's
    # sizes (the smallest planted flip it can hold to the margin, the offset it plants)
    offset_bounds: list[float] | None = None
    control_sizes: list[tuple[float, float]] | None = None
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
        mine = ""
        if rank == 0:
            mine = json.dumps(
                [
                    self.rounding_margins(dtype, world),
                    self.offset_yardsticks(dtype),
                    self.control_plants(dtype),
                ]
            )
        said = rendezvous.exchange("decisions", mine, label="the routing decisions' margins")
        self.margins, self.offset_bounds, self.control_sizes = json.loads(said[0])

    def _inputs(self, dtype: torch.dtype):
        """Each decision's dense and float64 inputs (on rank 0, which holds the truth; in a float64
        run the dense side is the truth)."""
        for k, d in enumerate(self.dense):
            assert dtype == torch.float64 or k < len(self.truth), "no float64 input to calibrate"
            yield d, self.truth[k] if k < len(self.truth) else d.x

    def rounding_margins(self, dtype: torch.dtype, world: int) -> list[float]:
        """FLIP_FACTOR x the dense side's error of each decision's input against the truth + 1 ulp
        of its scale, over its values that are no mask (`_values`)."""
        out = []
        for d, truth in self._inputs(dtype):
            x, t = _values(d, truth)
            out.append(FLIP_FACTOR * _dense_error(x, t, dtype) + tolerance.eps(dtype) * absmax(t))
        return out

    def offset_yardsticks(self, dtype: torch.dtype) -> list[float]:
        """BIAS_FACTOR x each decision's yardstick of a per-index offset: the dense side's largest
        error of its input (+ 1 ulp of its typical element, the root mean square) over the square
        root of its distinct rows (the mean of n roundings; copies of one row average nothing)."""
        out = []
        for d, truth in self._inputs(dtype):
            x, t = _values(d, truth)
            error = _dense_error(x, t, dtype) + tolerance.eps(dtype) * _rms(t)
            rows = distinct_rows(d.x, d.dim)
            out.append(BIAS_FACTOR * error / math.sqrt(rows) if rows >= MIN_ROWS else math.inf)
        return out

    def control_plants(self, dtype: torch.dtype) -> list[tuple[float, float]]:
        """The self-test's sizes for each decision, from the dense error measured apart
        (`tolerance.dense_error`) and CONTROL_RATIO: (the smallest planted flip that must exceed
        the margin, the offset planted on one index)."""
        out = []
        for d, truth in self._inputs(dtype):
            x, t = _values(d, truth)
            ulp, typical = tolerance.eps(dtype) * absmax(t), tolerance.eps(dtype) * _rms(t)
            error = tolerance.dense_error(x, t)
            if dtype == torch.float64:
                error = tolerance.FP64_FLOOR_ULPS * ulp
            planted = (error + typical) / distinct_rows(d.x, d.dim) ** 0.5
            out.append((CONTROL_RATIO * (error + ulp), CONTROL_RATIO * planted))
        return out


def _values(d: Decision, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements of the decision's dense input and of the truth's that are values, not masks:
    an input masked with -inf (a router's second choice, PhiMoE's sparsemixer) or with its dtype's
    extreme (`torch.finfo(x.dtype).min`, an attention sink's scores) holds a mask on both sides
    there, of another size in float64, which is no rounding."""
    extreme = torch.finfo(d.dtype).max
    value = (d.x.abs() < extreme) & (truth.abs() < extreme)  # NaN and +-inf compare False
    return d.x[value], truth[value]


def _dense_error(x: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> float:
    """max |dense - truth|; float64's bound in a float64 run (FP64_FLOOR_ULPS ulps of the scale)."""
    if not t.numel():
        return 0.0
    if dtype == torch.float64:
        return tolerance.FP64_FLOOR_ULPS * tolerance.eps(dtype) * absmax(t)
    return float((x - t).abs().max())


def _rms(t: torch.Tensor) -> float:
    """The root mean square of `t` (0 if empty)."""
    return float(t.square().mean().sqrt()) if t.numel() else 0.0


def _as_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`x` as [rows, the decided dim]."""
    moved = x.movedim(dim, -1) if x.dim() else x.reshape(1)
    return moved.reshape(-1, moved.shape[-1])


def _from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """`_as_rows`'s inverse: `rows` back in the layout of `like`."""
    if not like.dim():
        return rows.reshape(())
    return rows.reshape(like.movedim(dim, -1).shape).movedim(-1, dim)


def distinct_rows(x: torch.Tensor, dim: int) -> int:
    """The rows of the decision's input `x` that are not copies of one another (a score broadcast
    over the batch is one row)."""
    rows = _as_rows(x, dim)
    return max(int(torch.unique(rows.nan_to_num(), dim=0).shape[0]), 1) if rows.numel() else 1


def index_offset(diff: torch.Tensor, dim: int) -> tuple[float, int, float, float]:
    """(the largest |offset|, its index, its sign; the largest |diff| left once each index's mean
    is taken out) of `diff` (one side's decision input minus the other's) per index of the decided
    dim: its mean over the rows (finite elements only) minus the median index's mean (a shift of
    every value decides nothing). No offset over fewer than 2 indices."""
    d = _as_rows(diff, dim)
    finite = torch.isfinite(d)
    count = finite.sum(0)
    seen = count > 0
    mean = torch.where(finite, d, 0.0).sum(0) / count.clamp(min=1)
    left = torch.where(finite, d - mean, 0.0).abs().max() if d.numel() else torch.tensor(0.0)
    if int(seen.sum()) < 2:
        return 0.0, 0, 0.0, float(left)
    centred = torch.where(seen, mean - mean[seen].median(), 0.0)
    j = int(centred.abs().argmax())
    return float(centred[j].abs()), j, float(centred[j]), float(left)


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
            return self._tp(call, out, label, dense, idx, k)
        x = call.source().detach().double().cpu()
        if self.role == "draw":
            self.book.dense.append(Decision(label, call.kind, x, idx, call.dim, call.x.dtype))
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

    def _tp(self, call: Call, out, label: str, dense: Decision | None, idx, k: int):
        """The TP side's decision against the dense side's (see the module docstring)."""
        if dense is None or dense.kind != call.kind or dense.x.shape != call.source().shape:
            self.book.unreplayed.append(label)
            return out
        book = self.book
        margin = book.margins[k]
        gap, rows = flip_gap(call, dense.x, dense.idx, idx)
        of_rows = dense.idx.numel() // max(dense.idx.shape[call.dim], 1)
        judged = Judged(label, self.next_seq(), gap, margin, rows, of_rows, substituted=False)
        if book.offset_bounds is not None:
            diff = call.source().detach().double().cpu() - dense.x
            judged.offset, judged.at, judged.signed, judged.left = index_offset(diff, call.dim)
            judged.offset_bound = book.offset_bounds[k]
            judged.toward = picked_first(call, dense, idx, judged.at)
            if not book.judged:  # the self-test, from the forward's first decision
                judged.controls = controls(call, dense, book, k)
        judged.substituted = rows > 0 and gap <= margin and not judged.biased
        book.judged.append(judged)
        # a biased decision's flips are no near-ties (no note), but the dense decision is
        # replayed all the same: what follows stays comparable, the bias is the failure named
        replay = judged.substituted or (rows > 0 and judged.kind == DECISION_BIAS)
        return call.rebuild(out, dense.idx.to(_device(out))) if replay else out


def picked_first(call: Call, dense: Decision, tp_idx: torch.Tensor, index: int) -> int:
    """The rows where the TP side's decision differs from the dense side's and picked `index` at
    the first position where they differ (the direction of the flips)."""
    d, t = _as_rows(dense.idx, call.dim), _as_rows(tp_idx.to(dense.idx.device), call.dim)
    differ = d != t
    first = differ.int().argmax(1, keepdim=True)
    return int((differ.any(1) & (t.gather(1, first).squeeze(1) == index)).sum())


def controls(call: Call, dense: Decision, book: DecisionBook, k: int) -> list:
    """The self-test's two controls of decision `k`, through the very judgement of a real one:
    a flip planted in the row where it is largest (its first decided index replaced by the one
    farthest from it in value), against the margin, and an offset of the planted size on the
    index with the most values (no mask), against the offset bound. (kind, error, bound, blind)."""
    smallest, shift = book.control_sizes[k]
    x, idx = _as_rows(dense.x, call.dim), _as_rows(dense.idx, call.dim)
    value = x.abs() < torch.finfo(dense.dtype).max  # no mask (`_values`)
    farther = torch.where(value, x - x.gather(1, idx[:, :1]), 0.0).abs().nan_to_num(nan=0.0)
    row = int(farther.amax(1).argmax())
    planted = idx.clone()
    planted[row, 0] = farther[row].argmax()
    gap = flip_gap(call, dense.x, dense.idx, _from_rows(planted, dense.idx, call.dim))[0]
    blind = None
    if gap < smallest:
        blind = (
            f"the widest flip the decision's input allows ({gap:.3g}) is under {CONTROL_RATIO:g} "
            f"x the dense error + 1 ulp ({smallest:.3g}): its values are within rounding"
        )
    column = int(value.sum(0).argmax())
    shifted = x.clone()
    shifted[:, column] += shift
    size = index_offset(_from_rows(shifted, dense.x, call.dim) - dense.x, call.dim)[0]
    none = None
    if x.shape[1] < 2 or distinct_rows(dense.x, call.dim) < MIN_ROWS:
        none = f"a decision over one index, or fewer than {MIN_ROWS} distinct rows, has no offset"
    return [
        ("routing", gap, book.margins[k], blind),
        (DECISION_BIAS, size, book.offset_bounds[k], none),
    ]


def _device(out) -> torch.device:
    return (out if isinstance(out, torch.Tensor) else out.indices).device
