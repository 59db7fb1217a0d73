"""`tpcheck report FILE` checks FILE against the shipped schema first: a malformed report is exit 2
with the first schema error (where in the document, and what), never a traceback. The hand-written
checker (tpcheck.report.validate; jsonschema is a test dependency only) must
agree with jsonschema."""

import copy
import json

import jsonschema
import pytest

from tpcheck.cli import main
from tpcheck.report.schema import SCHEMA, load_schema
from tpcheck.report.validate import ANNOTATIONS, KEYWORDS, first_error


@pytest.fixture(scope="module")
def schema() -> dict:
    return load_schema()


@pytest.fixture(scope="module")
def base(seed_run, schema) -> dict:
    """A real, valid report (the seed modes: equivalent and not-equivalent cases, checks, ledgers,
    diagnoses), cut to a sample of each list, to the check keys the schema knows (a check is the one
    strict object, and it grows), and without the contents of the parts the schema leaves open (the
    seed's JSON, a diagnosis's evidence), so that every mutation below is judged
    in reasonable time."""
    report = copy.deepcopy(seed_run.report)
    known = set(schema["$defs"]["check"]["properties"])
    report["seed"] = {}
    for case in report["cases"]:
        case["checks"] = [{k: v for k, v in c.items() if k in known} for c in case["checks"][:1]]
        case["ledger"]["expected"] = case["ledger"]["expected"][:1]
        case["ledger"]["per_rank"] = {"0": case["ledger"]["per_rank"]["0"]}
        if case.get("diagnosis"):
            case["diagnosis"]["evidence"] = {}
    assert jsonschema.Draft202012Validator(schema).is_valid(report)
    return report


def _report(tmp_path, document, raw: str | None = None) -> str:
    path = tmp_path / "r.json"
    path.write_text(raw if raw is not None else json.dumps(document))
    return str(path)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpcheck: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _good():
    return {
        "schema": SCHEMA,
        "tpcheck": "0.1.0",
        "environment": {"python": "3", "torch": "2", "backend": "gloo"},
        "summary": {"cases": 0, "as_expected": 0, "verdicts": {}, "exit_code": 0},
        "cases": [],
    }


BAD = {  # name: (change to a valid report, where, what the message says)
    "cases [{}]": (lambda r: r.update(cases=[{}]), "cases[0]", "'name' is a required property"),
    "cases 'abc'": (lambda r: r.update(cases="abc"), "cases", '"abc" is not of type array'),
    "summary null": (lambda r: r.update(summary=None), "summary", "null is not of type object"),
    "no summary": (lambda r: r.pop("summary"), "the top level", "'summary' is a required property"),
    "exit code 7": (
        lambda r: r["summary"].update(exit_code=7),
        "summary.exit_code",
        "7 is not one of [0, 1, 2, 3, 4, 129, 130, 143]",
    ),
    "exit code true": (
        lambda r: r["summary"].update(exit_code=True),
        "summary.exit_code",
        "true is not one of",
    ),
    "extra summary key": (lambda r: r["summary"].update(x=1), "summary", "'x' was unexpected"),
    "bad verdict name": (
        lambda r: r["summary"].update(verdicts={"fine": 1}),
        "summary.verdicts",
        'property name "fine" is not one of',
    ),
    "environment list": (
        lambda r: r.update(environment=[]),
        "environment",
        "[] is not of type object",
    ),
    "interrupted by SIGKILL": (
        lambda r: r.update(
            interrupted={"signal": "SIGKILL", "cases_finished": 0, "cases_planned": 1}
        ),
        "interrupted.signal",
        '"SIGKILL" is not one of',
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_malformed_report_exits_2_with_the_first_schema_error(name, tmp_path, capsys):
    change, where, what = BAD[name]
    report = _good()
    change(report)
    assert main(["report", _report(tmp_path, report)]) == 2
    line = _one_error_line(capsys)
    assert f"is not a valid {SCHEMA} report: at {where}: {what}" in line, line


@pytest.mark.parametrize(
    "raw, words",
    [
        ("not json at all", "cannot read the report"),
        ("[1, 2]", "at the top level: [1, 2] is not of type object"),
        ('"tpcheck.report/1"', 'at the top level: "tpcheck.report/1" is not of type object'),
        ("null", "at the top level: null is not of type object"),
        ("[" * 100_000, "cannot read the report"),  # deeper than the JSON parser recurses
        (
            '{"schema": "something/2"}',
            "has schema 'something/2', this tpcheck reads 'tpcheck.report/1'",
        ),
    ],
)
def test_not_a_report_exits_2(raw, words, tmp_path, capsys):
    assert main(["report", _report(tmp_path, None, raw)]) == 2
    assert words in _one_error_line(capsys)


def test_a_valid_report_without_cases_is_read_and_rendered(tmp_path, capsys):
    html = tmp_path / "r.html"
    assert main(["report", _report(tmp_path, _good()), "--html", str(html)]) == 0
    assert "0 of 0 case(s) as expected" in capsys.readouterr().err
    assert html.read_text().startswith("<!DOCTYPE html>")


def test_the_seed_report_with_its_known_check_keys_is_read(base, tmp_path, capsys):
    assert main(["report", _report(tmp_path, base)]) == 0
    assert "3 of 3 case(s) as expected" in capsys.readouterr().err


# ------------------------------------------------------------------------ the checker vs jsonschema


def _paths(value, path=()):
    """Every path inside a JSON value."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


# one of each JSON type, and edges
REPLACEMENTS = [None, True, 1.0, -1, 1.5, float("nan"), "", [], {}]


def _mutations(report):
    """The report with one value replaced (by each of REPLACEMENTS) or one key removed, everywhere;
    each change is made in place and undone before the next."""
    for path in list(_paths(report)):
        if not path:
            continue
        parent = report
        for part in path[:-1]:
            parent = parent[part]
        key, old = path[-1], parent[path[-1]]
        for new in [*REPLACEMENTS, "REMOVE"]:
            if new == "REMOVE":
                parent.pop(key)
                if isinstance(parent, dict):
                    yield path, new, report
                    parent[key] = old
                else:
                    yield path, new, report
                    parent.insert(key, old)
            else:
                parent[key] = new
                yield path, new, report
                parent[key] = old


@pytest.mark.slow
def test_the_checker_agrees_with_jsonschema_on_every_mutation(base, schema):
    validator = jsonschema.Draft202012Validator(schema)
    base = copy.deepcopy(base)
    assert first_error(base, schema) is None
    tried = invalid = 0
    for path, new, doc in _mutations(base):
        mine = first_error(doc, schema)
        theirs = list(validator.iter_errors(doc))
        assert (mine is None) == (not theirs), (path, new, mine, [e.message for e in theirs])
        if mine is not None:
            invalid += 1
            # mine names a place jsonschema also finds wrong
            # (itself, or inside it for oneOf/if-then)
            places = {tuple(e.absolute_path) for e in theirs}
            assert any(mine.path[: len(p)] == p for p in places), (path, new, str(mine), places)
        tried += 1
    assert tried > 1000 and invalid > tried // 4, (tried, invalid)
    assert first_error(base, schema) is None  # every change was undone


def test_the_checker_knows_every_keyword_the_schema_uses(schema):
    def keywords(node):
        if isinstance(node, dict):
            yield from node
            for key, sub in node.items():
                if key in ("properties", "$defs"):
                    for s in sub.values():
                        yield from keywords(s)
                elif key not in ("enum", "const", "required", "type", "description"):
                    yield from keywords(sub)
        elif isinstance(node, list):
            for sub in node:
                yield from keywords(sub)

    assert set(keywords(schema)) <= KEYWORDS | ANNOTATIONS


def test_an_unknown_keyword_is_an_error_not_ignored():
    with pytest.raises(ValueError, match="multipleOf"):
        first_error(3, {"type": "integer", "multipleOf": 2})
