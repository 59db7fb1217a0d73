"""examples/inference_llama.py: inference-only TP code as inference engines write it (weights that
do not require grad, `torch.inference_mode()`, the row-parallel all-reduce in a forward hook, a KV
cache in module buffers filled at `start_pos`) is checked forward only, chosen by itself and said; a
batch-mixing hook is caught in the prefill of step 1, a decode-path cache bug at decode step 2, each
beside its correct twin; broken forward-only checkers do not call a buggy case equivalent."""

from __future__ import annotations

import pytest

from mutants import records_zero, tolerance_times_1000
from tpcheck.api import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import forward_only
from tpcheck.checker.rank.compare import Comparator
from tpcheck.report.schema import build_report, load_schema
from tpcheck.report.validate import first_error

from paths import REPO

EX = REPO / "examples" / "inference_llama.py"
CASES = ("correct", "batch_mixing_hook", "decode_cache_offset", "batch_mixing_hook_one_sequence")


def _run(*names, dtype=None):
    return {
        (r["name"].split("/")[0] + "_").removeprefix("inference_llama_")[:-1] or "correct": r
        for r in check([file_spec(f"{EX}:{n}", 2, dtype=dtype) for n in names])
    }


def _first(result):
    f = result["first_divergence"]
    return f["stage"], f["step"], f["name"]


def _failed(result):
    return {c["name"] for c in result["checks"] if not c["passed"]}


def _assert_batch_mixing_caught(r):
    assert r["verdict"] == "not equivalent", r["summary"]
    assert _first(r) == ("forward", 1, "act:layers.0.attention.wo")
    assert r["first_divergence"]["ranks"] == [0, 1]


def _assert_decode_bug_caught(r):
    """Caught at decode step 2 of step 1: the prefill and decode step 1 are equivalent."""
    assert r["verdict"] == "not equivalent", r["summary"]
    stage, step, name = _first(r)
    assert (stage, step) == ("forward", 1) and name.endswith(":decode2"), name
    failed = _failed(r)
    assert "output:decode2" in failed and "output:decode3" in failed
    assert not [n for n in failed if not n.endswith((":decode2", ":decode3"))], failed


@pytest.fixture(scope="module")
def results():
    return _run(*CASES)


def test_correct_is_equivalent_checked_forward_only_and_says_why(results):
    ok = results["correct"]
    assert ok["verdict"] == "equivalent", ok["summary"]
    assert ok["forward_only"] == {
        "reason": "no TP parameter requires grad",
        "decode_steps": 3,
        "notes": [],
    }
    assert "forward only: no TP parameter requires grad" in ok["summary"]
    assert ok["spec"]["train"] is False  # what ran
    stages = {c["stage"] for c in ok["checks"]}
    # no target: no loss; nothing trained; the buffers (rotary tables, KV caches) as built
    assert stages == {"weights", "buffers", "forward", "replicas"}
    names = {c["name"] for c in ok["checks"]}
    for step_name in ("output", "output:decode1", "output:decode2", "output:decode3"):
        assert step_name in names
        # every module output of the plan, at every pass
        assert f"act:layers.1.attention.wo{step_name[6:]}" in names
    # every rank, both steps, every pass
    outputs = {
        (c["rank"], c["step"], c["name"])
        for c in ok["checks"]
        if c["name"].startswith("output") and c["stage"] == "forward"
    }
    assert len(outputs) == 2 * 2 * 4
    # the controls ran in the forward-only check too, every one flagged
    assert ok["self_test"]["controls"] > 0 and not ok["self_test"]["failures"]
    assert ok["self_test"]["flagged"] == ok["self_test"]["controls"]
    # the hooks' all-reduces are the user's own: the same on both ranks, all in forward
    assert set(ok["ledger"]["per_rank"]["0"]) == {"forward"}
    assert not ok["ledger"]["problems"]


def test_a_batch_mixing_hook_is_caught_in_the_prefill_of_step_1(results):
    _assert_batch_mixing_caught(results["batch_mixing_hook"])
    # the same bug with one sequence in the batch cannot show, and the report says so
    one = results["batch_mixing_hook_one_sequence"]
    assert one["verdict"] == "equivalent", one["summary"]
    assert one["forward_only"]["notes"] == [forward_only.ONE_SEQUENCE]
    assert "a bug that mixes the sequences of a batch cannot show" in one["summary"]


def test_a_decode_path_cache_bug_is_caught_at_decode_step_2(results):
    _assert_decode_bug_caught(results["decode_cache_offset"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_each_bug_is_caught_at_the_same_place_in_every_dtype(dtype):
    """The dtypes the catalogue runs, and float64: the correct twin passes, each bug is first seen
    where it is in float32."""
    by_case = _run("correct", "batch_mixing_hook", "decode_cache_offset", dtype=dtype)
    assert by_case["correct"]["verdict"] == "equivalent", by_case["correct"]["summary"]
    _assert_batch_mixing_caught(by_case["batch_mixing_hook"])
    _assert_decode_bug_caught(by_case["decode_cache_offset"])


def test_the_report_of_a_forward_only_case_is_valid_and_rendered(results):
    from tpcheck.report.html import render_html

    report = build_report(list(results.values()), exit_code=1)
    assert first_error(report, load_schema()) is None
    page = render_html(report)
    assert "Forward only: no TP parameter requires grad" in page
    assert "cannot show" in page


# -------------------------------------------------------------------------------- checker mutants


def _skips_decode(monkeypatch):
    """The decode passes never run: only each step's prefill is compared."""
    monkeypatch.setattr(forward_only.ForwardOnly, "of", _of_without_decoding)


def _of_without_decoding(case, tp):
    why = forward_only.reason(case, tp)
    if why is None:
        return None
    fo = forward_only.ForwardOnly(why, case.decode_steps)
    run = fo.run

    def run_prefill_only(engine):
        fo.decode_steps = 0
        run(engine)
        fo.decode_steps = case.decode_steps

    fo.run = run_prefill_only
    return fo


@pytest.mark.parametrize(
    "mutant", [_skips_decode, records_zero, tolerance_times_1000], ids=lambda m: m.__name__
)
def test_a_broken_forward_only_checker_ends_in_error(monkeypatch, mutant):
    """The manifest (every pass's output on every rank and step) and the controls hold in the
    forward-only check: a checker that skips the decode passes, records every error as 0 or widens
    every calibrated bound 1000 times makes the buggy case "error", never "equivalent"."""
    mutant(monkeypatch)
    r = _run("decode_cache_offset")["decode_cache_offset"]
    assert r["verdict"] == "error", r["summary"]
    assert r["summary"].startswith("the checker failed its control")
    if mutant is _skips_decode:
        assert (
            "no check of output:decode1 (forward, step 1) on rank 0" in r["self_test"]["failures"]
        )


def test_a_checker_comparing_the_reference_with_itself_ends_in_error(monkeypatch):
    """Every forward check compares the reference with itself: the controls go through that same
    comparison (a perturbed copy of the TP tensor), so they are judged by an error of 0 and not
    flagged, and the buggy cases end in "error", never "equivalent"."""
    compare = Comparator.compare

    def with_itself(self, stage, step, name, tp_local, dense, truth, placement, *a, **k):
        if stage == "forward":
            tp_local = placement.shard(dense, self.group.rank, self.group.world_size)
        return compare(self, stage, step, name, tp_local, dense, truth, placement, *a, **k)

    monkeypatch.setattr(Comparator, "compare", with_itself)
    r = _run("batch_mixing_hook", "decode_cache_offset")
    for case in ("batch_mixing_hook", "decode_cache_offset"):
        assert r[case]["verdict"] == "error", r[case]["summary"]
        said = r[case]["summary"]
        assert "control:" in said and "was judged by an error of 0, not its planted" in said
