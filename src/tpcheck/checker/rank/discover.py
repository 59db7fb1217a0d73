"""The plan the engine checks through, and the only writer of it: a written plan as it is; for a
case with none written (`Case(plan=None, load_tp=...)`), the plan inferred as the run reveals it.

Three steps, each agreed over the ranks through the store (the engine holds the Case unchanged and
reads the plan from here, `Discovery.plan`):
1. before the first step, which TP parameter is which dense one (the same name, wrapper prefixes
   dropped, `Case.tp_names`, or by values: checker/rank/names.py), then the parameter placements,
   from what the user's loader loaded (checker/rank/plan_inference.py; a parameter one rank alone
   has is `OnRank(r)`; one that holds another rank's shard on some ranks is placed as the shard it
   is, `misloaded`, and fails at the weights stage);
2. in the first micro-batch, the activation placements, from the first micro-batch's output shapes
   and whether each output is the same on every rank (checker/rank/activations.py), for every module
   output the case does not name: a written plan's `Plan.activations` (or, with none written,
   `Case.activations`) are kept as written, the outputs it is silent about inferred -- so a written
   plan never checks fewer module outputs than no plan would;
3. after the first step's gradients, the parameters applied on one rank only: inferred `Replicate()`
   but with a gradient on one rank alone, `AppliedOnRank(r)` (the values cannot tell the two apart).
`as_code()` prints the result, with the module outputs left unchecked and why; `record()` says,
for a written plan too, which activations were written and which inferred.
"""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.distributed as dist
from torch import nn

from tpcheck.checker.case import Case
from tpcheck.checker.rank import activations, capture, names, torch_collectives
from tpcheck.checker.rank.ledger import CollectiveTap
from tpcheck.checker.rank.plan_inference import infer_plan, placement_code, plan_as_code
from tpcheck.checker.sync import Rendezvous
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import AppliedOnRank, Plan, Replicate


def infers_activations(case: Case) -> bool:
    """Whether the module outputs `case` does not name are inferred (and checked): with a written
    plan, whenever module outputs are captured at all (`RunSettings.capture`); with none written,
    unless the case names the outputs to check (`Case.activations`: the HuggingFace adapter names
    transformers' planned modules and decoder layers, and keeps to them)."""
    return case.run.capture and (case.plan is not None or not case.activations)


class Discovery:
    """The case's plan as known so far on this rank (`plan`), and what is still to be inferred."""

    def __init__(
        self, case: Case, group: TPGroup, rendezvous: Rendezvous, dense: nn.Module, tp: nn.Module
    ) -> None:
        assert isinstance(group.tap, CollectiveTap), (
            "the activations' checker collective goes through the tap"
        )
        self.group, self.rendezvous, self.dense = group, rendezvous, dense
        self.inferred = case.plan is None
        # the activation placements the case names: kept as written
        self.written = dict(case.activations if case.plan is None else case.plan.activations)
        # those of the other module outputs, inferred in the first micro-batch
        self.acts_pending = infers_activations(case)
        self.capturing = case.run.capture
        self.skipped: dict[str, str] = {}  # module outputs not checked, and why
        self.failed: dict[str, str] = {}  # module outputs no placement of the dense ones, and why
        self.by_values: dict[str, str] = {}  # dense -> TP names matched by values, not by name
        # parameters holding another rank's shard on some ranks, and what the ranks hold
        self.misloaded: dict[str, str] = {}
        # TP modules named otherwise than their dense modules (wrappers, renamed layers): their
        # outputs are captured under the dense names
        self.tp_modules: dict[str, str] = {}
        self._plan = case.plan
        if case.plan is None:  # no plan written: inferred from what the user's loader put there
            tp_names, self.by_values = self._names(case, tp)
            self.tp_modules = names.module_names(tp, dense, tp_names)
            plan, self.misloaded = infer_plan(
                tp, dense, rendezvous, group.rank, group.world_size, tp_names
            )
            plan = dataclasses.replace(plan, activations=dict(case.activations))
            plan.check_against(dense, group.world_size)
            self._plan = plan
        self.candidates = (
            activations.candidates(dense, tp, self.tp_modules) - set(self.written)
            if self.acts_pending
            else set()
        )

    def _names(self, case: Case, tp: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
        """Each dense parameter's TP name, agreed by the ranks (checker/rank/names.py): the user's
        `Case.tp_names`, the same name, the same name with wrapper prefixes dropped, or by
        values."""
        dense_params = {n: p.detach() for n, p in self.dense.named_parameters()}
        # a buffer may be named too (checker/rank/buffers.py reads those)
        known = list(dense_params) + [n for n, _ in self.dense.named_buffers()]
        given = names.given_names(case.tp_names, known)
        tp_params = {n: p.detach() for n, p in tp.named_parameters()}
        return names.agree(
            tp_params, dense_params, given, self.rendezvous, self.group.rank, self.group.world_size
        )

    @property
    def plan(self) -> Plan:
        return self._plan

    def capture_names(self) -> set[str]:
        """The module outputs captured: the plan's activations, and, while the others are being
        inferred, every module both models have (checker/rank/activations.py)."""
        if self.acts_pending:
            return self.candidates | set(self.written)
        return set(self._plan.activations)

    def infer_activations(
        self, dense_recorder: capture.Recorder, held: list, structures: dict[str, str]
    ) -> None:
        """The placements of the module outputs not written, from the first micro-batch: the dense
        side's captured outputs and the TP side's `held` ones ((stage, name, tensor, seq) each) and
        what each TP module returned (`structures`); the ranks agree through the store. The plan
        then carries them after the written ones, and says which outputs are not checked and why,
        and which are no placement of the dense output (`failed`)."""
        mine = activations.seen(
            [(stage, name, t) for stage, name, t, _ in held if name in self.candidates],
            structures,
        )
        said = activations.exchange(self.rendezvous, mine)
        dense = {
            name: q[0]
            for (stage, name), q in dense_recorder.tensors.items()
            if stage == "forward" and q and name in self.candidates
        }
        dense_shapes = {name: tuple(t.shape) for name, t in dense.items()}
        partial, selected = set(), set()
        # summed over the ranks: partial sums? each element on some rank: selections?
        if differ := activations.differing(dense_shapes, said):
            partial, selected = self._partial_sums(differ, dense, held)
        decided = activations.decide(
            dense_shapes,
            said,
            self._plan,
            self.group.world_size,
            partial,
            activations.row_split_linears(self.dense, self._plan),
            dense_recorder.structures,
            selected,
        )
        self._plan = dataclasses.replace(self._plan, activations={**self.written, **decided.placed})
        self.skipped, self.failed = decided.skipped, {**self.failed, **decided.failed}
        self.acts_pending = False

    def _partial_sums(
        self, names: list[str], dense: dict[str, torch.Tensor], held: list
    ) -> tuple[set[str], set[str]]:
        """Of the outputs in `names` (the dense shape on every rank, not the same on every rank),
        those whose sum over the ranks is the dense output (partial sums), and of the others the
        selections (`activations.is_selection`: every element the dense one on some rank, no rank
        holding them all; a lookup whose rows outside the rank's shard are masked later): one
        checker all-reduce for the sums, one for the least distances to the dense output (as the
        negated max: each element's over the ranks, and each output's whole-tensor one)."""
        first = {}
        for stage, name, t, _ in held:
            if stage == "forward":
                first.setdefault(name, t)
        mine = [first[n].double().reshape(-1).cpu() for n in names]
        gaps = [(t - dense[n].double().reshape(-1).cpu()).abs() for n, t in zip(names, mine)]
        sums = torch.cat(mine)
        whole = torch.tensor([float(g.max()) if g.numel() else 0.0 for g in gaps])
        near = torch.cat([-torch.cat(gaps), -whole.double()])
        for op, both in ((dist.ReduceOp.SUM, sums), (dist.ReduceOp.MAX, near)):
            self.group.tap.performing(
                ("all_reduce", "checker:activations", "forward"),
                torch_collectives.all_reduce,
                both,
                op=op,
                group=self.group.pg,
            )
        sizes = [dense[n].numel() for n in names]
        nearest = near[: sum(sizes)].split(sizes)
        partial, selected = set(), set()
        for k, (n, summed) in enumerate(zip(names, sums.split(sizes))):
            d = dense[n].reshape(-1).cpu()
            if activations.is_partial_sum(summed, d):
                partial.add(n)
            elif activations.is_selection(-nearest[k], -near[sum(sizes) + k], d):
                selected.add(n)
        return partial, selected

    def infer_applied_on(self, tp: nn.Module, grad_of=lambda p: p.grad) -> None:
        """After the first step's gradients, with an inferred plan: a parameter inferred Replicate()
        that gets a gradient on one rank only is applied on that rank, AppliedOnRank(r) (a
        row-parallel bias added before the all-reduce). The values cannot tell the two apart, the
        first step's gradients can; the ranks agree through the store. A gradient that is zero
        rather than absent on the other ranks is not inferred (the grads stage then compares
        it as a replica). `grad_of`: where the TP gradients are read (grad_source.py)."""
        plan = self._plan
        if not self.inferred or self.group.world_size == 1:
            return
        tp_params = dict(tp.named_parameters())
        names = [n for n, p in plan.params.items() if isinstance(p, Replicate)]
        mine = [n for n in names if grad_of(tp_params[plan.tp_name(n)]) is not None]
        said = [
            set(json.loads(t))
            for t in self.rendezvous.exchange(
                "applied", json.dumps(mine), label="inferring the plan"
            )
        ]
        applied = {}
        for name in names:
            holders = [r for r, got in enumerate(said) if name in got]
            if len(holders) == 1:
                applied[name] = AppliedOnRank(holders[0])
        if applied:
            self._plan = dataclasses.replace(plan, params={**plan.params, **applied})

    def as_code(self) -> str | None:
        """The plan of a case with no plan written, as inferred (parameters, then where the
        gradients appear, then the activations), as code; None for a written plan."""
        if not self.inferred:
            return None
        return plan_as_code(
            self._plan, self.skipped, set(self.written), self.failed, self.by_values, self.misloaded
        )

    def record(self) -> dict | None:
        """The module outputs as the run knew them, for the report (`activations`): `written` and
        `inferred` ({name: placement as code}), `not_checked` ({name: why}) and `no_placement`
        ({name: why}: outputs that fail at their module); None when nothing was captured."""
        if not self.capturing:
            return None
        acts = self._plan.activations
        return {
            "written": {n: placement_code(p) for n, p in acts.items() if n in self.written},
            "inferred": {n: placement_code(p) for n, p in acts.items() if n not in self.written},
            "not_checked": dict(sorted(self.skipped.items())),
            "no_placement": dict(sorted(self.failed.items())),
        }
