"""The mechanism signatures on transformers' own plans (`tpcheck hf`): the plan the adapter applies
travels as `Case.plan_rules`, the rule matching agrees with transformers' own, and the two
documented defects of transformers 5.24.0 are named and pointed at their write-ups.

Needs the extra `tpcheck[transformers]`: skipped with the reason without it, or with another
version (the findings are that version's).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the extra tpcheck[transformers] is not installed"
)
from tpcheck.adapters import transformers as hf  # noqa: E402
from tpcheck.checker.pool.session import run_specs  # noqa: E402
from tpcheck.checker.rule_match import covering  # noqa: E402
from tpcheck.resolve import launcher  # noqa: E402

pytestmark = pytest.mark.skipif(
    transformers.__version__ != hf.PINNED,
    reason=f"findings pinned for transformers {hf.PINNED}, found {transformers.__version__}",
)

from transformers.distributed.parallel_utils import _get_parameter_plan  # noqa: E402


@pytest.mark.parametrize("model_type", ["qwen3", "sarvam_moe", "llama", "mixtral"])
def test_rule_matching_agrees_with_transformers(model_type):
    """For every parameter, on the wildcard plan and on the resolved one: where transformers finds
    a style (the parameter's rule, else its module's), `covering` finds that style; where
    `covering` finds none, neither does transformers."""
    prep = hf.prepare(model_type, 2, None)
    model = hf.build_lm(model_type, prep.config, torch.float32, device="meta")
    for plan in (dict(model.tp_plan), prep.tp_plan):
        for name, _ in model.named_parameters():
            theirs = _get_parameter_plan(name, plan, is_weight=True)
            ours = covering(name, plan)
            if theirs is not None:
                assert ours.get("style") == theirs, (name, ours, theirs)
            if ours["rule"] is None:
                assert theirs is None, name


def test_the_resolved_plan_travels_as_plan_rules():
    spec = hf.hf_spec("sarvam_moe", 2, steps=1, micro_batches=1)
    case = hf.hf_case(spec)
    assert case.plan_rules == hf.prepare_spec(spec)[0].tp_plan
    assert case.plan_rules["model.layers.0.self_attn.q_proj"] == "colwise"


def _results(*runs, timeout: float = 60) -> dict:
    """{label: result} of (architecture, micro-batches, label) runs at world 2, one step each."""
    specs = [hf.hf_spec(a, 2, steps=1, micro_batches=n, label=label) for a, n, label in runs]
    with launcher(timeout) as pool:
        return {r.spec.label: r.to_json() for r in run_specs(specs, pool)}


def test_the_two_documented_defects_are_named_and_pointed_at():
    """qwen3 with two micro-batches: its q_norm gradient under `replicated_with_grad_allreduce` is
    2·G_1 + G_2; sarvam_moe with one micro-batch: its plan has no rule for q_norm, whose partial
    gradient is never reduced. Each names its write-up in docs/findings."""
    results = _results(("qwen3", 2, "qwen3"), ("sarvam_moe", 1, "sarvam"))
    qwen3, sarvam = results["qwen3"], results["sarvam"]
    for r in (qwen3, sarvam):
        assert r["verdict"] == "not equivalent", r["summary"]
        assert r["first_divergence"]["name"] == "grad:model.layers.0.self_attn.q_norm.weight"
    d = qwen3["diagnosis"]
    assert d["signature"] == "grad_accumulation_reduced", d
    assert d["evidence"]["style"] == "replicated_with_grad_allreduce"
    assert qwen3["finding"]["doc"] == "docs/findings/hf-replicated-grad-allreduce-accumulation.md"
    d = sarvam["diagnosis"]
    assert d["signature"] == "no_plan_rule", d
    assert "no rule of the TP plan matches model.layers.0.self_attn.q_norm.weight" in d["cause"]
    assert sarvam["finding"]["doc"] == "docs/findings/hf-moe-missing-norm-rules.md"


@pytest.mark.slow
def test_an_op_on_a_shard_in_transformers_code_is_named_at_its_line():
    """gemma3n_text: the activation-sparsity cutoff (mean + k·std of gate_proj's features) computed
    on each rank's colwise shard; inkling2_text: the packed experts' gate_up_proj split by
    `chunk(2)` after a contiguous colwise shard (its experts' output, all-reduced by
    moe_tp_experts, is checked). Each is named at transformers' line and its write-up."""
    results = _results(
        ("gemma3n_text", 1, "gemma3n"), ("inkling2_text", 1, "inkling2"), timeout=120
    )
    gemma, inkling = results["gemma3n"], results["inkling2/float32-truth"]
    assert gemma["first_divergence"]["name"] == "act:model.layers.0.mlp.down_proj"
    assert inkling["first_divergence"]["name"] == "act:model.layers.0.mlp.experts"
    for r, ops, path in (
        (gemma, {"mean", "std"}, "transformers/models/gemma3n/modeling_gemma3n.py:"),
        (inkling, {"chunk"}, "transformers/models/inkling2/modeling_inkling2.py:"),
    ):
        d = r["diagnosis"]
        assert d["signature"] == "op_on_shard", d
        assert {o["op"] for o in d["evidence"]["ops"]} == ops
        assert path in d["cause"]
    assert gemma["finding"]["doc"] == "docs/findings/hf-gemma3n-activation-sparsity.md"
    # no upstream finding: through from_pretrained its interleaved checkpoint is sharded right
    assert "finding" not in inkling or not inkling["finding"]
