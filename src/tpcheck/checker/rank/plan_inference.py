"""A plan nobody wrote: each TP parameter's placement
inferred from the values the user's loader put there.

With `Case(plan=None, load_tp=...)`, after the user's loader ran, every rank tries, for each dense
parameter, the placements its shape admits (in this order: replicate, a contiguous shard of each
dim, a fused weight of 2 or 3 equal parts along each dim; then a fused `[q; k; v]` with smaller,
sharded or replicated, k and v, which rank 0 proposes from its values: `uneven_fused`) and keeps
those whose shard of the dense tensor equals the TP tensor bitwise. The ranks then agree through the
rendezvous store: a parameter's placement is the first candidate every rank matched. Random weights
make an accidental match impossible (a shard is many independent values).

A parameter that holds, on some ranks, another rank's shard under a placement the other ranks hold
their own shard of (every rank holds rank 0's: a loader that forgot the rank offset; two ranks'
shards swapped) is a loader bug, not an unknown layout: its placement is inferred as that one
(`misloaded`, the placement the most ranks hold their own shard of), so the weights stage fails it
on the ranks that hold another's (signature `rank0_shard`, or `permuted`), as with a written plan,
and every later stage is still checked (each step after the first restarts the TP module through
the plan). A parameter no candidate explains on some rank in any of these ways is reported naming
it, the shapes and what was tried -- an unknown layout to write down, or values loaded wrong.

The inferred plan is then used like a written one (the weights stage still checks every parameter),
and is printed as code (`tpcheck verify --print-plan`) to paste into the case file.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from tpcheck.checker.sync import Rendezvous
from tpcheck.errors import UsageError
from tpcheck.plan import Fused, OnRank, Placement, Plan, Replicate, Shard


def candidates(shape: tuple[int, ...], world: int) -> list[Placement]:
    """The placements tried for a dense tensor of `shape` at `world` ranks, in order of preference
    (a dim of size 0 is sharded, never fused)."""
    out: list[Placement] = [Replicate()]
    out += [Shard(d) for d in range(len(shape)) if shape[d] % world == 0 and world > 1]
    for parts in (2, 3):
        for d in range(len(shape)):
            n = shape[d]
            # an empty dim (a cache not filled yet) has no fused parts: parts of no units
            if world > 1 and n > 0 and n % parts == 0 and (n // parts) % world == 0:
                out.append(Fused(d, (n // parts,) * parts))
    # fewer units than ranks along a dim, each held by world / n consecutive ranks (GQA's KV heads
    # replicated over ranks: a KV cache [seq, batch, kv_heads, head_dim] at kv_heads < world)
    out += [Fused(d, (n,)) for d, n in enumerate(shape) if 1 < n < world and world % n == 0]
    return out


def matches(
    dense: torch.Tensor,
    local: torch.Tensor,
    rank: int,
    world: int,
    tried: list[Placement] | None = None,
) -> list[int]:
    """Indices (into `tried`, by default `candidates`) of the placements whose shard of `dense` is
    `local`, bitwise."""
    found = []
    for i, placement in enumerate(
        candidates(tuple(dense.shape), world) if tried is None else tried
    ):
        try:
            shard = placement.shard(dense, rank, world)
        except UsageError:  # a proposed layout this shape does not admit
            continue
        if shard.shape == local.shape and torch.equal(shard.to(local.dtype), local):
            found.append(i)
    return found


def uneven_fused(dense: torch.Tensor, local: torch.Tensor, world: int) -> list[Fused]:
    """Rank 0's proposals for a fused `[q; k; v]` weight with a smaller k and v (grouped-query
    attention), which the shape alone does not determine: along a dim, the rows rank 0 holds equal
    the dense rows up to where its q block ends (`a` rows), so q has `a * world` rows and k and v
    split the rest. Proposed: k and v sharded (`Fused(d, (q, kv, kv))`, rows as units), and k and v
    replicated over ranks when rank 0's k block is a whole KV head of `u` rows
    (`Fused(d, (q/u, kv/u, kv/u), (u, u, u))`). Every rank then tests them like any candidate."""
    out: list[Fused] = []
    for d in range(dense.dim()):
        n, held = dense.shape[d], local.shape[d]
        if local.dim() != dense.dim() or any(
            local.shape[i] != dense.shape[i] for i in range(dense.dim()) if i != d
        ):
            continue
        m = min(n, held)
        rows_l, rows_d = (
            local.movedim(d, 0).reshape(held, -1)[:m],
            dense.movedim(d, 0).reshape(n, -1)[:m],
        )
        same = (rows_l.to(rows_d.dtype) == rows_d).all(dim=1).tolist()
        a = same.index(False) if False in same else m
        q, rest = a * world, n - a * world
        if a == 0 or a == held or rest <= 0 or rest % 2:
            continue
        kv = rest // 2
        if kv % world == 0 and held == a + 2 * kv // world:
            out.append(Fused(d, (q, kv, kv)))
        u = (held - a) // 2
        if (
            (held - a) % 2 == 0
            and u
            and kv % u == 0
            and q % u == 0
            and kv // u < world
            and world % (kv // u) == 0
        ):
            out.append(Fused(d, (q // u, kv // u, kv // u), (u, u, u)))
    return out


def held_elsewhere(
    dense: torch.Tensor,
    local: torch.Tensor,
    rank: int,
    world: int,
    tried: list[Placement] | None = None,
) -> list[tuple[int, int]]:
    """When no placement explains `local` on `rank`: (index into `tried`, by default `candidates`,
    other rank) for each placement whose shard for another rank is `local`, bitwise."""
    found = []
    for i, placement in enumerate(
        candidates(tuple(dense.shape), world) if tried is None else tried
    ):
        for other in range(world):
            if other == rank:
                continue
            try:
                shard = placement.shard(dense, other, world)
            except UsageError:  # a proposed layout this shape does not admit
                continue
            if shard.shape == local.shape and torch.equal(shard.to(local.dtype), local):
                found.append((i, other))
    return found


def looks_like(dense: torch.Tensor, local: torch.Tensor, rank: int, world: int) -> str | None:
    """When no placement explains `local` on `rank`:
    another rank's shard that it equals, in words."""
    tried = candidates(tuple(dense.shape), world)
    return _in_words(held_elsewhere(dense, local, rank, world, tried), tried)


def _in_words(holds: list[tuple[int, int]], tried: list[Placement]) -> str | None:
    """The first of `held_elsewhere`'s findings, in words (None when there is none)."""
    for i, other in holds[:1]:
        return f"it holds rank {other}'s {tried[i]}: a loader that forgot the rank offset?"
    return None


def infer_plan(
    tp: nn.Module,
    dense: nn.Module,
    rendezvous: Rendezvous,
    rank: int,
    world: int,
    tp_names: dict[str, str] | None = None,
) -> tuple[Plan, dict[str, str]]:
    """The plan every rank agrees on, from the loaded TP module and the dense one (same parameter
    names, or `tp_names`: names.py matches them), and the parameters loaded wrong ({name: what the
    ranks hold}, `misloaded`: the weights stage fails them). A parameter only one rank has is
    `OnRank(r)` when that rank holds the whole tensor. Raises UsageError naming the first parameter
    no placement explains."""
    tp_names = tp_names or {}
    pairs = _pairs(tp, dense, tp_names)
    tried_all, said = _matches_on_every_rank(pairs, rendezvous, rank, world)
    params: dict[str, Placement] = {}
    wrong: dict[str, str] = {}
    for name, p in dense.named_parameters():
        holders = [r for r, theirs in enumerate(said) if name in theirs]
        if len(holders) < world:
            params[name] = _on_one_rank(name, p, holders, said, world, tp_names.get(name, name))
            continue
        tried, views = tried_all[name], [theirs[name] for theirs in said]
        common, apart = set(range(len(tried))), None
        for r, view in enumerate(views):
            common &= set(view["matches"])
            apart = r if apart is None and not common else apart
        if common:
            params[name] = tried[min(common)]
        elif (found := misloaded(views, tried)) is not None:
            params[name], wrong[name] = found
        else:
            raise _no_placement(name, p, apart, world, tried, views[apart]["hint"])
    return Plan(params=params, tp_names=dict(tp_names)), wrong


def misloaded(views: list[dict], tried: list[Placement]) -> tuple[Placement, str] | None:
    """From every rank's view of one parameter ({"matches": [...], "holds": [[i, other], ...]},
    indices into `tried`): the placement every rank's values are a shard of -- its own on some
    ranks, another rank's on the others (a loader that forgot the rank offset, or swapped two
    ranks' shards) -- the one the most ranks hold their own shard of, first in `tried` on a tie;
    with what the ranks hold, in words. None when no placement explains every rank so."""
    best = None
    for i in range(len(tried)):
        own = [i in v["matches"] for v in views]
        other = [{o for j, o in v.get("holds", ()) if j == i} for v in views]
        if all(own) or not all(o or e for o, e in zip(own, other)):
            continue
        if best is None or sum(own) > best[0]:
            best = (sum(own), i, other)
    if best is None:
        return None
    _, i, other = best
    by_source: dict[int, list[int]] = {}
    for r, o in enumerate(other):
        if i not in views[r]["matches"]:
            by_source.setdefault(min(o), []).append(r)
    held = ", ".join(
        (f"rank {rs[0]} holds" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))} hold")
        + f" rank {src}'s shard"
        for src, rs in by_source.items()
    )
    return tried[i], f"{placement_code(tried[i])}, but {held}"


def _pairs(tp: nn.Module, dense: nn.Module, tp_names: dict[str, str]) -> dict[str, tuple]:
    """{dense parameter name: (its dense value, the TP module's value of it)}, for the parameters
    this rank's TP module has (one held on another rank only is left out: `OnRank`)."""
    tp_params = dict(tp.named_parameters())
    return {
        name: (p.detach(), tp_params[tp_names.get(name, name)].detach())
        for name, p in dense.named_parameters()
        if tp_names.get(name, name) in tp_params
    }


def _on_one_rank(
    name: str, p, holders: list[int], said: list[dict], world: int, tp_name: str
) -> OnRank:
    """A parameter the TP module has on some ranks only: `OnRank(r)` when rank r alone has it,
    whole (Replicate(), always the first candidate, among its matches); else refused, naming the
    ranks."""
    what = f"parameter {name!r} {list(p.shape)}" + (f" (TP {tp_name!r})" if tp_name != name else "")
    if not holders:
        raise UsageError(
            f"TP module has no {what} on any rank; name it like the dense one, or give "
            "Case(tp_names={dense name: TP name})"
        )
    others = [r for r in range(world) if r not in holders]
    if len(holders) > 1:
        raise UsageError(
            f"the TP module has {what} on ranks {holders} but not on {others}: a parameter lives "
            "on every rank (Replicate(), Shard(dim), Fused(...)) or on one (OnRank(r)); create it "
            "on every rank, or on one"
        )
    (r,) = holders
    if 0 not in said[r][name]["matches"]:
        hint = said[r][name]["hint"]
        raise UsageError(
            f"cannot infer a placement for {what}: only rank {r} has it (OnRank({r})), but its "
            f"values there are not the whole dense tensor{f' ({hint})' if hint else ''}; check "
            "what your load_tp puts there, or write the plan (Plan(params={...}), "
            "docs/case-files.md)"
        )
    return OnRank(r)


def _matches_on_every_rank(pairs: dict, rendezvous: Rendezvous, rank: int, world: int):
    """(the placements tried per parameter, every rank's matches among them and hint), through the
    store: uneven fused parts are proposed by rank 0 from its values, and every rank then tries the
    same candidates."""
    found = {name: matches(d, t, rank, world) for name, (d, t) in pairs.items()}
    proposals = {
        name: [[f.dim, list(f.units), list(f.unit_size)] for f in uneven_fused(d, t, world)]
        for name, (d, t) in pairs.items()
        if rank == 0 and world > 1 and not found[name]
    }
    proposed = json.loads(
        rendezvous.exchange("fused", json.dumps(proposals), label="inferring the plan")[0]
    )
    tried_all: dict[str, list[Placement]] = {}
    mine: dict[str, dict] = {}
    for name, (d, t) in pairs.items():
        base = candidates(tuple(d.shape), world)
        extra = [
            Fused(dim, tuple(units), tuple(sizes)) for dim, units, sizes in proposed.get(name, [])
        ]
        tried_all[name] = base + extra
        hits = found[name] + [len(base) + i for i in matches(d, t, rank, world, extra)]
        holds = [] if hits else held_elsewhere(d, t, rank, world, tried_all[name])
        mine[name] = {"matches": hits, "holds": holds, "hint": _in_words(holds, tried_all[name])}
    said = [
        json.loads(text)
        for text in rendezvous.exchange("plan", json.dumps(mine), label="inferring the plan")
    ]
    return tried_all, said


def _no_placement(name: str, p, r: int, world: int, tried: list, hint: str | None) -> UsageError:
    """Why no placement explains parameter `name` on rank `r`, and what to do."""
    if world > 1 and all(n % world for n in p.shape):  # only a replica could be tried
        fits = [w for w in range(2, 9) if any(n % w == 0 for n in p.shape)]
        return UsageError(
            f"cannot infer a placement for parameter {name!r} {list(p.shape)} at world "
            f"size {world}: no dim divides by {world}, so only a replica was tried, "
            f"and rank {r} does not hold the whole tensor (an uneven split, which "
            "tpcheck's placements do not express, or values loaded wrong); choose a "
            "world size that divides the dim it is split along "
            f"({', '.join(map(str, fits)) or 'none up to 8'} divide one of its dims)"
        )
    hint = f" ({hint})" if hint else ""
    return UsageError(
        f"cannot infer a placement for parameter {name!r} {list(p.shape)}: on rank {r} "
        f"its values are none of {', '.join(map(str, tried))} of the dense "
        f"tensor{hint}, or not the same one as on the ranks before; check what your "
        "load_tp puts there, or write the plan (Plan(params={...}), docs/case-files.md)"
    )


def placement_code(p: Placement) -> str:
    """A placement as the code that makes it (`Shard(2)`, `Fused(0, (4, 4))`)."""
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Fused):
        sizes = f", {tuple(p.unit_size)!r}" if p.unit_size and set(p.unit_size) != {1} else ""
        return f"Fused({p.dim}, {tuple(p.units)!r}{sizes})"
    return repr(p)


def plan_as_code(
    plan: Plan,
    not_checked: dict[str, str] | None = None,
    written: set[str] = frozenset(),
    no_placement: dict[str, str] | None = None,
    by_values: dict[str, str] | None = None,
    misloaded: dict[str, str] | None = None,
) -> str:
    """The plan as Python to paste into a case file; `not_checked`: module outputs no activation
    placement was inferred for, and why (as comments); `written`: the activations the case named
    (`Case.activations`): where there are any, each activation says whether it was written or
    inferred; `no_placement`: module outputs whose shape is no placement of the dense one (failed
    at their module), and why; `by_values`: the dense parameters whose TP names were matched by
    values, not by name (checker/rank/names.py); `misloaded`: the parameters that hold another
    rank's shard on some ranks (`misloaded`), failed at the weights stage -- as comments."""
    lines = [f"    {name!r}: {placement_code(p)}," for name, p in plan.params.items()]
    names = "".join(f"\n    {d!r}: {t!r}," for d, t in plan.tp_names.items())
    names = f", tp_names={{{names}\n}}" if names else ""

    def said(name: str) -> str:
        return "" if not written else "  # written" if name in written else "  # inferred"

    acts = "".join(
        f"\n    {name!r}: {placement_code(p)},{said(name)}" for name, p in plan.activations.items()
    )
    acts = f", activations={{{acts}\n}}" if acts else ""
    why = "".join(
        f"\n# not checked: {name}: {reason}" for name, reason in sorted((not_checked or {}).items())
    )
    why += "".join(
        f"\n# failed: {name}: {reason}" for name, reason in sorted((no_placement or {}).items())
    )
    why += "".join(
        f"\n# loaded wrong: {name}: {held} (failed at the weights stage)"
        for name, held in (misloaded or {}).items()
    )
    if by_values:
        why += "\n# matched by values (no TP parameter has the dense name): check these tp_names"
        why += "".join(f"\n#   {d!r} -> {t!r}" for d, t in by_values.items())
    return "Plan(params={\n" + "\n".join(lines) + "\n}" + acts + names + ")" + why
