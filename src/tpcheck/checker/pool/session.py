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
    first prepared by the launcher's resolver (a fault's own settings). `on_result`
    is called as each case
    finishes: what the caller keeps if the run is interrupted."""
    results = []
    for spec in specs:
        spec = launcher.resolver.prepare(spec)
        payloads = launcher.run(spec)
        if payloads is None:
            continue
        results.append(merge(spec, payloads))
        if on_result is not None:
            on_result(results[-1])
    return results
