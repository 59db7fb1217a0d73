"""The self-test can fail where it matters: on every rank, at every stage and step, a control (a
copy of the reference with one element moved by a known amount) goes through the same compare ->
bound -> merge -> verdict path as the real tensors. Broken checkers (mutants of that path) turn a
buggy case's run into verdict "error" (exit 3) saying the checker failed its control; the real
checker does not."""

import dataclasses

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
from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.verdict import result as result_module

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
# each with the catalogue fault it hid: five turned it into "equivalent" with every control flagged
# (reference_vs_itself, steps_after_first_dropped, verdict_reads_rank_0 on a bug rank 1 alone sees,
# dense_error_times_1000 and factor_times_50 on a float32 bug at 5e-6, floor_16bit_times_64 on a
# float16 bug at 3%); replicas_not_compared and activations_not_compared left every control flagged
# while whole stages went unchecked (their faults are still seen elsewhere, unlocalized).
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
