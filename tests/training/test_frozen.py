"""Partly frozen TP (checker/rank/frozen.py): inference-style TP layers whose sliced weights are
built with `requires_grad=False` while the norm and the biases train. The dense side follows what
every TP rank froze, the report says so, and the rest is checked as ever: equivalent; a bias
counted world-size times in the same frozen block is caught at the forward. Frozen on one rank
only is refused naming the rank. (Before, any parameter frozen on the TP side alone was refused:
"freeze it on both sides or on neither".)"""

import pytest

from tpcheck import CaseSpec, RunSettings, check, exit_code

from paths import REPO

FILE = REPO / "tests" / "training" / "case_files" / "megatron_style.py"
GRID = [
    (2, "float32"),
    pytest.param(2, "bfloat16", marks=pytest.mark.slow),
    pytest.param(4, "float32", marks=pytest.mark.slow),
    pytest.param(4, "bfloat16", marks=pytest.mark.slow),
]
NOTE = "the TP side keeps frozen (requires_grad=False): fc1.weight, fc2.weight"


def spec(name, world=2, dtype="float32"):
    return CaseSpec(
        block=f"file:{FILE}:{name}", world_size=world, run=RunSettings(dtype=dtype, steps=2)
    )


@pytest.mark.parametrize("world,dtype", GRID)
def test_frozen_sliced_weights_are_followed_and_a_bias_twice_is_caught(world, dtype):
    ok, bad = check(
        [spec("frozen_weights", world, dtype), spec("frozen_weights_bias_twice", world, dtype)]
    )
    assert ok["verdict"] == "equivalent", ok["summary"]
    assert NOTE in ok["summary"], ok["summary"]
    names = {c["name"] for c in ok["checks"]}
    # checked as loaded, trained where they train
    assert {"param:fc1.weight", "grad:fc1.bias", "update:norm.weight"} <= names
    assert not {"grad:fc1.weight", "update:fc2.weight"} & names
    assert bad["verdict"] == "not equivalent", bad["summary"]
    first = bad["first_divergence"]
    assert (first["stage"], first["step"]) == ("forward", 1), first
    assert exit_code([ok]) == 0 and exit_code([bad]) == 1


def test_a_bias_frozen_on_the_tp_side_alone_is_followed_and_frozen_on_one_rank_refused():
    bias, one_rank = check([spec("frozen_bias"), spec("frozen_on_rank0")])
    assert bias["verdict"] == "equivalent", bias["summary"]
    assert "keeps frozen (requires_grad=False): fc1.bias" in bias["summary"]
    assert one_rank["verdict"] == "invalid", one_rank["summary"]
    assert "'fc1.bias' has requires_grad=False on rank 0 of the TP side" in one_rank["summary"]
