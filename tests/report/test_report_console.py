"""Terminal output: a table with colours on a terminal,
plain text (no ANSI escapes) anywhere else."""

import io

import pytest

from tpcheck.report.console import print_summary, progress_printer

ANSI = "\x1b["


def _case(name, verdict, expected, **extra):
    return {
        "name": name,
        "world_size": 2,
        "dtype": "float32",
        "verdict": verdict,
        "expected": expected,
        "as_expected": verdict == expected,
        "summary": f"{verdict}: summary of {name}",
        **extra,
    }


FIRST = {
    "stage": "backward",
    "step": 1,
    "name": "grad:x",
    "ranks": [0, 1],
    "error": 0.1,
    "bound": 1e-6,
    "kind": "calibrated",
}
RESULTS = [
    _case("equivalence", "equivalent", "equivalent", first_divergence=None),
    _case(
        "missing_backward_reduce",
        "not equivalent",
        "not equivalent",
        first_divergence=FIRST,
        diagnosis={
            "signature": "partial_sum",
            "cause": "input grad not all-reduced",
            "location": "gate_up",
            "stage": "backward",
            "step": 1,
            "ranks": [0, 1],
        },
    ),
    _case("broken_tp", "not equivalent", "equivalent", first_divergence=FIRST),
]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal_env(monkeypatch):
    """A colour terminal, whatever the environment the tests run in says."""
    for var in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "CI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "200")


def test_plain_output_has_no_ansi_escapes_and_names_everything(terminal_env):
    out = io.StringIO()
    print_summary(RESULTS, out)
    text = out.getvalue()
    assert ANSI not in text
    assert all(line == line.rstrip() for line in text.splitlines())  # no padding left in CI logs
    for r in RESULTS:
        assert r["name"] in text
    assert "grad:x (backward, step 1) ranks [0, 1]" in text  # first divergence column
    assert "partial_sum at gate_up" in text  # the diagnosis' signature and location, when present
    # what was expected, then what came: never "UNEXPECTED (equivalent)", which reads backwards
    assert "expected equivalent, got not equivalent" in text and "UNEXPECTED" not in text
    assert "broken_tp: not equivalent: summary of broken_tp" in text
    assert text.rstrip().endswith("2 of 3 case(s) as expected")


def test_terminal_output_is_coloured(terminal_env):
    out = FakeTTY()
    print_summary(RESULTS, out)
    text = out.getvalue()
    assert ANSI in text  # rich detected the terminal: the plain test above is not plain by accident
    assert "missing_backward_reduce" in text


def test_cause_of_an_unexpected_case_is_printed():
    diagnosed = dict(
        RESULTS[2], diagnosis={"signature": "scale", "cause": "bias added on every rank"}
    )
    out = io.StringIO()
    print_summary([diagnosed], out)
    assert "cause: bias added on every rank" in out.getvalue()
    assert "scale" in out.getvalue()


def test_hang_names_the_collective_it_waited_on():
    hang = _case(
        "some_ranks",
        "hang",
        "not equivalent",
        problems=[
            {
                "status": "hang",
                "rank": 0,
                "message": "timed out",
                "last_collective": ["all_reduce", "down", "forward"],
            }
        ],
    )
    out = io.StringIO()
    print_summary([hang], out)
    assert "waiting in all_reduce at down (forward)" in out.getvalue()


def test_progress_is_one_line_per_case_off_a_terminal(terminal_env):
    out = io.StringIO()
    progress = progress_printer(out)
    for i, r in enumerate(RESULTS):
        progress(i + 1, len(RESULTS), r)
    lines = out.getvalue().splitlines()
    assert lines == [
        "[1/3] equivalence: equivalent",
        "[2/3] missing_backward_reduce: not equivalent",
        "[3/3] broken_tp: not equivalent",
    ]


def test_progress_bar_on_a_terminal_finishes_and_restores_the_cursor(terminal_env):
    out = FakeTTY()
    progress = progress_printer(out)
    for i, r in enumerate(RESULTS):
        progress(i + 1, len(RESULTS), r)
    text = out.getvalue()
    assert "3/3" in text and "broken_tp: expected equivalent, got not equivalent" in text
    assert text.endswith("\x1b[?25h")  # stopped at the last case: the cursor is shown again
