"""`tpcheck verify CASEFILE --repair`: a missing all-reduce, inserted where the diagnosis points,
and the case checked again.

A case whose first divergent tensor has the signature `partial_sum` (each rank holds a part, the sum
over the ranks is the dense value) is missing an all-reduce before that tensor. By the tensor:

- `act:M` (module M's output) or `output` (the model's): an all-reduce of M's output in a forward
  hook, with the identity as its backward (Megatron's reduce-from-the-TP-region); where the
  diagnosis says a bias was added on each rank (`plus: (world - 1) x M.bias`), a second candidate
  reduces the output before that bias: `all_reduce(out - bias) + bias`;
- `actgrad:M` (the gradient of M's output): an all-reduce of that gradient as it arrives in the
  backward (a tensor hook on M's output, put there by a forward hook), what Megatron's
  copy-to-the-TP-region does in the consumer;
- `grad:P` (a parameter's gradient): an all-reduce of each micro-batch's gradient of P as it arrives
  (a tensor hook).

For another signature, the candidates are the modules whose outputs the checker found to be partial
sums nothing reduced (with no written placement for them, it cannot tell a reduce done later from
one forgotten): an all-reduce after each, innermost first.

The all-reduce is the plain `torch.distributed.all_reduce` on the case's TP group, put in by the
same mechanism the fault catalogue uses (`Injection.tamper`, on every rank after the TP module is
built): the checker's collective tap counts it like the code's own. The repaired Case is registered
in this process (`checker.casefile.register`) and run by a fresh rank pool; it is the repair only if
its own full check says `equivalent`.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch
import torch.distributed as dist
from torch import nn

from tpcheck.repair.terms import slim

_BIAS = re.compile(r"x (\S+) \(a bias added on each rank\)")


@dataclasses.dataclass(frozen=True)
class Insertion:
    """One all-reduce to insert: `where` "after" (a module's output), "before_bias" (a module's
    output less its bias), "grad_of_output" (the gradient of a module's output) or "grad" (a
    parameter's gradient); `site` the module or parameter name ("" for the whole model)."""

    where: str
    site: str

    def sentence(self) -> str:
        site = self.site or "the model's output"
        return {
            "after": f"an all-reduce after {site}",
            "before_bias": f"an all-reduce after {site} (of its output before its bias is added)",
            "grad_of_output": f"an all-reduce of the gradient of {site}'s output (backward)",
            "grad": f"an all-reduce of {site}'s gradient (each micro-batch, as it arrives)",
        }[self.where]


def insertions(result: dict) -> list[Insertion]:
    """The candidate insertions for a case's diagnosis. Another signature than `partial_sum`: the
    modules whose outputs the checker found to be partial sums left unreduced (reported as not
    checked, "reduced later", when no plan names them), innermost first."""
    d = result.get("diagnosis") or {}
    if d.get("signature") != "partial_sum":
        unchecked = (result.get("activations") or {}).get("not_checked") or {}
        partial = [m for m, why in unchecked.items() if str(why).startswith("a partial sum")]
        return [Insertion("after", m) for m in sorted(partial, key=lambda m: -m.count("."))]
    tensor, location = d.get("tensor") or "", d.get("location") or ""
    kind, _, name = tensor.partition(":")
    if tensor == "output" or kind == "act":
        site = "" if tensor == "output" else (name or location)
        out = [Insertion("after", site)]
        plus = _BIAS.search(str((d.get("evidence") or {}).get("plus", "")))
        if plus and site:
            out.append(Insertion("before_bias", site))
        return out
    if kind == "actgrad":
        return [Insertion("grad_of_output", name or location)]
    if kind == "grad":
        return [Insertion("grad", name or location)]
    return []


# ------------------------------------------------------ the collectives, as TP code writes them


class _ReduceForward(torch.autograd.Function):
    """All-reduce in the forward, the identity in the backward."""

    @staticmethod
    def forward(ctx, x, pg):
        out = x.clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _reduce_grad(grad: torch.Tensor, pg) -> torch.Tensor:
    grad = grad.contiguous().clone()
    dist.all_reduce(grad, group=pg)
    return grad


def _matches(name: str, site: str) -> bool:
    return name == site or name.endswith("." + site)


def tamper_for(insertion: Insertion, previous=None):
    """`Injection.tamper` that inserts the all-reduce into the TP module (after `previous`, the
    case's own tamper, if any). Raises when nothing in the TP module matches the site."""

    def tamper(module: nn.Module, group) -> None:
        if previous is not None:
            previous(module, group)
        pg = group.pg
        if insertion.where == "grad":
            hits = [p for n, p in module.named_parameters() if _matches(n, insertion.site)]
            for p in hits:
                p.register_hook(functools.partial(_reduce_grad, pg=pg))
        else:
            hits = [
                m
                for n, m in module.named_modules()
                if (n == "" if not insertion.site else _matches(n, insertion.site))
            ]
            for m in hits:
                m.register_forward_hook(_hook(insertion.where, m, pg))
        if not hits:
            raise RuntimeError(f"the TP module has nothing named {insertion.site!r} to repair")

    return tamper


def _hook(where: str, module: nn.Module, pg):
    def hook(mod, args, out):
        if not isinstance(out, torch.Tensor):
            return out
        if where == "after":
            return _ReduceForward.apply(out, pg)
        if where == "before_bias":
            bias = getattr(module, "bias", None)
            if bias is None:
                return _ReduceForward.apply(out, pg)
            return _ReduceForward.apply(out - bias, pg) + bias
        if out.requires_grad:  # grad_of_output: the gradient reaching this output, reduced first
            out.register_hook(functools.partial(_reduce_grad, pg=pg))
        return out

    return hook


# ------------------------------------------------------------------ the search


def prepare(result: dict, spec) -> tuple[dict, list]:
    """(result, [(insertion, candidate spec)]): the repaired Cases registered in this process, all
    before the rank pool that runs them starts (the ranks inherit the registry when they fork)."""
    from tpcheck.checker.case import CaseSpec
    from tpcheck.checker.casefile import register
    from tpcheck.resolve import RESOLVER

    todo = insertions(result)
    if not todo:
        return result, []
    prepared = RESOLVER.prepare(spec)
    case = RESOLVER.build(prepared)
    out = []
    for n, insertion in enumerate(todo, 1):
        label = f"{result['name']}/repair{n}"
        fixed = dataclasses.replace(
            case,
            name=label,
            inject=dataclasses.replace(
                case.inject, tamper=tamper_for(insertion, case.inject.tamper)
            ),
        )
        candidate = CaseSpec(
            block=register(fixed),
            world_size=spec.world_size,
            run=case.run,
            sequence_parallel=prepared.sequence_parallel,
            label=label,
            device=spec.device,
        )
        out.append((insertion, candidate))
    return result, out


def repair_case(prepared: tuple[dict, list], run_one) -> dict:
    """The report's repair entry for one case (kind "collective"), from `prepare`'s candidates;
    `run_one(spec) -> result dict` runs a full check."""
    result, todo = prepared
    d = result.get("diagnosis") or {}
    entry = {
        "kind": "collective",
        "case": result["name"],
        "world_size": result.get("world_size"),
        "dtype": result.get("dtype"),
        "verdict": result["verdict"],
        "signature": d.get("signature", ""),
        "where": d.get("tensor", ""),
        "tried": [],
        "status": "not_repairable" if not todo else "not_repaired",
        "insertion": None,
        "sentence": "",
        "verified": None,
    }
    for insertion, candidate in todo:
        r = run_one(candidate)
        entry["tried"].append(
            {
                "insertion": dataclasses.asdict(insertion),
                "verdict": r.get("verdict"),
                "summary": (r.get("summary") or "")[:300],
            }
        )
        if r.get("verdict") == "equivalent":
            entry.update(
                status="repaired",
                insertion=dataclasses.asdict(insertion),
                sentence=f"inserting {insertion.sentence()} makes it equivalent",
                verified={
                    "case": r["name"],
                    "verdict": r["verdict"],
                    "summary": r["summary"],
                    "result": slim(r),
                },
            )
            return entry
    entry["sentence"] = "; ".join(
        f"inserting {Insertion(**t['insertion']).sentence()} does not make it equivalent "
        f"({t['verdict']})"
        for t in entry["tried"]
    )
    return entry
