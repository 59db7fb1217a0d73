"""The pytest plugin, black-box: an inner pytest run (a subprocess, so its forked ranks are
isolated) using the `tpcheck` fixture with a Case defined in the test module itself."""

pytest_plugins = ["pytester"]

TEST_MODULE = """
import re
import sys

import pytest
from tpcheck.errors import UsageError
sys.path.insert(0, {examples!r})
import dataclasses
import own_module

correct = dataclasses.replace(own_module.correct, name="inline_correct")
buggy = dataclasses.replace(own_module.buggy, name="inline_buggy")

def test_correct(tpcheck):
    results = tpcheck.verify(correct, world_sizes=[1, 2])
    assert [r["verdict"] for r in results] == ["equivalent", "equivalent"]

def test_buggy(tpcheck):
    tpcheck.verify(buggy, world_sizes=[2], steps=1)

def test_buggy_is_caught(tpcheck):
    results = tpcheck.verify(buggy, world_sizes=[2], expect="not equivalent", steps=1)
    assert [r["verdict"] for r in results] == ["not equivalent"]

def test_world_sizes_from_the_ini(tpcheck):
    results = tpcheck.verify(correct, steps=1)
    assert [r["world_size"] for r in results] == [1, 2]

def test_correct_expected_to_be_caught_fails(tpcheck):
    tpcheck.verify(correct, world_sizes=[2], expect="not equivalent", steps=1, timeout_s=30)

def test_one_world_size_as_a_number(tpcheck):
    assert [r["world_size"] for r in tpcheck.verify("mlp", 1, steps=1)] == [1]

@pytest.mark.parametrize("args,kw,words", [
    (("mlp", []), {{}}, "world_sizes=[]): give a world size or a non-empty list"),
    (("mlp", [1]), {{"bogus": 3}}, "['bogus'] are neither CaseSpec fields"),
    ((42, [1]), {{}}, "not int 42"),
    (("mlp", [1]), {{"expect": "caught"}}, "expect='caught': give one of"),
])
def test_misuse(tpcheck, args, kw, words):
    with pytest.raises(UsageError, match=re.escape(words)):
        tpcheck.verify(*args, **kw)
"""
INI = "[pytest]\ntpcheck_world_sizes = 1 2\ntpcheck_timeout = 30\n"


def test_case_object_in_test_module_pass_and_readable_failure(pytester):
    """Also, in the same inner run: a single number is one world size, and misused arguments (an
    empty list of world sizes, which would check nothing and pass; an unknown field; a case of
    another type; an unknown `expect`) are refused with tpcheck.UsageError."""
    from paths import REPO

    pytester.makepyfile(test_inner=TEST_MODULE.format(examples=str(REPO / "examples")))
    pytester.makeini(INI)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(passed=8, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*inline_buggy/tp2/float32: not equivalent*",
            "*first: output (forward, step 1) on rank(s) [[]0, 1[]]*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*inline_correct/tp2/float32: equivalent (expected not equivalent)*"]
    )
    assert "__tracebackhide__" not in result.stdout.str()  # the fixture's own source is not dumped
