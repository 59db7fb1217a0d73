"""A row-parallel bias added before an all-reduce that a forward hook does (case_files/
hook_reduce.py, the reduce put on the dense `nn.Linear` from outside) is diagnosed `offset`, the
bias counted world-size times, as when the all-reduce is inside the module; the bias added after
the hook is equivalent."""

import pytest

from tpcheck import check
from tpcheck.checker.casefile import file_spec

from paths import REPO

FILE = REPO / "tests" / "checker" / "rank" / "case_files" / "hook_reduce.py"
GRID = [
    (2, "float32"),
    pytest.param(2, "bfloat16", marks=pytest.mark.slow),
    pytest.param(4, "float32", marks=pytest.mark.slow),
    pytest.param(4, "bfloat16", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("world", "dtype"), GRID)
def test_a_bias_before_a_hooks_all_reduce_reads_offset(world, dtype):
    names = ("hook_then_bias", "bias_before_hook")
    correct, buggy = check([file_spec(f"{FILE}:{n}", world, dtype=dtype) for n in names])
    assert correct["verdict"] == "equivalent", correct["summary"]
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    assert buggy["first_divergence"]["name"] == "act:down"
    assert buggy["diagnosis"]["signature"] == "offset", buggy["diagnosis"]
    assert "counted tp times" in buggy["diagnosis"]["cause"]
