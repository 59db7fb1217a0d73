"""A module output that differs across ranks and is no partial sum, whose every element is the
dense one on some rank (a selection: an embedding lookup whose rows outside the rank's shard are
masked after it, tests/checker/rank/case_files/embedding_mask_outside.py): not checked, with the
note, never assumed replicated (it was: `act:emb` failed while the output, the loss and every
gradient agreed). The same model without the mask is caught at the next module."""

import pytest
import torch

from tpcheck import check, exit_code
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import activations
from tpcheck.plan import Plan, Replicate

from paths import REPO

FILE = REPO / "tests" / "checker" / "rank" / "case_files" / "embedding_mask_outside.py"
NOTE = "# not checked: emb: a selection: each element is the dense one on some rank"


def spec(name, world=2, dtype="float32"):
    return file_spec(f"{FILE}:{name}", world, dtype=dtype)


@pytest.mark.parametrize(
    "world,dtype",
    [
        (2, "float32"),
        pytest.param(4, "float32", marks=pytest.mark.slow),
        pytest.param(2, "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_a_lookup_masked_later_is_left_to_its_user_and_a_missing_mask_is_caught(world, dtype):
    masked, no_mask = check([spec("masked", world, dtype), spec("no_mask", world, dtype)])
    assert masked["verdict"] == "equivalent", masked["summary"]
    assert NOTE in masked["inferred_plan"], masked["inferred_plan"]
    assert no_mask["verdict"] == "not equivalent", no_mask["summary"]
    first = no_mask["first_divergence"]
    assert (first["stage"], first["step"], first["name"]) == ("forward", 1, "act:proj"), first
    assert exit_code([masked]) == 0 and exit_code([no_mask]) == 1


def test_checker_mutant_no_selection_held_replicated_fails_the_correct_model(monkeypatch):
    monkeypatch.setattr(activations, "is_selection", lambda nearest, whole, dense: False)
    (r,) = check([spec("masked")])
    assert r["verdict"] == "not equivalent", r["summary"]
    assert r["first_divergence"]["name"] == "act:emb", r["first_divergence"]


def test_a_selection_needs_every_element_on_some_rank_and_no_rank_with_them_all():
    dense, off = torch.ones(4, 3), torch.tensor(1.0)
    assert activations.is_selection(torch.zeros(12), off, dense)
    assert not activations.is_selection(torch.tensor([0.0] * 11 + [0.5]), off, dense)
    # one rank holds the whole dense output: the others are wrong, not selecting
    assert not activations.is_selection(torch.zeros(12), torch.tensor(0.0), dense)
    views = [{"m": [[4, 3], "a"]}, {"m": [[4, 3], "b"]}]
    placed, skipped, _ = activations.decide(
        {"m": (4, 3)}, views, Plan(params={}), 2, selected={"m"}
    )
    assert placed == {} and "a selection" in skipped["m"]
    placed, _, _ = activations.decide({"m": (4, 3)}, views, Plan(params={}), 2)
    assert placed == {"m": Replicate()}
