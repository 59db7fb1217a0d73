"""Turn a CaseSpec into a Case on a rank: a built-in block or a user's case file, plus a fault."""
from __future__ import annotations

from tpcheck.check.case import Case, CaseSpec


def build_case(spec: CaseSpec) -> Case:
    from tpcheck.models.cases import builtin_case

    case = builtin_case(spec)
    if spec.fault:
        from tpcheck.faults import apply_fault

        case = apply_fault(case, spec)
    return case
