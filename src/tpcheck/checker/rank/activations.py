"""Activation placements nobody wrote: for the module outputs a case does not name (in
`Plan.activations` of a written plan, `Case.activations` of an inferred one), which are checked, and
how each lives on the ranks. A placement written is kept as written; the rest are inferred here.

The first micro-batch captures the output (and its gradient) of every module the dense and the TP
model both have by name; the TP side's tensors are held, not compared, until the ranks have agreed
on the placements, then compared in the order they were produced. A placement is inferred only where
the layout, not the values against the dense side, decides it -- a wrong guess would be a false "not
equivalent", and a guess from the values would hide the bug the check is there to find:

- the TP output has the dense shape on every rank and is bitwise the same on every
  rank: `Replicate()`;
- it has the dense shape but differs across ranks: the ranks' outputs are summed (one checker
  all-reduce for all of them). If the sum is the dense output (within `PARTIAL_RELATIVE` of its
  scale: the rounding of a sum, never a bug's O(1) difference), it is a partial sum before its
  all-reduce (a row-parallel linear whose reduction comes later): not checked. If instead every
  element is the dense one on some rank (the least distance over the ranks, in a second checker
  all-reduce) and no rank holds them all, it is a selection: a lookup whose rows outside the
  rank's shard are masked later (a vocab-parallel embedding's `nn.Embedding`, the mask applied by
  its caller): not checked, what uses it is. (One rank holding the whole dense output makes the
  others' values a bug, checked.) Otherwise it is a tensor every rank should hold whole and does
  not -- `Replicate()`, so its check fails and names the module (a missing all-reduce is then named
  one module up, where the partial sum is used as if it were whole);
- the module's own 2-D `weight` is split along its output rows -- `Shard(0)` (a column-parallel
  linear, an LM head) or `Fused(0, ...)` (a fused gate/up or QKV linear) -- and its output has the
  shape that layout gives the last dim: the same layout on the last dim
  (`[gate_r; up_r]` for a fused one);
- the TP output has the same shape on every rank, the dense shape with one dim `world` times
  smaller: `Shard(dim)` -- unless that dim is the last (the features) and the plan holds a fused
  parameter: a module downstream of a fused linear may carry `[a_r; b_r]` with that very shape (not
  checked: name it in `Plan.activations`, or `Case.activations` with no plan written).

An output whose shape is no placement of the dense output at all -- another number of dims (a
flattened `[s*b, h]` for `[s, b, h]`), dims no reordering of the dense ones explains, a dim larger
than the dense one (an embedding whose ids were taken for a shard of the sequence and gathered,
`[b, world*s, h]`) -- while both modules return the same structure (a tensor each, or tuples of
the same length) is a failure at that module (`failed`, a check of kind "layout"): every later
tensor is computed from something the dense model does not have at this point, and skipping it
would put the blame on the next module. The same holds of a module output whose placement the case
names (`unmappable`: its TP shape is no placement of the dense one, not only another placement's)
and of the model's output (passes.py: the run then stops after that forward).

Not comparable, and only said (not checked, with why): a module the TP model does not call, an
output that is not a tensor on every rank or has different shapes on the ranks, a module whose
output has another structure on the two sides (a tuple on one, a tensor on the other), an output one
dim of which is smaller than the dense one but not `world` times smaller (an uneven or padded split,
which no placement expresses), and an output whose dims are the dense ones (or a shard of them) in
another order (Megatron's embedding under sequence parallelism returns `[s/tp, b, h]` where its
dense twin returns `[b, s, h]`).

The gradient of a module output is checked with the output's placement, as a written plan's is.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import torch
from torch import nn

from tpcheck.checker.rank import capture
from tpcheck.checker.rank.measure import absmax, max_abs_diff
from tpcheck.errors import UsageError
from tpcheck.plan import Fused, Placement, Plan, Replicate, Shard


def candidates(dense: nn.Module, tp: nn.Module, rename: dict[str, str] | None = None) -> set[str]:
    """The modules both models have by name, TP modules under `rename`'s dense names where given
    (the root excluded: its output is checked as `output`)."""
    rename = rename or {}
    ours = {rename.get(name, name) for name, _ in capture.named_modules(tp)}
    return {name for name, _ in capture.named_modules(dense) if name and name in ours}


def seen(
    tensors: list[tuple[str, str, torch.Tensor]], structures: dict[str, str] | None = None
) -> dict[str, list]:
    """This rank's view of each captured module output: its first forward tensor's shape, a hash
    of its bytes and what the module returned (`capture.structure`; what the ranks exchange)."""
    out: dict[str, list] = {}
    for stage, name, t in tensors:
        if stage == "forward" and name not in out:
            data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[name] = [
                list(t.shape),
                hashlib.blake2b(data, digest_size=16).hexdigest(),
                (structures or {}).get(name, capture.TENSOR),
            ]
    return out


# how close the sum of the ranks' outputs must be to the dense output, relative to its largest
# element, for an output that differs across ranks to be taken for a partial sum (the rounding of a
# sum in 16 bits is ~1e-2 of the scale at most; the sum of anything else is off by O(1))
PARTIAL_RELATIVE = 0.05


def differing(dense_shapes: dict[str, tuple[int, ...]], said: list[dict[str, list]]) -> list[str]:
    """The outputs with the dense shape on every rank that differ across ranks: the ones whose sum
    over the ranks decides (`is_partial_sum`), in the same order on every rank."""
    out = []
    for name in sorted(dense_shapes):
        views = [rank.get(name) for rank in said]
        if (
            all(v is not None and tuple(v[0]) == tuple(dense_shapes[name]) for v in views)
            and len({v[1] for v in views}) > 1
        ):
            out.append(name)
    return out


def is_partial_sum(summed: torch.Tensor, dense: torch.Tensor) -> bool:
    """Whether the ranks' outputs summed (float64) are the dense output, up to rounding."""
    if not dense.numel():
        return True
    return float(max_abs_diff(summed, dense, torch.float64)) <= PARTIAL_RELATIVE * max(
        absmax(dense), 1e-30
    )


def is_selection(nearest: torch.Tensor, closest_whole: torch.Tensor, dense: torch.Tensor) -> bool:
    """Whether every element of the dense output is held by some rank (`nearest`: each element's
    least |TP - dense| over the ranks) while no rank holds them all (`closest_whole`: the least over
    the ranks of a rank's largest |TP - dense|), up to the partial-sum test's rounding. A rank that
    holds the whole dense output makes the others' values a bug there, not a selection."""
    if not dense.numel():
        return False
    tol = PARTIAL_RELATIVE * max(absmax(dense), 1e-30)
    return float(nearest.max()) <= tol < float(closest_whole)


def row_split_linears(dense: nn.Module, plan: Plan) -> dict[str, Shard | Fused]:
    """The modules whose own 2-D `weight` is split along
    its rows (Shard(0) or Fused(0, ...)), by name."""
    out = {}
    for name, module in dense.named_modules():
        w = getattr(module, "weight", None)
        p = plan.params.get(f"{name}.weight" if name else "weight")
        if (
            isinstance(w, torch.Tensor)
            and w.dim() == 2
            and isinstance(p, (Shard, Fused))
            and p.dim in (0, -2)
        ):
            out[name] = p
    return out


def _row_split_output(
    p: Shard | Fused, dense: tuple[int, ...], world: int
) -> tuple[Placement, tuple] | None:
    """The output layout of a linear whose weight is split along its rows as `p`, and rank 0's
    output shape under it (None when this output's last dim cannot be the weight's rows)."""
    last = len(dense) - 1
    out = Shard(last) if isinstance(p, Shard) else Fused(last, p.units, p.unit_size)
    try:
        return out, tuple(out.shard(torch.empty(dense, device="meta"), 0, world).shape)
    except (UsageError, RuntimeError):  # this output's last dim is not the weight's rows
        return None


class Decision(NamedTuple):
    """What `decide` makes of the module outputs: `placed` (name -> placement, checked),
    `skipped` (name -> why it is not comparable, said in the plan) and `failed` (name -> why its
    output is no placement of the dense one: a failed check at that module)."""

    placed: dict[str, Placement]
    skipped: dict[str, str]
    failed: dict[str, str]


def decide(
    dense_shapes: dict[str, tuple[int, ...]],
    said: list[dict[str, list]],
    plan: Plan,
    world: int,
    partial: set[str] = frozenset(),
    row_split: dict[str, Shard | Fused] | None = None,
    dense_structures: dict[str, str] | None = None,
    selected: set[str] = frozenset(),
) -> Decision:
    """The placements of the outputs in `dense_shapes`, from every rank's `seen`, the outputs found
    to be partial sums, the linears split along their rows (`row_split_linears`) and what each
    dense module returned (`capture.structure`; a tensor where not given); the same on every rank
    (every rank decides from the same data)."""
    out = Decision({}, {}, {})
    for name in sorted(dense_shapes):
        views = [rank.get(name) for rank in said]
        if all(v is None for v in views):
            out.skipped[name] = "the TP model does not call it (its parameters used directly?)"
        elif any(v is None for v in views):
            out.skipped[name] = "its output is not a tensor on every rank"
        elif len(shapes := {tuple(v[0]) for v in views}) != 1:
            out.skipped[name] = f"its output has different shapes on the ranks ({sorted(shapes)})"
        else:
            dense = tuple(dense_shapes[name])
            kinds = {v[2] if len(v) > 2 else capture.TENSOR for v in views}
            kinds.add((dense_structures or {}).get(name, capture.TENSOR))
            verdict, what = _placement(
                name, dense, shapes.pop(), plan, world, partial, row_split or {}, selected
            )
            if verdict == "failed" and len(kinds) > 1:
                verdict, what = "skipped", _not_comparable(name, views, dense_structures)
            getattr(out, verdict)[name] = what
    return out


def _not_comparable(name: str, views: list, dense_structures: dict[str, str] | None) -> str:
    tp = sorted({v[2] if len(v) > 2 else capture.TENSOR for v in views})
    dense = (dense_structures or {}).get(name, capture.TENSOR)
    return f"it returns {' or '.join(tp)} on the TP side, {dense} on the dense side: not comparable"


def _placement(
    name: str,
    dense: tuple[int, ...],
    local: tuple[int, ...],
    plan: Plan,
    world: int,
    partial: set[str],
    row_split: dict[str, Shard | Fused],
    selected: set[str] = frozenset(),
) -> tuple[str, Placement | str]:
    """("placed", placement), ("skipped", why) or ("failed", why) for one output, the same
    `local` shape on every rank, against the `dense` shape."""
    if local == dense:
        if name in partial:
            return "skipped", (
                "a partial sum: the ranks' outputs add up to the dense one (reduced later)"
            )
        if name in selected:
            return "skipped", (
                "a selection: each element is the dense one on some rank and something else on "
                "the others (a lookup whose rows outside the rank's shard are masked later)"
            )
        return "placed", Replicate()
    if (
        name in row_split
        and (layout := _row_split_output(row_split[name], dense, world))
        and layout[1] == local
    ):
        return "placed", layout[0]
    dims = [d for d in range(len(dense)) if len(local) == len(dense) and local[d] != dense[d]]
    if len(dims) == 1 and local[dims[0]] * world == dense[dims[0]]:
        if any(isinstance(p, Fused) for p in plan.params.values()) and dims[0] == len(dense) - 1:
            return "skipped", (
                f"its output is 1/{world} of the dense one along its last dim, and the plan "
                "holds a fused parameter: contiguous or fused parts cannot be "
                "told from the shape"
            )
        return "placed", Shard(dims[0])
    if len(dims) == 1 and local[dims[0]] < dense[dims[0]]:
        return "skipped", (
            f"its output {list(local)} is an uneven part of the dense {list(dense)} along dim "
            f"{dims[0]} (split unevenly, or padded): no placement expresses it"
        )
    if _reordered(local, dense, world):
        return "skipped", (
            f"its output {list(local)} holds the dims of the dense {list(dense)} in another order "
            "(sequence-first on one side, batch-first on the other?): no placement expresses it"
        )
    return "failed", f"its output {list(local)} is no placement of the dense {list(dense)}"


def no_placement(local: tuple[int, ...], dense: tuple[int, ...], world: int) -> str | None:
    """Why a TP output of shape `local` is no placement of a dense output of shape `dense`, as
    `decide` fails one (another number of dims, a dim larger than the dense one, dims no reordering
    explains); None when a placement, or a layout said and not checked, may map it."""
    verdict, what = _placement("", tuple(dense), tuple(local), Plan(params={}), world, set(), {})
    return what if verdict == "failed" else None


def unmappable(
    tp: torch.Tensor, dense: torch.Tensor, placement: Placement, rank: int, world: int
) -> str | None:
    """For an output compared through a placement known before it is produced (a module output the
    case names, the model's output): why the TP tensor is no placement of the dense one
    (`no_placement`), when `placement`'s shard has another shape. None otherwise: the shard's own
    shape, or a shape another placement gives (the comparison refuses it: the written placement is
    the one to fix)."""
    try:
        shard = placement.shard(torch.empty(dense.shape, device="meta"), rank, world)
    except (UsageError, RuntimeError, NotImplementedError):  # no meta shard: the real one
        shard = placement.shard(dense, rank, world)
    if tuple(shard.shape) == tuple(tp.shape):
        return None
    return no_placement(tuple(tp.shape), tuple(dense.shape), world)


def _reordered(local: tuple[int, ...], dense: tuple[int, ...], world: int) -> bool:
    """Whether `local` is the dense shape, or the dense shape with one dim `world` times smaller,
    with its dims in another order (Megatron's embedding under sequence parallelism transposes
    `[b, s, h]` to `[s/tp, b, h]` inside the module its dense twin leaves batch-first)."""
    if len(local) != len(dense):
        return False
    parts = [dense] + [
        dense[:d] + (dense[d] // world,) + dense[d + 1 :]
        for d in range(len(dense))
        if dense[d] % world == 0
    ]
    return any(sorted(local) == sorted(p) for p in parts)


def exchange(rendezvous, mine: dict[str, list]) -> list[dict[str, list]]:
    """Every rank's `seen`, through the rendezvous store (no collective)."""
    return [
        json.loads(t)
        for t in rendezvous.exchange("acts", json.dumps(mine), label="inferring the plan")
    ]
