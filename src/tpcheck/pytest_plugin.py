"""pytest plugin: the `tpcheck` fixture.

    def test_my_tp(tpcheck):
        tpcheck.verify("path/to/case.py:NAME", world_sizes=[2, 4])

A failing check fails the test with the diagnosis (first divergent tensor, stage, signature).
"""
from __future__ import annotations

import dataclasses

import pytest


class TPCheckFixture:
    def __init__(self, timeout_s: float = 20.0) -> None:
        self.timeout_s = timeout_s

    def verify(self, case, world_sizes=(2,), **spec_fields) -> list[dict]:
        """Check `case` (a CaseSpec, a built-in block name, or "path.py[:NAME]") at each world size;
        raise AssertionError with the diagnosis unless every check went as expected."""
        from tpcheck.check.case import CaseSpec
        from tpcheck.check.session import check

        if isinstance(case, CaseSpec):
            base = dataclasses.replace(case, **spec_fields)
        elif isinstance(case, str) and (case.endswith(".py") or ".py:" in case):
            base = CaseSpec(block=f"file:{case}", **spec_fields)
        else:
            base = CaseSpec(block=str(case), **spec_fields)
        specs = [dataclasses.replace(base, world_size=w) for w in world_sizes]
        results = check(specs, timeout_s=self.timeout_s)
        bad = [r for r in results if not r["as_expected"]]
        if bad:
            raise AssertionError("tpcheck: " + "\n".join(f"{r['name']}: {r['summary']}" for r in bad))
        return results


@pytest.fixture
def tpcheck() -> TPCheckFixture:
    return TPCheckFixture()
