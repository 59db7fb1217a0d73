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
- a buffer whose TP shape is no placement of the dense one fails as a layout check; one that only
  one side has (or some ranks only) is not compared and the report's notes say so.

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
    too]}, "left": TP buffers that stand for no dense one}. A written placement is the one
    candidate."""
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
        out[d] = [t, fits, same]
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


class BufferChecks:
    """The buffers compared on this rank: which TP buffer is which dense one and where it lives,
    decided once at step 0 (`start`), then compared at every step (`compare`)."""

    def __init__(self, s: Sides, watched: list, notes: list[str]) -> None:
        self.s, self.watched, self.notes = s, watched, notes

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
        mine = propose(dense, tp, renames, plan.buffers, group.rank, group.world_size)
        said = [
            json.loads(text)
            for text in s.rendezvous.exchange(
                "buffers", json.dumps(mine), label="matching the buffers"
            )
        ]
        checks = cls(s, *decide(said, dense, plan.buffers, group.world_size))
        checks.compare(0)
        return checks

    def compare(self, step: int) -> None:
        """Every matched buffer on this rank against the dense module's, through its placement."""
        s = self.s
        rank, world = s.group.rank, s.group.world_size
        dense, tp = dict(s.dense.named_buffers()), dict(s.tp.named_buffers())
        truth = dict(s.truth.named_buffers()) if s.truth is not None else {}
        for d, t, placement in self.watched:
            local, ref = _local(tp[t]).detach(), dense[d].detach()
            check_id = CheckId("buffer", d)
            if placement is None:
                s.cmp.record_layout(
                    step,
                    check_id,
                    s.cmp.next_seq(),
                    f"TP buffer {t!r} {list(local.shape)} (rank {rank}) is no placement of the "
                    f"dense buffer {list(ref.shape)} at {world} rank(s)",
                    stage="buffers",
                )
                continue
            shape = _shard_shape(placement, ref, rank, world)
            if shape != tuple(local.shape):  # resized since step 0: never equal, on this rank
                like = ref.dtype if ref.is_floating_point() else torch.float64
                local = torch.full(shape or ref.shape, math.nan, dtype=like, device=ref.device)
            floating = ref.is_floating_point()
            s.cmp.compare(
                "buffers",
                step,
                check_id,
                local,
                ref,
                truth[d].detach() if floating and d in truth else None,
                placement,
                exact=not floating,
                dtype=ref.dtype if floating else None,
            )


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
