"""The self-test can fail where it matters: on every rank, at every stage and step, a control (a
copy of the reference with one element moved by a known amount) goes through the same compare ->
bound -> merge -> verdict path as the real tensors. Broken checkers (mutants of that path) turn a
buggy case's run into verdict "error" (exit 3) saying the checker failed its control; the real
checker does not."""

import dataclasses

import numpy as np
import pytest
import torch

from mutants import (
    activations_not_compared,
    dense_error_times_1000,
    factor_times_50,
    floor_16bit_times_64,
    records_zero,
    reference_vs_itself,
    replicas_not_compared,
    steps_after_first_dropped,
    tolerance_times_1000,
    verdict_reads_rank_0,
)
from tpcheck import CaseSpec, check, exit_code
from tpcheck.checker.checkid import CheckId
from tpcheck.checker.payload import Check
from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.verdict import result as result_module

from paths import REPO

# a bug at the bound's scale (one rank's partial sum 3% off) and its correct twin, at world 2
BUGGY = CaseSpec(block="mlp", preset="tiny", world_size=2, fault="partial_sum_off_by_3pct")
CORRECT = dataclasses.replace(BUGGY, fault=None)
STAGES = {"weights", "forward", "loss", "backward", "grads", "optimizer", "replicas"}


def _factor_times_1000(monkeypatch):
    factor = tolerance.factor
    monkeypatch.setattr(tolerance, "factor", lambda *args: 1000 * factor(*args))


def _ranks_above_0_pass(monkeypatch):
    judge = result_module.judge
    monkeypatch.setattr(result_module, "judge", lambda c: c.rank > 0 or judge(c))


def _evidence_dropped(monkeypatch):
    monkeypatch.setattr(Comparator, "_keep_evidence", lambda self, *args, **kwargs: None)


MUTANTS = [
    records_zero,
    tolerance_times_1000,
    _factor_times_1000,
    _ranks_above_0_pass,
    _evidence_dropped,
]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__.strip("_"))
def test_a_broken_checker_ends_in_error_not_a_verdict(monkeypatch, mutant):
    mutant(monkeypatch)
    results = check([BUGGY, CORRECT])
    for r in results:
        assert r["verdict"] == "error", (mutant.__name__, r["summary"])
        assert r["summary"].startswith("the checker failed its control"), r["summary"]
        assert r["self_test"]["failures"]
    assert exit_code(results) == 3


def test_the_real_checker_passes_its_controls_on_every_rank_stage_and_step():
    buggy, correct = check([BUGGY, CORRECT])
    assert buggy["verdict"] == "not equivalent" and buggy["as_expected"], buggy["summary"]
    assert correct["verdict"] == "equivalent" and correct["as_expected"], correct["summary"]
    for r in (buggy, correct):
        st = r["self_test"]
        assert st["failures"] == [] and st["skipped"] == [] and st["controls"] == st["flagged"] > 0
        # every (rank, stage, step) with checks has its own control (self_test would list it
        # otherwise), and every stage is represented
        assert {c["stage"] for c in r["checks"]} == STAGES
        # controls are not checks
        assert not any(c["name"].startswith("control:") for c in r["checks"])


def test_a_control_that_is_not_flagged_names_where(monkeypatch):
    """Only float64 bounds are loosened (x 1e6, far above the float64 control's 1e-8 relative
    shift): a float64 run ends in "error" and the message names the control that was not flagged."""
    calibrated = tolerance.calibrated

    def loose_in_float64(dense, truth, dtype, world):
        bound = calibrated(dense, truth, dtype, world)
        return (
            dataclasses.replace(bound, value=bound.value * 1e6) if dtype == torch.float64 else bound
        )

    monkeypatch.setattr(tolerance, "calibrated", loose_in_float64)
    (r,) = check([CORRECT.with_run(dtype="float64")])
    assert r["verdict"] == "error"
    assert "control:" in r["summary"] and "was not flagged" in r["summary"]


# Mutants that passed the self-test while it stood apart from the comparison (a control planted on
# the reference, no manifest, its own reading of the failures, skips on the bound's own numbers),
# each with the catalogue fault it hid: six turned it into "equivalent" with every control flagged
# (reference_vs_itself, steps_after_first_dropped, verdict_reads_rank_0 on a bug rank 1 alone sees,
# dense_error_times_1000 and factor_times_50 on a float32 bug at 5e-6, floor_16bit_times_64 on a
# float16 bug at 3%); replicas_not_compared and activations_not_compared left every control flagged
# while whole stages went unchecked (their faults are still seen by other checks).
HIDDEN = [
    (reference_vs_itself, "partial_sum_off_by_3pct", "float32"),
    (steps_after_first_dropped, "weight_cached_at_first_forward", "float32"),
    (verdict_reads_rank_0, "lr_times_world_on_last_rank", "float32"),
    (dense_error_times_1000, "norm_eps_differs", "float32"),
    (factor_times_50, "norm_eps_differs", "float32"),
    (replicas_not_compared, "optimizer_differs_across_ranks", "float32"),
    (floor_16bit_times_64, "partial_sum_off_by_3pct", "float16"),
    (activations_not_compared, "partial_sum_off_by_3pct", "float32"),
]


def _buggy(fault: str, dtype: str) -> CaseSpec:
    return CaseSpec(block="mlp", preset="tiny", world_size=2, fault=fault).with_run(dtype=dtype)


@pytest.mark.parametrize("mutant, fault, dtype", HIDDEN, ids=lambda v: getattr(v, "__name__", v))
def test_a_mutant_that_hid_a_caught_bug_ends_in_error(monkeypatch, mutant, fault, dtype):
    mutant(monkeypatch)
    buggy = _buggy(fault, dtype)
    results = check([buggy, dataclasses.replace(buggy, fault=None)])
    for r in results:
        assert r["verdict"] == "error", (mutant.__name__, r["summary"])
        assert r["summary"].startswith("the checker failed its control"), r["summary"]
    assert exit_code(results) == 3


def test_the_real_checker_catches_each_hidden_bug_and_passes_its_twin():
    buggy = list(dict.fromkeys(_buggy(fault, dtype) for _, fault, dtype in HIDDEN))
    results = check(buggy + [dataclasses.replace(b, fault=None) for b in buggy])
    by_fault = dict(zip([(b.fault, b.run.dtype) for b in buggy], results))
    for r in results:
        assert r["verdict"] == r["expected"] and r["as_expected"], r["summary"]
        assert r["self_test"]["failures"] == [] and r["self_test"]["manifest"] > 0
    # what made the mutants' bugs hideable: seen by rank 1 alone, first at step 2
    ranks = {c["rank"] for c in by_fault["lr_times_world_on_last_rank", "float32"]["checks"]}
    failing = by_fault["lr_times_world_on_last_rank", "float32"]["checks"]
    assert ranks == {0, 1} and {c["rank"] for c in failing if not c["passed"]} == {1}
    assert by_fault["weight_cached_at_first_forward", "float32"]["first_divergence"]["step"] == 2


def _check(name="act:a", **kw) -> Check:
    """A check named as the report names it (`control:` before a control's name)."""
    base = dict(stage="forward", step=1, rank=0, error=0.0, diff_vs_dense=0.0)
    base.update(bound=1.0, kind="calibrated", reason="", passed=True)
    return Check(id=CheckId.parse(name), **{**base, **kw})


def test_an_unflagged_control_is_excused_only_by_the_dense_error_measured_apart():
    """An ill-conditioned tensor's control (`blind`: rank 0's own measure) is skipped; any other
    unflagged control, whatever its bound's ref_error says, is a failure."""
    real = _check()
    excused = _check(name="control:act:a", ref_error=10.0, blind="ill-conditioned")
    unexcused = _check(name="control:act:b", rank=1, ref_error=10.0)
    st = result_module.self_test([real, _check(rank=1)], [excused, unexcused], [{}, {}])
    assert st.skipped == ["control:act:a (forward, step 1, rank 0): ill-conditioned"]
    assert st.failures == [
        "a planted error of 0 in control:act:b (forward, step 1, rank 1) was not flagged (bound 1)"
    ]


def test_a_control_the_verdict_did_not_read_as_failed_is_not_flagged():
    """The self-test reads the failures the verdict reads (`failing`), not a judgement of its
    own: a failed control left out of that list is unflagged."""
    control = _check(name="control:act:a", error=2.0, passed=False, planted=2.0)
    kept = {"tp": np.array([2.0]), "ref": np.zeros(1)}
    evidence = [{("forward", 1, CheckId.parse("control:act:a")): kept}]
    read = result_module.self_test([_check()], [control], evidence, [control])
    assert read.failures == [] and read.flagged == 1
    unread = result_module.self_test([_check()], [control], evidence, [])
    assert unread.flagged == 0 and "was not flagged" in unread.failures[0]


def test_the_manifest_counts_every_micro_batch_on_every_rank():
    checks = [_check(name="output"), _check(name="output"), _check(name="output", rank=1)]
    output, loss = CheckId("output"), CheckId("loss")
    manifests = [(0, [["forward", 1, output, 2]]), (1, [["forward", 1, output, 2]]), (2, None)]
    assert result_module.missing_checks(checks, manifests) == [
        "1 check(s) of output (forward, step 1) on rank 1 where 2 were due (one per micro-batch)",
        "no manifest from rank 2: what it compared cannot be held to the plan",
    ]
    assert result_module.missing_checks(checks, [(0, [["loss", 1, loss, 1]])]) == [
        "no check of loss (loss, step 1) on rank 0"
    ]


F16 = REPO / "tests" / "checker" / "verdict" / "case_files" / "float16_range.py"


def test_a_float16_activation_past_half_the_range_plants_finite_controls():
    """One module output reaches ~4e4 (above 32752): a control planted at 1.0x its scale overflowed
    to inf and the correct case ended in "error"; the controls now stay finite and are flagged."""
    (r,) = check([CaseSpec(block=f"file:{F16}:near_range", world_size=2)])
    assert r["verdict"] == "equivalent", r["summary"]
    st = r["self_test"]
    assert st["failures"] == [] and st["controls"] == st["flagged"] > 0
    amp = [c for c in r["checks"] if c["name"] == "act:amp" and c["stage"] == "forward"]
    assert amp and all(c["error"] <= c["bound"] for c in amp)


def test_a_float16_overflow_with_master_weights_does_not_blame_adamw():
    """The dense float16 model itself overflows (bad input, exit 2): the message says float16
    overflows, and, the run stepping float32 masters, not that pure float16 AdamW is the cause."""
    (r,) = check([CaseSpec(block=f"file:{F16}:overflowing", world_size=2)])
    assert r["verdict"] == "invalid", r["summary"]
    assert "float16 overflows past 65504" in r["summary"], r["summary"]
    assert "AdamW" not in r["summary"] and "master" not in r["summary"], r["summary"]
