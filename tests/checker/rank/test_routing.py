"""Discrete decisions (checker/rank/decisions.py): a correct top-1 MoE router after a TP block, in
bfloat16, picks another expert at a near-tie on some tokens; the dense decision is replayed there
and the report says so, never a mismatch. A router that decides on other values (computed from a
rank's slice of the hidden state) is a routing difference. The case file:
tests/checker/rank/case_files/moe_router.py (its router's rows 0 and 1 tie to within rounding)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.rank import decisions
from tpcheck.checker.rank.decisions import FLIPPED, Call, DecisionBook, flip_gap
from tpcheck.errors import UsageError

MOE = Path(__file__).parent / "case_files" / "moe_router.py"
# seed 1 flips experts 0/1 at a near-tie at world 1 and 2 (found once by the 40-seed sweep below)
FLIP_SEED = 1


def _spec(name: str, world: int, seed: int = FLIP_SEED) -> CaseSpec:
    return CaseSpec(
        block=f"file:{MOE}:{name}",
        world_size=world,
        run=RunSettings(steps=1, dtype="bfloat16", seed=seed),
    )


def _routing(result) -> list[dict]:
    return [c for c in result["checks"] if c["kind"] == "routing"]


# --------------------------------------------------------------------------- the pieces, in process


def test_the_gap_of_a_flip_is_measured_between_the_competing_values():
    x = torch.tensor([[0.50, 0.49, 0.01], [0.1, 0.2, 0.7]], dtype=torch.float64)
    dense = torch.tensor([[0], [2]])
    assert flip_gap(Call("topk", x, 1), x, dense, torch.tensor([[0], [2]])) == (0.0, 0)
    gap, rows = flip_gap(Call("topk", x, 1), x, dense, torch.tensor([[1], [2]]))
    assert rows == 1 and gap == pytest.approx(0.01)
    gap, rows = flip_gap(Call("topk", x, 1), x, dense, torch.tensor([[1], [0]]))
    assert rows == 2 and gap == pytest.approx(0.6)
    # top-2 without a decided order: the same experts in another order are no flip
    top2 = torch.tensor([[0, 1], [2, 1]])
    unordered = Call("topk", x, 1, unordered=True)
    assert flip_gap(unordered, x, top2, torch.tensor([[1, 0], [1, 2]])) == (0.0, 0)
    gap, rows = flip_gap(unordered, x, top2, torch.tensor([[2, 0], [1, 2]]))
    assert rows == 1 and gap == pytest.approx(0.48)


class _Router(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, logits):
        return self.how(logits)


def _judge(how, dense_in, tp_in, margin):
    """One decision through the three roles: dense, truth (the dense input in float64), TP."""
    book = DecisionBook()
    with book.mode("draw", _Router(how)):
        dense_out = how(dense_in)
    with book.mode("replay", _Router(how)):
        how(dense_in.double())
    book.margins = [margin]
    seq = iter(range(1, 100))
    with book.mode("tp", _Router(how), lambda: next(seq)):
        tp_out = how(tp_in)
    return book, dense_out, tp_out


@pytest.mark.parametrize(
    "how",
    [
        lambda x: torch.topk(x, 1, dim=-1),
        lambda x: x.topk(1),
        lambda x: x.max(dim=-1),
        lambda x: torch.argmax(x, -1),
        lambda x: torch.sort(x, descending=True),
        lambda x: x.argsort(dim=-1),
    ],
)
def test_a_flip_within_the_margin_takes_the_dense_decision_with_the_tp_values(how):
    dense_in = torch.tensor([[1.00, 1.01, 0.0], [0.0, 2.0, 1.0]])
    tp_in = torch.tensor([[1.02, 1.01, 0.0], [0.0, 2.0, 1.0]], requires_grad=True)
    book, dense_out, tp_out = _judge(how, dense_in, tp_in, margin=0.05)
    (judged,) = book.judged
    assert judged.substituted and judged.rows == 1 and judged.gap == pytest.approx(0.01)
    idx = lambda out: out if isinstance(out, torch.Tensor) else out.indices  # noqa: E731
    assert torch.equal(idx(tp_out), idx(dense_out))
    if not isinstance(tp_out, torch.Tensor):  # values from the TP input, gradients flowing
        picked = tp_in.gather(-1, idx(tp_out).reshape(2, -1))
        assert torch.equal(tp_out.values, picked.reshape(tp_out.values.shape))
        assert tp_out.values.requires_grad
    # beyond the margin the TP side keeps its own decision
    book, dense_out, tp_out = _judge(how, dense_in, tp_in, margin=0.001)
    assert not book.judged[0].substituted
    assert not torch.equal(idx(tp_out), idx(dense_out))


def test_a_decision_on_another_shape_is_not_replayed_and_the_truth_must_decide_alike():
    how = lambda x: torch.topk(x, 1)  # noqa: E731
    book = DecisionBook()
    with book.mode("draw", _Router(how)):
        how(torch.rand(4, 6))
    book.margins = [1.0]
    with book.mode("tp", _Router(how), lambda: 1):
        how(torch.rand(4, 3))  # a rank's half of the experts
    assert book.judged == [] and book.unreplayed == ["(model).topk#1"]
    with pytest.raises(UsageError, match="float64 copy of the dense model took other decisions"):
        with book.mode("replay", _Router(how)):
            torch.argmax(torch.rand(4, 6).double(), -1)


def test_decisions_of_the_checkers_own_code_pass_through():
    """A capture hook's comparison runs inside the TP forward (its control picks the element to
    move with an argmax): a function of tpcheck's checker is not the model."""
    checker_code: dict = {"__name__": "tpcheck.checker.rank.compare"}
    exec("def pick(x):\n    return x.abs().argmax()\n", checker_code)
    book = DecisionBook()
    with book.mode("draw", nn.Identity()):
        checker_code["pick"](torch.rand(3))
        torch.rand(3).argmax()
        torch.topk(torch.rand(4), 2)
    assert [d.kind for d in book.dense] == ["argmax", "topk"]


# --------------------------------------------------------------------------- through check()


@pytest.fixture(scope="module")
def runs():
    specs = [
        _spec("correct", 1),
        _spec("correct", 2),
        _spec("local_shard", 2),
        _spec("offset_by_rank", 2),
    ]
    return dict(zip(("correct1", "correct2", "local_shard", "offset_by_rank"), check(specs)))


@pytest.mark.parametrize("which", ["correct1", "correct2"])
def test_a_correct_router_that_flips_at_a_near_tie_is_equivalent_with_a_note(runs, which):
    r = runs[which]
    assert r["verdict"] == "equivalent", r["summary"]
    assert r["self_test"]["failures"] == []
    flipped = [c for c in _routing(r) if c["error"] > 0]
    assert flipped, "the case must flip a decision at this seed"
    assert all(c["passed"] and c["error"] <= c["bound"] for c in flipped)
    assert all(math.isfinite(c["bound"]) and c["bound"] < 0.2 for c in _routing(r))
    (note,) = [n for n in r["notes"] if n.startswith(FLIPPED)]
    assert "moe.gate.topk#1" in note and "(margin " in note
    assert FLIPPED in r["summary"]


def test_a_router_on_a_ranks_slice_of_the_hidden_state_is_a_routing_difference(runs):
    r = runs["local_shard"]
    assert runs["correct2"]["verdict"] == "equivalent"  # its correct twin
    assert r["verdict"] == "not equivalent"
    first = r["first_divergence"]
    assert first["name"] == "routing:moe.gate.topk#1" and first["stage"] == "forward"
    assert first["step"] == 1 and first["error"] > first["bound"]
    assert r["diagnosis"]["signature"] == "routing"
    assert "beyond rounding" in r["diagnosis"]["cause"]


def test_an_expert_index_offset_by_rank_after_the_decision_is_caught_by_the_values(runs):
    """The decision is the dense one (its checks pass); rank 1 then sends each token to the next
    expert: the MoE layer's output differs there, the first divergence, not a routing check."""
    r = runs["offset_by_rank"]
    assert r["verdict"] == "not equivalent"
    assert all(c["passed"] for c in _routing(r))
    first = r["first_divergence"]
    assert (first["name"], first["stage"], first["step"], first["ranks"]) == (
        "act:moe",
        "forward",
        1,
        [1],
    )
    assert r["diagnosis"]["signature"] != "routing"


def test_without_the_replay_the_correct_router_is_a_false_alarm(monkeypatch):
    """The TP side's own decision at the near-tie (the replay disabled) sends a token to another
    expert: the correct case is then not equivalent, which is what the replay removes."""
    monkeypatch.setattr(decisions._DecisionMode, "_tp", lambda self, call, out, *rest: out)
    (r,) = check([_spec("correct", 1)])
    assert r["verdict"] != "equivalent"


def test_a_checker_that_replays_every_flip_still_catches_the_bug(monkeypatch):
    """A mutant whose rounding margin is infinite substitutes the dense decision even for the buggy
    router: its routing weights still come from the wrong logits and the run is not equivalent."""
    monkeypatch.setattr(
        DecisionBook, "rounding_margins", lambda self, dtype, world: [math.inf] * len(self.dense)
    )
    (r,) = check([_spec("local_shard", 2)])
    assert r["verdict"] != "equivalent"
    assert all(c["passed"] for c in _routing(r))  # the mutant did replay every flip


@pytest.mark.slow
def test_forty_seeds_of_a_correct_router_in_bfloat16_raise_no_false_alarm():
    specs = [_spec("correct", world, seed) for seed in range(40) for world in (1, 2)]
    results = check(specs)
    alarms = [(s.world_size, s.settings.seed, r["summary"]) for s, r in zip(specs, results)]
    assert [a for a, r in zip(alarms, results) if r["verdict"] != "equivalent"] == []
    # the sweep exercises the replay: most seeds flip somewhere
    assert sum(any(n.startswith(FLIPPED) for n in r.get("notes") or ()) for r in results) >= 40


def test_the_margin_of_an_input_masked_with_minus_inf_is_finite():
    """A second choice over scores with the first masked to -inf (PhiMoE's sparsemixer): the
    masked entries are -inf on both sides, no rounding; the margin comes from the finite ones."""
    from tpcheck.checker.rank.decisions import Decision

    book = DecisionBook()
    truth = torch.tensor([[0.5, -math.inf, 0.25, 0.125]], dtype=torch.float64)
    dense = truth.to(torch.bfloat16).double()
    book.dense = [Decision("router.max#2", "max", dense, torch.tensor([[0]]))]
    book.truth = [truth]
    (margin,) = book.rounding_margins(torch.bfloat16, 2)
    assert math.isfinite(margin) and margin > 0
