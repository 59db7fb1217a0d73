"""The Python API: `check(specs)` runs CaseSpecs on a fresh pool of forked ranks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tpcheck.checker.case import CaseSpec
from tpcheck.checker.pool.launch import DEFAULT_TIMEOUT_S
from tpcheck.checker.pool.session import Progress, run_specs
from tpcheck.checker.verdict.result import exit_code
from tpcheck.errors import UsageError
from tpcheck.resolve import launcher


def check(
    specs: Sequence[CaseSpec],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: Progress | None = None,
) -> list[dict]:
    """Run `specs` (built-in blocks, case files, registered Cases) on a fresh pool of forked ranks
    and return the case results, as in the JSON report (`docs/report-schema.md`). Anything but a
    list of CaseSpecs is refused (UsageError) before a rank starts."""
    specs = _spec_list(specs)
    reported: list[dict] = []

    def report(result) -> None:  # the report's case, made once, here at the edge
        reported.append(result.to_json())
        if progress is not None:
            progress(len(reported), len(specs), reported[-1])

    with launcher(timeout_s) as pool:
        run_specs(specs, pool, report)
    return reported


def _spec_list(specs) -> list[CaseSpec]:
    if isinstance(specs, CaseSpec):
        raise UsageError(
            "tpcheck.check takes a list of CaseSpecs, not one CaseSpec: tpcheck.check([spec])"
        )
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Iterable):
        raise UsageError(
            f"tpcheck.check takes a list of CaseSpecs, not {type(specs).__name__} {specs!r:.60}: "
            "tpcheck.check([tpcheck.CaseSpec(block='mlp', world_size=2)])"
        )
    specs = list(specs)
    for i, spec in enumerate(specs):
        if not isinstance(spec, CaseSpec):
            raise UsageError(
                f"tpcheck.check: item {i} is {type(spec).__name__} {spec!r:.60}, not a CaseSpec: "
                "give tpcheck.CaseSpec(block=...) (a built-in block, 'file:PATH' "
                "or a registered case)"
            )
    return specs


__all__ = ["check", "exit_code"]
