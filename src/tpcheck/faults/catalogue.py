"""Declarative fault entries. Each names a bug class in one sentence, where it is injected and what
the checker must say about it; `inject` turns a correct Case into the faulty one."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from tpcheck.check.case import Case, CaseSpec
from tpcheck.errors import UsageError
from tpcheck.faults import injectors as inj


@dataclass(frozen=True)
class Fault:
    name: str
    bug_class: str
    where: str
    expected_stage: str  # the stage of the first divergent check
    expected_signature: str
    inject: Callable[[Case, CaseSpec], Case]
    blocks: tuple[str, ...] = ("mlp",)
    min_world: int = 2


def _tamper(fn) -> Callable[[Case, CaseSpec], Case]:
    """An injector that acts on the built TP module (and its group) on every rank."""

    def inject(case: Case, spec: CaseSpec) -> Case:
        return dataclasses.replace(case, tamper=fn)

    return inject


CATALOGUE: dict[str, Fault] = {f.name: f for f in [
    Fault("missing_forward_reduce",
          "The row-parallel output is used without the all-reduce: each rank keeps its partial sum.",
          "forward all-reduce of the down projection (site 'down')",
          "forward", "partial_sum",
          _tamper(inj.drop_collective("all_reduce", "down", "forward"))),
    Fault("missing_backward_reduce",
          "The column-parallel input grad is not all-reduced: forward is bit-identical, grads are partial.",
          "backward all-reduce entering the TP region (site 'gate_up')",
          "backward", "partial_sum",
          _tamper(inj.drop_collective("all_reduce", "gate_up", "backward"))),
    Fault("collective_on_some_ranks",
          "A collective is issued on some ranks only (a rank-dependent branch around it): ranks wait forever.",
          "forward all-reduce of the down projection skipped on ranks > 0",
          "forward", "hang",
          _tamper(inj.drop_collective("all_reduce", "down", "forward", ranks=lambda r, w: r > 0))),
]}


def get_fault(name: str) -> Fault:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise UsageError(f"unknown fault {name!r}; `tpcheck faults` lists them: {sorted(CATALOGUE)}") from None


def apply_fault(case: Case, spec: CaseSpec) -> Case:
    fault = get_fault(spec.fault)
    if spec.block not in fault.blocks:
        raise UsageError(f"fault {fault.name!r} applies to block(s) {list(fault.blocks)}, not {spec.block!r}")
    if spec.world_size < fault.min_world:
        raise UsageError(f"fault {fault.name!r} needs world size >= {fault.min_world}, got {spec.world_size}")
    return fault.inject(case, spec)
