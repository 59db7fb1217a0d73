"""A spec's target is a typed value (`CaseSpec.target`, checker/case.py `Target`): every kind reads
back from the `block` string the report writes, and renders to it again; code reads the kind and the
name, never the prefix."""

import pytest

from tpcheck.checker.case import CaseSpec, Target


@pytest.mark.parametrize(
    ("block", "kind", "name", "user"),
    [
        ("mlp", "block", "mlp", False),
        ("file:/x/case.py:correct", "file", "/x/case.py:correct", True),
        ("registered:mine-7f3a", "registered", "mine-7f3a", True),
        ("hf:qwen3", "hf", "qwen3", False),
    ],
)
def test_a_block_reads_back_to_its_target_and_renders_to_it(block, kind, name, user):
    target = CaseSpec(block=block, world_size=1).target
    assert (target.kind, target.name, target.user) == (kind, name, user)
    assert str(target) == block and Target.parse(str(target)) == target


def test_a_user_case_keeps_its_own_settings_out_of_its_name():
    """The spec's name carries the run settings of a built-in block, not of a case file's own."""
    assert CaseSpec(block="mlp", world_size=2).name == "mlp/seed/tp2/float32"
    assert CaseSpec(block=str(Target("file", "c.py")), world_size=2).name == "file:c.py/seed/tp2"
