"""Discrete decisions held to measured error (checker/rank/decisions.py): the rounding margin of a
flip and the bound of a per-index offset come from the dense side's own error of the scores that
decide, never from the TP side; a TP router that adds a constant to some experts' logits before its
top-k is a `decision_bias` at the router, in bfloat16, with the float64 run off; its correct twin is
equivalent; a checker whose replay excuses every flip ends in "error". The case file:
tests/checker/rank/case_files/moe_top2.py (a Mistral-style top-2 router, TP experts)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from mutants import decision_margins_times_1000
from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.rank import decisions
from tpcheck.checker.rank.decisions import (
    BIAS_FACTOR,
    DECISION_BIAS,
    FLIP_FACTOR,
    FLIPPED,
    DecisionBook,
    distinct_rows,
    index_offset,
)

HERE = Path(__file__).parent / "case_files"
TOP2, TOP1 = HERE / "moe_top2.py", HERE / "moe_router.py"
ROUTER = "routing:moe.topk#1"


def _spec(name, world=2, dtype="bfloat16", seed=1, train=False, path=TOP2, steps=3):
    steps = 1 if train else steps
    run = RunSettings(steps=steps, dtype=dtype, seed=seed, float64_run="off", train=train)
    return CaseSpec(block=f"file:{path}:{name}", world_size=world, run=run)


# --------------------------------------------------------------------------- the pieces, in process


class _TopK(nn.Module):
    def forward(self, logits):
        return torch.topk(logits, 2, dim=-1)


def _scores(rows=64, experts=8, seed=0):
    """(truth in float64, the dense side's bfloat16 rounding of it, a correct TP side's: the truth
    moved by rounding-sized noise, then rounded)."""
    g = torch.Generator().manual_seed(seed)
    truth = 2 * torch.randn(rows, experts, generator=g, dtype=torch.float64)
    noise = 0.01 * torch.randn(rows, experts, generator=g, dtype=torch.float64)
    return truth, truth.to(torch.bfloat16), (truth + noise).to(torch.bfloat16)


def _judge(truth, dense, tp, module=None):
    """One decision through the three roles, what the TP side is held to shared as rank 0 shares
    it (`DecisionBook.share`'s three lists)."""
    module = module or _TopK()
    book = DecisionBook()
    with book.mode("draw", module):
        dense_out = module(dense)
    with book.mode("replay", module):
        module(truth)
    book.margins = book.rounding_margins(torch.bfloat16, 2)
    book.offset_bounds = book.offset_yardsticks(torch.bfloat16)
    book.control_sizes = book.control_plants(torch.bfloat16)
    with book.mode("tp", module, iter(range(1, 100)).__next__):
        tp_out = module(tp)
    return book, dense_out, tp_out


def test_the_margin_and_the_offset_bound_are_the_dense_sides_measured_error():
    truth, dense, tp = _scores()
    error = float((dense.double() - truth).abs().max())
    eps = torch.finfo(torch.bfloat16).eps
    book, _, _ = _judge(truth, dense, tp)
    (margin,) = book.margins
    assert margin == pytest.approx(FLIP_FACTOR * error + eps * float(truth.abs().max()))
    rms = float(truth.square().mean().sqrt())
    assert book.offset_bounds == [pytest.approx(BIAS_FACTOR * (error + eps * rms) / 8)]
    # far under the old allowance (twice the calibrated bound: 16 x the error + 2 ulps)
    assert margin < 0.6 * (16 * error + 2 * eps * float(truth.abs().max()))
    # the TP side cannot buy its own allowance: a wilder TP input is held to the same numbers
    wild = (truth + 0.3 * torch.randn(truth.shape, dtype=torch.float64)).to(torch.bfloat16)
    again, _, _ = _judge(truth, dense, wild)
    assert (again.margins, again.offset_bounds) == (book.margins, book.offset_bounds)


def test_a_constant_on_one_experts_logit_is_a_decision_bias_not_a_near_tie():
    truth, dense, tp = _scores()
    book, dense_out, tp_out = _judge(truth, dense, tp)
    (fair,) = book.judged
    assert fair.passed and fair.offset < fair.offset_bound
    biased = tp.clone()
    biased[:, 0] += 0.2
    book, dense_out, tp_out = _judge(truth, dense, biased)
    (j,) = book.judged
    assert j.kind == DECISION_BIAS and not j.passed
    assert j.at == 0 and j.signed == pytest.approx(0.2, abs=0.03) and j.offset > 2 * j.offset_bound
    assert j.rows > 0 and j.gap <= j.margin  # every flip within the margin: a near-tie alone
    assert not j.substituted  # no near-tie note, but the dense decision replayed all the same
    assert torch.equal(tp_out.indices, dense_out.indices)
    assert "index 0" in j.reason() and "systematic bias" in j.reason()


def test_a_shift_of_every_score_decides_nothing_and_a_router_on_other_values_is_routing():
    truth, dense, tp = _scores()
    book, _, _ = _judge(truth, dense, tp + 0.5)
    assert book.judged[0].passed and book.judged[0].offset < 1e-2
    # other scores altogether (a router on a rank's shard): beyond the margin, offsets or not
    other = torch.randn(truth.shape, dtype=torch.float64).to(torch.bfloat16)
    book, _, _ = _judge(truth, dense, other)
    (j,) = book.judged
    assert not j.passed and j.gap > j.margin and j.kind == "routing"


def test_the_offset_of_each_index_is_its_mean_over_the_rows_from_the_median_indexs():
    diff = torch.zeros(4, 5, dtype=torch.float64)
    diff[:, 3] = 0.25
    diff[0, 1] = math.nan  # not a value: left out of its index's mean
    assert index_offset(diff, 1) == (0.25, 3, 0.25, 0.0)
    assert index_offset(diff - 1.0, 1)[0] == pytest.approx(0.25)  # the same, every score shifted
    assert index_offset(torch.ones(4, 1), 1)[0] == 0.0  # one index: nothing to lean towards
    assert distinct_rows(torch.randn(1, 8).expand(16, 8), 1) == 1  # copies average nothing
    assert distinct_rows(torch.randn(16, 8), 1) == 16


def test_a_decision_over_a_few_rows_is_held_to_its_margin_only():
    """A greedy decode's argmax over a batch of 2: a mean of two roundings is as wide as one, so
    no offset test (and its control says why), the margin still judging any flip."""
    truth, dense, tp = _scores(rows=2, experts=64)
    book, _, _ = _judge(truth, dense, tp)
    assert book.offset_bounds == [math.inf] and book.judged[0].passed
    flip, offset = book.judged[0].controls
    assert flip[1] > flip[2] and flip[3] is None
    assert offset[3] is not None and "fewer than" in offset[3]


def test_a_mask_at_the_dtypes_extreme_is_no_rounding():
    """Attention-sink scores masked with `torch.finfo(dtype).min` (gpt-oss): the dense side's mask
    and the float64 truth's are of other sizes, which is no error of the values."""
    truth, dense, tp = _scores()
    mask = torch.zeros_like(truth, dtype=torch.bool)
    mask[:, -1] = True
    book, _, _ = _judge(
        truth.masked_fill(mask, torch.finfo(torch.float64).min),
        dense.masked_fill(mask, torch.finfo(torch.bfloat16).min),
        tp.masked_fill(mask, torch.finfo(torch.bfloat16).min),
    )
    plain, _, _ = _judge(truth[:, :-1], dense[:, :-1], tp[:, :-1])
    assert book.margins[0] <= plain.margins[0] and math.isfinite(book.offset_bounds[0])
    assert book.judged[0].passed and all(math.isfinite(c[1]) for c in book.judged[0].controls)


def test_the_controls_plant_a_flip_beyond_the_margin_and_an_offset_beyond_the_bound():
    truth, dense, tp = _scores()
    book, _, _ = _judge(truth, dense, tp)
    (flip, offset) = book.judged[0].controls
    assert flip[0] == "routing" and flip[1] > flip[2] and flip[3] is None
    assert offset[0] == DECISION_BIAS and offset[1] > offset[2] and offset[3] is None
    # the planted sizes do not move with the margin and bound they test: widened 1000 times,
    # they hold the same planted flip and offset, now unflagged
    d = book.dense[0]
    book.margins = [1000 * m for m in book.margins]
    book.offset_bounds = [1000 * b for b in book.offset_bounds]
    wide_flip, wide_offset = decisions.controls(decisions.Call("topk", d.x, d.dim), d, book, 0)
    assert wide_flip[1] == flip[1] and wide_flip[1] <= wide_flip[2]
    assert wide_offset[1] == offset[1] and wide_offset[1] <= wide_offset[2]
    # scores all within rounding of one another: no flip to plant beyond rounding, said so
    flat = torch.full((64, 8), 1.0, dtype=torch.float64) + 1e-4 * truth
    book, _, _ = _judge(flat, flat.to(torch.bfloat16), flat.to(torch.bfloat16))
    assert book.judged[0].controls[0][3] is not None


# --------------------------------------------------------------------------- through check()

BIASED = ("bias", "bias_select", "bias_all")


@pytest.fixture(scope="module")
def runs():
    specs = {
        **{name: _spec(name) for name in BIASED},
        "bias_trained": _spec("bias_select", train=True),
        "correct": _spec("correct"),
        "correct_fp32": _spec("correct", dtype="float32"),
        "correct_trained": _spec("correct", train=True),
        "correct_trained_fp32": _spec("correct", dtype="float32", train=True),
    }
    return dict(zip(specs, check(list(specs.values()))))


@pytest.mark.parametrize("which", [*BIASED, "bias_trained"])
def test_a_router_logit_bias_before_top_k_is_a_decision_bias_in_bfloat16(runs, which):
    r = runs[which]
    assert "float64_run" not in r  # no float64 run to see it
    assert r["verdict"] == "not equivalent", r["summary"]
    first = r["first_divergence"]
    assert (first["name"], first["stage"], first["step"]) == (ROUTER, "forward", 1)
    assert first["kind"] == DECISION_BIAS and first["error"] > first["bound"]
    assert r["diagnosis"]["signature"] == DECISION_BIAS
    assert "systematic bias" in r["diagnosis"]["cause"]
    assert f"index {0 if which != 'bias_all' else 7}" in first["reason"]
    assert r["self_test"]["failures"] == []


@pytest.mark.parametrize(
    "which", ["correct", "correct_fp32", "correct_trained", "correct_trained_fp32"]
)
def test_the_correct_twin_is_equivalent(runs, which):
    r = runs[which]
    assert r["verdict"] == "equivalent", r["summary"]
    assert r["self_test"]["failures"] == [] and r["self_test"]["flagged"] > 0
    routing = [c for c in r["checks"] if c["name"] == ROUTER]
    assert routing and all(c["passed"] and c["kind"] == "routing" for c in routing)


def test_a_flip_at_a_near_tie_is_still_replayed_with_the_tighter_margin():
    """Seed 0 of the top-2 case flips an expert at a near-tie in bfloat16 (gap 0.03, the margin
    ~0.8, half the old allowance's ~1.5): replayed, with its note."""
    (r,) = check([_spec("correct", seed=0)])
    assert r["verdict"] == "equivalent", r["summary"]
    flipped = [c for c in r["checks"] if c["name"] == ROUTER and c["error"] > 0]
    assert flipped and all(c["passed"] for c in flipped)
    assert all(c["bound"] < 1.0 for c in r["checks"] if c["name"] == ROUTER)
    assert any(n.startswith(FLIPPED) for n in r["notes"])


def _margins_only(monkeypatch):
    margins = DecisionBook.rounding_margins
    monkeypatch.setattr(
        DecisionBook, "rounding_margins", lambda self, *a: [1000 * m for m in margins(self, *a)]
    )


def _offsets_only(monkeypatch):
    bounds = DecisionBook.offset_yardsticks
    monkeypatch.setattr(
        DecisionBook, "offset_yardsticks", lambda self, *a: [1000 * b for b in bounds(self, *a)]
    )


@pytest.mark.parametrize(
    ("mutant", "control"),
    [
        (decision_margins_times_1000, "control:routing:moe.topk#1"),
        (_margins_only, "control:routing:moe.topk#1 ("),
        (_offsets_only, "control:routing:moe.topk#1:offset"),
    ],
    ids=["both", "margins", "offset_bounds"],
)
def test_a_replay_that_excuses_every_flip_ends_in_error(monkeypatch, mutant, control):
    """The biased router under a replay 1000 times as lenient: its own checks pass, and the
    self-test's planted flip (or offset) goes unflagged: "error", naming the control."""
    mutant(monkeypatch)
    (r,) = check([_spec("bias_select")])
    assert r["verdict"] == "error", r["summary"]
    assert any(control in f for f in r["self_test"]["failures"]), r["self_test"]["failures"]


# --------------------------------------------------------------------------- no false alarm

SWEEP = [(dtype, world) for dtype in ("bfloat16", "float16", "float32") for world in (2, 4)]


def _no_alarm(specs):
    results = check(specs)
    alarms = [
        (s.block.rsplit(":", 1)[1], s.settings.dtype, s.world_size, s.settings.seed, r["summary"])
        for s, r in zip(specs, results)
        if r["verdict"] != "equivalent"
    ]
    assert alarms == []
    return results


def test_correct_top2_routers_raise_no_false_alarm_at_any_dtype_and_world():
    _no_alarm([_spec("correct", world, dtype, seed=2) for dtype, world in SWEEP])


@pytest.mark.slow
def test_correct_routers_over_many_seeds_raise_no_false_alarm():
    """Forward-only, the top-2 case and the top-1 near-tie one (moe_router.py, the training run
    its own 40-seed test sweeps): 20 seeds each, every dtype, tp 2 and 4."""
    specs = [
        _spec("correct", world, dtype, seed=seed, path=path)
        for path in (TOP2, TOP1)
        for dtype, world in SWEEP
        for seed in range(20)
    ]
    results = _no_alarm(specs)
    assert sum(any(n.startswith(FLIPPED) for n in r.get("notes") or ()) for r in results) >= 40
