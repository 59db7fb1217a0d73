"""HuggingFace transformers' own TP plans (tpcheck.adapters.transformers, `tpcheck hf`).

Needs the extra `tpcheck[transformers]` (transformers==5.24.0, installed by .ci/run): skipped with
the reason without it, or with another version (the findings pinned here are that version's).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the extra tpcheck[transformers] is not installed"
)
from tpcheck.adapters import transformers as hf  # noqa: E402
from tpcheck.adapters.transformers import discovery  # noqa: E402
from tpcheck.checker.pool.session import run_specs  # noqa: E402
from tpcheck.resolve import launcher  # noqa: E402

pytestmark = pytest.mark.skipif(
    transformers.__version__ != hf.PINNED,
    reason=f"findings pinned for transformers {hf.PINNED}, found {transformers.__version__}",
)

from torch.distributed.tensor import Replicate as DReplicate  # noqa: E402
from torch.distributed.tensor import Shard as DShard  # noqa: E402
from transformers.distributed.tensor_parallel import (  # noqa: E402
    ALL_PARALLEL_STYLES,
    RowwiseParallel,
)

from tpcheck.adapters.transformers.styles import REDUCE_GRAD_ON_ARRIVAL  # noqa: E402

# ---------------------------------------------------------- styles registered before the ranks fork


class RowwiseNoGradReduceSkipped(RowwiseParallel):
    """A planted bug in the no-grad path only: the local inference path forgets its all-reduce (the
    grad-enabled DTensor path is untouched)."""

    def transform_output_post_forward(self, module, output, mesh):
        if not output.requires_grad and not hasattr(output, "to_local"):
            return output  # partial sums returned as if reduced
        return super().transform_output_post_forward(module, output, mesh)


ALL_PARALLEL_STYLES.register(
    "test_rowwise_nograd_unreduced",
    RowwiseNoGradReduceSkipped(input_layouts=DShard(-1), output_layouts=DReplicate()),
)


def run(*specs):
    with launcher(60) as pool:
        return {r.name: r.to_json() for r in run_specs(list(specs), pool)}


def names(result: dict, prefix: str) -> set[str]:
    return {c["name"] for c in result["checks"] if c["name"].startswith(prefix)}


# ------------------------------------------------------------------ the reduction, in this process


@pytest.mark.parametrize(
    "model_type", ["llama", "mixtral", "deepseek_v3", "qwen3", "gemma2", "phi3"]
)
@pytest.mark.parametrize("world", [2, 4])
def test_small_config_keeps_every_divisibility(model_type, world):
    prep = hf.prepare(model_type, world)
    cfg = prep.config
    assert cfg.num_attention_heads % world == 0 and cfg.num_key_value_heads % world == 0
    assert cfg.num_key_value_heads >= world and cfg.vocab_size % world == 0
    assert cfg.intermediate_size % (2 * world) == 0 and cfg.num_hidden_layers >= 2
    meta = hf.build_lm(model_type, cfg, torch.float32, device="meta")
    assert sum(p.numel() for p in meta.parameters()) < hf.MAX_PARAMS
    modules = dict(meta.named_modules())
    linear_rules = {
        n
        for n, style in prep.tp_plan.items()
        if n in modules and style.startswith(("colwise", "rowwise"))
    }
    # every planned linear's output is checked
    assert linear_rules and linear_rules <= set(prep.activations)
    assert "model.layers.0" in prep.activations and "model.layers.1" in prep.activations


def test_mha_stays_mha_and_mla_rope_head_dim_is_kept():
    v2 = hf.prepare("deepseek_v2", 2).config
    assert v2.num_attention_heads == v2.num_key_value_heads  # MLA: k and v have every head
    v3 = hf.prepare("deepseek_v3", 2).config
    assert v3.head_dim == v3.qk_rope_head_dim


def test_unbuildable_architectures_are_skipped_with_a_reason():
    """The two architectures left skipped: a config no model class is built from, and a forward
    whose layers read an input its signature does not name (docs/hf.md)."""
    with pytest.raises(hf.Skip, match="no model class"):
        hf.prepare("t5_gemma_module", 2)
    with pytest.raises(hf.Skip, match="does not run from the inputs made here"):
        hf.prepare("voxtral_realtime_text", 2)


# ------------------------------------------------------------------ checks on ranks


def test_plain_architectures_are_equivalent_on_every_path():
    """llama, mistral, qwen2, gemma2, phi3, mixtral at world 2: logits, loss, per-module outputs and
    their grads, every grad, AdamW state and weights, 2 micro-batches, and the no-grad forward."""
    archs = ["llama", "mistral", "qwen2", "gemma2", "phi3", "mixtral"]
    results = run(*(hf.hf_spec(a, 2, steps=2) for a in archs))
    for name, r in results.items():
        assert r["verdict"] == "equivalent", (name, r["summary"])
        assert {"output", "output:no_grad"} <= names(r, "output")
        assert {"act:model.layers.0", "act:model.layers.1"} <= names(r, "act:")
        assert names(r, "update:") and names(r, "state:") and names(r, "grad:model.")
        assert (
            r["inferred_plan"]
            and "Shard(0)" in r["inferred_plan"]
            and "Shard(1)" in r["inferred_plan"]
        )
    llama = results["hf:llama/tp2/float32"]
    # colwise: this rank's slice
    assert "act:model.layers.0.self_attn.q_proj" in names(llama, "act:")
    assert "act:model.layers.0.mlp.down_proj" in names(llama, "act:")  # rowwise: whole


@pytest.mark.slow
def test_world_4_and_bfloat16():
    results = run(
        hf.hf_spec("llama", 4, steps=2),
        hf.hf_spec("mixtral", 4, steps=2),
        hf.hf_spec("qwen2", 2, "bfloat16", steps=2),
    )
    for name, r in results.items():
        assert r["verdict"] == "equivalent", (name, r["summary"])


def test_replicated_with_grad_allreduce_counts_early_micro_batches_world_times():
    """The finding (docs/findings/hf-replicated-grad-allreduce-accumulation.md): Qwen3's
    q_norm/k_norm under `replicated_with_grad_allreduce` all-reduce the accumulated grad after
    every micro-batch. One
    micro-batch: equivalent; two: the q_norm grad is wrong; the style that reduces each
    micro-batch's grad as it arrives (the fix, as a rule override): equivalent with two."""
    fixed = {
        "model.layers.*.self_attn.q_norm": REDUCE_GRAD_ON_ARRIVAL,
        "model.layers.*.self_attn.k_norm": REDUCE_GRAD_ON_ARRIVAL,
    }
    one = hf.hf_spec("qwen3", 2, steps=1, micro_batches=1, label="one")
    two = hf.hf_spec("qwen3", 2, steps=1, micro_batches=2, label="two")
    mended = hf.hf_spec("qwen3", 2, rules=fixed, steps=1, micro_batches=2, label="mended")
    results = run(one, two, mended)
    assert results["one"]["verdict"] == "equivalent", results["one"]["summary"]
    assert results["mended"]["verdict"] == "equivalent", results["mended"]["summary"]
    bad = results["two"]
    assert bad["verdict"] == "not equivalent"
    first = bad["first_divergence"]
    assert (first["stage"], first["step"]) == ("grads", 1)
    assert first["name"] == "grad:model.layers.0.self_attn.q_norm.weight"
    failed = {c["name"] for c in bad["checks"] if not c["passed"]}
    assert all("q_norm" in n or "k_norm" in n for n in failed if n.startswith("grad:")), failed
    assert not any(n.startswith(("act:", "output")) for n in failed)  # the forward is right


def test_a_plan_rule_that_double_reduces_a_grad_is_caught_at_that_parameter():
    rules = {"model.layers.*.input_layernorm": "replicated_with_grad_allreduce"}
    r = run(hf.hf_spec("llama", 2, rules=rules, steps=1, micro_batches=1))[
        "hf:llama/tp2/float32/rules"
    ]
    assert r["verdict"] == "not equivalent"
    assert r["first_divergence"]["name"] == "grad:model.layers.0.input_layernorm.weight"


def test_a_bug_in_the_no_grad_path_only_is_caught_by_the_no_grad_forward():
    rules = {"model.layers.*.mlp.down_proj": "test_rowwise_nograd_unreduced"}
    r = run(hf.hf_spec("llama", 2, rules=rules, steps=1, micro_batches=1))[
        "hf:llama/tp2/float32/rules"
    ]
    assert r["verdict"] == "not equivalent"
    failed = {c["name"] for c in r["checks"] if not c["passed"]}
    # the training path is right; the eval-mode forward runs without autograd too
    assert failed == {"output:no_grad", "output:eval"}, failed
    assert r["first_divergence"]["name"] == "output:no_grad"


def test_a_model_whose_tp_forward_raises_is_an_error_naming_the_exception():
    """Doge's plan shards q/k/v by head but its dynamic mask (dt_proj, rowwise) keeps every head:
    the TP forward raises a shape error (docs/findings/hf-doge-dynamic-mask.md). Llama4's MoE adds
    in place to a rowwise output, a DTensor view: the grad-enabled forward raises
    (docs/findings/hf-llama4-text-training-path.md). Inkling normalizes its vocab-parallel
    embedding's partial lookup inside the sharded module: DTensor refuses to reduce it."""
    results = run(
        *(
            hf.hf_spec(a, 2, steps=1, micro_batches=1)
            for a in ("doge", "llama4_text", "inkling_text")
        )
    )
    doge, llama4 = results["hf:doge/tp2/float32"], results["hf:llama4_text/tp2/float32"]
    assert doge["verdict"] == "error" and "must match the size of tensor b" in doge["summary"]
    assert (
        llama4["verdict"] == "error"
        and "is a view and is being modified inplace" in llama4["summary"]
    )
    inkling = results["hf:inkling_text/tp2/float32"]  # docs/findings/hf-inkling-embedding-norm.md
    assert inkling["verdict"] == "error" and "AssertionError" in inkling["summary"]
    assert "raised at transformers/models/inkling/modeling_inkling.py" in inkling["summary"]


# ------------------------------------------------------------------ the command


def tpcheck(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "tpcheck", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


@pytest.mark.slow
def test_cli_sweep_report(tmp_path):
    import jsonschema

    from tpcheck.report.schema import load_schema

    out = tpcheck(
        "hf",
        "llama",
        "qwen3",
        "t5_gemma_module",
        "--steps",
        "1",
        "--json",
        str(tmp_path / "r.json"),
        "--html",
        str(tmp_path / "r.html"),
    )
    assert out.returncode == 1, out.stderr  # qwen3 is not equivalent
    report = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(report, load_schema())
    rows = {r["architecture"]: r for r in report["sweep"]["rows"]}
    assert rows["llama"]["verdict"] == "equivalent" and rows["qwen3"]["verdict"] == "not equivalent"
    assert rows["qwen3"]["first_divergence"].startswith(
        "grad:model.layers.0.self_attn.q_norm.weight"
    )
    assert (
        rows["t5_gemma_module"]["verdict"] == "skipped"
        and "no model class" in rows["t5_gemma_module"]["reason"]
    )
    assert report["sweep"]["counts"] == {"equivalent": 1, "not equivalent": 1, "skipped": 1}
    llama = next(c for c in report["cases"] if c["name"] == "hf:llama/tp2/float32")
    assert llama["checks"] == [] and llama["checks_omitted"]["passed"] > 500
    assert "t5_gemma_module (tp2) skipped" in out.stderr
    page = (tmp_path / "r.html").read_text()
    assert "id=sweep" in page and "t5_gemma_module" in page
    again = tpcheck("report", str(tmp_path / "r.json"), "--html", str(tmp_path / "again.html"))
    # the report's own validator accepts the sweep; as a gate it exits 1, as the run did (qwen3)
    assert again.returncode == 1 and "Traceback" not in again.stderr, again.stderr
    assert "id=sweep" in (tmp_path / "again.html").read_text()


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "args, message",
    [
        (["lama"], "unknown architecture 'lama' (did you mean"),
        pytest.param(
            ["t5_gemma_module"], "nothing to check: t5_gemma_module (tp2) skipped", marks=SLOW
        ),
        pytest.param([], "name architectures", marks=SLOW),
        pytest.param(["llama", "--rule", "nonsense"], "write PATTERN=STYLE", marks=SLOW),
        (["llama", "--world-size", "1"], "transformers shards nothing on one rank"),
        pytest.param(
            ["llama", "--rule", "model.layers.*.mlp.nothing=colwise"], "match nothing", marks=SLOW
        ),
    ],
)
def test_cli_bad_input_exits_2_with_a_message(args, message):
    out = tpcheck("hf", *args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_cli_list():
    out = tpcheck("hf", "--list")
    assert out.returncode == 0
    listed = out.stdout.split()
    assert {"llama", "mixtral", "qwen3", "gemma2"} <= set(listed) and len(listed) >= 150


def test_the_sweep_runs_every_rank_on_one_thread(monkeypatch):
    """`tpcheck hf` forks its ranks under a cap of one intra-op thread (rank 0's float64 passes
    too): its models are too small for a thread team to pay, and on a loaded machine the team's
    waits cost seconds an op. The cap is lifted when the command returns. Its cases run in two
    lanes (pools side by side)."""
    import os

    from tpcheck.checker.pool import spawn
    from tpcheck.cli import hf as cli_hf
    from tpcheck.cli import main

    monkeypatch.setattr(spawn, "_PARENT_KEPT_TO_ONE_THREAD", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = []

    def execute(specs, args, finish_report=None, lanes=1):
        seen.append((spawn.rank_threads(2), spawn.threads_while_others_wait(2), lanes))
        return 0

    monkeypatch.setattr(cli_hf, "execute", execute)
    assert main(["hf", "llama", "-q"]) == 0
    assert seen == [(1, 1, cli_hf.SWEEP_LANES)] and cli_hf.SWEEP_LANES == 2  # two pools
    assert (spawn.rank_threads(2), spawn.threads_while_others_wait(2)) == (4, 8)


def test_discovery_is_read_from_its_cache_while_the_installation_is_unchanged(
    tmp_path, monkeypatch
):
    """The architectures with a plan are scanned once (every config class imported) and kept under
    the installation's fingerprint; a cache of another installation (a stale fingerprint) or not
    ours is scanned again and rewritten."""
    monkeypatch.setenv("TPCHECK_CACHE_DIR", str(tmp_path))
    scans = []
    monkeypatch.setattr(
        discovery, "_scan_architectures", lambda: scans.append(1) or ["llama", "qwen3"]
    )
    path = hf.discovery_cache_path()
    assert path.parent == tmp_path and transformers.__version__ in path.name
    assert hf.architectures() == ["llama", "qwen3"] and len(scans) == 1
    assert hf.architectures() == ["llama", "qwen3"] and len(scans) == 1  # from the file
    assert hf.architectures(["qwen3", "bert", "nonsense"]) == ["qwen3"] and len(scans) == 1
    kept = json.loads(path.read_text())
    assert kept["fingerprint"] == discovery._fingerprint()
    # stale: written for another installation -> scanned again, not trusted
    path.write_text(json.dumps({"fingerprint": "another", "architectures": ["gpt2"]}))
    assert hf.architectures() == ["llama", "qwen3"] and len(scans) == 2
    assert json.loads(path.read_text())["architectures"] == ["llama", "qwen3"]
    # a fingerprint that moves with the installation: a newer config file makes the cache stale
    monkeypatch.setattr(
        discovery, "CONFIG_MAPPING_NAMES", {**discovery.CONFIG_MAPPING_NAMES, "new_arch": "X"}
    )
    assert discovery._fingerprint() != kept["fingerprint"]
    assert hf.architectures() == ["llama", "qwen3"] and len(scans) == 3
    path.write_text("not json")
    assert hf.architectures() == ["llama", "qwen3"] and len(scans) == 4


@pytest.mark.slow
def test_the_cached_discovery_is_the_scan(tmp_path, monkeypatch):
    monkeypatch.setenv("TPCHECK_CACHE_DIR", str(tmp_path))
    scanned = discovery._scan_architectures()
    assert hf.architectures() == scanned and hf.discovery_cache_path().exists()
    monkeypatch.setattr(discovery, "_scan_architectures", lambda: pytest.fail("scanned again"))
    assert hf.architectures() == scanned and len(scanned) >= 150
    assert {"llama", "mixtral", "qwen3"} <= set(scanned) and "bert" not in scanned
