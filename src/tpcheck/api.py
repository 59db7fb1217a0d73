"""The Python API: `check(specs)` runs CaseSpecs on a fresh pool of forked ranks."""
from __future__ import annotations

from collections.abc import Sequence

from tpcheck.check.case import CaseSpec
from tpcheck.check.launch import DEFAULT_TIMEOUT_S
from tpcheck.check.result import exit_code
from tpcheck.check.session import Progress, run_specs
from tpcheck.resolve import launcher


def check(specs: Sequence[CaseSpec], *, timeout_s: float = DEFAULT_TIMEOUT_S,
          progress: Progress | None = None) -> list[dict]:
    """Run `specs` (built-in blocks, case files, registered Cases) on a fresh pool of forked ranks and
    return the case results, as in the JSON report (`docs/report-schema.md`)."""
    with launcher(timeout_s) as pool:
        return run_specs(specs, pool, progress)


__all__ = ["check", "exit_code"]
