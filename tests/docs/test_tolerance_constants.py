"""docs/tolerances.md#the-bounds-constants is the code's: the table between its two markers is what
`published.constants_table()` makes of checker/rank/tolerance.py's constants, the module's names are
the values its data (`BOUND_CONSTANTS`) gives, and the blind spot's constants, frozen apart from the
bound's, are the bound's published values. The tests at the end show that a page out of date, and a
constant changed in the code, are each seen."""

from __future__ import annotations

import pytest

from tpcheck.checker.rank import published, tolerance

from paths import REPO

PAGE = REPO / "docs" / "tolerances.md"


def test_the_page_holds_the_table_the_code_makes():
    page = PAGE.read_text()
    assert published.BEGIN in page and published.END in page
    assert published.section(page) == published.constants_table(), (
        "docs/tolerances.md's table of constants is out of date: run "
        "`python -m tpcheck.checker.rank.published --write`"
    )
    assert published.rewritten(page) == page


def test_the_modules_constants_are_its_data():
    for c in tolerance.BOUND_CONSTANTS:
        assert getattr(tolerance, c.name) == c.value, c.name
    assert len({c.name for c in tolerance.BOUND_CONSTANTS}) == len(tolerance.BOUND_CONSTANTS)


def test_the_blind_spot_is_frozen_at_the_published_bound():
    """The blind spot's own constants (never read from the bound's at run time) are the bound's
    published values: 8 x the dense error + 1 ulp from SMALL_NUMEL elements on, 16 x + 8 under."""
    value = {c.name: c.value for c in tolerance.BOUND_CONSTANTS}
    assert tolerance.BLIND_SPOT_FACTOR == {
        "large": value["MAX_FACTOR"],
        "small": value["SMALL_FACTOR"],
    }
    assert tolerance.BLIND_SPOT_ULPS == {
        "large": value["FLOOR_ULPS"],
        "small": value["SMALL_FLOOR_ULPS"],
    }
    assert tolerance.BLIND_SPOT_SMALL_NUMEL == value["SMALL_NUMEL"]


# ------------------------------------------------------------------ the checks can fail


def test_a_page_out_of_date_is_seen():
    page = PAGE.read_text()
    stale = page.replace("| `MAX_FACTOR` | 8 |", "| `MAX_FACTOR` | 9 |")
    assert stale != page
    assert published.section(stale) != published.constants_table()
    assert published.section("no markers here") == ""
    assert published.section(published.rewritten(stale)) == published.constants_table()


@pytest.mark.parametrize("name", ["MAX_FACTOR", "FP64_FLOOR_ULPS", "BLIND_SPOT_SMALL_NUMEL"])
def test_a_constant_changed_in_the_code_changes_the_table(monkeypatch, name):
    before = published.constants_table()
    monkeypatch.setattr(tolerance, name, 2 * getattr(tolerance, name) + 1)
    assert published.constants_table() != before
