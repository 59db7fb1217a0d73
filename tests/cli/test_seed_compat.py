"""Seed compatibility: for the seed fixture at world size 2, tpcheck's JSON for each run mode has every
key of the seed's RunResult with values within 1e-7 of reference.py's, and `passed` identical."""
import json
import subprocess
import sys

import pytest

from paths import REPO

MODES = ["equivalence", "missing_forward_reduce", "missing_backward_reduce"]


@pytest.fixture(scope="module")
def seed_results(seed_reference, tmp_path_factory):
    out = {}
    for mode in MODES:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                               str(seed_reference), "--mode", mode], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path_factory.mktemp("seed"))
        assert proc.returncode == 0, proc.stderr
        out[mode] = json.loads(proc.stdout)
    return out


@pytest.fixture(scope="module")
def ours():
    proc = subprocess.run([sys.executable, "-m", "tpcheck", "run", "--mode", "all", "--world-size", "2", "-q"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("mode", MODES)
def test_run_modes_match_the_seed(mode, seed_results, ours):
    theirs, mine = seed_results[mode], ours[mode]
    assert set(theirs) <= set(mine)
    for key, value in theirs.items():
        if isinstance(value, float):
            assert abs(mine[key] - value) <= 1e-7, (key, mine[key], value)
        else:
            assert mine[key] == value, key


def test_inspect_has_the_seed_keys(ours):
    inspect = ours["inspect"]
    for key in ["python", "pytorch", "platform", "backend", "world_size", "block_path", "dense_shapes",
                "rank_local_shapes", "collectives", "not_included"]:
        assert key in inspect
    assert inspect["rank_local_shapes"]["gate_up_weight"] == [2, 6, 8]


def test_single_mode_prints_the_seed_run_result():
    proc = subprocess.run([sys.executable, "-m", "tpcheck", "run", "--mode", "missing_backward_reduce", "-q"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    result = json.loads(proc.stdout)
    assert result["mode"] == "missing_backward_reduce" and result["passed"] is False
    # the fault is caught, as expected for an injected fault: exit 0 (see README, exit codes)
    assert proc.returncode == 0
