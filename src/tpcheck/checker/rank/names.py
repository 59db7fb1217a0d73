"""Which TP parameter is which dense one, for a plan nobody wrote (`Case(plan=None, load_tp=...)`).

Wrappers rename parameters: DDP's `module.`, torch.compile's `_orig_mod.`, FSDP's
`_fsdp_wrapped_module.`, checkpoint_wrapper's `_checkpoint_wrapped_module.`, a TP library's
`tp_wrapped_module.`, at the root or anywhere below it (they nest). And a TP module may name a layer
its own way (`up_proj` for the dense `fc1`). Each rank matches, for every dense parameter, in order:
1. the name the user gave (`Case.tp_names`: a dict, or a function of the dense name);
2. the same name;
3. the same name once the wrapper segments (`WRAPPERS`) are dropped from both, when exactly one
   TP parameter left has it;
4. by values: the TP parameters left whose values are the dense tensor's shard under some
   candidate placement (plan_inference.py's `matches`: random weights make an accidental match
   impossible).
The ranks then agree through the rendezvous store (`agree`): a dense parameter takes the one TP name
the ranks matched it to (a rank that has no parameter for it says nothing: a tensor held on one rank
only, `OnRank`); matched by values to several, or by no rank, or a TP parameter left over on some
rank, is refused naming them. The printed plan carries the TP names as `tp_names` and says which
were matched by values.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from torch import nn

from tpcheck.checker.rank import capture
from tpcheck.checker.rank.plan_inference import matches
from tpcheck.checker.sync import Rendezvous
from tpcheck.errors import UsageError
from tpcheck.plan import closest

# the attribute names wrappers hold the wrapped module under (each a segment of a parameter's name)
WRAPPERS = frozenset(
    {
        "module",  # torch.nn.parallel.DistributedDataParallel, DataParallel, and their likes
        "_orig_mod",  # torch.compile's OptimizedModule
        "_fsdp_wrapped_module",  # FullyShardedDataParallel (FSDP1)
        "_checkpoint_wrapped_module",  # torch.distributed.algorithms._checkpoint.checkpoint_wrapper
        "tp_wrapped_module",  # a TP library's own wrapper
    }
)

Tensors = dict[str, torch.Tensor]


def strip_wrappers(name: str) -> str:
    """`name` without the segments wrappers add: 'module.layers.0._checkpoint_wrapped_module.fc1.
    weight' -> 'layers.0.fc1.weight'."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def given_names(
    tp_names: dict[str, str] | Callable[[str], str] | None, dense_names: list[str]
) -> dict[str, str]:
    """`Case.tp_names` as a dict over the dense names (a function called on each; a name mapped to
    itself left out). A dict key that is no dense parameter is refused, with the closest names."""
    if tp_names is None:
        return {}
    if callable(tp_names):
        return {n: t for n in dense_names if (t := tp_names(n)) != n}
    unknown = sorted(set(tp_names) - set(dense_names))
    if unknown:
        hints = [
            f"{' or '.join(map(repr, c))} for {k!r}"
            for k in unknown
            if (c := closest(k, dense_names))
        ]
        hint = f" (did you mean {'; '.join(hints)}?)" if hints else ""
        raise UsageError(
            f"Case tp_names names dense parameter(s) {unknown} that the dense module does not "
            f"have{hint}; its keys are dense names (dense.named_parameters()), its values the TP "
            "module's"
        )
    return {n: t for n, t in tp_names.items() if t != n}


def propose(tp: Tensors, dense: Tensors, given: dict[str, str], rank: int, world: int) -> dict:
    """This rank's matches: {"match": {dense name: TP name (given, the same, or the same with
    wrapper prefixes dropped)}, "values": {dense name: [TP names whose values fit]}, "left": [TP
    names matched to nothing by name]}."""
    match = {d: given[d] for d in dense if d in given}
    claimed = set(match.values())
    for d in dense:
        if d not in match and d in tp and d not in claimed:
            match[d] = d
            claimed.add(d)
    by_key: dict[str, list[str]] = {}
    for t in tp:
        if t not in claimed:
            by_key.setdefault(strip_wrappers(t), []).append(t)
    for d in dense:
        if d not in match and len(found := by_key.get(strip_wrappers(d), [])) == 1:
            match[d] = found[0]
            claimed.add(found[0])
    left = [t for t in tp if t not in claimed]
    values = {
        d: [t for t in left if matches(dense[d], tp[t], rank, world)]
        for d in dense
        if d not in match
    }
    return {"match": match, "values": {d: ts for d, ts in values.items() if ts}, "left": left}


def agree(
    tp: Tensors,
    dense: Tensors,
    given: dict[str, str],
    rendezvous: Rendezvous,
    rank: int,
    world: int,
) -> tuple[dict[str, str], dict[str, str]]:
    """The TP name of every dense parameter, agreed by every rank: ({dense name: TP name} where they
    differ, {dense name: TP name} of those matched by values). Raises UsageError on every rank alike
    (the decision is made from what every rank said) for a parameter matched to no TP parameter or
    to several, or a TP parameter left over."""
    mine = propose(tp, dense, given, rank, world)
    said = [
        json.loads(t)
        for t in rendezvous.exchange("names", json.dumps(mine), label="matching parameter names")
    ]
    names: dict[str, str] = {}
    by_values: dict[str, str] = {}
    for d in dense:
        named = {m["match"][d] for m in said if d in m["match"]}
        if len(named) > 1:
            raise UsageError(
                f"the ranks match dense parameter {d!r} to different TP parameters "
                f"{sorted(named)}; name it alike on every rank, or give Case(tp_names=...)"
            )
        if named:
            names[d] = named.pop()
            continue
        names[d] = by_values[d] = _by_values(d, said, tp)
    _refuse_ambiguous_or_left(names, said)
    return {d: t for d, t in names.items() if t != d}, by_values


def module_names(tp: nn.Module, dense: nn.Module, tp_names: dict[str, str]) -> dict[str, str]:
    """{TP module name: dense module name} for the TP modules named otherwise than the dense module
    they stand for, so that their outputs are captured and compared under the dense names: a
    wrapper's (`module.fc1` for `fc1`: the outermost TP module of a name once wrapper segments are
    dropped) and a renamed layer's (`up_proj` for `fc1`: from the matched parameter names). A dense
    name some TP module has as it is keeps that one."""
    dense_modules = {n for n, _ in capture.named_modules(dense) if n}
    tp_modules = [n for n, _ in capture.named_modules(tp) if n]
    taken = {n for n in tp_modules if n in dense_modules}
    outermost: dict[str, str] = {}
    for n in tp_modules:
        outermost.setdefault(strip_wrappers(n), n)
    pairs = [(key, key) for key in outermost]  # wrappers: the same name, wrapper segments dropped
    for d, t in tp_names.items():  # renamed layers: the modules of the renamed parameters
        pairs.append((strip_wrappers(t.rpartition(".")[0]), d.rpartition(".")[0]))
    out: dict[str, str] = {}
    for key, dense_name in pairs:
        tp_name = outermost.get(key)
        if tp_name is None or tp_name in out or dense_name in taken:
            continue
        if dense_name in dense_modules and tp_name != dense_name:
            out[tp_name] = dense_name
            taken.add(dense_name)
    return out


def _by_values(d: str, said: list[dict], tp: Tensors) -> str:
    """The one TP parameter the ranks matched dense `d` to by values."""
    fits = [set(m["values"].get(d, [])) for m in said]
    found = set().union(*fits)
    if len(found) == 1:
        return found.pop()
    if not found:
        shown = sorted(tp)[:20]
        raise UsageError(
            f"TP module has no parameter for dense parameter {d!r}: none of that name (wrapper "
            "prefixes dropped), and no TP parameter left holds its values on any rank; TP "
            f"parameters (this rank's) are {shown}{' ...' if len(tp) > 20 else ''}; give "
            "Case(tp_names={dense name: TP name}), or check what your load_tp loads"
        )
    raise UsageError(
        f"dense parameter {d!r} has no TP parameter of its name, and its values fit several: "
        f"{sorted(found)}; say which with Case(tp_names={{{d!r}: <TP name>}})"
    )


def _refuse_ambiguous_or_left(names: dict[str, str], said: list[dict]) -> None:
    """Two dense parameters matched to one TP parameter, or a TP parameter some rank has that no
    dense parameter was matched to: refused, naming them."""
    seen: dict[str, str] = {}
    for d, t in names.items():
        if t in seen:
            raise UsageError(
                f"dense parameters {seen[t]!r} and {d!r} both match TP parameter {t!r}; say which "
                "is which with Case(tp_names={dense name: TP name})"
            )
        seen[t] = d
    for r, m in enumerate(said):
        left = [t for t in m["left"] if t not in seen]
        if left:
            raise UsageError(
                f"TP module has parameter(s) {left} on rank {r} that match no dense parameter "
                "(by name, wrapper prefixes dropped, or by values); name them like the dense "
                "ones, or give Case(tp_names={dense name: TP name})"
            )
