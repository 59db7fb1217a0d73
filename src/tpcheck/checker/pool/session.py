"""Run a list of CaseSpecs to case results, in this process's pool or under torchrun."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tpcheck.checker.case import CaseSpec
from tpcheck.checker.pool.launch import Launcher, TorchrunLauncher
from tpcheck.checker.verdict.result import CaseResult, merge

# (cases done, cases planned, the last one's report case)
Progress = Callable[[int, int, dict], None]


def run_specs(
    specs: Sequence[CaseSpec],
    launcher: Launcher | TorchrunLauncher,
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Case results in the order of `specs` (empty on torchrun ranks other than 0). Each spec is
    first prepared by the launcher's resolver (a fault's own settings). With `on_result`, each
    result is handed to it as its case finishes (what the caller keeps if the run is interrupted)
    and none is kept here: a sweep of thousands of cases holds one copy of them, the caller's."""
    results = []
    for spec in specs:
        spec = launcher.resolver.prepare(spec)
        payloads = launcher.run(spec)
        if payloads is None:
            continue
        result = merge(spec, payloads)
        if on_result is not None:
            on_result(result)  # the caller keeps what it needs of it (the report's case)
        else:
            results.append(result)
    return results
