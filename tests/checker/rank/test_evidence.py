"""The evidence a rank sends to the parent: only what the diagnosis can read (the tensors of every
check that fails on some rank, the loaded weights, the controls), chosen after one store exchange of
rank 0's bounds and the other ranks' errors; everything when the ranks' check orders differ."""

import dataclasses
import json
import os

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.checkid import CheckId
from tpcheck.checker.payload import Check
from tpcheck.checker.rank import evidence
from tpcheck.faults import CATALOGUE


def K(stage: str, step: int, name: str) -> tuple:
    """An evidence key, its check named as the report names it."""
    return stage, step, CheckId.parse(name)


def _check(stage, name, error, bound, kind="calibrated", step=1, rank=0):
    return Check(
        stage=stage,
        step=step,
        id=CheckId.parse(name),
        rank=rank,
        error=error,
        diff_vs_dense=error,
        bound=bound,
        kind=kind,
        reason="",
        passed=None,
    )


KEPT = {
    K("weights", 0, "param:w"): {},
    K("forward", 1, "act:a"): {},
    K("forward", 1, "act:b"): {},
    K("forward", 1, "output"): {},
    K("grads", 1, "grad:w"): {},
}


class Rendezvous:
    """Rank `rank`'s view of the store; the other ranks' posts given."""

    def __init__(self, rank, others):
        self.rank, self.others = rank, others

    def exchange(self, tag, value, label=None):
        said = dict(self.others)
        said[self.rank] = value
        return [said[r] for r in sorted(said)]


def _post(checks, rank):
    """What rank `rank` posts for `checks` (run the
    function against a one-rank store to capture it)."""
    posted = {}

    class Capture(Rendezvous):
        def exchange(self, tag, value, label=None):
            posted["value"] = value
            return [value]

    evidence.needed_evidence(checks, KEPT, Capture(rank, {}))
    return posted["value"]


def test_rank_0_keeps_the_failing_checks_and_the_weights():
    checks = [
        _check("weights", "param:w", 0.0, 0.0, "exact", step=0),
        _check("forward", "act:a", 1e-7, 1e-6),
        _check("forward", "act:b", 1e-3, 1e-6),
        _check("forward", "output", 0.0, 1e-6),
    ]
    assert evidence.needed_evidence(checks, KEPT, Rendezvous(0, {})) == {
        K("weights", 0, "param:w"),
        K("forward", 1, "act:b"),
    }


def test_another_rank_is_judged_by_rank_0s_bounds_and_its_failure_kept_on_every_rank():
    rank0 = [_check("forward", "act:a", 1e-7, 1e-6), _check("forward", "act:b", 1e-7, 1e-6)]
    rank1 = [
        _check("forward", "act:a", 1e-7, None, rank=1),
        _check("forward", "act:b", 5e-6, None, rank=1),
    ]
    keys0 = evidence.needed_evidence(rank0, KEPT, Rendezvous(0, {1: _post(rank1, 1)}))
    keys1 = evidence.needed_evidence(rank1, KEPT, Rendezvous(1, {0: _post(rank0, 0)}))
    # rank 1's failure, on both ranks
    assert keys0 == keys1 == {K("weights", 0, "param:w"), K("forward", 1, "act:b")}


def test_check_orders_that_differ_send_everything():
    rank0 = [_check("forward", "act:a", 1e-7, 1e-6)]
    rank1 = [_check("forward", "act:b", 1e-7, None, rank=1)]
    assert evidence.needed_evidence(rank1, KEPT, Rendezvous(1, {0: _post(rank0, 0)})) is None
    posted = json.loads(_post(rank0, 0))
    assert set(posted) == {"failing", "digest", "values"}


def test_diagnosis_reads_the_evidence_it_needs_and_a_mutant_sending_none_loses_the_signature(
    monkeypatch,
):
    """The catalogue's forward all-reduce fault keeps its signature with the evidence chosen; a
    mutant that sends no evidence but the controls' loses it (the diagnosis cannot read the
    failing tensors)."""
    good = CaseSpec(block="mlp", preset="tiny", run=RunSettings(steps=1))
    fault = CATALOGUE["missing_forward_reduce"].prepare(
        dataclasses.replace(good, fault="missing_forward_reduce")
    )
    (r,) = check([fault])
    assert r["verdict"] == "not equivalent" and r["diagnosis"]["signature"] == "partial_sum"
    monkeypatch.setattr(evidence, "needed_evidence", lambda checks, kept, rendezvous: set())
    (r,) = check([fault])
    assert r["verdict"] == "not equivalent" and r["diagnosis"]["signature"] != "partial_sum"


def _tensor_check(name, step, stage="forward"):
    return _check(stage, name, 0.0, 1.0, step=step)


def test_a_step_releases_the_tensors_of_its_passing_checks_back_to_the_budget():
    import torch

    kept = evidence.Evidence()
    t = torch.ones(10)
    kept.keep(_tensor_check("param:w", 0, "weights"), t, t, t)
    for name in ("act:a", "act:b", "act:a"):  # act:a recurs (a second micro-batch): counted once
        kept.keep(_tensor_check(name, 1), t, t, t)
    kept.keep(_tensor_check("act:a", 2), t, t, t)
    assert kept.left == evidence.EVIDENCE_BUDGET - 4 * 30
    kept.release(1, None)  # the ranks could not tell: nothing goes
    assert len(kept.kept) == 4
    kept.release(1, {K("forward", 1, "act:b")})
    # act:a of step 1 passed: dropped; the failing act:b, the weights and step 2's stay
    assert set(kept.kept) == {
        K("weights", 0, "param:w"),
        K("forward", 1, "act:b"),
        K("forward", 2, "act:a"),
    }
    assert kept.left == evidence.EVIDENCE_BUDGET - 3 * 30
    kept.release(0, set())  # the loaded weights are never released
    assert K("weights", 0, "param:w") in kept.kept


def _late_skip():
    """The forward all-reduce of the MLP's down projection skipped from the second step's forward
    on (its first call is step 1's): a bug whose first divergence is at step 2."""
    from tpcheck.faults import injectors as i
    from tpcheck.faults.catalogue import Fault

    calls = {"n": 0}

    def skip_late(x, perform):
        calls["n"] += 1
        return x if calls["n"] > 1 else perform(x)

    return Fault(
        "test_late_missing_forward_reduce",
        "the forward all-reduce skipped from step 2 on",
        "forward all-reduce of the down projection",
        "forward",
        "partial_sum",
        i.intercept("all_reduce", "down", "forward", skip_late),
        sequence_parallel=False,
    )


def test_a_late_first_divergence_keeps_its_tensors_when_step_1_spent_the_budget(
    monkeypatch, tmp_path
):
    """With a budget that step 1's tensors fill, the step-2 divergence of a missing all-reduce is
    still diagnosed `partial_sum`: step 1's passing checks give their elements back. A mutant that
    releases nothing leaves step 2 without tensors and loses the signature."""
    fault = _late_skip()
    monkeypatch.setitem(CATALOGUE, fault.name, fault)
    spec = fault.prepare(
        CaseSpec(block="mlp", preset="tiny", run=RunSettings(steps=2, micro_batches=1))
    )
    (r,) = check([spec])
    assert r["verdict"] == "not equivalent"
    assert r["first_divergence"]["step"] == 2 and r["diagnosis"]["signature"] == "partial_sum"
    real_release = evidence.Evidence.release

    def measuring(self, step, needed):  # in the ranks: what step 1 kept, written for the test
        path = tmp_path / f"spent{step}-{os.getpid()}"
        path.write_text(str(evidence.EVIDENCE_BUDGET - self.left))
        real_release(self, step, needed)

    monkeypatch.setattr(evidence.Evidence, "release", measuring)
    check([spec])
    spent = max(int(p.read_text()) for p in tmp_path.glob("spent1-*"))
    # a budget step 1 fills to within a few elements: step 2's tensors fit only after the release
    monkeypatch.setattr(evidence, "EVIDENCE_BUDGET", spent + 8)
    monkeypatch.setattr(evidence.Evidence, "release", real_release)
    (r,) = check([spec])
    assert r["first_divergence"]["step"] == 2 and r["diagnosis"]["signature"] == "partial_sum"
    monkeypatch.setattr(evidence.Evidence, "release", lambda self, step, needed: None)
    (r,) = check([spec])
    assert r["verdict"] == "not equivalent" and r["diagnosis"]["signature"] != "partial_sum"
