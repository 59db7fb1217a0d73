"""The JSON report: valid against report/schema.json (draft 2020-12), strict on its core, open for
additions, and deterministic apart from keys named `seconds`."""

import copy
import json

import jsonschema
import pytest

from tpcheck.report.schema import SCHEMA, load_schema

from report_helpers import SEED_ARGS, tpcheck
from timings import without_timings


@pytest.fixture(scope="module")
def validator():
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(validator, report) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(report)
    ]


def test_schema_names_the_version_build_report_writes():
    assert load_schema()["$id"] == SCHEMA == "tpcheck.report/1"


def test_seed_modes_report_is_valid(validator, seed_run):
    report = seed_run.report
    assert _errors(validator, report) == []
    assert [c["verdict"] for c in report["cases"]] == [
        "equivalent",
        "not equivalent",
        "not equivalent",
    ]
    assert set(report["seed"]) == {
        "inspect",
        "equivalence",
        "missing_forward_reduce",
        "missing_backward_reduce",
    }


def test_matrix_report_with_a_hang_is_valid(validator, matrix_run):
    report = matrix_run.report
    assert _errors(validator, report) == []
    verdicts = {c["spec"]["fault"]: c["verdict"] for c in report["cases"]}
    assert verdicts == {
        None: "equivalent",
        "missing_forward_reduce": "not equivalent",
        "missing_backward_reduce": "not equivalent",
        "collective_on_some_ranks": "hang",
    }
    assert max(c["step"] for c in report["cases"][0]["checks"]) == 2


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda r: r.update(schema="tpcheck.report/0"), "tpcheck.report/1"),
        (lambda r: r["summary"].update(extra=1), "'extra' was unexpected"),
        (lambda r: r["cases"][0].pop("verdict"), "'verdict' is a required property"),
        (lambda r: r["cases"][0].update(verdict="fine"), "'fine' is not one of"),
        (lambda r: r["cases"][0].update(as_expected="yes"), "'yes' is not of type 'boolean'"),
        (lambda r: r["cases"][0].pop("checks"), "'checks' is a required property"),
        (lambda r: r["cases"][0]["checks"][0].update(typo=1), "'typo' was unexpected"),
        (lambda r: r["cases"][0]["checks"][0].pop("bound"), "'bound' is a required property"),
        (
            lambda r: r["cases"][0]["ledger"]["expected"][0].update(op="broadcast"),
            "'broadcast' is not one of",
        ),
        (
            lambda r: r["cases"][0]["ledger"]["per_rank"]["0"].update(setup={}),
            "'setup' is not one of",
        ),
    ],
)
def test_schema_is_strict_on_the_core(validator, seed_run, breakage, expected):
    report = copy.deepcopy(seed_run.report)
    breakage(report)
    errors = _errors(validator, report)
    assert any(expected in e for e in errors), errors


def test_schema_is_open_for_additions(validator, seed_run):
    report = copy.deepcopy(seed_run.report)
    report["cases"][1]["diagnosis"] = {
        "signature": "partial_sum",
        "cause": "no forward all-reduce",
        "location": "down",
        "stage": "forward",
        "step": 1,
        "ranks": [0, 1],
        "evidence": {"ratio": 2.0},
        "confidence": "high",
    }
    report["cases"][1]["ledger_check"] = {"missing": ["forward all_reduce at 'down'"]}
    report["environment"]["cpu"] = "x86_64"
    report["generated_by"] = "a later tpcheck"
    assert _errors(validator, report) == []


def test_same_command_same_json_apart_from_seconds(seed_run, tmp_path):
    again = tmp_path / "again.json"
    proc = tpcheck(*SEED_ARGS, "--json", str(again), "-q")
    assert proc.returncode == 0, proc.stderr
    first, second = seed_run.report, json.loads(again.read_text())
    assert "seconds" in first["cases"][0]  # the timings exist and are what is set aside
    assert without_timings(first) == without_timings(second)
    assert seed_run.proc.stdout == proc.stdout  # the seed-compatible JSON on stdout too
