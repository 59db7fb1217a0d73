"""pytest plugin: the `tpcheck` fixture.

    def test_my_tp(tpcheck):
        tpcheck.verify(my_case, world_sizes=[2, 4])  # a tpcheck.Case defined in the test module
        tpcheck.verify("path/to/case.py:NAME", world_sizes=[2])  # or a case file, or a CaseSpec

A Case holds lambdas and cannot be pickled to the rank processes; it does not need to be: `verify`
registers it in this process (`tpcheck.checker.casefile.register`) before the rank pool is forked,
and the ranks, forked copies of this process, look it up by id (`CaseSpec(block="registered:ID")`).

A check that does not go as expected fails the test with the verdict and the diagnosis (first
divergent tensor, stage, step, ranks, cause); a mistake in the case (or the user's code raising)
fails it with the message naming the user's file and line. A test of a planted bug says what it
expects: `tpcheck.verify(buggy, expect="not equivalent")` passes only if the bug is caught.

Settings (pytest.ini / pyproject's [tool.pytest.ini_options], or per call): `tpcheck_timeout`
(seconds any collective may wait, default 20) and `tpcheck_world_sizes` (default "2").
"""

from __future__ import annotations

import dataclasses

import pytest

# checker/vocabulary.py's VERDICTS_EXPECTED, spelled here: importing tpcheck at pytest's start would
# import torch in every test run (tests/checker/verdict/test_result.py holds the two equal)
EXPECTS = ("equivalent", "not equivalent", "hang")


class TPCheckFixture:
    def __init__(self, timeout_s: float = 20.0, world_sizes: tuple[int, ...] = (2,)) -> None:
        self.timeout_s, self.world_sizes = timeout_s, tuple(world_sizes)

    def verify(
        self,
        case,
        world_sizes=None,
        *,
        expect: str | None = None,
        timeout_s: float | None = None,
        device: str | None = None,
        **fields,
    ) -> list[dict]:
        """Check `case` (a tpcheck.Case, "path.py[:NAME]", a CaseSpec or a built-in block name) at
        each world size (a number or a non-empty list; default: the `tpcheck_world_sizes` setting);
        raise tpcheck.UsageError for arguments it cannot run, AssertionError with the diagnosis
        unless every case got the verdict expected -- `expect` ("equivalent", "not equivalent" for a
        planted bug, "hang"), by default "equivalent" (a catalogue fault: caught). `device`: "cuda"
        runs each rank on its own GPU (default: the CPU). `fields`: run settings (RunSettings
        fields: dtype, steps, optimizer, lr, seed, micro_batches, ...; for a Case or case file they
        override its own), and for a built-in block or a CaseSpec any other CaseSpec field."""
        # a failure shows the test's line and the diagnosis, not this function
        __tracebackhide__ = True
        from tpcheck.api import check
        from tpcheck.checker.case import RUN_FIELDS, Case, CaseSpec
        from tpcheck.checker.casefile import file_spec, register
        from tpcheck.errors import UsageError

        if expect is not None and expect not in EXPECTS:
            raise UsageError(f"expect={expect!r}: give one of {list(EXPECTS)}")
        world_sizes = self._world_sizes(world_sizes)
        if isinstance(case, Case) or (
            isinstance(case, str) and (case.endswith(".py") or ".py:" in case)
        ):
            target = register(case) if isinstance(case, Case) else case
            specs = [file_spec(target, w, **fields) for w in world_sizes]
        elif isinstance(case, (CaseSpec, str)):
            spec_fields = [f.name for f in dataclasses.fields(CaseSpec) if f.name != "run"]
            unknown = sorted(set(fields) - set(spec_fields) - set(RUN_FIELDS))
            if unknown:
                raise UsageError(
                    f"tpcheck.verify({case!r}, ..., {unknown[0]}=...): {unknown} are neither "
                    f"CaseSpec fields {spec_fields} nor run settings {list(RUN_FIELDS)}"
                )
            base = case if isinstance(case, CaseSpec) else CaseSpec(block=case)
            base = dataclasses.replace(
                base, **{k: v for k, v in fields.items() if k not in RUN_FIELDS}
            )
            if run := {k: v for k, v in fields.items() if k in RUN_FIELDS}:
                base = base.with_run(**run)
            specs = [dataclasses.replace(base, world_size=w) for w in world_sizes]
        else:
            raise UsageError(
                f"tpcheck.verify takes a tpcheck.Case, a CaseSpec, a built-in block name or "
                f"'path/to/case.py[:NAME]', not {type(case).__name__} {case!r:.60}"
            )
        if expect is not None:
            specs = [dataclasses.replace(s, expected=expect) for s in specs]
        if device is not None:
            specs = [dataclasses.replace(s, device=device) for s in specs]
        results = check(specs, timeout_s=self.timeout_s if timeout_s is None else timeout_s)
        bad = [r for r in results if not r["as_expected"]]
        if bad:
            raise AssertionError("tpcheck: " + "\n".join(describe(r) for r in bad))
        return results

    def _world_sizes(self, given) -> tuple[int, ...]:
        """The world sizes to check: the setting's by default; one number or a list of them. An
        empty list is refused: a test that checks no case would pass having proved nothing."""
        __tracebackhide__ = True
        from tpcheck.errors import UsageError

        if given is None:
            return self.world_sizes
        sizes = (
            (given,)
            if isinstance(given, int)
            else tuple(given)
            if isinstance(given, (list, tuple, range))
            else None
        )
        if not sizes:
            raise UsageError(
                f"tpcheck.verify(..., world_sizes={given!r}): give a world size or a non-empty "
                "list of them, e.g. world_sizes=[2, 4] (with none, nothing would be checked)"
            )
        return sizes


def describe(result: dict) -> str:
    """One failing case, readable: name, verdict, summary, and the diagnosis when there is one."""
    lines = [
        f"{result['name']}: {result['verdict']} (expected {result['expected']})",
        f"  {result['summary']}",
    ]
    diagnosis = result.get("diagnosis")
    if isinstance(diagnosis, dict):
        for key in ("signature", "cause", "location", "tensor"):
            if diagnosis.get(key):
                lines.append(f"  {key}: {diagnosis[key]}")
    return "\n".join(lines)


def pytest_addoption(parser) -> None:
    parser.addini(
        "tpcheck_timeout",
        "tpcheck fixture: seconds any collective may wait (default 20)",
        default="20",
    )
    parser.addini(
        "tpcheck_world_sizes",
        "tpcheck fixture: world sizes checked by default (default: 2)",
        default="2",
    )


@pytest.fixture
def tpcheck(request) -> TPCheckFixture:
    ini = request.config.getini
    try:
        timeout = float(ini("tpcheck_timeout"))
        worlds = tuple(int(w) for w in str(ini("tpcheck_world_sizes")).replace(",", " ").split())
    except ValueError as e:
        raise pytest.UsageError(
            f"tpcheck_timeout / tpcheck_world_sizes in the pytest settings: {e} (e.g. "
            "tpcheck_timeout = 60, tpcheck_world_sizes = 2 4)"
        ) from None
    return TPCheckFixture(timeout_s=timeout, world_sizes=worlds or (2,))
