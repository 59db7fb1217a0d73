"""The float64 run of a case (`RunSettings.float64_run`, checker/verdict/float64_run.py): after a
16-bit run the TP model runs again in float64 against the float64 truth, and the two verdicts merge.

The cases are OLMo-2-style attention written with plain torch.distributed calls
(case_files/qk_norm.py): q/k RMSNorm over the whole sharded projection, its statistics in float32
as HuggingFace computes them."""

import dataclasses
from pathlib import Path

import pytest

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.pool import session
from tpcheck.checker.rank import precision
from tpcheck.errors import UsageError

FILE = Path(__file__).parent / "case_files" / "qk_norm.py"
BF16 = RunSettings(dtype="bfloat16", steps=1, micro_batches=1)


def spec(name: str, run: RunSettings = BF16, **kw) -> CaseSpec:
    return CaseSpec(block=f"file:{FILE}:{name}", world_size=2, run=run, **kw)


@pytest.fixture(scope="module")
def results():
    """Each case once, with the float64 run (auto in bfloat16) and without it (today's)."""
    off = dataclasses.replace(BF16, float64_run="off")
    specs = [spec(n) for n in ("local_norm", "correct", "partial_1pct")]
    specs += [spec(n, off) for n in ("local_norm", "partial_1pct")]
    specs.append(spec("bf16_reduce", dataclasses.replace(BF16, dtype="float32", float64_run="on")))
    return dict(zip(specs, check(specs)))


def test_a_norm_over_the_local_shard_is_caught_in_float64_too_and_said_structural(results):
    r = results[spec("local_norm")]
    f64 = r["float64_run"]
    assert r["verdict"] == "not equivalent" and r["as_expected"] is False, r["summary"]
    assert f64["verdict"] == "not equivalent", f64["summary"]
    # at the norm itself, at float64's resolution: the bug acts in float64 as in bfloat16
    d = f64["first_divergence"]
    assert (d["name"], d["stage"], d["step"], d["kind"]) == ("act:q_norm", "forward", 1, "fp64")
    assert d["error"] > 1e6 * d["bound"]
    assert "not equivalent in the float64 run too: structural" in r["summary"]
    assert r["dtype"] == "bfloat16" and r["first_divergence"]["name"] == "act:q_norm"
    assert f64["self_test"]["controls"] == f64["self_test"]["flagged"] > 0


def test_near_bound_is_not_said_once_the_float64_run_fails(results):
    """In bfloat16 alone the local-shard norm reads as 'a tolerance question'; the float64 run shows
    it is structural, so the diagnosis says so instead."""
    alone = results[spec("local_norm", dataclasses.replace(BF16, float64_run="off"))]
    assert alone["diagnosis"]["signature"] == "near_bound" and "float64_run" not in alone
    merged = results[spec("local_norm")]["diagnosis"]
    assert merged["signature"] != "near_bound"
    assert "float64 run fails at this check: structural" in merged["cause"]
    assert "near_bound" not in results[spec("local_norm")]["summary"]


def test_the_correct_twin_is_equivalent_in_both_runs(results):
    r = results[spec("correct")]
    assert r["verdict"] == "equivalent" and r["as_expected"], r["summary"]
    f64 = r["float64_run"]
    assert f64["verdict"] == "equivalent" and f64["checks"] == len(r["checks"]) > 0
    assert "the float64 run too" in r["summary"] and f64["seconds"] > 0


def test_a_structural_bug_under_bfloat16_rounding_is_caught_only_in_float64(results):
    """1% on one rank's partial sum passes bfloat16 at tp 2: alone, 'equivalent'."""
    off = results[spec("partial_1pct", dataclasses.replace(BF16, float64_run="off"))]
    assert off["verdict"] == "equivalent", off["summary"]
    r = results[spec("partial_1pct")]
    assert r["verdict"] == "not equivalent", r["summary"]
    assert r["summary"].startswith("not equivalent only in the float64 run: a structural bug")
    assert r["first_divergence"] == r["float64_run"]["first_divergence"]
    assert r["first_divergence"]["kind"] == "fp64" and r["diagnosis"]["signature"] != "near_bound"


def test_a_bfloat16_and_a_float16_case_of_one_spec_share_one_float64_run(monkeypatch):
    """The float64 run does not depend on the working dtype: in one check it runs once for both,
    and the second case's record names the first; a case of another seed runs its own."""
    from tpcheck.checker.pool.launch import Launcher

    ran, run = [], Launcher.run

    def counted(self, spec):
        ran.append((spec.settings.dtype, spec.settings.seed))
        return run(self, spec)

    monkeypatch.setattr(Launcher, "run", counted)
    fp16 = dataclasses.replace(BF16, dtype="float16")
    specs = [
        spec("partial_1pct"),
        spec("partial_1pct", fp16),
        spec("partial_1pct", dataclasses.replace(fp16, seed=BF16.seed + 1)),
    ]
    bf, fp, other = check(specs)
    assert ran.count(("float64", BF16.seed)) == 1 and ran.count(("float64", BF16.seed + 1)) == 1
    assert "same_as" not in bf["float64_run"] and "same_as" not in other["float64_run"]
    assert fp["float64_run"]["same_as"] == bf["name"] and fp["name"] != bf["name"]
    assert bf["verdict"] == fp["verdict"] == other["verdict"] == "not equivalent", fp["summary"]
    shared = {k: v for k, v in fp["float64_run"].items() if k != "same_as"}
    assert shared == bf["float64_run"] and shared["verdict"] == "not equivalent"
    # merged into each case as its own: bfloat16's 1% is caught only there, float16's in both
    assert bf["summary"].startswith("not equivalent only in the float64 run")
    assert "in the float64 run too: structural" in fp["summary"]


def test_a_precision_specific_bug_is_caught_by_the_working_run_only(results):
    """Partial sums all-reduced in bfloat16 from a float32 model: the float64 run (asked for with
    "on") passes, the float32 run fails, and the summary says precision-specific."""
    r = results[spec("bf16_reduce", dataclasses.replace(BF16, dtype="float32", float64_run="on"))]
    assert r["verdict"] == "not equivalent", r["summary"]
    assert r["float64_run"]["verdict"] == "equivalent"
    assert "only in float32: precision-specific" in r["summary"]
    assert r["first_divergence"]["kind"] == "calibrated"


def test_off_is_todays_behaviour_and_float32_has_none_by_default(results):
    off = results[spec("local_norm", dataclasses.replace(BF16, float64_run="off"))]
    assert "float64_run" not in off and "float64" not in off["summary"]
    assert off["spec"]["float64_run"] == "off"
    assert not RunSettings(dtype="float32").wants_float64_run
    assert not RunSettings(dtype="float64", float64_run="on").wants_float64_run
    assert RunSettings(dtype="float16").wants_float64_run
    with pytest.raises(UsageError, match="float64_run 'yes' is not one of"):
        RunSettings(float64_run="yes")


def test_a_case_that_cannot_run_in_float64_gets_a_note_not_an_error():
    (r,) = check([spec("pinned", run=None)])  # its own settings: float32, float64_run="on"
    assert r["verdict"] == "equivalent" and r["as_expected"], r["summary"]
    why = r["float64_run"]["skipped"]
    assert "does not run in float64" in why and "same dtype" in why
    assert any(n.startswith("the float64 run: skipped") for n in r["notes"])
    assert "not checked: the float64 run: skipped" in r["summary"]


def test_the_float64_run_keeps_float64_through_the_models_own_float32_casts(monkeypatch):
    """Mutant: without `keep_float64`, the correct twin's float32 norm statistics, all-reduced in
    another order than the dense model's mean, differ by float32 rounding, far over the float64
    bound: the mutant is visibly caught (a false 'not equivalent', never a wrong 'equivalent')."""
    monkeypatch.setattr(precision.KeepFloat64, "__torch_function__", _plain)
    (r,) = check([spec("correct")])
    assert r["verdict"] == "not equivalent", r["summary"]
    assert r["float64_run"]["verdict"] == "not equivalent"
    assert r["float64_run"]["first_divergence"]["error"] < 1e-5  # float32 rounding, not a bug


def _plain(self, func, types, args=(), kwargs=None):
    return func(*args, **(kwargs or {}))


def test_a_float64_run_that_did_not_run_in_float64_is_an_error(monkeypatch):
    """Mutant: the follow-up spec keeps the working dtype, so the 1% bug would pass both runs; the
    ranks' own record of their dtype turns it into "error"."""
    real = session.float64_spec

    def same_dtype(spec, result):
        follow = real(spec, result)
        return follow and dataclasses.replace(follow, run=result.run)

    monkeypatch.setattr(session, "float64_spec", same_dtype)
    (r,) = check([spec("partial_1pct")])
    assert r["verdict"] == "error" and "float64 run ran in bfloat16" in r["summary"], r["summary"]


@pytest.mark.parametrize("flag", ["auto", "off"])
def test_the_cli_flag_and_the_report_json_console_and_html(tmp_path, capsys, flag):
    import json

    import jsonschema

    from tpcheck.cli import main
    from tpcheck.report.schema import load_schema
    from tpcheck.report.validate import first_error

    out, page = tmp_path / "r.json", tmp_path / "r.html"
    argv = ["verify", f"{FILE}:local_norm", "--world-size", "2", "--float64-run", flag]
    assert main([*argv, "--json", str(out), "--html", str(page)]) == 1
    report = json.loads(out.read_text())
    jsonschema.validate(report, load_schema())
    assert first_error(report, load_schema()) is None
    (case,) = report["cases"]
    assert case["spec"]["float64_run"] == flag and case["dtype"] == "bfloat16"
    shown = "float64 run: not equivalent, first at act:q_norm (forward, step 1)"
    if flag == "off":
        assert "float64_run" not in case and "float64 run" not in page.read_text()
        return
    assert case["float64_run"]["verdict"] == "not equivalent"
    assert shown in capsys.readouterr().err and shown in page.read_text()


@pytest.mark.slow
def test_under_torchrun_every_rank_runs_the_float64_run_rank_0_decides(tmp_path):
    """torchrun: only rank 0 holds the working run's result; it shares the float64 run's spec, so
    every rank runs it (else they would part at their next collective)."""
    import json
    import os
    import subprocess
    import sys

    report = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "tpcheck", "torchrun", "--nproc_per_node", "2", "--", "verify"]
    cmd += [f"{FILE}:partial_1pct", f"{FILE}:correct", "--world-size", "2", "--json", str(report)]
    src = str(Path(__file__).resolve().parents[2] / "src")  # this checkout's tpcheck on the ranks
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr
    cases = {c["name"]: c for c in json.loads(report.read_text())["cases"]}
    buggy, twin = (
        cases["olmo2_qk_norm_partial_1pct/tp2/bfloat16"],
        cases["olmo2_qk_norm/tp2/bfloat16"],
    )
    assert buggy["summary"].startswith("not equivalent only in the float64 run"), buggy["summary"]
    assert twin["verdict"] == twin["float64_run"]["verdict"] == "equivalent", twin["summary"]
