"""Run a list of CaseSpecs to case results, in this process's pool or under torchrun."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tpcheck.checker.case import CaseSpec
from tpcheck.checker.pool.launch import Launcher, TorchrunLauncher
from tpcheck.checker.verdict.result import merge

Progress = Callable[[int, int, dict], None]


def run_specs(specs: Sequence[CaseSpec], launcher: Launcher | TorchrunLauncher,
              progress: Progress | None = None, results: list[dict] | None = None) -> list[dict]:
    """Case results (the report's case objects) in the order of `specs` (empty on torchrun ranks
    other than 0). Each spec is first prepared by the launcher's resolver (a fault's own settings).
    `results`, when given, is filled as cases finish: what the caller keeps if the run is interrupted."""
    results = [] if results is None else results
    for i, spec in enumerate(specs):
        spec = launcher.resolver.prepare(spec)
        payloads = launcher.run(spec)
        if payloads is None:
            continue
        results.append(merge(spec, payloads).to_json())
        if progress is not None:
            progress(i + 1, len(specs), results[-1])
    return results
