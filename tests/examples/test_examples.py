"""Every example: its correct cases are equivalent and its planted bug is flagged at the documented
first-divergent tensor. One launch per example file (a pool per world size serves all its cases)."""
import pytest

from tpcheck.api import check
from tpcheck.check.usercode import file_spec

from paths import REPO

EX = REPO / "examples"


def _run(targets_and_worlds):
    specs = [file_spec(str(EX / t), w) for t, w in targets_and_worlds]
    return {r["name"]: r for r in check(specs)}


def _first(result):
    f = result["first_divergence"]
    return f["stage"], f["step"], f["name"]


def test_own_module():
    r = _run([("own_module.py:correct", 2), ("own_module.py:correct", 4), ("own_module.py:buggy", 2)])
    assert r["own_mlp/tp2/float32"]["verdict"] == r["own_mlp/tp4/float32"]["verdict"] == "equivalent"
    bad = r["own_mlp_bias_before_reduce/tp2/float32"]
    assert bad["verdict"] == "not equivalent"
    assert _first(bad) == ("forward", 1, "output")


def test_dtensor_llama():
    r = _run([("dtensor_llama.py:tp", 2), ("dtensor_llama.py:sp", 2), ("dtensor_llama.py:buggy", 2)])
    assert r["dtensor_llama/tp2/float32"]["verdict"] == "equivalent"
    assert r["dtensor_llama_sp/tp2/float32"]["verdict"] == "equivalent"
    bad = r["dtensor_llama_global_heads/tp2/float32"]
    assert bad["verdict"] == "not equivalent" and _first(bad) == ("forward", 1, "output")


def test_megatron_mlp():
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install 'tpcheck[megatron]')")
    names = ["gated_mlp", "column", "row", "embedding", "cross_entropy", "buggy"]
    r = _run([(f"megatron_mlp.py:{n}", 2) for n in names])
    good = [v for k, v in r.items() if "contiguous" not in k]
    assert len(good) == 5 and all(v["verdict"] == "equivalent" for v in good), [v["summary"] for v in good]
    bad = r["megatron_gated_mlp_contiguous_fc1/tp2/float32"]
    assert bad["verdict"] == "not equivalent"
    assert _first(bad) == ("weights", 0, "param:layer.linear_fc1.weight")
