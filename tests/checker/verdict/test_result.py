"""Typed results: `CaseResult` keeps `Check` records to the edge, `to_json` is the report's case and
`from_json` reads it back; the checker's vocabulary (`Verdict`, `Stage`) is the report schema's."""

from __future__ import annotations

import json
import typing

import pytest

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.payload import Check
from tpcheck.checker.verdict.result import CaseResult
from tpcheck.checker.vocabulary import STAGES, VERDICTS, VERDICTS_EXPECTED
from tpcheck.pytest_plugin import EXPECTS
from tpcheck.report.schema import load_schema


def test_the_schema_spells_the_verdicts_of_the_vocabulary():
    schema = load_schema()
    assert tuple(schema["$defs"]["verdict"]["enum"]) == VERDICTS
    # the plugin spells them
    assert set(VERDICTS_EXPECTED) <= set(VERDICTS) and EXPECTS == VERDICTS_EXPECTED
    assert typing.get_args(typing.get_type_hints(Check)["stage"]) == STAGES


@pytest.fixture(scope="module")
def reports():
    """A passing case, a caught fault (a diagnosis, a
    first divergence) and an invalid one, as reported."""
    specs = [
        CaseSpec(block="mlp", preset="tiny", world_size=2, run=RunSettings(steps=1)),
        CaseSpec(
            block="mlp",
            preset="tiny",
            world_size=2,
            run=RunSettings(steps=1),
            fault="missing_backward_reduce",
        ),
        CaseSpec(block="mlp", preset="tiny", world_size=3),
    ]  # the tiny MLP's sizes do not divide by 3
    return json.loads(json.dumps(check(specs)))  # as a report file holds them


def test_a_report_case_reads_back_to_the_same_result(reports):
    assert [r["verdict"] for r in reports] == ["equivalent", "not equivalent", "invalid"]
    for case in reports:
        result = CaseResult.from_json(case)
        assert json.loads(json.dumps(result.to_json())) == case
        if case.get("checks"):
            assert all(isinstance(c, Check) and c.stage in STAGES for c in result.checks)
    caught = CaseResult.from_json(reports[1])
    assert caught.spec.fault == "missing_backward_reduce" and caught.run.steps == 1
    assert caught.first_divergence.stage in STAGES and not all(c.passed for c in caught.checks)


def test_checks_in_a_report_carry_no_control_and_no_empty_loader(reports):
    for c in reports[0]["checks"]:
        assert "control" not in c and "loaded_by" not in c
