"""Activation placements inferred for a case with no plan written: from the shapes, whether each
output is the same on every rank, whether the ranks' outputs add up to the dense one, and the
module's own weight. Every placement inferred is one a written plan would give; a bug is then
named at its module."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, CaseSpec, RunSettings, check
from tpcheck.checker.casefile import register
from tpcheck.checker.rank import activations
from tpcheck.parallel.collectives import copy_to_tp_region, reduce_from_tp_region
from tpcheck.plan import Fused, Plan, Replicate, Shard
from tpcheck.resolve import RESOLVER

PLAIN = Plan(params={"w": Shard(0)})
FUSED = Plan(params={"w": Fused(0, (4, 4))})


def _views(*per_rank):
    """Every rank's `seen` of one output named "m": (shape, hash) per rank."""
    return [{"m": [list(shape), h]} for shape, h in per_rank]


def test_the_same_dense_shaped_output_on_every_rank_is_replicated():
    placed, skipped, _ = activations.decide(
        {"m": (4, 2, 8)}, _views(((4, 2, 8), "a"), ((4, 2, 8), "a")), PLAIN, 2
    )
    assert placed == {"m": Replicate()} and skipped == {}


def test_a_partial_sum_is_not_checked_and_anything_else_that_differs_is_held_replicated():
    views = _views(((4, 2, 8), "a"), ((4, 2, 8), "b"))
    placed, skipped, _ = activations.decide({"m": (4, 2, 8)}, views, PLAIN, 2, partial={"m"})
    assert placed == {} and "a partial sum" in skipped["m"]
    placed, _, _ = activations.decide({"m": (4, 2, 8)}, views, PLAIN, 2, partial=set())
    # should be whole on every rank and is not: checked, and it fails
    assert placed == {"m": Replicate()}


def test_is_partial_sum_reads_the_sum_against_the_dense_output():
    dense = torch.randn(16, generator=torch.Generator().manual_seed(0))
    halves = [dense * 0.3, dense * 0.7]
    assert activations.is_partial_sum(halves[0].double() + halves[1].double(), dense)
    assert not activations.is_partial_sum(
        halves[0].double() + halves[1].double() + dense.double(), dense
    )


def test_a_shard_along_one_dim_is_inferred_unless_a_fused_parameter_makes_the_last_dim_ambiguous():
    views = _views(((2, 2, 8), "a"), ((2, 2, 8), "b"))
    # sequence-sharded
    assert activations.decide({"m": (4, 2, 8)}, views, FUSED, 2)[0] == {"m": Shard(0)}
    views = _views(((4, 2, 4), "a"), ((4, 2, 4), "b"))
    assert activations.decide({"m": (4, 2, 8)}, views, PLAIN, 2)[0] == {"m": Shard(2)}
    placed, skipped, _ = activations.decide({"m": (4, 2, 8)}, views, FUSED, 2)
    assert placed == {} and "fused parameter" in skipped["m"]


def test_a_linear_split_along_its_rows_gives_its_output_the_same_layout_on_the_last_dim():
    dense = nn.Module()
    dense.gate_up = nn.Linear(4, 8)
    plan = Plan(params={"gate_up.weight": Fused(0, (4, 4)), "gate_up.bias": Fused(0, (4, 4))})
    rows = activations.row_split_linears(dense, plan)
    assert rows == {"gate_up": Fused(0, (4, 4))}
    views = [{"gate_up": [[3, 4], "a"]}, {"gate_up": [[3, 4], "b"]}]
    placed, _, _ = activations.decide({"gate_up": (3, 8)}, views, plan, 2, row_split=rows)
    assert placed == {"gate_up": Fused(1, (4, 4))}
    head = Plan(
        params={
            "gate_up.weight": Shard(0),
            "gate_up.bias": Shard(0),
            "qkv.weight": Fused(0, (4, 4)),
        }
    )
    placed, _, _ = activations.decide(
        {"gate_up": (3, 8)}, views, head, 2, row_split=activations.row_split_linears(dense, head)
    )
    assert placed == {"gate_up": Shard(1)}  # its own weight decides, whatever else the plan holds


def test_outputs_the_layout_does_not_determine_are_named_with_why():
    dense = {"a": (4, 8), "b": (4, 8), "c": (4, 8), "d": (4, 8)}
    said = [
        {"b": [[4, 8], "x"], "c": [[4, 8], "x"], "d": [[4, 3], "x"]},
        {"c": [[2, 8], "y"], "d": [[4, 3], "y"]},
    ]
    placed, skipped, failed = activations.decide(dense, said, PLAIN, 2)
    assert placed == {} and failed == {}
    assert "does not call it" in skipped["a"]
    assert "not a tensor on every rank" in skipped["b"]
    assert "different shapes on the ranks" in skipped["c"]
    assert "an uneven part of the dense [4, 8] along dim 1" in skipped["d"]


@pytest.mark.parametrize(
    "local",
    [
        (8, 32),  # flattened [s*b, h]
        (4, 1, 64),  # reshaped
        (4, 2, 64),  # a dim larger than the dense one
        (4, 2, 2, 16),  # one dim more
    ],
)
def test_an_output_that_is_no_placement_of_the_dense_one_fails_at_its_module(local):
    views = _views((local, "a"), (local, "b"))
    placed, skipped, failed = activations.decide({"m": (4, 2, 32)}, views, PLAIN, 2)
    assert placed == {} and skipped == {}
    assert failed == {"m": f"its output {list(local)} is no placement of the dense [4, 2, 32]"}


@pytest.mark.parametrize("local", [(2, 4, 32), (1, 4, 32)])
def test_an_output_with_the_dense_dims_in_another_order_is_said_not_failed(local):
    """[b, s, h] for the dense [s, b, h] (or a sequence shard of it, Megatron's embedding under
    sequence parallelism): a layout convention, not comparable, said with why."""
    views = _views((local, "a"), (local, "b"))
    placed, skipped, failed = activations.decide({"m": (4, 2, 32)}, views, PLAIN, 2)
    assert placed == {} and failed == {}
    assert "dims of the dense [4, 2, 32] in another order" in skipped["m"]


def test_an_output_of_another_structure_on_the_two_sides_is_not_compared_and_not_failed():
    """A TP module that returns a tuple where the dense one returns a tensor (or the other way
    round): the capture takes the tuple's first element, which need not be the output at all."""
    views = [{"m": [[8, 32], "a", "a tuple of 2"]}, {"m": [[8, 32], "b", "a tuple of 2"]}]
    placed, skipped, failed = activations.decide({"m": (4, 2, 32)}, views, PLAIN, 2)
    assert placed == {} and failed == {}
    assert skipped["m"] == (
        "it returns a tuple of 2 on the TP side, a tensor on the dense side: not comparable"
    )
    # the same structure on both sides: comparable, and no placement of the dense output
    _, _, failed = activations.decide(
        {"m": (4, 2, 32)}, views, PLAIN, 2, dense_structures={"m": "a tuple of 2"}
    )
    assert "no placement" in failed["m"]


def _no_plan(block: str, fault: str | None = None, sp: bool = False, world: int = 2):
    """A built-in block loaded by a user loader (the block's
    own layout), with no plan and no activations."""
    spec = CaseSpec(
        block=block,
        preset="tiny",
        world_size=world,
        run=RunSettings(steps=1),
        fault=fault,
        sequence_parallel=sp,
    )
    case = RESOLVER.build(spec)
    plan = case.plan

    def load_tp(tp, state, group):
        for name, p in tp.named_parameters():
            p.copy_(plan.params[name].shard(state[name], group.rank, group.world_size))

    name = f"{block}_{fault}_{sp}_no_plan"
    return CaseSpec(
        block=register(dataclasses.replace(case, name=name, plan=None, load_tp=load_tp)),
        world_size=world,
        run=RunSettings(steps=1),
    ), case


def _dense_output_shapes(case) -> dict[str, tuple]:
    model, shapes = case.build_dense(torch.float32), {}

    def keep(name, out):
        shapes.setdefault(name, tuple((out[0] if isinstance(out, tuple) else out).shape))

    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, a, out, name=name: keep(name, out))
    inputs, _ = case.make_batch(torch.Generator().manual_seed(0), torch.float32)
    model(**inputs)
    return shapes


def _same_layout(a, b, shape, world):
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    return all(torch.equal(a.shard(x, r, world), b.shard(x, r, world)) for r in range(world))


@pytest.mark.parametrize("sp", [False, True])
def test_a_layer_with_no_plan_checks_its_modules_where_the_written_plan_does(sp):
    """The layer block, no plan and no activations given: equivalent; every output the written plan
    names is inferred with the same layout or named as not checked; the inferred ones are
    checked (act:/actgrad:)."""
    spec, case = _no_plan("layer", sp=sp)
    written, shapes = case.plan, _dense_output_shapes(case)
    (r,) = check([spec])
    assert r["verdict"] == "equivalent", r["summary"]
    code = r["inferred_plan"]
    from tpcheck.plan import AppliedOnRank  # noqa: F401 - names the printed plan may use

    inferred = eval(
        code.split("\n# not checked")[0],
        {"Plan": Plan, "Shard": Shard, "Replicate": Replicate, "Fused": Fused},
    )
    for name, placement in written.activations.items():
        if name in inferred.activations:
            assert _same_layout(inferred.activations[name], placement, shapes[name], 2), (
                name,
                code,
            )
        else:
            assert f"# not checked: {name}:" in code
    assert {"attention.o", "mlp.down", "mlp.norm"} <= set(inferred.activations)
    names = {c["name"] for c in r["checks"]}
    assert {"act:mlp.down", "actgrad:mlp.norm", "act:attention.o"} <= names


@pytest.mark.parametrize(
    "fault,first",
    [
        ("missing_backward_reduce", ("backward", "actgrad:mlp.norm")),
        ("missing_forward_reduce", ("forward", "act:mlp")),
    ],
)
def test_a_bug_in_a_case_with_no_plan_is_named_at_its_module(fault, first):
    """The missing backward all-reduce is named where the written plan names it; the missing forward
    all-reduce one module up (mlp.down's output adds up to the dense one: a partial sum, not
    checked; mlp's does not, and it is held whole), the correct twin equivalent (previous test)."""
    spec, _ = _no_plan("layer", fault=fault)
    (r,) = check([spec])
    assert r["verdict"] == "not equivalent"
    assert (r["first_divergence"]["stage"], r["first_divergence"]["name"]) == first, r["summary"]
    if fault == "missing_forward_reduce":
        assert "# not checked: mlp.down: a partial sum" in r["inferred_plan"]


# ---- a user's row-parallel module whose all-reduce comes later (vLLM's reduce_results=False)

H, FF = 8, 16


class Dense(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(H, FF, dtype=dtype)
        self.fc2 = nn.Linear(FF, H, bias=False, dtype=dtype)
        self.bias = nn.Parameter(torch.zeros(H, dtype=dtype))

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x))) + self.bias


class RowNoReduce(nn.Module):
    def __init__(self, ff, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(H, ff, dtype=dtype))

    def forward(self, h):
        return F.linear(h, self.weight)  # this rank's partial sum


class TP(nn.Module):
    def __init__(self, group, dtype=None):
        super().__init__()
        self.group = group
        self.fc1 = nn.Linear(H, FF // group.world_size, dtype=dtype)
        self.fc2 = RowNoReduce(FF // group.world_size, dtype)
        self.bias = nn.Parameter(torch.zeros(H, dtype=dtype))

    def forward(self, x):
        h = F.gelu(self.fc1(copy_to_tp_region(x, self.group, "fc1")))
        return x + reduce_from_tp_region(self.fc2(h), self.group, "fc2") + self.bias


def _load(tp, state, group):
    r, w = group.rank, group.world_size
    tp.fc1.weight.copy_(state["fc1.weight"].chunk(w, 0)[r])
    tp.fc1.bias.copy_(state["fc1.bias"].chunk(w, 0)[r])
    tp.fc2.weight.copy_(state["fc2.weight"].chunk(w, 1)[r])
    tp.bias.copy_(state["bias"])


def _batch(g, dtype):
    return {"x": torch.randn(4, 2, H, generator=g).to(dtype)}, torch.randn(4, 2, H, generator=g).to(
        dtype
    )


PARTIAL_CASE = Case(
    name="row_no_reduce",
    build_dense=Dense,
    build_tp=lambda group, dtype: TP(group, dtype),
    plan=None,
    make_batch=_batch,
    load_tp=_load,
)


def test_a_partial_sum_module_output_is_left_unchecked_not_failed():
    (r,) = check([CaseSpec(block=register(PARTIAL_CASE), world_size=2, run=RunSettings(steps=1))])
    assert r["verdict"] == "equivalent", r["summary"]
    assert "# not checked: fc2: a partial sum" in r["inferred_plan"]
    assert "'fc1': Shard(2)" in r["inferred_plan"]


def test_checker_mutant_a_partial_sum_held_whole_fails_the_correct_twin(monkeypatch):
    """Mutant: no output is ever taken for a partial sum. The correct module's fc2 output is then
    held to the dense one and fails: the partial-sum test is what keeps a correct
    model equivalent."""
    monkeypatch.setattr(activations, "is_partial_sum", lambda summed, dense: False)
    (r,) = check(
        [
            CaseSpec(
                block=register(dataclasses.replace(PARTIAL_CASE, name="row_no_reduce_mutant")),
                world_size=2,
                run=RunSettings(steps=1),
            )
        ]
    )
    assert r["verdict"] == "not equivalent" and r["first_divergence"]["name"] == "act:fc2"
