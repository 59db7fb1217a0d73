"""DeepSpeed AutoTP training of a transformers Llama (examples/deepspeed_autotp.py): the model as
`deepspeed.initialize` shards it (`tensor_parallel.autotp_size`), stepped by DeepSpeed's engine,
checked on CPU/gloo against the dense model; a row-parallel layer without its group (no all-reduce)
caught at that layer."""

import importlib.util
import subprocess
import sys

import pytest

from tpcheck.api import check
from tpcheck.checker.casefile import file_spec

from paths import REPO

# found, not imported: the ranks import DeepSpeed; this process, whose later checks fork ranks,
# keeps out of its import-time setup
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed not installed: pip install 'tpcheck[deepspeed]'",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None,
        reason="transformers not installed (tpcheck[deepspeed])",
    ),
]

EX = REPO / "examples" / "deepspeed_autotp.py"

# DeepSpeed's own first-use step: its CPU all-reduce op compiled (half a minute to a minute of
# g++) into torch's extensions directory, where the ranks load it
BUILD_SHM_OP = "import importlib; importlib.import_module('deepspeed.comm.torch').build_shm_op()"


@pytest.fixture(scope="module")
def shm_op_built(tmp_path_factory):
    """The op compiled once, before the checks, into a directory of this test's own (a compile
    killed elsewhere leaves a lock in ~/.cache/torch_extensions that every later build waits on);
    the ranks, forked from this process, find it there. A rank waiting on a compile is no hang
    (the launcher stretches its deadline; tests/robustness/test_hang.py), but the checks should
    time AutoTP, not g++."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path_factory.mktemp("torch_extensions")))
        env.setenv("DS_ACCELERATOR", "cpu")
        done = subprocess.run(
            [sys.executable, "-c", BUILD_SHM_OP], capture_output=True, text=True, timeout=1800
        )
        assert done.returncode == 0, f"DeepSpeed's shm op did not build:\n{done.stderr[-3000:]}"
        yield


@pytest.mark.slow
def test_autotp_llama_equivalent_and_ungrouped_row_layer_caught(shm_op_built):
    """Equivalent: forward (every projection's output), loss, every gradient, DeepSpeed's clipping
    (its total norm and every clipped gradient) and DeepSpeed's AdamW state over 2 steps. Layer 0's
    down_proj without its group: its output is a partial sum, caught there in the forward of step
    1. The engine's default clipping with a dense side that does not clip: caught at step 1 in the
    optimizer's moments, scaled by the clip coefficient, and said so."""
    names = ("autotp", "buggy", "engine_clips_alone")
    r = {x["name"]: x for x in check([file_spec(f"{EX}:{n}", 2) for n in names])}
    ok = r["deepspeed_autotp_llama/tp2/float32"]
    assert ok["verdict"] == "equivalent", ok["summary"]
    names = {c["name"] for c in ok["checks"]}
    assert "clip:grad_norm" in names and "clipped:lm.model.norm.weight" in names
    alone = r["deepspeed_autotp_llama_engine_clips_alone/tp2/float32"]
    assert alone["verdict"] == "not equivalent", alone["summary"]
    f, d = alone["first_divergence"], alone["diagnosis"]
    assert (f["stage"], f["step"], f["name"].split(":")[0]) == ("optimizer", 1, "moment"), f
    assert d["signature"] == "scaled" and 0 < d["evidence"]["factor"] < 1, d
    assert "gradient clipping" in d["cause"], d["cause"]
    assert {("loss", 2), ("grads", 2), ("optimizer", 2)} <= {
        (c["stage"], c["step"]) for c in ok["checks"]
    }
    assert {"loss", "output", "act:lm.model.layers.1.mlp.down_proj", "act:lm.lm_head"} <= names
    params = [n.removeprefix("param:") for n in names if n.startswith("param:")]
    assert len(params) == 2 * 9 + 3  # 9 per layer, the embedding, the final norm, the LM head
    for p in params:
        assert f"grad:{p}" in names and f"state:{p}.exp_avg_sq" in names
    bad = r["deepspeed_autotp_llama_ungrouped_down_proj/tp2/float32"]
    assert bad["verdict"] == "not equivalent"
    f = bad["first_divergence"]
    assert (f["stage"], f["step"], f["name"]) == (
        "forward",
        1,
        "act:lm.model.layers.0.mlp.down_proj",
    )
    assert bad["diagnosis"]["signature"] == "partial_sum"
