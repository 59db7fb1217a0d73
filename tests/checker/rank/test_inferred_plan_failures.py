"""Two bugs that used to end in verdict "invalid" (exit 2) are caught where they are, each beside
its correct twin (case_files/inferred_plan_failures.py):

- with no plan written, a checkpoint loader that forgot the rank offset (`full[0:k]` on every
  rank): the placement is inferred as the shard it is, and the weights stage fails the parameter on
  the ranks that hold rank 0's shard, signature `rank0_shard`, as with a written plan
  (checker/rank/plan_inference.py `misloaded`); the later steps are still checked;
- a module output larger than the dense one along a dim (a DTensor embedding without
  `input_layouts=Replicate()`, a vocab-parallel embedding that gathers where it should sum): a
  failed `act:<module>` check, signature `no_placement`, both shapes said; the run stops after that
  forward, at the model's output no placement maps (checker/rank/passes.py `Stopped`), and says so.

Each at world sizes 2 and 4 in float32 and at world size 2 in bfloat16; exit codes 1 and 0.
"""

from pathlib import Path

import pytest
import torch

from tpcheck import exit_code
from tpcheck.api import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import activations
from tpcheck.checker.rank.plan_inference import misloaded
from tpcheck.plan import Replicate, Shard

CASES = Path(__file__).parent / "case_files" / "inferred_plan_failures.py"
SETTINGS = [(2, "float32"), (4, "float32"), (2, "bfloat16")]
PAIRS = [
    ("megatron_mlp", "megatron_mlp_no_offset"),
    ("dtensor_embedding", "dtensor_embedding_no_input_layouts"),
    ("vocab_parallel_embedding", "vocab_parallel_embedding_gathered"),
]
# checked at world sizes 2 and 4 in float32 only
MORE = [
    "megatron_mlp_reversed",
    "vocab_parallel_embedding_forward_only",
    "vocab_parallel_embedding_gathered_forward_only",
    "vocab_parallel_embedding_no_grad",
    "vocab_parallel_embedding_gathered_no_grad",
]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    """Every case of the file at its settings, in one pool: {case name/tpW/dtype: result}."""
    specs = [
        file_spec(f"{CASES}:{name}", world, dtype=dtype)
        for pair in PAIRS
        for name in pair
        for world, dtype in SETTINGS
    ]
    specs += [file_spec(f"{CASES}:{name}", world) for name in MORE for world in (2, 4)]
    return {r["name"]: r for r in check(specs)}


def _first(r: dict) -> tuple:
    f = r["first_divergence"]
    return f["stage"], f["step"], f["name"], f["ranks"]


def _failed(r: dict) -> set[tuple]:
    return {(c["stage"], c["step"], c["name"], c["rank"]) for c in r["checks"] if not c["passed"]}


def _equivalent(r: dict) -> None:
    assert r["verdict"] == "equivalent", r["summary"]
    assert exit_code([r]) == 0
    assert r["self_test"]["failures"] == []


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", SETTINGS)
def test_a_loader_that_forgot_the_rank_offset_is_rank0_shard_at_the_weights(results, world, dtype):
    """plan=None, the loader slices `full[0:k]` on every rank: "not equivalent" (exit 1) at
    `param:fc1.weight` in the weights stage, on every rank but 0, `rank0_shard`, naming the loader;
    the plan inferred as the shards they are, the misloaded parameters said; step 2, restarted
    through that plan, passes. The twin (`full[rank*k:(rank+1)*k]`) is equivalent with the same
    plan."""
    ok = results[f"megatron_mlp/tp{world}/{dtype}"]
    bad = results[f"megatron_mlp_no_offset/tp{world}/{dtype}"]
    _equivalent(ok)
    others = list(range(1, world))
    assert bad["verdict"] == "not equivalent", bad["summary"]
    assert exit_code([bad]) == 1
    assert _first(bad) == ("weights", 0, "param:fc1.weight", others)
    assert bad["diagnosis"]["signature"] == "rank0_shard"
    assert "rank0_shard: every rank holds rank 0's shard" in bad["summary"]
    assert "as loaded by your load_tp (tests/checker/rank/case_files/" in bad["summary"]
    weights = {(n, r) for stage, _, n, r in _failed(bad) if stage == "weights"}
    wrong = ("param:fc1.weight", "param:fc1.bias", "param:fc2.weight")
    assert weights == {(n, r) for n in wrong for r in others}
    plan = (
        "Plan(params={\n    'fc1.weight': Shard(0),\n    'fc1.bias': Shard(0),\n"
        "    'fc2.weight': Shard(1),\n    'fc2.bias': Replicate(),\n})"
    )
    assert ok["inferred_plan"].startswith(plan) and "loaded wrong" not in ok["inferred_plan"]
    assert bad["inferred_plan"].startswith(plan)
    held = ", ".join(map(str, others))
    who = f"rank {held} holds" if world == 2 else f"ranks {held} hold"
    assert (
        f"# loaded wrong: fc1.weight: Shard(0), but {who} rank 0's shard (failed at the weights "
        "stage)"
    ) in bad["inferred_plan"]
    step2 = [c for c in bad["checks"] if c["step"] == 2]
    assert step2 and all(c["passed"] for c in step2)
    assert bad["self_test"]["failures"] == []


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_shards_loaded_in_reverse_rank_order_are_permuted_at_the_weights(results, world):
    """Every rank holds another rank's shard (the ranks numbered the other way round): no rank
    holds its own, the placement is still inferred (Shard(0)), and the weights stage fails every
    rank, `permuted`."""
    bad = results[f"megatron_mlp_reversed/tp{world}/float32"]
    assert bad["verdict"] == "not equivalent", bad["summary"]
    assert exit_code([bad]) == 1
    assert _first(bad) == ("weights", 0, "param:fc1.weight", list(range(world)))
    assert bad["diagnosis"]["signature"] == "permuted"
    assert f"rank 0 holds rank {world - 1}'s shard" in bad["inferred_plan"]


def _stopped_at_the_forward(bad: dict, world: int) -> None:
    """Nothing after the first forward was checked: no loss, backward, gradient or step 2."""
    assert {c["step"] for c in bad["checks"]} <= {0, 1}
    assert {c["stage"] for c in bad["checks"] if c["step"] == 1} == {"forward"}
    assert bad["self_test"]["failures"] == []


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", SETTINGS)
@pytest.mark.parametrize(
    "pair,tp_shape",
    [
        (PAIRS[1], lambda w: [2, 4 * w, 16]),  # the ids gathered along the sequence
        (PAIRS[2], lambda w: [2 * w, 4, 16]),  # the lookups concatenated along the batch
    ],
    ids=["dtensor_rowwise_without_input_layouts", "vocab_parallel_gathered"],
)
def test_an_embedding_output_larger_than_the_dense_one_fails_at_its_module(
    results, world, dtype, pair, tp_shape
):
    """Not equivalent (exit 1), first at `act:tok_embeddings` in the forward of step 1 on every
    rank, `no_placement`, both shapes in the summary; the head after it fails too, the model's
    output stops the run (said in the summary), and the self-test holds. The twin is
    equivalent."""
    ok = results[f"{pair[0]}/tp{world}/{dtype}"]
    bad = results[f"{pair[1]}/tp{world}/{dtype}"]
    _equivalent(ok)
    assert bad["verdict"] == "not equivalent", bad["summary"]
    assert exit_code([bad]) == 1
    assert _first(bad) == ("forward", 1, "act:tok_embeddings", list(range(world)))
    shapes = f"its output {tp_shape(world)} is no placement of the dense [2, 4, 16]"
    assert bad["diagnosis"]["signature"] == "no_placement"
    assert bad["diagnosis"]["location"] == "tok_embeddings"
    assert (
        f"act:tok_embeddings (forward, step 1) on rank(s) {list(range(world))}: "
        in (bad["summary"])
    )
    assert f"no_placement: {shapes}" in bad["summary"]
    assert bad["activations"]["no_placement"]["tok_embeddings"] == shapes
    names = {n for _, _, n, _ in _failed(bad)}
    assert names == {"act:tok_embeddings", "act:head", "output"}
    assert (
        "not checked: the loss, the backward and the optimizer of step 1 and every step after it: "
        f"the run stopped at the TP model's output (output): {shapes}"
    ) in bad["summary"]
    _stopped_at_the_forward(bad, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_forward_only_and_the_forward_without_autograd_stop_at_the_same_bug(results, world):
    """Checked forward only, the gathered embedding fails at its module and stops at the output;
    with a forward without autograd first (`no_grad_forward`, no module outputs captured there), it
    fails at `output:no_grad`. Both twins are equivalent."""
    for ok in ("vocab_parallel_embedding_forward_only", "vocab_parallel_embedding_no_grad"):
        _equivalent(results[f"{ok}/tp{world}/float32"])
    shapes = f"its output [{2 * world}, 4, 16] is no placement of the dense [2, 4, 16]"
    bad = results[f"vocab_parallel_embedding_gathered_forward_only/tp{world}/float32"]
    assert exit_code([bad]) == 1
    assert _first(bad) == ("forward", 1, "act:tok_embeddings", list(range(world)))
    assert bad["diagnosis"]["signature"] == "no_placement"
    _stopped_at_the_forward(bad, world)
    bad = results[f"vocab_parallel_embedding_gathered_no_grad/tp{world}/float32"]
    assert exit_code([bad]) == 1
    assert _first(bad) == ("forward", 1, "output:no_grad", list(range(world)))
    assert bad["diagnosis"]["signature"] == "no_placement" and shapes in bad["summary"]
    _stopped_at_the_forward(bad, world)


# ---- the rules on their own


def test_misloaded_places_a_parameter_held_as_another_ranks_shard():
    """Every rank's values another rank's shard, or its own, under one placement: that placement,
    the one the most ranks hold their own shard of; values no rank's shard explains: none."""
    tried = [Replicate(), Shard(0), Shard(1)]
    own, zero = {"matches": [1], "holds": []}, {"matches": [], "holds": [[1, 0]]}
    assert misloaded([own, zero, zero], tried) == (
        Shard(0),
        "Shard(0), but ranks 1, 2 hold rank 0's shard",
    )
    swapped = [{"matches": [], "holds": [[2, 1]]}, {"matches": [], "holds": [[2, 0]]}]
    assert misloaded(swapped, tried) == (
        Shard(1),
        "Shard(1), but rank 0 holds rank 1's shard, rank 1 holds rank 0's shard",
    )
    # rank 1's values are another rank's shard under Shard(1), which rank 0 does not hold
    assert misloaded([own, {"matches": [], "holds": [[2, 0]]}], tried) is None
    assert misloaded([own, {"matches": [], "holds": []}], tried) is None
    # every rank holds its own: nothing misloaded
    assert misloaded([own, own], tried) is None


@pytest.mark.parametrize(
    "local,why",
    [
        ((2, 8, 16), "its output [2, 8, 16] is no placement of the dense [2, 4, 16]"),
        ((4, 4, 16), "its output [4, 4, 16] is no placement of the dense [2, 4, 16]"),
        ((8, 16), "its output [8, 16] is no placement of the dense [2, 4, 16]"),
        ((2, 4, 16), None),  # the dense shape: a replica
        ((2, 4, 8), None),  # a shard of the last dim: another placement, the plan's to fix
        ((4, 2, 16), None),  # the dense dims in another order: said, not failed
    ],
)
def test_an_output_no_placement_maps_is_told_from_one_the_written_placement_misses(local, why):
    dense = torch.zeros(2, 4, 16)
    assert activations.unmappable(torch.zeros(local), dense, Replicate(), 0, 2) == why
    assert activations.no_placement(local, (2, 4, 16), 2) == why
    # the written placement's own shard: comparable
    assert activations.unmappable(torch.zeros(2, 4, 8), dense, Shard(2), 1, 2) is None


@pytest.mark.slow
def test_the_report_of_each_bug_validates_and_prints_its_plan(results):
    """The JSON report of the caught bugs and their twins validates against the schema; the printed
    plans say which parameters were loaded wrong and which module outputs failed."""
    import json

    from tpcheck.cli.execute import plans_text
    from tpcheck.report.schema import build_report, load_schema
    from tpcheck.report.validate import first_error

    cases = [results[f"{name}/tp2/float32"] for pair in PAIRS for name in pair]
    report = build_report(cases, exit_code=exit_code(cases))
    assert exit_code(cases) == 1
    assert first_error(json.loads(json.dumps(report)), load_schema()) is None
    text = plans_text(cases)
    assert "# loaded wrong: fc1.weight: Shard(0), but rank 1 holds rank 0's shard" in text
    assert "# failed: tok_embeddings: its output [4, 4, 16] is no placement" in text
