"""A packed weight sharded as one block (case_files/fused_qkv.py): a fused [q; k; v] projection
whose weight a user's loader, or a written plan, shards as contiguous rows. The weight is a fine
`Shard(0)` of the dense one; the bug shows where the attention code splits the local output
into q, k and v. The diagnosis (`packed_shard`, checker/verdict/mechanisms.py) names the weight,
the split's line, and the `Fused` placement that shards each part on its own; that placement,
written in the plan, makes the case equivalent. The correct loader is equivalent.

Checker mutant: the split's producer not annotated with its weight (shard_ops.packed a no-op): the
same failure reads `replicas_differ` with no weight named."""

import pytest

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.casefile import file_spec, load_module, register
from tpcheck.checker.rank import shard_ops
from tpcheck.plan import Fused

from paths import REPO

FILE = REPO / "tests" / "checker" / "rank" / "case_files" / "fused_qkv.py"
GRID = [
    (2, "float32"),
    pytest.param(2, "bfloat16", marks=pytest.mark.slow),
    pytest.param(4, "float32", marks=pytest.mark.slow),
    pytest.param(4, "bfloat16", marks=pytest.mark.slow),
]


def run(name, world=2, dtype="float32"):
    (r,) = check([file_spec(f"{FILE}:{name}", world, dtype=dtype)])
    return r


@pytest.mark.parametrize(("world", "dtype"), GRID)
def test_a_fused_qkv_loaded_as_one_block_is_named_at_its_weight(world, dtype):
    correct, buggy = run("fused_qkv", world, dtype), run("contiguous_qkv", world, dtype)
    assert correct["verdict"] == "equivalent", correct["summary"]
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    d = buggy["diagnosis"]
    assert d["signature"] == "packed_shard", d
    assert d["evidence"]["weight"] == "attn.qkv.weight"
    assert d["evidence"]["placement"] == "Shard(0)"
    assert d["evidence"]["suggested"] == "Fused(0, (64, 32, 32))"
    assert d["evidence"]["split_at"].endswith("fused_qkv.py:70")


def test_in_a_written_plan_the_suggested_placement_makes_it_equivalent():
    buggy = run("contiguous_in_plan")
    assert buggy["diagnosis"]["signature"] == "packed_shard", buggy["summary"]
    suggested = eval(buggy["diagnosis"]["evidence"]["suggested"], {"Fused": Fused})
    assert suggested == Fused(0, (64, 32, 32))
    fixed = register(load_module(str(FILE)).in_plan(suggested, "fused_qkv_fixed_plan"))
    (r,) = check([CaseSpec(block=fixed, world_size=2, run=RunSettings(steps=1))])
    assert r["verdict"] == "equivalent", r["summary"]


def test_without_the_weight_beside_the_split_the_failure_names_no_weight(monkeypatch):
    monkeypatch.setattr(shard_ops, "packed", lambda ops, plan, shapes: ops)
    r = run("contiguous_qkv")
    assert r["verdict"] == "not equivalent"
    assert r["diagnosis"]["signature"] != "packed_shard", r["diagnosis"]
