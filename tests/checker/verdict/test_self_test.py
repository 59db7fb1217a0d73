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
    bin_errors_zero,
    bound_from_the_tp_side,
    dense_error_times_1000,
    factor_constants_times_50,
    factor_times_50,
    float64_run_failures_dropped,
    float64_run_ignored,
    float64_run_never_runs,
    floor_16bit_times_64,
    records_zero,
    reference_vs_itself,
    replay_update_is_the_tp_sides,
    replicas_not_compared,
    replicas_only_control,
    self_test_reads_rank_0,
    steps_after_first_dropped,
    tolerance_times_1000,
    verdict_list_rank_0,
    verdict_reads_rank_0,
)
from tpcheck import CaseSpec, check, exit_code
from tpcheck.checker.checkid import CheckId
from tpcheck.checker.payload import Check
from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.verdict import result as result_module
from tpcheck.checker.verdict import selftest
from tpcheck.checker.verdict.divergence import SelfTest
from tpcheck.checker.verdict.result import CaseResult
from tpcheck.checker.verdict.selftest import Reading, read_failures
from tpcheck.faults.detectability import Probe

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


# Mutants of the comparison path, each with a catalogue fault it hides where the self-test does not
# see it (the self-test then ends the run in "error"). Each of these turned that fault into
# "equivalent" with every control flagged while the self-test stood apart from the comparison (a
# control planted on the reference, no manifest, its own reading of the failures, an excuse made of
# the bound's own constants): reference_vs_itself, steps_after_first_dropped, verdict_reads_rank_0
# and verdict_list_rank_0 on a bug rank 1 alone sees, dense_error_times_1000, factor_times_50 and
# factor_constants_times_50 on a float32 bug at 5e-6, floor_16bit_times_64 on a float16 bug at 3%;
# replicas_not_compared and activations_not_compared left every control flagged while whole stages
# went unchecked (their faults are still seen by other checks). bound_from_the_tp_side hides its
# fault from every check; self_test_reads_rank_0 and replicas_only_control blind the self-test
# without touching the verdict. The last column: the correct twin's verdict under the mutant
# ("equivalent" where the mutant acts only on failures of real checks: the twin has none).
HIDDEN = [
    (reference_vs_itself, "partial_sum_off_by_3pct", "float32", "error"),
    (steps_after_first_dropped, "weight_cached_at_first_forward", "float32", "error"),
    (verdict_reads_rank_0, "lr_times_world_on_last_rank", "float32", "error"),
    (verdict_list_rank_0, "lr_times_world_on_last_rank", "float32", "equivalent"),
    (self_test_reads_rank_0, "lr_times_world_on_last_rank", "float32", "error"),
    (dense_error_times_1000, "norm_eps_differs", "float32", "error"),
    (factor_times_50, "norm_eps_differs", "float32", "error"),
    (factor_constants_times_50, "norm_eps_differs", "float32", "error"),
    (bound_from_the_tp_side, "partial_sum_off_by_3pct", "float32", "equivalent"),
    (replicas_not_compared, "optimizer_differs_across_ranks", "float32", "error"),
    (replicas_only_control, "partial_sum_off_by_3pct", "float32", "error"),
    (floor_16bit_times_64, "partial_sum_off_by_3pct", "float16", "error"),
    (activations_not_compared, "partial_sum_off_by_3pct", "float32", "error"),
]


def _buggy(fault: str, dtype: str) -> CaseSpec:
    return CaseSpec(block="mlp", preset="tiny", world_size=2, fault=fault).with_run(dtype=dtype)


@pytest.mark.parametrize(
    "mutant, fault, dtype, twin", HIDDEN, ids=lambda v: getattr(v, "__name__", None)
)
def test_a_mutant_that_hid_a_caught_bug_ends_in_error(monkeypatch, mutant, fault, dtype, twin):
    mutant(monkeypatch)
    buggy = _buggy(fault, dtype)
    r, correct = check([buggy, dataclasses.replace(buggy, fault=None)])
    assert r["verdict"] == "error", (mutant.__name__, r["summary"])
    assert r["summary"].startswith("the checker failed its control"), r["summary"]
    assert correct["verdict"] == twin, (mutant.__name__, correct["summary"])
    assert exit_code([r, correct]) == 3


def test_the_real_checker_catches_each_hidden_bug_and_passes_its_twin():
    buggy = list(dict.fromkeys(_buggy(fault, dtype) for _, fault, dtype, _ in HIDDEN))
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


# The float64 run's mutants, on a bug only the float64 run sees (one rank's partial sum 1% off in
# bfloat16 at world 2: under bfloat16's own bounds). The float64 run merged as a record whose
# verdict never reaches the case, or never run at all, is caught where the case is read
# (`result.held_to_float64_run`); its failures dropped inside the float64 run, by its own
# self-test there.
BELOW_BFLOAT16 = Probe("partial", "bfloat16", 2, 0.01, 1)
FLOAT64_MUTANTS = [
    (float64_run_ignored, "the float64 run its bfloat16 settings want did not pass", "equivalent"),
    (float64_run_never_runs, "none was recorded", "error"),
    (float64_run_failures_dropped, "error in the float64 run: the checker failed its", "error"),
]


def _bfloat16_pair() -> list[CaseSpec]:
    correct = CaseSpec(block="mlp", preset="tiny", world_size=2).with_run(dtype="bfloat16")
    return [BELOW_BFLOAT16.spec(), correct]


@pytest.mark.parametrize(
    "mutant, said, twin", FLOAT64_MUTANTS, ids=lambda v: getattr(v, "__name__", None)
)
def test_a_float64_run_mutant_ends_in_error_naming_the_float64_run(monkeypatch, mutant, said, twin):
    mutant(monkeypatch)
    r, correct = check(_bfloat16_pair())
    assert r["verdict"] == "error" and said in r["summary"], (mutant.__name__, r["summary"])
    assert correct["verdict"] == twin, (mutant.__name__, correct["summary"])
    assert exit_code([r, correct]) == 3


def test_the_real_checker_catches_the_bug_below_bfloat16_in_its_float64_run_only():
    r, correct = check(_bfloat16_pair())
    assert r["verdict"] == "not equivalent", r["summary"]
    assert r["summary"].startswith("not equivalent only in the float64 run"), r["summary"]
    assert r["float64_run"]["verdict"] == "not equivalent"
    assert correct["verdict"] == "equivalent", correct["summary"]
    assert correct["float64_run"]["verdict"] == "equivalent"


# The optimizer replay's mutant: its update the TP side's own, so the bitwise update check compares
# TP with itself. An lr 1 + 1e-6 times too large on the last rank (under every calibrated bound:
# only the bitwise replay sees it) then passes with every control flagged: a control planted on
# the compared TP tensor goes through the comparison, not through the replay that made the
# reference. Seeing it takes a control of the replay itself (the dense rule re-run on a planted
# input, its update held to move), in the optimizer stage.
TINY_LR_BUG = Probe("lr", "float32", 2, 1e-6, 1, float64_run="off")


def test_a_replay_that_returns_the_tp_update_ends_in_error(monkeypatch):
    replay_update_is_the_tp_sides(monkeypatch)
    (r,) = check([TINY_LR_BUG.spec()])
    assert r["verdict"] == "error", r["summary"]


def test_the_real_checker_catches_the_lr_bug_only_the_replay_sees():
    (r,) = check([TINY_LR_BUG.spec()])
    assert r["verdict"] == "not equivalent", r["summary"]
    failed = {c["name"].split(":")[0] for c in r["checks"] if not c["passed"]}
    assert failed == {"update"}, failed


def test_the_replays_control_and_the_updates_are_two_controls_with_their_own_evidence():
    """A block with one parameter and SGD (no state): the control planted on its `update:` check and
    the control of the replay are both about that parameter at step 1. Each has its own identity
    and its own evidence; under one name, one's evidence replaced the other's and the self-test
    failed on a correct case."""
    spec = CaseSpec(
        block="embedding",
        preset="tiny",
        world_size=1,
        overrides=(("vocab", 16), ("hidden", 8), ("seq", 3), ("batch", 2), ("layers", 1)),
    ).with_run(dtype="float32", optimizer="sgd", steps=2, float64_run="off")
    (r,) = check([spec])
    assert r["verdict"] == "equivalent", r["summary"]
    st = r["self_test"]
    assert st["failures"] == [] and st["controls"] == st["flagged"], st
    optimizer = {c["name"] for c in r["checks"] if c["stage"] == "optimizer"}
    assert optimizer == {"update:weight", "param:weight"}


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


def test_a_control_judged_by_less_than_its_planted_error_fails_even_where_excused():
    """What a control was judged by must show its planted error, flagged or blind: a blind spot
    excuses a bound wide enough to hide the control, never an error misread. `read` holds the
    errors `judge` read (over every bin of a tensor judged by magnitude)."""
    blind = _check(name="control:act:a", error=0.5, planted=0.5, blind="ill-conditioned")
    read_right = result_module.self_test([_check()], [blind], [{}], read={id(blind): 0.5})
    assert read_right.failures == [] and read_right.skipped
    misread = result_module.self_test([_check()], [blind], [{}], read={id(blind): 0.0})
    assert misread.failures == [
        "control:act:a (forward, step 1, rank 0) was judged by an error of 0, not its planted 0.5"
    ]


# a case with tensors judged by magnitude (a tiny LM's activations and their gradients), in 16 bits:
# its controls there are often excused as blind (the dense error is large), so only what they were
# judged by can show a misread bin
BINNED = CaseSpec(block="lm", preset="tiny", world_size=2).with_run(dtype="bfloat16", steps=1)


def test_errors_per_bin_misread_end_in_error_where_the_controls_are_excused():
    """Every bin's error read as 0: each tensor judged by magnitude passes whatever its error. The
    control of the tensors judged by magnitude (planted in the row of smallest magnitude) shows it:
    "error" naming that control; the real checker flags every control of the same case."""
    (real,) = check([BINNED])
    assert real["verdict"] == "equivalent" and real["self_test"]["failures"] == [], real["summary"]
    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        bin_errors_zero(m)
        (r,) = check([BINNED])
    assert r["verdict"] == "error", r["summary"]
    assert "was judged by an error of 0, not its planted" in r["summary"], r["summary"]


def test_a_control_the_verdict_did_not_read_as_failed_is_not_flagged():
    """The self-test reads the failures the verdict reads (`read_failures`), not a judgement of its
    own: a failed control left out of that list is unflagged."""
    control = _check(name="control:act:a", error=2.0, passed=False, planted=2.0)
    kept = {"tp": np.array([2.0]), "ref": np.zeros(1)}
    evidence = [{("forward", 1, CheckId.parse("control:act:a")): kept}]
    read = result_module.self_test([_check()], [control], evidence, read_failures([control]))
    assert read.failures == [] and read.flagged == 1
    unread = result_module.self_test([_check()], [control], evidence, read_failures([]))
    assert unread.flagged == 0 and "was not flagged" in unread.failures[0]


def _two_ranks():
    """On ranks 0 and 1 a real check that failed and a flagged control (its evidence showing its
    planted error), as `merge` has them: (checks, controls, evidence, the one list of failures)."""
    checks = [_check(rank=r, error=2.0, passed=False) for r in (0, 1)]
    controls = [
        _check(name="control:act:a", rank=r, error=2.0, passed=False, planted=2.0) for r in (0, 1)
    ]
    kept = {"tp": np.array([2.0]), "ref": np.zeros(1)}
    evidence = [{("forward", 1, CheckId.parse("control:act:a")): kept} for _ in (0, 1)]
    return checks, controls, evidence, result_module.failing(checks + controls)


def test_the_verdict_and_the_self_test_read_one_reading_of_the_failures():
    checks, controls, evidence, flagged = _two_ranks()
    reading = read_failures(flagged)
    assert reading.verdict == "not equivalent"
    assert reading.failed == checks and reading.caught == controls
    st = result_module.self_test(checks, controls, evidence, reading)
    assert st.failures == [] and st.flagged == 2
    assert read_failures([]).verdict == "equivalent"


# A filter on either side of the reading, or on the list itself (rank 0's failures only, the
# mutants that once ended in "equivalent"), a failure read on the wrong side or twice: each is a
# failure of the self-test, the first it says here.
FILTERS = {
    "the verdict's list": (
        lambda r: Reading(r.flagged, [c for c in r.failed if c.rank == 0], r.caught),
        "1 of the 4 failures were not read (first: act:a (forward, step 1, rank 1))",
    ),
    "the self-test's list": (
        lambda r: Reading(r.flagged, r.failed, [c for c in r.caught if c.rank == 0]),
        "1 of the 4 failures were not read (first: control:act:a (forward, step 1, rank 1))",
    ),
    "the one list": (
        lambda r: Reading([c for c in r.flagged if c.rank == 0], r.failed, r.caught),
        "2 check(s) read are not among the failures (first: act:a (forward, step 1, rank 1))",
    ),
    "a control read as a check": (
        lambda r: Reading(r.flagged, r.failed + r.caught[:1], r.caught[1:]),
        "1 failure(s) were read on the wrong side (first: control:act:a (forward, step 1, rank 0))",
    ),
    "a failure read twice": (
        lambda r: Reading(r.flagged, r.failed + r.failed[:1], r.caught),
        "1 failure(s) were read twice",
    ),
}


@pytest.mark.parametrize("where", FILTERS)
def test_a_filter_on_either_side_of_the_reading_fails_the_self_test(where):
    checks, controls, evidence, flagged = _two_ranks()
    mutate, said = FILTERS[where]
    st = result_module.self_test(checks, controls, evidence, mutate(read_failures(flagged)))
    assert st.failures and st.failures[0] == said, st.failures


def test_the_blind_spot_does_not_move_with_the_bounds_constants(monkeypatch):
    """What excuses an unflagged control is frozen apart from the bound (`blind_spot`,
    BLIND_SPOT_*): the bound's constants 50 times larger (and every tensor "small") excuse no more
    controls. A float32 control of 1e-5 at scale 1: the dense error, the tensor's size, and the
    excuse."""
    probes = [(1e-7, 4096), (1e-6, 4096), (5e-7, 4096), (5e-7, 32)]
    excused = [tolerance.blind_spot(m, 1.0, n, torch.float32, 1e-5) is not None for m, n in probes]
    assert excused == [False, True, False, True]
    for name in ("MAX_FACTOR", "SMALL_FACTOR", "FLOOR_ULPS", "SMALL_FLOOR_ULPS"):
        monkeypatch.setattr(tolerance, name, 50 * getattr(tolerance, name))
    monkeypatch.setattr(tolerance, "SMALL_NUMEL", 10**9)
    factor = tolerance.factor
    monkeypatch.setattr(tolerance, "factor", lambda *args: 50 * factor(*args))
    again = [tolerance.blind_spot(m, 1.0, n, torch.float32, 1e-5) is not None for m, n in probes]
    assert again == excused


def _equivalent(dtype: str, float64_run: dict | None) -> CaseResult:
    """An "equivalent" case in `dtype`, its float64 run as the record holds it."""
    spec = CaseSpec(block="mlp", preset="tiny", world_size=2).with_run(dtype=dtype)
    return CaseResult(
        spec=spec,
        run=spec.settings,
        verdict="equivalent",
        as_expected=True,
        summary="equivalent: 1 checks passed on 2 rank(s)",
        seconds=0.0,
        checks=[_check()],
        self_test=SelfTest(controls=1, flagged=1),
        float64_run=float64_run,
    )


@pytest.mark.parametrize(
    "dtype, record, verdict",
    [
        ("bfloat16", {"verdict": "equivalent"}, "equivalent"),
        ("bfloat16", {"skipped": "the case does not run in float64"}, "equivalent"),
        ("float32", None, "equivalent"),  # float32 wants none by default
        ("bfloat16", None, "error"),
        ("float16", {"verdict": "not equivalent"}, "error"),
        ("bfloat16", {"verdict": "error"}, "error"),
    ],
)
def test_an_equivalent_case_is_held_to_the_float64_run_it_wants(dtype, record, verdict):
    case = _equivalent(dtype, record).to_json()
    assert case["verdict"] == verdict, case["summary"]
    if verdict == "error":
        assert case["summary"].startswith("the checker failed its control: the case reads "), case
        assert case["self_test"]["failures"] and case["as_expected"] is False
    assert exit_code([case]) == (3 if verdict == "error" else 0)


def test_the_manifest_counts_every_micro_batch_on_every_rank():
    checks = [_check(name="output"), _check(name="output"), _check(name="output", rank=1)]
    output, loss = CheckId("output"), CheckId("loss")
    manifests = [(0, [["forward", 1, output, 2]]), (1, [["forward", 1, output, 2]]), (2, None)]
    assert selftest.missing_checks(checks, manifests) == [
        "1 check(s) of output (forward, step 1) on rank 1 where 2 were due (one per micro-batch)",
        "no manifest from rank 2: what it compared cannot be held to the plan",
    ]
    assert selftest.missing_checks(checks, [(0, [["loss", 1, loss, 1]])]) == [
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
