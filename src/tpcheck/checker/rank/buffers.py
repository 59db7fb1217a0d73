"""The module's buffers and its eval mode, on this rank.

Buffers (`named_buffers()`, persistent or not: a batch norm's running statistics, a rotary
cos/sin cache, a causal mask) are state the forward may change, and `model.eval()` computes with
them. Every step restarts the TP module's parameters from the dense ones (optimizer_stage.py), never
its buffers: a buffer the TP forward updates follows its own course, as in training, and is compared
with the dense module's at step 0 (as built, beside the weights) and after every step's optimizer
stage, stage "buffers", check `buffer:<dense name>`:
- which TP buffer is which dense one (`BufferChecks.start`, agreed over the ranks through the
  store): the plan's `tp_names` (a buffer may be named there, or in a `Case.tp_names` dict), else
  the name under the TP module the parameters of its module were matched to (`fc1` -> `up_proj`,
  checker/rank/names.py), the same name, or the same name once wrapper segments are dropped;
- where it lives: the written plan's `Plan.buffers`, else the first placement its shape admits
  (plan_inference.py's candidates) whose shard of the dense buffer has the TP buffer's shape on
  every rank, one whose values match too preferred: Replicate() where the TP module holds the whole
  buffer, and then every rank's copy is held bitwise to the others' (compare.py);
- a floating buffer is bounded by the float64 truth's own buffer (its running statistics come from
  its own forwards, its caches from its own constructor), any other (`num_batches_tracked`, a bool
  mask) compared exactly;
- a buffer whose shape changes during the run (a rotary cache grown in the forward when a longer
  sequence comes) is compared at its current shapes: after every step the ranks exchange their
  buffers' shapes, and one whose dense or TP shape changed on some rank is placed again, as at
  step 0, at its new shapes (a written placement is kept, and applied to them);
- a buffer whose TP shape is no placement of the dense one fails as a layout check; one that only
  one side has (or some ranks only) is not compared and the report's notes say so; one empty on
  both sides (a cache not filled yet) is not compared there (nothing to compare, and a check of no
  element carries no control), nor one empty on one side only where no placement fits (a cache one
  side filled and the other not yet), the notes naming the steps and shapes (`skip_reason`).

The eval-mode forward (`eval_forward`): at the last step, after its training forwards (the running
statistics are those training left), every side in `.eval()` and without autograd, as the forward
without autograd is run (passes.py `no_grad_forward`), its output compared as "output:eval"
(forward stage), each module's own mode restored after; its collectives checked alike on every
rank, not counted against a case's expected ones. Eval mode draws no dropout: the dense side
draws nothing, and a TP draw there is one the dense side did not make (rng.py).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tpcheck.checker.checkid import EVAL_OUTPUT, CheckId
from tpcheck.checker.rank.names import strip_wrappers
from tpcheck.checker.rank.passes import no_grad_forward
from tpcheck.checker.rank.plan_inference import candidates
from tpcheck.errors import UsageError
from tpcheck.plan import Placement

if TYPE_CHECKING:
    from tpcheck.checker.rank.sides import Sides


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor buffer's local part; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def tp_buffer_name(dense_name: str, tp_names: dict[str, str], tp_buffers: set[str]) -> str | None:
    """The TP buffer that stands for dense buffer `dense_name`, None when there is none: named in
    `tp_names` (the plan's renames: of parameters, or of this buffer), the same name under the TP
    module its module's parameters were renamed to, the same name, or the one TP buffer of that
    name once wrapper segments are dropped."""
    if dense_name in tp_names:
        return tp_names[dense_name] if tp_names[dense_name] in tp_buffers else None
    module, _, leaf = dense_name.rpartition(".")
    modules = {d.rpartition(".")[0]: t.rpartition(".")[0] for d, t in tp_names.items()}
    if module and modules.get(module, module) != module:
        if (renamed := f"{modules[module]}.{leaf}") in tp_buffers:
            return renamed
    if dense_name in tp_buffers:
        return dense_name
    same = [t for t in tp_buffers if strip_wrappers(t) == strip_wrappers(dense_name)]
    return same[0] if len(same) == 1 else None


def _shard_shape(placement: Placement, dense: torch.Tensor, rank: int, world: int):
    try:
        return tuple(placement.shard(dense, rank, world).shape)
    except UsageError:  # a written placement this shape does not admit
        return None


def propose(
    dense: dict[str, torch.Tensor],
    tp: dict[str, torch.Tensor],
    tp_names: dict[str, str],
    written: dict[str, Placement],
    rank: int,
    world: int,
) -> dict:
    """This rank's view: {"buffers": {dense name: None (no TP buffer here) or [TP name, the
    candidate placements (indices) whose shard has the TP buffer's shape, those whose values match
    too, [the dense buffer's shape, the TP buffer's]]}, "left": TP buffers that stand for no dense
    one}. A written placement is the one candidate."""
    out: dict[str, list | None] = {}
    claimed = set()
    for d, buf in dense.items():
        t = tp_buffer_name(d, tp_names, set(tp))
        if t is None:
            out[d] = None
            continue
        claimed.add(t)
        local = _local(tp[t]).detach()
        tried = [written[d]] if d in written else candidates(tuple(buf.shape), world)
        fits = [i for i, p in enumerate(tried) if _shard_shape(p, buf, rank, world) == local.shape]
        same = [
            i
            for i in fits
            if torch.equal(tried[i].shard(buf.detach(), rank, world).to(local.dtype), local)
        ]
        out[d] = [t, fits, same, [list(buf.shape), list(local.shape)]]
    return {"buffers": out, "left": sorted(set(tp) - claimed)}


def decide(
    said: list[dict], dense: dict[str, torch.Tensor], written: dict[str, Placement], world: int
) -> tuple[list[tuple[str, str, Placement | None]], list[str]]:
    """From every rank's `propose`: the buffers compared, (dense name, TP name, placement; None:
    no placement fits on some rank), and the notes on those not compared. The same on every rank
    (made from what every rank said)."""
    watched, notes = [], []
    for d, buf in dense.items():
        views = [s["buffers"][d] for s in said]
        holders = [r for r, v in enumerate(views) if v is not None]
        if len(holders) < len(views):
            where = "none" if not holders else f"one on rank(s) {holders} only"
            notes.append(
                f"buffer {d!r}: the dense module has it, the TP module {where} (not compared; "
                "if it is there under another name, name it in the tp_names of the plan or case)"
            )
            continue
        names = {v[0] for v in views}
        if len(names) > 1:
            notes.append(f"buffer {d!r}: the ranks hold it under different names {sorted(names)}")
            continue
        tried = [written[d]] if d in written else candidates(tuple(buf.shape), world)
        same = set.intersection(*(set(v[2]) for v in views))
        fits = set.intersection(*(set(v[1]) for v in views))
        pick = min(same) if same else min(fits) if fits else None
        watched.append((d, names.pop(), tried[pick] if pick is not None else None))
    left = sorted({t for s in said for t in s["left"]})
    if left:
        notes.append(f"TP buffer(s) {left}: no dense buffer stands for them (not compared)")
    return watched, notes


@dataclass
class Watched:
    """One compared buffer: its dense and TP names, its placement at `shapes` (None: none fits on
    some rank), `shapes` every rank's [dense shape, TP shape] it was placed at (None: the module no
    longer holds it), and `skip`: why it is not compared at those shapes, None when it is."""

    dense: str
    tp: str
    placement: Placement | None
    shapes: list
    skip: str | None = None


def _shape(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else list(_local(t).shape)


def skip_reason(placement: Placement | None, shapes: list) -> str | None:
    """Why a buffer at `shapes` (every rank's [dense shape, TP shape]) is not compared, None when it
    is. Empty on both sides (no element on any rank: a cache not filled yet): nothing to compare,
    and a check of no element could carry no control. Empty on one side only, on some rank, where
    no placement fits (one side filled a cache the other has not): not compared either, the notes
    say where. Held by one module only (a buffer set to None since). Any other shape no placement
    fits is compared, as a layout failure."""
    if any(d is None or t is None for d, t in shapes):
        gone = [r for r, (d, t) in enumerate(shapes) if d is None or t is None]
        return f"held by one module only, or by neither (rank(s) {gone})"
    dense = shapes[0][0]
    empty = [r for r, (_, t) in enumerate(shapes) if math.prod(t) == 0]
    if math.prod(dense) == 0 and len(empty) == len(shapes):
        return f"empty on both sides (dense {dense})"
    if placement is not None or (math.prod(dense) and not empty):
        return None
    held: dict[str, list[int]] = {}
    for r, (_, t) in enumerate(shapes):
        held.setdefault(str(t), []).append(r)
    tp = ", ".join(f"{t} on rank(s) {ranks}" for t, ranks in held.items())
    return f"empty on one side only (dense {dense}, TP {tp})"


class BufferChecks:
    """The buffers compared on this rank: which TP buffer is which dense one and where it lives,
    decided at step 0 (`start`) and again whenever a buffer's shape changes on some rank (`compare`:
    a cache grown in the forward is compared at its current shapes)."""

    def __init__(self, s: Sides, watched: list[Watched], notes: list[str]) -> None:
        self.s, self.watched, self.matching_notes = s, watched, notes
        self.skipped: dict[tuple[str, str], list[int]] = {}  # (dense name, why) -> steps

    @property
    def notes(self) -> list[str]:
        """The notes on the buffers not matched, then on those not compared at some step."""
        return self.matching_notes + [
            f"buffer {d!r}: {why} at step(s) {steps} (not compared there)"
            for (d, why), steps in self.skipped.items()
        ]

    @classmethod
    def start(cls, s: Sides) -> BufferChecks:
        """Match and place the buffers (the ranks agree through the store), then compare them as
        built (step 0)."""
        plan, group = s.plan, s.group
        dense = dict(s.dense.named_buffers())
        tp = dict(s.tp.named_buffers())
        # a case with no plan written may name a buffer in its tp_names dict
        given = s.case.tp_names if isinstance(s.case.tp_names, dict) else {}
        renames = {**given, **plan.tp_names}
        said = _agree(s, propose(dense, tp, renames, plan.buffers, group.rank, group.world_size))
        placed, notes = decide(said, dense, plan.buffers, group.world_size)
        watched = []
        for d, t, placement in placed:
            shapes = [v["buffers"][d][3] for v in said]
            watched.append(Watched(d, t, placement, shapes, skip_reason(placement, shapes)))
        checks = cls(s, watched, notes)
        checks.compare(0)
        return checks

    def replace_resized(self) -> None:
        """Every rank's current shapes of the matched buffers (one exchange through the store);
        those whose shapes changed on some rank since they were placed are placed again at their
        current shapes, as at step 0 (a second exchange), the written placement kept. No exchange
        without a matched buffer (every rank matched the same ones)."""
        if not self.watched:
            return
        s = self.s
        dense, tp = dict(s.dense.named_buffers()), dict(s.tp.named_buffers())
        mine = {w.dense: [_shape(dense.get(w.dense)), _shape(tp.get(w.tp))] for w in self.watched}
        text = s.rendezvous.exchange("buffer-shapes", json.dumps(mine), label="the buffers' shapes")
        every = [json.loads(t) for t in text]
        resized = []
        for w in self.watched:
            if (shapes := [v[w.dense] for v in every]) != w.shapes:
                w.shapes, w.placement = shapes, None
                w.skip = skip_reason(None, shapes)
                if all(d is not None and t is not None for d, t in shapes):
                    resized.append(w)
        if not resized:
            return
        names = {w.dense: w.tp for w in resized}
        group, written = s.group, s.plan.buffers
        shown = {d: dense[d] for d in names}
        said = _agree(s, propose(shown, tp, names, written, group.rank, group.world_size))
        placed = {d: p for d, _, p in decide(said, shown, written, group.world_size)[0]}
        for w in resized:
            w.placement = placed.get(w.dense)
            w.skip = skip_reason(w.placement, w.shapes)

    def compare(self, step: int) -> None:
        """Every matched buffer on this rank against the dense module's, through its placement at
        the buffers' current shapes (placed again where they changed)."""
        if step > 0:
            self.replace_resized()
        s = self.s
        rank, world = s.group.rank, s.group.world_size
        dense, tp = dict(s.dense.named_buffers()), dict(s.tp.named_buffers())
        truth = dict(s.truth.named_buffers()) if s.truth is not None else {}
        for w in self.watched:
            if w.skip is not None:
                self.skipped.setdefault((w.dense, w.skip), []).append(step)
                continue
            local, ref = _local(tp[w.tp]).detach(), dense[w.dense].detach()
            check_id = CheckId("buffer", w.dense)
            if w.placement is None:
                s.cmp.record_layout(
                    step,
                    check_id,
                    s.cmp.next_seq(),
                    f"TP buffer {w.tp!r} {list(local.shape)} (rank {rank}) is no placement of the "
                    f"dense buffer {list(ref.shape)} at {world} rank(s)",
                    stage="buffers",
                )
                continue
            floating = ref.is_floating_point()
            s.cmp.compare(
                "buffers",
                step,
                check_id,
                local,
                ref,
                truth[w.dense].detach() if floating and w.dense in truth else None,
                w.placement,
                exact=not floating,
                dtype=ref.dtype if floating else None,
            )


def _agree(s: Sides, mine: dict) -> list[dict]:
    """Every rank's `propose`, through the store."""
    text = s.rendezvous.exchange("buffers", json.dumps(mine), label="matching the buffers")
    return [json.loads(t) for t in text]


@contextlib.contextmanager
def evaluating(models: list[nn.Module]) -> Iterator[None]:
    """Every module of `models` in eval mode (through `eval()`, which a module may extend: the
    adapters' hidden parallelized module); each module's own mode restored after."""
    modes = [(m, m.training) for model in models for m in model.modules()]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for model in models:
            model.train(True)
        for m, training in modes:
            m.training = training


def eval_forward(s: Sides, step: int, inputs: dict) -> None:
    """The forward in eval mode, without autograd, of every side; its output compared as
    "output:eval" (the forward without autograd's own comparison, passes.py). Its collectives are
    held alike on every rank (a checkpoint after it), then left out of the ledger: a case's expected
    collectives are those of a training forward, its loss's included."""
    issued = len(s.tap.ledger)
    with evaluating(s.models()):
        no_grad_forward(s, step, inputs, EVAL_OUTPUT)
    s.sync(f"the forward in eval mode of step {step}")
    del s.tap.ledger[issued:]
