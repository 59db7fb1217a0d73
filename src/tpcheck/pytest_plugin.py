"""pytest plugin: the `tpcheck` fixture.

    def test_my_tp(tpcheck):
        tpcheck.verify(my_case, world_sizes=[2, 4])           # a tpcheck.Case defined in the test module
        tpcheck.verify("path/to/case.py:NAME", world_sizes=[2])  # or a case file, or a CaseSpec

A Case holds lambdas and cannot be pickled to the rank processes; it does not need to be: `verify`
registers it in this process (`tpcheck.check.usercode.register`) before the rank pool is forked, and the ranks,
forked copies of this process, look it up by id (`CaseSpec(block="registered:ID")`).

A check that does not go as expected fails the test with the verdict and the diagnosis (first
divergent tensor, stage, step, ranks, cause); a mistake in the case (or the user's code raising)
fails it with the message naming the user's file and line.
"""
from __future__ import annotations

import dataclasses

import pytest


class TPCheckFixture:
    def __init__(self, timeout_s: float = 20.0) -> None:
        self.timeout_s = timeout_s

    def verify(self, case, world_sizes=(2,), **fields) -> list[dict]:
        """Check `case` (a tpcheck.Case, "path.py[:NAME]", a CaseSpec or a built-in block name) at each
        world size; raise AssertionError with the diagnosis unless every check went as expected.
        `fields` for a Case or case file: dtype, steps, optimizer, lr, seed, micro_batches (override the
        Case's own); for a built-in block: any CaseSpec field."""
        from tpcheck.api import check
        from tpcheck.check.case import Case, CaseSpec
        from tpcheck.check.usercode import file_spec, register

        if isinstance(case, Case) or (isinstance(case, str) and (case.endswith(".py") or ".py:" in case)):
            target = register(case) if isinstance(case, Case) else case
            specs = [file_spec(target, w, **fields) for w in world_sizes]
        else:
            base = dataclasses.replace(case, **fields) if isinstance(case, CaseSpec) else CaseSpec(block=str(case),
                                                                                                   **fields)
            specs = [dataclasses.replace(base, world_size=w) for w in world_sizes]
        results = check(specs, timeout_s=self.timeout_s)
        bad = [r for r in results if not r["as_expected"]]
        if bad:
            raise AssertionError("tpcheck: " + "\n".join(describe(r) for r in bad))
        return results


def describe(result: dict) -> str:
    """One failing case, readable: name, verdict, summary, and the diagnosis when there is one."""
    lines = [f"{result['name']}: {result['verdict']} (expected {result['expected']})", f"  {result['summary']}"]
    diagnosis = result.get("diagnosis")
    if isinstance(diagnosis, dict):
        for key in ("signature", "cause", "location", "tensor"):
            if diagnosis.get(key):
                lines.append(f"  {key}: {diagnosis[key]}")
    return "\n".join(lines)


@pytest.fixture
def tpcheck() -> TPCheckFixture:
    return TPCheckFixture()
