"""The pytest plugin, black-box: an inner pytest run (a subprocess, so its forked ranks are isolated)
using the `tpcheck` fixture with a Case defined in the test module itself."""
pytest_plugins = ["pytester"]

TEST_MODULE = '''
import sys
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
'''


def test_case_object_in_test_module_pass_and_readable_failure(pytester):
    from paths import REPO

    pytester.makepyfile(test_inner=TEST_MODULE.format(examples=str(REPO / "examples")))
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*inline_buggy/tp2/float32: not equivalent*",
                                 "*first: output (forward, step 1) on rank(s) [[]0, 1[]]*"])
