"""The frameworks' idioms at world 2 in float32, one case each, in one pool: what `make test` keeps
of the slow files beside it (test_own_optimizers.py, test_main_grad.py, test_clip_yardstick.py,
test_dtensor_clipping.py, tests/checker/rank/test_inferred_plan_failures.py run every world size
and dtype)."""

from tpcheck import CaseSpec, RunSettings, check, exit_code
from tpcheck.checker.casefile import file_spec

from paths import REPO

TRAINING = REPO / "tests" / "training" / "case_files"
INFERRED = REPO / "tests" / "checker" / "rank" / "case_files" / "inferred_plan_failures.py"


def _file(path, name, **run):
    return CaseSpec(block=f"file:{path}:{name}", world_size=2, run=RunSettings(**run))


def test_each_idiom_at_world_2():
    megatron = TRAINING / "megatron_style.py"
    specs = [
        _file(megatron, "fused_adamw", steps=2),
        _file(megatron, "fused_adamw_strided_shards", steps=2),
        _file(megatron, "clip_sharded_gradients_only", clip_grad_norm=0.05, steps=2),
        _file(megatron, "clip_correct", clip_grad_norm=0.05, steps=2),
        _file(TRAINING / "main_grad_style.py", "main_grad", steps=2),
        _file(TRAINING / "main_grad_style.py", "main_grad_not_zeroed", steps=2),
        file_spec(f"{INFERRED}:megatron_mlp_no_offset", 2),
        file_spec(f"{INFERRED}:vocab_parallel_embedding_gathered", 2),
    ]
    r = check(specs)
    verdicts = [x["verdict"] for x in r]
    assert verdicts == [
        "equivalent",
        "not equivalent",
        "not equivalent",
        "equivalent",
        "equivalent",
        "not equivalent",
        "not equivalent",
        "not equivalent",
    ], [x["summary"] for x in r]
    where = [(x["first_divergence"] or {}).get("name") for x in r]
    assert where[1] == "update:fc2.weight" and where[2] == "clipped:norm.weight", where
    assert where[5] == "grad:norm.weight" and where[6] == "param:fc1.weight", where
    assert where[7] == "act:tok_embeddings", where
    signatures = [(x.get("diagnosis") or {}).get("signature") for x in r]
    assert signatures[2] == "clip_partial" and signatures[6] == "rank0_shard", signatures
    assert exit_code([r[0], r[3], r[4]]) == 0 and exit_code([r[6]]) == 1
