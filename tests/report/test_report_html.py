"""The HTML report, read as text: self-contained, escaped, and showing what the run found."""

import base64
import copy
import dataclasses
import json
import re
import subprocess
import sys

import numpy as np

from tpcheck.report.html import render_html
from tpcheck.report.plots import CAP, heatmap_matrix, log_ratio

from report_helpers import REPO, tpcheck

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _images(page: str) -> list[bytes]:
    return [
        base64.b64decode(b)
        for b in re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    ]


def test_page_is_self_contained(seed_run):
    page = seed_run.html_path.read_text()
    assert page.startswith("<!DOCTYPE html>")
    # nothing fetched from a network
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:|//)""", page)
    assert "<script" not in page and "<link" not in page
    images = _images(page)
    # the heatmap's failing region and, folded, every check; 1 step: no curves
    assert len(images) == 2 and all(i.startswith(PNG_MAGIC) for i in images)


def test_page_shows_verdicts_diagnosis_and_ledger(seed_run):
    page = seed_run.html_path.read_text()
    report = seed_run.report
    for case in report["cases"]:
        assert f"<h3>{case['name']} " in page
    assert "3 of 3 case(s) as expected" in page
    assert page.count('class="v v-not-equivalent"') >= 2 and 'class="v v-equivalent"' in page
    assert "<h4>Diagnosis</h4>" in page and "partial_sum" in page
    assert "<h4>First divergent tensor</h4>" in page
    # the forward all-reduce the fault removed, in the ledger table and in the ledger check
    assert (
        "missing collective: all_reduce at &#x27;down&#x27; in forward: expected 1, issued 0"
        in page
    )


def test_heatmap_cells_say_which_tensors_diverged(seed_run):
    rows, cols, m = heatmap_matrix(seed_run.report["cases"])
    cell = {(r, c): m[i, j] for i, r in enumerate(rows) for j, c in enumerate(cols)}
    assert (
        cols.index("output")
        < cols.index("loss")
        < cols.index("grad:x")
        < cols.index("param:down.weight")
    )
    assert all(cell[("equivalence", c)] < 0 for c in cols)  # all inside the bound
    for c in ("output", "loss", "grad:x", "grad:down.weight", "param:down.weight"):
        assert cell[("missing_forward_reduce", c)] > 0, c
    # forward and TP-region grads fine
    for c in ("output", "loss", "grad:down.weight", "grad:gate_up.weight"):
        assert cell[("missing_backward_reduce", c)] < 0, c
    # upstream of the TP region: partial
    for c in ("grad:x", "grad:norm.weight", "param:norm.weight"):
        assert cell[("missing_backward_reduce", c)] > 0, c


def test_log_ratio_treats_exact_bounds_and_caps():
    assert log_ratio(1e-8, 1e-6) == -2.0
    assert log_ratio(0.0, 0.0) == -CAP  # exact and exactly equal
    assert log_ratio(1e-30, 0.0) == CAP  # exact and off by anything
    assert log_ratio(float("nan"), 1e-6) == CAP
    assert log_ratio(1e9, 1.0) == CAP


def test_multi_step_matrix_has_curves_and_a_hang_row(matrix_run):
    page = matrix_run.html_path.read_text()
    assert page.count("class=curves") == 3  # one per case that ran its steps (not the hang)
    assert all(i.startswith(PNG_MAGIC) for i in _images(page))
    rows, cols, m = heatmap_matrix(matrix_run.report["cases"])
    hang_row = [i for i, r in enumerate(rows) if r.endswith("collective_on_some_ranks")]
    assert len(hang_row) == 1 and np.isnan(m[hang_row[0]]).all()  # grey: never checked
    assert 'class="v v-hang"' in page and "Rank problems" in page


def test_all_text_is_escaped(seed_run):
    report = copy.deepcopy(seed_run.report)
    evil = "<script>alert('x')</script>"
    report["cases"][1]["name"] = evil
    report["cases"][1]["diagnosis"]["cause"] = evil
    report["cases"][1]["ledger_check"] = {"note": evil}  # an unknown key, shown as JSON
    page = render_html(report)
    assert "<script" not in page
    assert page.count(html_escaped := "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;") >= 3, (
        html_escaped
    )


def test_report_subcommand_renders_a_json_report(seed_run, tmp_path):
    out = tmp_path / "again.html"
    proc = tpcheck("report", str(seed_run.json_path), "--html", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"HTML report: {out}" in proc.stderr and "3 of 3 case(s) as expected" in proc.stderr
    assert "\x1b[" not in proc.stderr  # not a terminal: plain text
    assert "missing_backward_reduce" in out.read_text()


def test_report_subcommand_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something/2"}')
    proc = tpcheck("report", str(bad))
    assert (
        proc.returncode == 2 and "something/2" in proc.stderr and "tpcheck.report/1" in proc.stderr
    )
    proc = tpcheck("report", str(tmp_path / "missing.json"))
    assert proc.returncode == 2 and "missing.json" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_run_ends_with_summary_and_both_paths(seed_run):
    """What `make demo` runs: the table, the tally, then where the reports are."""
    lines = seed_run.proc.stderr.strip().splitlines()
    assert lines[-3] == "3 of 3 case(s) as expected"
    assert lines[-2] == f"JSON report: {seed_run.json_path}"
    assert lines[-1] == f"HTML report: {seed_run.html_path}"
    assert "\x1b[" not in seed_run.proc.stderr


def test_matplotlib_is_imported_only_for_html():
    code = (
        "import sys, tpcheck.cli, tpcheck.report.console, tpcheck.report.schema, "
        "tpcheck.report.html\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported without --html'\n"
        "from tpcheck.report import plots\nassert 'matplotlib' in sys.modules"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr


def test_page_shows_the_rng_placement_checks():
    """A run with dropout and the `rng_diverged` fault: the report validates, and the page lists
    every random draw with its mask placement, its rule and how many of its checks failed."""
    from tpcheck import CaseSpec, RunSettings, check, exit_code
    from tpcheck.faults import CATALOGUE
    from tpcheck.report.schema import build_report, load_schema
    from tpcheck.report.validate import first_error

    good = CaseSpec(
        block="layer",
        preset="tiny",
        overrides=(("dropout", 0.1), ("attention_dropout", 0.1)),
        run=RunSettings(steps=1),
    )
    results = check(
        [good, CATALOGUE["rng_diverged"].prepare(dataclasses.replace(good, fault="rng_diverged"))]
    )
    report = build_report(results, exit_code=exit_code(results))
    assert first_error(json.loads(json.dumps(report)), load_schema()) is None
    page = render_html(report)
    # the correct case and the faulty one
    assert page.count("<h4>Random masks (RNG placement)</h4>") == 2
    rows = re.findall(
        r"<tr><td>([^<]+)</td><td>([^<]+)</td><td>[^<]+</td><td class=num>(\d+)</td>"
        r"<td class='num( off)?'>(\d+)</td></tr>",
        page,
    )
    # 1 step x 2 micro-batches x 2 ranks
    assert ("attention.attn_dropout", "shard(dim=1)", "4", "", "0") in rows
    assert ("mlp.dropout", "replicate", "4", "", "0") in rows
    # the planted rank-seeded dropout
    assert ("attention.dropout", "replicate", "4", " off", "4") in rows
    assert "rng_diverged" in page


def test_page_shows_the_inferred_plan():
    """A case with no plan written: the page shows the plan tpcheck inferred, activations and the
    outputs it did not check included, as code; a case with a written plan shows none."""
    from tpcheck import check, exit_code
    from tpcheck.checker.casefile import file_spec
    from tpcheck.report.schema import build_report, load_schema
    from tpcheck.report.validate import first_error

    example = REPO / "examples" / "own_loader.py"
    results = check([file_spec(f"{example}:no_plan", 2), file_spec(f"{example}:correct", 2)])
    report = build_report(results, exit_code=exit_code(results))
    assert first_error(json.loads(json.dumps(report)), load_schema()) is None
    page = render_html(report)
    assert page.count("<h4>Plan inferred") == 1
    assert "1 module output(s) not checked" in page
    shown = re.search(r"<pre class=plan>(.*?)</pre>", page, re.S).group(1)
    assert "&#x27;fc1&#x27;: Shard(2)" in shown and "# not checked: fc2:" in shown


def test_warm_up_collectives_are_listed_and_not_held_to_the_expected_counts(seed_run):
    """The ledger's "warmup" phase (RunSettings.warmup): shown per rank with no expectation, never
    marked against the per-step counts (ranks that differ are the ledger check's to report)."""
    report = copy.deepcopy(seed_run.report)
    case = report["cases"][0]
    assert case["ledger"]["expected"]  # a built-in block: counts are held to the expectation
    for counts in case["ledger"]["per_rank"].values():
        counts["warmup"] = {"all_reduce": {"count": 4, "bytes": 64}}
    page = render_html(report)
    row = re.search(r"<tr><td>warmup</td><td>all_reduce</td>(.*?)</tr>", page).group(1)
    assert "num off" not in row and "<td class='num'>4</td>" in row
