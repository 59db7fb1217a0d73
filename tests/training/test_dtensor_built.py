"""DTensor TP built as trainers build it. A case file's `build_tp` may return the
`parallelize_module` result itself (DTensor parameters) with `plan=None` and the trainer's own
loader: the engine sees it through `LocalShards` (the plan inferred from the loaded shards, the
loader handed the module as built); it crashed inside the plan inference before (`aten.equal`
on mixed tensors, exit 3). And `dtensor_case(prepare=...)`: the framework's preparation before
`parallelize_module` (the head count divided by the ranks). Each correct case equivalent; the
same with the head width divided instead of the count caught at the attention's output."""

import pytest

from tpcheck import check, exit_code
from tpcheck.checker.casefile import file_spec

from paths import REPO

FILE = REPO / "tests" / "training" / "case_files" / "dtensor_built.py"
PAIRS = [("built", "built_heads_not_divided"), ("prepared", "prepared_heads_not_divided")]


def _check_pairs(world, dtype):
    names = [n for pair in PAIRS for n in pair]
    results = dict(zip(names, check([file_spec(f"{FILE}:{n}", world, dtype=dtype) for n in names])))
    for good, bad in PAIRS:
        ok, wrong = results[good], results[bad]
        assert ok["verdict"] == "equivalent", (good, ok["summary"])
        assert wrong["verdict"] == "not equivalent", (bad, wrong["summary"])
        first = wrong["first_divergence"]
        assert (first["stage"], first["step"], first["name"]) == (
            "forward",
            1,
            "act:attn.o_proj",
        ), first
        assert exit_code([ok]) == 0 and exit_code([wrong]) == 1
    # the module built by the case file is checked module by module and parameter by parameter
    names = {c["name"] for c in results["built"]["checks"]}
    assert {"act:attn.q_proj", "act:down", "param:attn.o_proj.weight", "grad:up.bias"} <= names


def test_a_parallelize_module_result_and_a_preparation_step_world_2():
    _check_pairs(2, "float32")


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", [(4, "float32"), (2, "bfloat16")])
def test_the_same_at_world_4_and_in_bfloat16(world, dtype):
    _check_pairs(world, dtype)
