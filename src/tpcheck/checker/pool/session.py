"""Run a list of CaseSpecs to case results, in this process's pool or under torchrun."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tpcheck.checker.case import CaseSpec
from tpcheck.checker.pool.launch import Launcher, TorchrunLauncher
from tpcheck.checker.verdict.float64_run import float64_spec, merge_float64
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
        result = run_case(spec, launcher)
        if result is None:
            continue
        if on_result is not None:
            on_result(result)  # the caller keeps what it needs of it (the report's case)
        else:
            results.append(result)
    return results


def run_case(spec: CaseSpec, launcher: Launcher | TorchrunLauncher) -> CaseResult | None:
    """One case: its run in the working dtype, then, where its settings want one, its float64 run,
    merged in (checker/verdict/float64_run.py). None on torchrun ranks other than 0."""
    spec = launcher.resolver.prepare(spec)
    payloads = launcher.run(spec)
    result = None if payloads is None else merge(spec, payloads)
    follow = result and float64_spec(spec, result)
    if isinstance(launcher, TorchrunLauncher):  # every rank runs what rank 0's results decide
        follow = launcher.share(follow)
    if follow is None:
        return result
    follow = launcher.resolver.prepare(follow)
    payloads = launcher.run(follow)
    return None if result is None else merge_float64(result, merge(follow, payloads))
