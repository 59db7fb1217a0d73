"""What a reader sees in the HTML report, read as text: the ledger of user code, the per-step plot's
legend, the HF sweep's one table, the heatmap's panels, tables that scroll, with headers."""

import re
import struct
import warnings

import pytest

from tpcheck.report import plots
from tpcheck.report.html import MANY_CASES, MAX_CURVES, render_html

from report_helpers import (
    hf_sweep_report,
    synthetic_case,
    synthetic_report,
    user_code_ledger,
    wide_report,
)


def _tables(page: str) -> list[str]:
    return re.findall(r"<table[^>]*>.*?</table>", page, re.S)


def _ledger_table(page: str) -> str:
    return re.search(r"<table class=ledger>.*?</table>", page, re.S).group(0)


def _png_size(uri: str) -> tuple[int, int]:
    import base64

    data = base64.b64decode(uri.split(",", 1)[1])
    return struct.unpack(">II", data[16:24])


# ------------------------------------------------------------------------------ 1. the ledger


def test_user_code_ledger_shows_no_expectation_and_nothing_marked_when_ranks_agree():
    case = synthetic_case("own_mlp/tp2/float32")
    case["ledger"] = user_code_ledger()
    table = _ledger_table(render_html(synthetic_report([case])))
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]
    assert len(rows) == 3
    for row in rows:
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        assert cells[2:4] == ["—", "—"], cells  # no expectation given: not `expected 0`
    assert " off" not in table  # the ranks agree: nothing red
    assert ">0<" not in table  # the all_gather has no byte count: "—", not 0
    assert "<td class=none>—</td>" in table


def test_user_code_ledger_marks_what_differs_between_ranks():
    case = synthetic_case("own_mlp/tp2/float32")
    case["ledger"] = user_code_ledger(asymmetric=True)
    page = render_html(synthetic_report([case]))
    table = _ledger_table(page)
    marked = re.findall(r"<td class='num off' title='([^']+)'>(\d+)</td>", table)
    # forward: rank 0 issued 4, rank 1 none; backward all_reduce 4 vs 3; all_gather agrees
    assert ("no collective here on this rank", "0") in marked
    assert ("ranks differ", "3") in marked and len(marked) == 4
    assert "Ranks differ:</b> forward all_reduce (rank 0: 4, rank 1: 0)" in page


def test_block_ledger_still_marks_counts_off_the_expectation(seed_run):
    page = seed_run.html_path.read_text()
    assert "title='expected 1'" in page  # the forward all-reduce the fault removed
    assert "<td class=none>—</td><td class=none>—</td>" not in page  # expectations shown


# ------------------------------------------------------------------------------ 2. the step plot


def test_step_plot_legend_names_each_line_once():
    case = synthetic_case("many", columns=40, failing=True)
    fig = plots.curves_figure(case)
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(texts) == len(set(texts)), texts
    assert len(texts) <= plots.MAX_LEGEND + 2  # the named ones, the rest, the bound
    assert any(t.startswith("28 other tensor(s)") for t in texts), texts
    assert "bound" in texts
    # the tensors past their bound are the ones named
    failing = {c["name"] for c in case["checks"] if not c["passed"]}
    assert failing <= set(texts)
    few = plots.curves_figure(synthetic_case("few", columns=5))
    texts = [t.get_text() for t in few.axes[0].get_legend().get_texts()]
    assert len(texts) == len(set(texts)) == 6  # every tensor and the bound


def test_the_step_plot_draws_only_the_tensors_that_moved():
    """A tensor whose figure is the same at every step (an exact match pinned at the floor) adds
    nothing to a per-step plot: left out; a case where nothing moved has no plot at all."""
    case = synthetic_case("moving", columns=6)
    still = [c for c in case["checks"] if c["name"] != "act:layers.0.mlp"]
    for c in still:  # every tensor but one pinned: its step 1 figure at every step
        c["error"] = next(
            d["error"]
            for d in still
            if (d["name"], d["step"], d["rank"]) == (c["name"], 1, c["rank"])
        )
    assert list(plots.step_curves(case)) == ["act:layers.0.mlp"]
    page = render_html(synthetic_report([case]))
    assert page.count("class=curves") == 1
    for c in case["checks"]:
        c["error"] = 1e-8
    assert plots.step_curves(case) == {}
    assert "class=curves" not in render_html(synthetic_report([case]))


# 30 cases repeat the path of one at scale: in the slow suite
@pytest.mark.parametrize("n_cases", [1, pytest.param(30, marks=pytest.mark.slow)])
def test_rendering_emits_no_warning(n_cases, capsys):
    cases = [
        synthetic_case(f"case_{i}/tp2/float32", columns=10 + i, failing=i % 3 == 0)
        for i in range(n_cases)
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        page = render_html(synthetic_report(cases))
    assert not caught, [str(w.message) for w in caught]
    out = capsys.readouterr()
    assert "warn" not in (out.out + out.err).lower(), out
    assert page.count("class=curves") == min(n_cases, MAX_CURVES)


def test_a_page_of_many_cases_stays_small_and_says_what_it_left_out():
    """A sweep's page: more cases than MANY_CASES and more tensors than MAX_COLUMNS. The heatmap is
    drawn by stage (its cell the worst check of the stage, so a failure still shows red), the
    cases as expected get a brief section (no curves); a traceback two ranks share is shown
    once. A page of few cases keeps every
    tensor's column (the mutant: by stage always)."""
    cases = [synthetic_case(f"arch_{i}/tp2/float32", columns=8) for i in range(MANY_CASES + 2)]
    for i, c in enumerate(cases):  # each model its own tensors, as a sweep's are
        for check in c["checks"]:
            check["name"] = f"{check['name']}.m{i}"
    bad = cases[-1]
    bad.update(as_expected=False, verdict="error", summary="raised")
    bad["problems"] = [
        {"rank": r, "status": "raised", "message": "boom", "traceback": "Traceback\n  x\n"}
        for r in (0, 1)
    ]
    bad["checks"][0].update(error=1.0, passed=False)
    page = render_html(synthetic_report(cases))
    assert "Error relative to bound, by stage" in page and "stage:forward" not in page
    assert page.count("As expected; its inferred plan") == MANY_CASES + 1
    assert page.count("class=curves") == 1  # the one full section, the failed case's
    assert page.count("<summary>traceback</summary>") == 1
    assert "traceback: the same as rank 0" in page
    (row,) = plots.by_stage([bad])
    worst = max(plots.heatmap_matrix([row])[2][0])
    assert worst == plots.CAP  # the failure is the stage's cell
    few = render_html(synthetic_report(cases[:3]))
    assert "Error relative to bound, by stage" not in few
    assert "As expected; its inferred plan" not in few


# ------------------------------------------------------------------------------ 3. the HF sweep


def test_hf_sweep_is_one_table_and_says_passed_not_stored():
    page = render_html(hf_sweep_report())
    assert "id=sweep" in page and "id=summary" not in page and "<h2>Summary</h2>" not in page
    sweep = re.search(r"<table id=sweep>.*?</table>", page, re.S).group(0)
    rows = re.findall(r"<tr>(.*?)</tr>", sweep, re.S)
    llama, qwen, gpt2 = rows[1:]
    assert "passed, not stored" in llama and "passed, not stored" not in qwen
    assert "href='#case-0'" in llama and "href='#case-1'" in qwen
    reason = re.findall(r"<td[^>]*>(.*?)</td>", qwen)[-1]
    assert "replicated_with_grad_allreduce" in reason
    assert "<code>docs/findings/hf-replicated-grad-allreduce-accumulation.md</code>" in reason
    assert re.findall(r"<td[^>]*>(.*?)</td>", gpt2)[-1] == "no TP plan"
    # the heatmap does not draw llama as "not checked": it is listed as passed, not stored
    assert "Passed, not stored" in page and "hf:llama/tp2/float32</p>" in page
    rows_drawn, _, _ = plots.heatmap_matrix(hf_sweep_report()["cases"][1:])
    assert rows_drawn == ["hf:qwen3/tp2/float32"]
    assert "Checks: 24 passed, not stored" in page  # llama's case section
    assert ">0</td>" not in _ledger_table(page)  # the all_gather has no byte count


# ------------------------------------------------------------------------------ 4. the heatmap


def test_heatmap_panels_keep_stages_together_and_fit_the_page():
    cases = wide_report()["cases"][:1]  # one block, 50 tensors
    rows, cols, _ = plots.heatmap_matrix(cases)
    assert len(cols) == 50
    place = plots.column_stages(cases)
    stages = [place[c][2] for c in cols]
    panels = plots.column_panels(cols, stages, 16)
    assert sorted(j for p in panels for j in p) == list(range(50))
    assert all(len(p) <= 16 for p in panels)
    # a stage is split only where it is wider than a panel
    for stage in set(stages):
        holding = [k for k, p in enumerate(panels) if any(stages[j] == stage for j in p)]
        width = stages.count(stage)
        assert len(holding) <= -(-width // 16) + 1, (stage, holding)
    width, height = _png_size(plots.heatmap_png(cases))
    assert width <= 1200 and height > 300, (width, height)  # no squeezing into 1280 px


def test_heatmap_of_a_small_run_is_one_panel():
    assert plots.column_panels(["a", "b", "c"], ["forward", "loss", "grads"], 20) == [[0, 1, 2]]


# ------------------------------------------------------------------------------ 5. the tables


@pytest.mark.parametrize("make", [wide_report, hf_sweep_report])
def test_every_table_scrolls_in_a_wrapper_and_every_column_has_a_header(make):
    page = render_html(make())
    assert ".wrap{overflow-x:auto" in page
    assert page.count("<table") == page.count("<div class=wrap><table")
    for table in _tables(page):
        rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
        heads = re.findall(r"<th>(.*?)</th>", rows[0])
        assert all(h.strip() for h in heads), heads  # no empty header
        widest = max(len(re.findall(r"<td[ >]", r)) for r in rows[1:])
        assert len(heads) == widest, table[:300]


def test_seed_page_tables_have_headers(seed_run):
    page = seed_run.html_path.read_text()
    assert "<th></th>" not in page and "<th>as expected</th>" in page
    assert page.count("<table") == page.count("<div class=wrap><table")
