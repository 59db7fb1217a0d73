"""What the diagnosis of a replicated parameter's gradient needs beside its tensors, on this rank.

- `micro_grads`: with several micro-batches per step, the dense side's gradient of each micro-batch
  (G_1..G_n, the increments of the accumulated `.grad`, in float64), so the parent can tell a
  gradient that is G_1 + ... + G_n from one that counts the earlier micro-batches world times over
  (an all-reduce of the accumulated `.grad` after every backward: checker/verdict/mechanisms.py).
- `plan_rule`: with `Case.plan_rules` (the TP code's own plan), which rule covers the parameter,
  or that none does and the closest sibling's (checker/rule_match.py), to name it.

Taken for the replicated parameters of at most `EVIDENCE_MAX_NUMEL` elements only (norm weights,
the like), and attached to the evidence of their gradient checks (`Evidence.annotate`): only those
of failing checks travel to the parent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.rank.evidence import EVIDENCE_MAX_NUMEL
from tpcheck.checker.rule_match import covering, styles

if TYPE_CHECKING:
    from tpcheck.checker.rank.sides import Sides


def _watched(s: Sides):
    """(dense name, parameter) of the replicated parameters small enough to keep per micro-batch."""
    params = s.plan.params
    for name, p in s.dense.named_parameters():
        placement = params.get(name)
        if (
            placement is not None
            and placement.replicated
            and placement.applied_on is None
            and p.numel() <= EVIDENCE_MAX_NUMEL
        ):
            yield name, p


class GradEvidence:
    """The per-micro-batch dense gradients of one step, and their annotation of the evidence."""

    def __init__(self) -> None:
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.last: dict[str, torch.Tensor] = {}

    def take(self, s: Sides) -> None:
        """After a micro-batch's backward: each watched parameter's gradient increment."""
        if s.settings.micro_batches < 2:
            return
        for name, p in _watched(s):
            if p.grad is None:
                continue
            now = p.grad.detach().to(torch.float64, copy=True)
            before = self.last.get(name)
            self.parts.setdefault(name, []).append(now if before is None else now - before)
            self.last[name] = now

    def annotate(self, s: Sides, step: int) -> None:
        """After the step's gradient checks: the kept evidence of each watched parameter's
        gradient gets its micro-batch gradients and, with `Case.plan_rules`, the rule covering
        it; the step's increments are then dropped."""
        evidence, rules = s.cmp.evidence, s.case.plan_rules
        for name, parts in self.parts.items():
            if len(parts) == s.settings.micro_batches:
                evidence.annotate(
                    ("grads", step, CheckId("grad", name)), "micro_grads", torch.stack(parts)
                )
        self.parts, self.last = {}, {}
        if rules is None:
            return
        used = styles(rules)
        for name, _ in _watched(s):
            key = ("grads", step, CheckId("grad", name))
            if key in evidence.kept:
                evidence.annotate(key, "plan_rule", {**covering(name, rules), "styles": used})
