"""The evidence a rank sends to the parent: only what the diagnosis can read (the tensors of every
check that fails on some rank, the loaded weights, the controls), chosen after one store exchange of
rank 0's bounds and the other ranks' errors; everything when the ranks' check orders differ."""

import dataclasses
import json

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.payload import Check
from tpcheck.checker.rank import evidence
from tpcheck.faults import CATALOGUE


def _check(stage, name, error, bound, kind="calibrated", step=1, rank=0):
    return Check(
        stage=stage,
        step=step,
        name=name,
        rank=rank,
        error=error,
        diff_vs_dense=error,
        bound=bound,
        kind=kind,
        reason="",
        passed=None,
    )


KEPT = {
    ("weights", 0, "param:w"): {},
    ("forward", 1, "act:a"): {},
    ("forward", 1, "act:b"): {},
    ("forward", 1, "output"): {},
    ("grads", 1, "grad:w"): {},
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
        ("weights", 0, "param:w"),
        ("forward", 1, "act:b"),
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
    assert keys0 == keys1 == {("weights", 0, "param:w"), ("forward", 1, "act:b")}


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
