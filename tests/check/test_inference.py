"""Plan inference on synthetic tensors: every placement a shape admits is found from a rank's values,
the first one every rank matches wins, and another rank's shard is named as such."""
import pytest
import torch

from tpcheck.check.inference import candidates, looks_like, matches, plan_as_code
from tpcheck.plan import Fused, Plan, Replicate, Shard


@pytest.mark.parametrize("placement", [Replicate(), Shard(0), Shard(1), Fused(0, (8, 8)), Fused(0, (4, 4, 4))])
@pytest.mark.parametrize("world", [2, 4])
def test_each_placement_is_recovered_from_every_ranks_values(placement, world):
    dense = torch.randn(16 if not isinstance(placement, Fused) or len(placement.units) == 2 else 12, 8,
                        generator=torch.Generator().manual_seed(world))
    tried = candidates(tuple(dense.shape), world)
    common = set(range(len(tried)))
    for rank in range(world):
        common &= set(matches(dense, placement.shard(dense, rank, world), rank, world))
    assert tried[min(common)] == placement


def test_a_rank_holding_another_ranks_shard_is_named():
    dense = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    local = Shard(0).shard(dense, 0, 2)
    assert matches(dense, local, 1, 2) == []
    assert looks_like(dense, local, 1, 2) == "it holds rank 0's shard(dim=0): a loader that forgot the rank offset?"
    assert looks_like(dense, torch.zeros_like(local), 1, 2) is None


def test_plan_as_code_round_trips():
    plan = Plan(params={"a": Shard(1), "b": Replicate(), "c": Fused(0, (4, 4))})
    from tpcheck.plan import Fused as F  # noqa: F401 - the names the code uses
    from tpcheck.plan import Replicate as R
    from tpcheck.plan import Shard as S

    rebuilt = eval(plan_as_code(plan), {"Plan": Plan, "Shard": S, "Replicate": R, "Fused": F})
    assert rebuilt == plan
