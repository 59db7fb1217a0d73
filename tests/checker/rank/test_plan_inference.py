"""Plan inference on synthetic tensors: every placement a shape admits is found from a rank's
values, the first one every rank matches wins, and another rank's shard is named as such."""

import pytest
import torch

from tpcheck.checker.rank.plan_inference import candidates, looks_like, matches, plan_as_code
from tpcheck.plan import Fused, Plan, Replicate, Shard


@pytest.mark.parametrize(
    "placement", [Replicate(), Shard(0), Shard(1), Fused(0, (8, 8)), Fused(0, (4, 4, 4))]
)
@pytest.mark.parametrize("world", [2, 4])
def test_each_placement_is_recovered_from_every_ranks_values(placement, world):
    dense = torch.randn(
        16 if not isinstance(placement, Fused) or len(placement.units) == 2 else 12,
        8,
        generator=torch.Generator().manual_seed(world),
    )
    tried = candidates(tuple(dense.shape), world)
    common = set(range(len(tried)))
    for rank in range(world):
        common &= set(matches(dense, placement.shard(dense, rank, world), rank, world))
    assert tried[min(common)] == placement


def test_a_rank_holding_another_ranks_shard_is_named():
    dense = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    local = Shard(0).shard(dense, 0, 2)
    assert matches(dense, local, 1, 2) == []
    assert (
        looks_like(dense, local, 1, 2)
        == "it holds rank 0's shard(dim=0): a loader that forgot the rank offset?"
    )
    assert looks_like(dense, torch.zeros_like(local), 1, 2) is None


def test_plan_as_code_round_trips():
    plan = Plan(params={"a": Shard(1), "b": Replicate(), "c": Fused(0, (4, 4))})
    from tpcheck.plan import Fused as F  # noqa: F401 - the names the code uses
    from tpcheck.plan import Replicate as R
    from tpcheck.plan import Shard as S

    rebuilt = eval(plan_as_code(plan), {"Plan": Plan, "Shard": S, "Replicate": R, "Fused": F})
    assert rebuilt == plan


def test_plan_as_code_round_trips_on_rank_and_tp_names():
    """A parameter on one rank and renamed TP parameters print as code that rebuilds the plan; the
    names matched by values are listed as comments."""
    from tpcheck.plan import OnRank

    plan = Plan(
        params={"fc.weight": Shard(1), "fc.bias": OnRank(1)},
        tp_names={"fc.weight": "module.fc.weight", "fc.bias": "proj.bias"},
    )
    code = plan_as_code(plan, by_values={"fc.bias": "proj.bias"})
    assert code.endswith(
        "\n# matched by values (no TP parameter has the dense name): check these tp_names"
        "\n#   'fc.bias' -> 'proj.bias'"
    )
    assert eval(code, {"Plan": Plan, "Shard": Shard, "OnRank": OnRank}) == plan


@pytest.mark.parametrize("world,kv", [(2, 2), (2, 4), (4, 2), (4, 1), (8, 2)])
def test_uneven_fused_qkv_is_proposed_by_rank_0_and_matched_on_every_rank(world, kv):
    """GQA's fused [q; k; v] with fewer KV heads than query heads, KV heads sharded (kv >= world) or
    replicated over ranks (kv < world): the shape alone does not say where q ends,
    rank 0's values do."""
    from tpcheck.checker.rank.plan_inference import uneven_fused

    heads, hd, hidden = 8, 4, 16
    true = Fused(0, (heads, kv, kv), (hd, hd, hd))
    dense = torch.randn(
        (heads + 2 * kv) * hd, hidden, generator=torch.Generator().manual_seed(world * 10 + kv)
    )
    locals_ = [true.shard(dense, r, world) for r in range(world)]
    assert not matches(dense, locals_[0], 0, world)  # no shape-derived candidate explains it
    tried = candidates(tuple(dense.shape), world) + uneven_fused(dense, locals_[0], world)
    common = set(range(len(tried)))
    for r in range(world):
        common &= set(matches(dense, locals_[r], r, world, tried))
    found = tried[min(common)]
    assert all(torch.equal(found.shard(dense, r, world), locals_[r]) for r in range(world))
    rebuilt = eval(plan_as_code(Plan(params={"qkv": found})), {"Plan": Plan, "Fused": Fused})
    assert rebuilt.params["qkv"] == found


def test_a_contiguous_split_of_a_fused_qkv_is_inferred_as_the_shard_it_is():
    """A loader that split [q; k; v] contiguously (the classic bug) holds `Shard(0)` of the dense
    weight; no uneven-fused proposal claims it too, so the plan says what the loader did (and the TP
    forward's values then fail)."""
    from tpcheck.checker.rank.plan_inference import uneven_fused

    dense = torch.randn((8 + 4) * 4, 16, generator=torch.Generator().manual_seed(3))
    naive = [Shard(0).shard(dense, r, 2) for r in range(2)]
    tried = candidates(tuple(dense.shape), 2) + uneven_fused(dense, naive[0], 2)
    common = set(matches(dense, naive[0], 0, 2, tried)) & set(matches(dense, naive[1], 1, 2, tried))
    assert [tried[i] for i in common] == [Shard(0)]


@pytest.mark.parametrize("world,kv", [(2, 2), (4, 2)])
def test_a_gqa_attention_loaded_by_its_own_loader_is_checked_with_no_plan_written(world, kv):
    """The built-in attention block (fused [q; k; v], 8 query heads, `kv` KV heads, sharded at world
    2, replicated over ranks at world 4) loaded by a user loader, with no plan: the plan is
    inferred, uneven fused parts included, and the case is equivalent."""
    import dataclasses

    from tpcheck import CaseSpec, RunSettings, check
    from tpcheck.blocks.attention import BLOCK
    from tpcheck.blocks.base import config_for
    from tpcheck.checker.casefile import register

    spec = CaseSpec(
        block="attention",
        preset="tiny",
        world_size=world,
        run=RunSettings(steps=1),
        overrides=(("heads", 8), ("kv_heads", kv), ("hidden", 64)),
    )
    case = BLOCK.case(spec, config_for(spec))
    plan = case.plan

    def load_tp(tp, state, group):
        for name, p in tp.named_parameters():
            p.copy_(plan.params[name].shard(state[name], group.rank, group.world_size))

    mine = register(
        dataclasses.replace(
            case,
            name=f"gqa_no_plan_{world}",
            plan=None,
            load_tp=load_tp,
            activations=dict(plan.activations),
        )
    )
    (r,) = check([CaseSpec(block=mine, world_size=world, run=RunSettings(steps=1))])
    assert r["verdict"] == "equivalent", r["summary"]
    assert "'qkv.weight': Fused(0, " in r["inferred_plan"]


def test_a_weight_split_unevenly_is_named_with_the_world_sizes_that_divide_it():
    """A loader that splits a [4, 10] weight over 3 ranks (tensor_split: 2, 1, 1 rows): no dim
    divides by 3, so only a replica can be inferred; the case is invalid naming the parameter, the
    world size and the world sizes that would divide it -- not "none of replicate" alone."""
    from torch import nn

    from tpcheck import Case, CaseSpec, RunSettings, check
    from tpcheck.checker.casefile import register

    class TP(nn.Module):
        def __init__(self, group, dtype):
            super().__init__()
            rows = torch.zeros(4).tensor_split(group.world_size)[group.rank].numel()
            self.lin = nn.Linear(10, rows, dtype=dtype)

        def forward(self, x):
            return self.lin(x)

    def load_tp(tp, state, group):
        for name in ("weight", "bias"):
            getattr(tp.lin, name).copy_(
                state[f"lin.{name}"].tensor_split(group.world_size)[group.rank]
            )

    case = Case(
        name="uneven",
        build_dense=_Dense,
        build_tp=TP,
        plan=None,
        load_tp=load_tp,
        make_batch=lambda g, dtype: (
            {"x": torch.randn(3, 10, generator=g).to(dtype)},
            torch.randn(3, 4, generator=g).to(dtype),
        ),
    )
    (r,) = check(
        [CaseSpec(block=register(case), world_size=3, run=RunSettings(steps=1))], timeout_s=30
    )
    assert r["verdict"] == "invalid", r["summary"]
    assert (
        "cannot infer a placement for parameter 'lin.weight' [4, 10] at world size 3: no dim "
        "divides by 3, so only a replica was tried"
    ) in r["summary"], r["summary"]
    assert "(2, 4, 5 divide one of its dims)" in r["summary"], r["summary"]


class _Dense(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.lin = torch.nn.Linear(10, 4, dtype=dtype)

    def forward(self, x):
        return self.lin(x)
