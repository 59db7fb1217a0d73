"""The restart before every step after the first writes the dense weights into the TP module's own
parameters, in place, through the plan; the user's loader runs once. State a loader derives from the
weights and nothing rebuilds (case_files/weight_cache.py: a transposed copy the forward reads) then
goes stale as in training and is caught at the step it first matters; its correct twins (the copy
rebuilt when the weight changed, or marked stale by a hook) are equivalent."""

from pathlib import Path

import pytest
import torch
from torch import nn

from tpcheck.api import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import optimizer_stage, sides
from tpcheck.checker.rank.loading import restart_in_place
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import OnRank, Plan, Replicate, Shard

CASES = Path(__file__).parent / "case_files" / "weight_cache.py"
NAMES = [
    "stale_cache",
    "stale_cache_no_plan",
    "rebuilt_in_forward",
    "invalidated_by_hook",
    "loads_once",
]


def _run(names, **run):
    specs = [file_spec(f"{CASES}:{n}", 2, **run) for n in names]
    return dict(zip(names, check(specs)))


@pytest.fixture(scope="module")
def results():
    return _run(NAMES)


def _first(r):
    f = r["first_divergence"]
    return f["stage"], f["step"], f["name"]


@pytest.mark.parametrize("name", ["stale_cache", "stale_cache_no_plan"])
def test_a_derived_cache_nothing_rebuilds_is_caught_at_step_2_forward(results, name):
    r = results[name]
    assert r["verdict"] == "not equivalent", r["summary"]
    assert _first(r) == ("forward", 2, "act:fc1"), r["summary"]
    # step 1 computes from the weights as loaded: every check up to its optimizer step passes
    assert all(c["passed"] for c in r["checks"] if c["step"] <= 1)


@pytest.mark.parametrize("name", ["rebuilt_in_forward", "invalidated_by_hook", "loads_once"])
def test_a_cache_rebuilt_after_the_weights_change_is_equivalent(results, name):
    r = results[name]
    assert r["verdict"] == "equivalent", r["summary"]
    assert {c["step"] for c in r["checks"] if c["stage"] == "optimizer"} == {1, 2, 3}


def test_the_loader_is_called_once_per_rank_and_checked_at_the_weights_stage(results):
    """`loads_once` refuses a second load of its module (a RuntimeError: "invalid"); three steps
    pass, and its loads are held to the plan bitwise at the weights stage on both ranks."""
    r = results["loads_once"]
    assert r["verdict"] == "equivalent", r["summary"]
    weights = [c for c in r["checks"] if c["stage"] == "weights"]
    assert {c["rank"] for c in weights} == {0, 1}
    assert all("load_tp" in (c.get("loaded_by") or "") for c in weights)


def test_a_restart_through_the_loader_hides_the_stale_cache(monkeypatch):
    """Checker mutant: the restart goes back through the user's loader (each step rebuilds what it
    derives): the stale cache then reads "equivalent", and the loader that loads once is called
    again (its refusal: "invalid", naming it)."""

    def through_the_loader(s, opts):
        kept = {n: p for n, p in s.tp.named_parameters()}
        sides._load_tp(s.case, s.tp, s.dense, s.group, s.dtype)
        assert all(p is kept[n] for n, p in s.tp.named_parameters())

    monkeypatch.setattr(optimizer_stage, "restart_tp", through_the_loader)
    r = _run(["stale_cache", "loads_once"])
    assert r["stale_cache"]["verdict"] == "equivalent", r["stale_cache"]["summary"]
    assert r["loads_once"]["verdict"] == "invalid", r["loads_once"]["summary"]
    assert "load_tp was called a second time" in r["loads_once"]["summary"]


# ------------------------------------------------------------------------------ restart_in_place


class Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 4)


class TP(nn.Module):
    """Rank 1 of 2: fc1 renamed `up`, column-parallel; fc2's bias only on rank 0 (OnRank)."""

    def __init__(self, extra=False):
        super().__init__()
        self.up = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 4, bias=False)
        self.register_buffer("up_t", self.up.weight.detach().t().clone())
        if extra:
            self.scale = nn.Parameter(torch.ones(4))


PLAN = Plan(
    params={
        "fc1.weight": Shard(0),
        "fc1.bias": Shard(0),
        "fc2.weight": Shard(1),
        "fc2.bias": OnRank(0),
    },
    tp_names={"fc1.weight": "up.weight", "fc1.bias": "up.bias"},
)
RANK1 = TPGroup(rank=1, world_size=2)


def test_restart_writes_the_plans_shards_into_the_same_parameters():
    dense, tp = Dense(), TP()
    before = dict(tp.named_parameters())
    cache = tp.up_t.clone()
    restart_in_place(tp, dense, PLAN, RANK1)
    assert all(p is before[n] for n, p in tp.named_parameters())
    assert torch.equal(tp.up.weight, dense.fc1.weight[3:])
    assert torch.equal(tp.up.bias, dense.fc1.bias[3:])
    assert torch.equal(tp.fc2.weight, dense.fc2.weight[:, 3:])
    assert torch.equal(tp.up_t, cache)  # what the module derived is not touched


def test_restart_refuses_a_tp_parameter_the_plan_does_not_place():
    dense, tp = Dense(), TP(extra=True)
    with pytest.raises(UsageError) as e:
        restart_in_place(tp, dense, PLAN, RANK1)
    text = str(e.value)
    assert "['scale']" in text and "no placement in the plan" in text
    assert "tp_names" in text  # the fix


def test_restart_refuses_a_shard_of_another_shape():
    dense, tp = Dense(), TP()
    plan = Plan(params={**PLAN.params, "fc1.weight": Replicate()}, tp_names=PLAN.tp_names)
    with pytest.raises(UsageError, match="'up.weight' on rank 1"):
        restart_in_place(tp, dense, plan, RANK1)
