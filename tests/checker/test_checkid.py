"""A check's identity (checker/checkid.py) is made once where the tensor is compared and rendered
to the report's name only at the edge: every kind, with a pass, a state entry or as a control,
renders to the name the report has always shown and reads back from it to the same identity, alone,
through a report's JSON (`CaseResult.to_json` / `from_json`), and for every check a real run
makes."""

from __future__ import annotations

import json

import pytest

import tpcheck
from tpcheck.checker.checkid import KINDS, CheckId
from tpcheck.checker.payload import Check
from tpcheck.checker.verdict.divergence import Diagnosis, FirstDivergence, SelfTest
from tpcheck.checker.verdict.result import CaseResult

# every kind, with the names the report has shown for it
NAMED = [
    (CheckId("output"), "output"),
    (CheckId("output", pass_="decode2"), "output:decode2"),
    (CheckId("output", pass_="eval"), "output:eval"),
    (CheckId("output", pass_="no_grad"), "output:no_grad"),
    (CheckId("loss"), "loss"),
    (CheckId("act", "layers.0.mlp"), "act:layers.0.mlp"),
    (CheckId("act", "layers.0.attention.wo", "decode3"), "act:layers.0.attention.wo:decode3"),
    (CheckId("actgrad", "norm"), "actgrad:norm"),
    (CheckId("param", "fc1.weight"), "param:fc1.weight"),
    (CheckId("grad", "fc1.weight"), "grad:fc1.weight"),
    (CheckId("grad", "tokens"), "grad:tokens"),
    (CheckId("update", "fc1.weight"), "update:fc1.weight"),
    (CheckId("weight", "fc1.weight"), "weight:fc1.weight"),
    (CheckId("state", "fc1.weight", entry="exp_avg_sq"), "state:fc1.weight.exp_avg_sq"),
    (CheckId("moment", "fc1.weight", entry="exp_avg"), "moment:fc1.weight.exp_avg"),
    (CheckId("clipped", "norm.bias"), "clipped:norm.bias"),
    (CheckId("replay", "fc1.bias"), "replay:fc1.bias"),
    (CheckId("buffer", "rope.cos"), "buffer:rope.cos"),
    (CheckId("rng", "layers.0.mlp: dropout #1"), "rng:layers.0.mlp: dropout #1"),
    (CheckId("routing", "layers.1.gate.topk#1"), "routing:layers.1.gate.topk#1"),
    (CheckId("clip", "grad_norm"), "clip:grad_norm"),
]


def test_every_kind_is_named():
    assert {i.kind for i, _ in NAMED} == set(KINDS)


@pytest.mark.parametrize(("check_id", "name"), NAMED, ids=[n for _, n in NAMED])
def test_an_identity_renders_to_its_name_and_reads_back(check_id, name):
    assert str(check_id) == name
    assert CheckId.parse(name) == check_id
    control = check_id.as_control()
    assert str(control) == f"control:{name}" and control.control
    assert CheckId.parse(f"control:{name}") == control


def test_the_location_is_what_the_diagnosis_names():
    """The place the diagnosis names: the target with its entry and pass, else the pass, else the
    kind."""
    assert CheckId("act", "layers.0", "decode2").location == "layers.0:decode2"
    assert CheckId("state", "w", entry="exp_avg").location == "w.exp_avg"
    assert CheckId("output", pass_="decode1").location == "decode1"
    assert CheckId("loss").location == "loss"


def test_a_malformed_identity_is_refused():
    with pytest.raises(AssertionError):
        CheckId("activation", "x")  # no such kind
    with pytest.raises(AssertionError):
        CheckId("grad", "w", pass_="decode2")  # a gradient has no decode pass
    with pytest.raises(AssertionError):
        CheckId("param", "w", entry="exp_avg")  # only optimizer state has an entry


def _check(check_id: CheckId, seq: int) -> Check:
    return Check(
        stage="forward",
        step=1,
        id=check_id,
        rank=0,
        error=1.0,
        diff_vs_dense=1.0,
        bound=0.5,
        kind="calibrated",
        reason="r",
        passed=False,
        seq=seq,
    )


def test_every_identity_round_trips_through_a_reports_json():
    """A result holding a check of every kind (and its first divergence) written to JSON and read
    back: the same identities, the report's names as they were."""
    spec = tpcheck.CaseSpec(block="mlp", preset="tiny", world_size=1)
    checks = [_check(i, seq) for seq, (i, _) in enumerate(NAMED)]
    first = FirstDivergence(NAMED[6][0], "forward", 1, [0], 1.0, 0.5, "calibrated", "r")
    result = CaseResult(
        spec=spec,
        run=spec.settings,
        verdict="not equivalent",
        as_expected=False,
        summary="s",
        seconds=0.0,
        checks=checks,
        first_divergence=first,
        self_test=SelfTest(controls=3, flagged=3, manifest=7),
        diagnosis=Diagnosis("mismatch", "c", "down", first.name, "forward", 1, [0], {}, "s"),
    )
    text = json.dumps(result.to_json())
    assert [c["name"] for c in json.loads(text)["checks"]] == [n for _, n in NAMED]
    back = CaseResult.from_json(json.loads(text))
    assert [c.id for c in back.checks] == [i for i, _ in NAMED]
    assert back.first_divergence == first
    assert (back.self_test, back.diagnosis) == (result.self_test, result.diagnosis)
    assert back.to_json() == json.loads(text)


def test_every_check_of_real_runs_reads_back_to_its_own_name():
    """Training with clipping and the forward without autograd, and a decoding run: every check's
    name parses to an identity that renders it again, of a known kind."""
    clip = tpcheck.RunSettings(steps=1, clip_grad_norm=0.5)
    specs = [
        tpcheck.CaseSpec(block="layer", preset="tiny", world_size=2, run=clip),
        tpcheck.CaseSpec(block="decode", preset="tiny", world_size=2),
    ]
    results = tpcheck.check(specs)
    names = {c["name"] for r in results for c in r["checks"]}
    assert all(r["verdict"] == "equivalent" for r in results), [r["summary"] for r in results]
    assert {"clip:grad_norm", "output:decode3", "loss"} <= names
    for name in names:
        check_id = CheckId.parse(name)
        assert str(check_id) == name and check_id.kind in KINDS
