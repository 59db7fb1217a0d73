"""The dense model's rounding twin: what rounding alone explains of the dense side's own error, so
that a bound is never widened by a dense model that is not its own float64 twin.

A calibrated bound is a multiple of the dense side's error against its float64 copy (tolerance.py).
That error is rounding only if the dense model computes the same function in both dtypes. Some do
not: an in-place normalisation that writes into its input where `x.float()` is a no-op (float32)
and into a copy where it converts (float64), a branch on `x.dtype`, a kernel chosen by dtype. The
float64 copy then takes another path, the gap is no rounding (2 to 3.7 on values of about 2 in one
real inference engine), and every bound made of it would let a real bug pass.

The twin tells the two apart. On the first pass of a case, where some dense tensor is more than
GATE_ULPS ulps of its scale away from the float64 run, the dense model (a copy taken before its
pass, same weights, buffers and masks) runs again in the working dtype with the result of every op
moved by up to one ulp of its dtype, at random (`Rounding`: Monte Carlo arithmetic). Its distance
from the dense side is what rounding explains there: measured on correct models it is at least the
true rounding error (the float64 gap is 0.1 to 1.4 times it), also where cancellation makes both
large. A tensor whose float64 gap is more than RATIO times that is on another path: its bound is
then made from the twin (the same calibrated bound, the twin in the float64 run's place), its reason
says so, and the case's notes name the first such tensor with both numbers. Which tensors: the
captured module outputs and their gradients, the output, the loss, the inputs' gradients; the
parameters' gradients from the twin's own (summed over the step's micro-batches as the dense
side's are); and in the optimizer stage the float64 truth steps from the twin's gradient of every
such parameter (`stand_in_grads`), so the clipped gradients, the state and the update are held to
rounding there too. From then on the twin runs on every pass of the case; where nothing is past
the gate on the first pass, or nothing past the ratio, it runs no more.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.measure import maxdiff

GATE_ULPS = 32  # a dense tensor this many ulps of its scale from the float64 run is looked at
RATIO = 16  # a float64 gap more than this many times what rounding explains is another path
SEED = 20240611  # the twin's moves: its own generator, never the model's
OFF_PATH = "against the float64 run from "  # how the note starts (the float64 run's merge reads it)


class Rounding(TorchDispatchMode):
    """Every floating result of every op (views aside) moved by a random factor in
    [1 - eps, 1 + eps] of its dtype, in place, from a generator of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(SEED)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if not schema.is_mutable and any(r.alias_info is not None for r in schema.returns):
            return out  # a view: its base was moved when it was made
        tree_map(self._move, out)
        return out

    def _move(self, t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            eps = torch.finfo(t.dtype).eps
            r = torch.rand(t.shape, generator=self.gen, dtype=torch.float64)
            factor = r.mul_(2 * eps).add_(1 - eps).to(t.device)
            with torch.no_grad():
                t.copy_(t.double().mul_(factor))
        return t


@dataclasses.dataclass
class Twin:
    """One case's rounding twin on rank 0: `on` None until the first pass decides, then whether
    it runs; `notes` for the report."""

    on: bool | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    made: dict = dataclasses.field(default_factory=dict)  # id(dense tensor) -> its bound
    # the twin's parameter gradients, summed over the passes of step `grads_step`, by name
    grads: dict = dataclasses.field(default_factory=dict)
    grads_step: int = 0
    off_path: list = dataclasses.field(default_factory=list)  # names whose grad bound is the twin's
    stood_in: bool = False  # the optimizer stage's truth has stepped from the twin's gradients

    def snapshot(self, dense: nn.Module, wanted: bool) -> nn.Module | None:
        """A copy of the dense model before its pass, where the twin may run on it."""
        if not wanted or self.on is False:
            return None
        try:
            twin = copy.deepcopy(dense)
        except Exception as e:  # noqa: BLE001 - a model that cannot be copied has no twin
            self.on = False
            self.notes.append(
                f"the dense model's rounding twin: the model could not be copied "
                f"({type(e).__name__}: {e}); the bounds are made from the float64 run alone"
            )
            return None
        for p in twin.parameters():
            p.grad = None
        return twin

    def looks(self, dtype: torch.dtype, bounds: list, pairs: list) -> bool:
        """Whether the twin runs on this pass: on, or (first pass) some dense tensor past the
        gate: a captured bound's dense error, or an output's or loss's gap (`pairs`: dense,
        float64)."""
        if self.on is not None:
            return self.on
        eps = tolerance.eps(dtype)
        past = any(
            b.ref_error is not None and b.scale and b.ref_error > GATE_ULPS * eps * b.scale
            for b in bounds
        ) or any(
            _gap(d, t) > GATE_ULPS * eps * float(t.abs().max())
            for d, t in pairs
            if d is not None and t is not None and t.numel()
        )
        self.on = past
        return past

    def judge(self, cmp, where: str, dense, bound, twin) -> tolerance.Bound | None:
        """The twin's bound for a tensor whose float64 gap (`bound.ref_error`) is more than RATIO
        times what rounding explains (max |dense - twin|), else None (the float64 bound stands)."""
        gap, explained = bound.ref_error, maxdiff(dense, twin)
        eps = tolerance.eps(dense.dtype)
        if gap is None or gap <= GATE_ULPS * eps * (bound.scale or 0.0) or gap <= RATIO * explained:
            return None
        made = cmp.calibrated(dense, twin.double())
        self.note(where, gap, explained)
        return dataclasses.replace(
            made,
            reason=f"{made.reason.replace('vs float64', 'vs its rounding twin')}: the float64 run "
            f"takes another path here ({gap:.3g} away, {gap / max(explained, 1e-300):.3g} x what "
            "rounding explains)",
        )

    def note(self, where: str, gap: float, explained: float) -> None:
        if not self.notes:
            ratio = gap / max(explained, 1e-300)
            self.notes.append(
                f"{OFF_PATH}{where} on: the dense model is not its own float64 "
                f"twin there (its working dtype {gap:.3g} away from its float64 run, {ratio:.3g} x "
                f"what rounding explains, {explained:.3g}: its rounding twin, the dense model "
                "rerun with every op's result moved by up to an ulp); the bounds from there are "
                "made from the rounding twin"
            )

    def settle(self, cmp, step: int, rec_d, rec_t, rec_w) -> None:
        """Each captured tensor's float64 bound (`rec_t`, Calibrating's) replaced by the twin's
        where the float64 run takes another path (`judge`)."""
        for key, kept in rec_t.tensors.items():
            dense, twin = rec_d.tensors.get(key, []), rec_w.tensors.get(key, [])
            for i, b in enumerate(kept):
                if not isinstance(b, tolerance.Bound) or i >= min(len(dense), len(twin)):
                    continue
                if dense[i].shape != twin[i].shape:
                    continue
                where = f"{'act' if key[0] == 'forward' else 'actgrad'}:{key[1]} (step {step})"
                made = self.judge(cmp, where, dense[i], b, twin[i])
                if made is not None:
                    kept[i] = made

    def stand_in(self, cmp, where: str, dense, truth, twin) -> None:
        """An output's or a loss's bound from the twin where the float64 run takes another path
        (`judge`), kept for its comparison (`bound_for`)."""
        if twin is None or truth is None or dense is None or dense.shape != twin.shape:
            return
        made = self.judge(cmp, where, dense, cmp.calibrated(dense, truth), twin)
        if made is not None:
            self.made[id(dense)] = made

    def bound_for(self, dense) -> tolerance.Bound | None:
        """The twin's bound made for `dense` (an output or a loss of this pass), or None."""
        return self.made.pop(id(dense), None)

    def keep_grads(self, step: int, twin: nn.Module) -> None:
        """The twin's parameter gradients of one pass, added to those of the step's earlier
        passes (its micro-batches), as the dense side accumulates its own."""
        if step != self.grads_step:
            self.grads, self.grads_step, self.off_path = {}, step, []
        for name, p in twin.named_parameters():
            if p.grad is not None:
                kept = self.grads.get(name)
                self.grads[name] = p.grad.detach().clone() if kept is None else kept.add_(p.grad)

    def grad_bound(self, cmp, step: int, name: str, dense, truth) -> tolerance.Bound | None:
        """The twin's bound for parameter `name`'s gradient at `step` where the float64 run takes
        another path (`judge`), else None; only where the twin ran on every pass of the step."""
        twin = self.grads.get(name) if self.on and self.grads_step == step else None
        if twin is None or dense is None or truth is None or twin.shape != dense.shape:
            return None
        where = f"grad:{name} (step {step})"
        made = self.judge(cmp, where, dense, cmp.calibrated(dense, truth), twin)
        if made is not None:
            self.off_path.append(name)
        return made

    def stand_in_grads(self, truth: nn.Module, step: int) -> bool:
        """Before the optimizer stage of `step`: the float64 truth's gradient of every parameter
        whose gradient bound was the twin's (`grad_bound`) replaced by the twin's, so that the
        clipping, the optimizer state and the update the truth computes from it differ from the
        dense side's by rounding, not by the float64 run's other path. Whether it did."""
        if self.grads_step != step or not self.off_path:
            return False
        params = dict(truth.named_parameters())
        for name in self.off_path:
            p = params.get(name)
            if p is not None and p.grad is not None:
                with torch.no_grad():
                    p.grad.copy_(self.grads[name])
        if not self.stood_in:
            self.stood_in = True
            self.notes.append(
                f"the optimizer stage's float64 truth steps from the rounding twin's gradients "
                f"where the float64 run's are on another path ({len(self.off_path)} parameter(s), "
                f"first {self.off_path[0]}): its bounds are made from rounding too"
            )
        return True


def twin_pass(s, twin: nn.Module, book, run):
    """The twin's pass (`run(model, recorder, masks)`, the caller's reference pass) under
    `Rounding`, with the dense side's masks replayed (not its discrete decisions: a flip of the
    twin's own only makes it explain more); (recorder, what `run` returns), or None where it fails
    (said in the notes, the float64 bounds then stand)."""
    from tpcheck.checker.rank.capture import Recorder

    rec = Recorder()
    masks = book.replay(twin) if s.draws.draws_random is not False else contextlib.nullcontext()
    try:
        with Rounding():
            got = run(twin, rec, masks)
    except Exception as e:  # noqa: BLE001 - the twin is a second opinion, never a verdict
        s.twin.on = False
        s.twin.notes.append(
            f"the dense model's rounding twin could not run ({type(e).__name__}: {e}): the bounds "
            "are made from the float64 run alone"
        )
        return None
    return rec, got


def consult(s, step: int, twin, book, run, rec_d, rec_t, sides: dict) -> None:
    """The twin on one pass, where it runs (`Twin.looks`): its pass (`run(model, recorder, masks)`
    -> {name: tensor}), then each captured bound and each of `sides` ({name: (dense, float64)}:
    the output, the loss) from the twin where the float64 run takes another path."""
    s.twin.made.clear()  # a bound made for an earlier pass's tensor is never another's
    if twin is None or not s.twin.looks(s.dtype, bounds_of(rec_t), list(sides.values())):
        return
    if (ran := twin_pass(s, twin, book, run)) is None:
        return
    rec_w, got = ran
    s.twin.keep_grads(step, twin)
    s.twin.settle(s.cmp, step, rec_d, rec_t, rec_w)
    for name, (dense, truth) in sides.items():
        s.twin.stand_in(s.cmp, f"{name} (step {step})", dense, truth, got.get(name))
    if not s.twin.notes:
        s.twin.on = False  # nothing on another path at the first pass: the twin runs no more


def bounds_of(rec_t) -> list:
    return [b for kept in rec_t.tensors.values() for b in kept if isinstance(b, tolerance.Bound)]


def _gap(dense, truth) -> float:
    if dense is None or truth is None or dense.shape != truth.shape or not truth.numel():
        return 0.0
    return float((dense.double() - truth.double()).abs().max())
