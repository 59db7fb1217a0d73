"""Placements are pure indexing; unshard(shard(x)) == x for every placement and world size."""

import math

import pytest
import torch

from tpcheck.errors import UsageError
from tpcheck.plan import AppliedOnRank, Fused, OnRank, Placement, Plan, Replicate, Shard, validate


def unshard(
    placement: Placement, locals_: list[torch.Tensor], shape: tuple[int, ...]
) -> tuple[torch.Tensor, float]:
    """Reassemble rank-local tensors into the dense tensor. Returns (dense, replica_spread): the max
    abs difference between copies of one element held by several ranks (0.0 when
    they agree bitwise)."""
    world = len(locals_)
    flat = torch.full((math.prod(shape),), float("nan"), dtype=torch.float64)
    lo = torch.full_like(flat, float("inf"))
    hi = torch.full_like(flat, float("-inf"))
    for rank, local in enumerate(locals_):
        idx = placement.index_map(shape, rank, world).reshape(-1)
        vals = local.detach().reshape(-1).to(torch.float64)
        flat[idx] = vals
        lo[idx] = torch.minimum(lo[idx], vals)
        hi[idx] = torch.maximum(hi[idx], vals)
    spread = (hi - lo).nan_to_num(nan=float("inf"))
    return flat.reshape(shape), float(spread.max()) if spread.numel() else 0.0


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("placement", [Replicate(), Shard(0), Shard(1), Fused(0, (12, 12))])
def test_roundtrip(placement, world):
    x = torch.randn(24, 12)
    locals_ = [placement.shard(x, r, world) for r in range(world)]
    dense, spread = unshard(placement, locals_, tuple(x.shape))
    assert torch.equal(dense.float(), x)
    assert spread == 0.0


def test_fused_rank_holds_its_gate_and_up_rows():
    ffn, world = 4, 2
    gate = torch.arange(ffn).float()[:, None]  # rows 0..3
    up = 100 + torch.arange(ffn).float()[:, None]
    dense = torch.cat([gate, up])  # [gate; up] = [8, 1]
    p = Fused(0, (ffn, ffn))
    assert p.shard(dense, 0, world).flatten().tolist() == [0, 1, 100, 101]
    assert p.shard(dense, 1, world).flatten().tolist() == [2, 3, 102, 103]
    # Concatenating the shards gives [g0; u0; g1; u1], not the dense [g; u].
    cat = torch.cat([p.shard(dense, r, world) for r in range(world)])
    assert not torch.equal(cat, dense)


def test_fused_replicates_parts_with_fewer_units_than_ranks():
    # q: 4 heads, k: 1 head, head size 2; at world 4 every rank holds k head 0.
    p = Fused(0, (4, 1), (2, 2))
    dense = torch.arange(10).float()
    assert [p.shard(dense, r, 4).tolist() for r in range(4)] == [
        [0, 1, 8, 9],
        [2, 3, 8, 9],
        [4, 5, 8, 9],
        [6, 7, 8, 9],
    ]
    locals_ = [p.shard(dense, r, 4) for r in range(4)]
    locals_[3] = locals_[3].clone()
    locals_[3][-1] += 1.0  # one replica differs
    _, spread = unshard(p, locals_, (10,))
    assert spread == 1.0


def test_shard_not_dividing_names_both_numbers():
    with pytest.raises(UsageError, match=r"size 12.*world size 5"):
        validate(Shard(0), (12, 3), 5, "w")


def test_plan_missing_parameter_is_an_error():
    dense = torch.nn.Linear(4, 4)
    with pytest.raises(UsageError, match="no placement for dense parameter.*bias"):
        Plan(params={"weight": Shard(0)}).check_against(dense, 2)
    with pytest.raises(UsageError, match="does not have"):
        Plan(params={"weight": Shard(0), "bias": Replicate(), "extra": Replicate()}).check_against(
            dense, 2
        )


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)


TWO_LINEARS_PLAN = {
    "fc1.weight": Shard(0),
    "fc1.bias": Shard(0),
    "fc2.weight": Shard(1),
    "fc2.bias": Replicate(),
}


def _message(params: dict, dense: torch.nn.Module) -> str:
    with pytest.raises(UsageError) as raised:
        Plan(params=params).check_against(dense, 2)
    return str(raised.value)


def test_a_typo_in_a_plan_key_is_named_with_did_you_mean():
    """The typo'd key, not only the real parameter it leaves without a placement: the closest name
    among those unplaced ('fc1.weight', not the already placed 'fc2.weight'), and the fix."""
    params = dict(TWO_LINEARS_PLAN)
    params["fc1.weigth"] = params.pop("fc1.weight")
    message = _message(params, TwoLinears())
    assert message.startswith(
        "plan names parameter(s) ['fc1.weigth'] that the dense module does not have (did you mean "
        "'fc1.weight' for 'fc1.weigth'?); rename each to the dense parameter it places"
    )
    assert "the plan has no placement for dense parameter(s) ['fc1.weight']" in message
    assert "dense parameters are ['fc1.bias', 'fc1.weight', 'fc2.bias', 'fc2.weight']" in message


def test_an_unknown_key_with_nothing_unplaced_is_matched_against_every_name():
    params = {**TWO_LINEARS_PLAN, "fc2.weights": Replicate(), "zzz": Replicate()}
    message = _message(params, TwoLinears())
    assert (  # zzz: nothing close
        "parameter(s) ['fc2.weights', 'zzz'] that the dense module does not have (did you mean "
        "'fc2.weight' for 'fc2.weights'?);" in message
    )
    assert "no placement" not in message


def test_a_big_dense_module_is_counted_not_listed():
    dense = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(30)))
    params = {n: Replicate() for n, _ in dense.named_parameters()}
    params["29.wieght"] = params.pop("29.weight")
    message = _message(params, dense)
    assert "(did you mean '29.weight' for '29.wieght'?)" in message
    assert message.endswith("; the dense module has 60 parameters")


def test_applied_on_rank_names_a_rank_the_world_has():
    dense = torch.nn.Linear(4, 4)
    Plan(params={"weight": Shard(0), "bias": AppliedOnRank(1)}).check_against(dense, 2)
    with pytest.raises(
        UsageError,
        match=r"'bias' \[4\]: AppliedOnRank\(2\) names a rank that world size 2 does not have",
    ):
        Plan(params={"weight": Shard(0), "bias": AppliedOnRank(2)}).check_against(dense, 2)
    for bad in (-1, 0.5, True):
        with pytest.raises(UsageError, match="is a rank number"):
            AppliedOnRank(bad)


def test_on_rank_holds_the_whole_tensor_on_one_rank_and_nothing_elsewhere():
    """OnRank(r): rank r's shard is the dense tensor, every other rank's is empty (its module has no
    parameter of that name); the shards reassemble the dense tensor, nothing is held twice."""
    from tpcheck.plan import copies

    x = torch.randn(6, 4)
    p = OnRank(1)
    locals_ = [p.shard(x, r, 3) for r in range(3)]
    assert torch.equal(locals_[1], x) and locals_[0].numel() == locals_[2].numel() == 0
    assert [p.held_on(r, 3) for r in range(3)] == [False, True, False]
    assert Replicate().held_on(0, 3) and AppliedOnRank(1).held_on(0, 3)
    dense, spread = unshard(p, locals_, tuple(x.shape))
    assert torch.equal(dense.float(), x) and spread == 0.0
    assert copies(p, tuple(x.shape), 3) is None
    assert p.applied_on == 1 and not p.replicated and str(p) == "on rank 1 only"


def test_on_rank_names_a_rank_the_world_has():
    import tpcheck

    assert tpcheck.OnRank is OnRank
    dense = torch.nn.Linear(4, 4)
    Plan(params={"weight": Shard(1), "bias": OnRank(1)}).check_against(dense, 2)
    with pytest.raises(
        UsageError, match=r"'bias' \[4\]: OnRank\(2\) names a rank that world size 2 does not have"
    ):
        Plan(params={"weight": Shard(1), "bias": OnRank(2)}).check_against(dense, 2)
    for bad in (-1, 0.5, True):
        with pytest.raises(UsageError, match="is a rank number"):
            OnRank(bad)


class DropLastRow(Shard):
    def shard(self, dense, rank, world):
        return super().shard(dense, rank, world)[:-1]


def test_plan_that_leaves_elements_uncovered_is_an_error():
    with pytest.raises(UsageError, match="leaves 4 of 8 elements on no rank"):
        validate(DropLastRow(0), (4, 2), 2, "w")


def test_copies_counts_the_ranks_holding_each_element():
    """Elements several ranks hold (a fused part with fewer units than ranks: GQA KV heads) are what
    the checker compares across ranks; plain shards hold each element once and
    need no index maps."""
    from tpcheck.plan import copies

    assert copies(Shard(0), (8, 4), 4) is None
    assert copies(Fused(0, (4, 4)), (8, 4), 2) is None  # every part splits over the ranks
    # q: 4 rows sharded; kv: one unit of 2 rows on all 4
    held = copies(Fused(0, (4, 1), (1, 2)), (6, 3), 4)
    assert held is not None
    rows = held.reshape(6, 3)[:, 0].tolist()
    assert rows == [1, 1, 1, 1, 4, 4]


def test_copies_of_a_user_placement_without_a_hash():
    """A user's placement need not be hashable: counted without the cache."""
    from tpcheck.plan import Placement, copies

    class Everywhere(Placement):
        __hash__ = None

        def shard(self, dense, rank, world):
            return dense

    held = copies(Everywhere(), (2, 2), 3)
    assert held is not None and held.tolist() == [3, 3, 3, 3]
