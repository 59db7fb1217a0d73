"""Run a list of CaseSpecs to case results, in this process's pool or under torchrun."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tpcheck.check.case import CaseSpec
from tpcheck.check.launch import DEFAULT_TIMEOUT_S, Launcher, TorchrunLauncher
from tpcheck.check.result import merge
from tpcheck.errors import EXIT_EQUIVALENT, EXIT_NOT_EQUIVALENT, EXIT_USAGE

Progress = Callable[[int, int, dict], None]


def run_specs(specs: Sequence[CaseSpec], launcher: Launcher | TorchrunLauncher,
              progress: Progress | None = None) -> list[dict]:
    """Case results in the order of `specs` (empty on torchrun ranks other than 0)."""
    results: list[dict] = []
    for i, spec in enumerate(specs):
        payloads = launcher.run(spec)
        if payloads is None:
            continue
        results.append(merge(spec, payloads))
        if progress is not None:
            progress(i + 1, len(specs), results[-1])
    return results


def check(specs: Sequence[CaseSpec], *, timeout_s: float = DEFAULT_TIMEOUT_S,
          progress: Progress | None = None) -> list[dict]:
    """The Python API: run `specs` on a fresh pool of forked ranks and return the case results."""
    with Launcher(timeout_s) as launcher:
        return run_specs(specs, launcher, progress)


def exit_code(results: Sequence[dict]) -> int:
    """2 if any case was invalid or errored, else 1 if any case did not go as expected, else 0."""
    if any(r["verdict"] in ("invalid", "error") for r in results):
        return EXIT_USAGE
    if not all(r["as_expected"] for r in results):
        return EXIT_NOT_EQUIVALENT
    return EXIT_EQUIVALENT
