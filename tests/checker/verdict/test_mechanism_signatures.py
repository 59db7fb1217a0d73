"""The two gradient mechanisms the diagnosis names (checker/verdict/mechanisms.py), the plan-rule
matching behind the second (checker/rule_match.py) and the findings index (tpcheck/findings.py).

The cases (case_files/norm_grad_hooks.py) are Qwen3-style per-head q/k norms in a column-parallel
attention, written as public TP code writes them: the TP code's own plan of rules installs a
`register_post_accumulate_grad_hook` that `dist.all_reduce`s `p.grad` (the accumulated gradient,
after every backward) or a `register_hook` that reduces each micro-batch's gradient as it arrives.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from tpcheck import Case, CaseSpec, RunSettings, check
from tpcheck.checker.checkid import CheckId
from tpcheck.checker.rule_match import covering, generic
from tpcheck.checker.verdict import diagnose as diagnosing
from tpcheck.checker.verdict import mechanisms
from tpcheck.checker.verdict.diagnose import CAUSES
from tpcheck.checker.verdict.divergence import FirstDivergence
from tpcheck.errors import UsageError
from tpcheck.findings import FINDINGS, finding_for
from tpcheck.report.console import print_summary
from tpcheck.report.schema import build_report, load_schema
from tpcheck.report.validate import first_error

FILE = Path(__file__).parent / "case_files" / "norm_grad_hooks.py"
ACCUMULATION_DOC = "docs/findings/hf-replicated-grad-allreduce-accumulation.md"


def spec(name: str, micro_batches: int) -> CaseSpec:
    run = RunSettings(dtype="float32", steps=1, micro_batches=micro_batches)
    return CaseSpec(block=f"file:{FILE}:{name}", world_size=2, run=run)


SPECS = [
    spec("accumulated", 2),
    spec("accumulated", 3),
    spec("accumulated", 1),
    spec("on_arrival", 2),
    spec("on_arrival", 3),
    spec("unruled", 1),
    spec("unruled", 2),
    spec("ruled", 1),
]


@pytest.fixture(scope="module")
def results():
    return dict(zip(SPECS, check(SPECS)))


def assert_accumulation(r: dict, n: int) -> None:
    """The case is caught at q_norm's gradient, step 1, and named a micro-batch's gradient
    counted world times, with W, n and the fix."""
    assert r["verdict"] == "not equivalent", r["summary"]
    first = r["first_divergence"]
    assert (first["name"], first["stage"], first["step"]) == (
        "grad:layers.0.q_norm.weight",
        "grads",
        1,
    )
    d = r["diagnosis"]
    assert d["signature"] == "grad_accumulation_reduced", d
    ev = d["evidence"]
    assert (ev["world"], ev["micro_batches"], ev["parameter"]) == (2, n, "layers.0.q_norm.weight")
    assert ev["tp_minus_formula"] <= ev["bound"] < ev["tp_minus_sum"]
    assert ev["style"] == "replicated_with_grad_allreduce"
    assert "W = 2 ranks" in d["cause"] and f"n = {n} micro-batches" in d["cause"]
    assert "reduce each micro-batch's gradient as it arrives (a tensor hook" in d["cause"]
    assert "layers.0.q_norm.weight" in d["cause"]


def assert_unruled(r: dict) -> None:
    assert r["verdict"] == "not equivalent", r["summary"]
    assert r["first_divergence"]["name"] == "grad:layers.0.q_norm.weight"
    d = r["diagnosis"]
    assert d["signature"] == "no_plan_rule", d
    assert d["evidence"]["sibling"] == "k_norm"
    assert "no rule of the TP plan matches layers.0.q_norm.weight" in d["cause"]
    assert "k_norm has a rule" in d["cause"] and "q_norm has none" in d["cause"]


@pytest.mark.parametrize("n", [2, 3])
def test_an_accumulated_grad_reduced_after_every_micro_batch_is_named(results, n):
    r = results[spec("accumulated", n)]
    assert_accumulation(r, n)
    assert r["finding"]["doc"] == ACCUMULATION_DOC
    # n = 3: the first micro-batch counted W^2 times
    assert ("2^2·G_1 + 2·G_2 + G_3" if n == 3 else "2·G_1 + G_2") in r["diagnosis"]["cause"]


def test_one_micro_batch_and_the_tensor_hook_twin_are_equivalent(results):
    for s in (spec("accumulated", 1), spec("on_arrival", 2), spec("on_arrival", 3)):
        r = results[s]
        assert r["verdict"] == "equivalent" and r["as_expected"], (s.name, r["summary"])
        assert "finding" not in r


@pytest.mark.parametrize("n", [1, 2])
def test_a_partial_grad_no_plan_rule_covers_is_named_with_the_sibling_rule(results, n):
    r = results[spec("unruled", n)]
    assert_unruled(r)
    # the plan's styles are not transformers' (reduce_grad_on_arrival): no upstream finding
    assert "finding" not in r


def test_the_twin_with_the_rule_is_equivalent(results):
    r = results[spec("ruled", 1)]
    assert r["verdict"] == "equivalent" and r["as_expected"], r["summary"]


def test_the_terminal_summary_points_at_the_finding(results):
    out = io.StringIO()
    print_summary([results[spec("accumulated", 2)], results[spec("ruled", 1)]], out)
    text = out.getvalue()
    assert f"finding: {ACCUMULATION_DOC}" in text
    assert text.count("finding:") == 1


def test_the_report_with_a_finding_is_valid_and_the_key_is_strict(results):
    cases = [results[spec("accumulated", 2)], results[spec("ruled", 1)]]
    report = build_report(cases, exit_code=1)
    schema = load_schema()
    assert first_error(report, schema) is None
    report["cases"][0]["finding"]["extra"] = 1
    assert "finding" in str(first_error(report, schema))


# ------------------------------------------------------ checker mutants: the signature test fails


def test_a_broken_accumulation_detector_fails_the_signature_test(monkeypatch):
    """A detector that fits the plain sum (factors all 1) instead of W^(n-1), ..., 1 no longer
    names the bug: the signature assertion fails; the verdict stays not equivalent."""
    monkeypatch.setattr(mechanisms, "accumulation_weights", lambda world, n: np.ones(n))
    (r,) = check([spec("accumulated", 2)])
    assert r["verdict"] == "not equivalent"
    with pytest.raises(AssertionError):
        assert_accumulation(r, 2)


def test_a_broken_plan_rule_reader_fails_the_signature_test(monkeypatch):
    """A reader that takes any rule as covering the parameter leaves `partial_sum`: the signature
    assertion fails."""
    monkeypatch.setattr(mechanisms, "unruled", lambda first, ev: None)
    (r,) = check([spec("unruled", 1)])
    assert r["verdict"] == "not equivalent" and r["diagnosis"]["signature"] == "partial_sum"
    with pytest.raises(AssertionError):
        assert_unruled(r)


# -------------------------------------------------- the detectors on synthetic evidence (no ranks)


def diagnose(first: dict | FirstDivergence, evidence: list[dict], *args, **kw) -> dict:
    """The diagnosis of a first divergence (given as the report's object: read back as the verdict
    holds it)."""
    if not isinstance(first, FirstDivergence):
        first = FirstDivergence.from_json(first)
    return diagnosing.diagnose(first, evidence, *args, **kw).to_json()


def grad_evidence(tps, parts, rule=None):
    key = ("grads", 1, CheckId("grad", "norm.weight"))
    out = []
    for tp, g in zip(tps, parts):
        e = {"tp": tp, "ref": g.sum(0), "dense": g.sum(0), "placement": "replicate", "eps": 1e-7}
        e["micro_grads"] = g
        if rule is not None:
            e["plan_rule"] = rule
        out.append({key: e})
    return out


FIRST = {"stage": "grads", "step": 1, "name": "grad:norm.weight", "ranks": [0, 1]}


@pytest.mark.parametrize(("world", "n"), [(2, 2), (2, 3), (4, 2)])
def test_the_formula_is_tested_against_the_plain_sum(world, n):
    g = np.random.default_rng(n).standard_normal((n, 8))
    wrong = mechanisms.accumulation_weights(world, n) @ g
    first = {**FIRST, "ranks": list(range(world)), "bound": 1e-9, "error": 1.0}
    d = diagnose(first, grad_evidence([wrong] * world, [g] * world), world, n)
    assert d["signature"] == "grad_accumulation_reduced" and d["evidence"]["micro_batches"] == n
    assert list(mechanisms.accumulation_weights(world, n)) == [world**k for k in range(n)][::-1]
    # the right sum within the bound is no such thing (nor any other signature of this one)
    d = diagnose(first, grad_evidence([g.sum(0) * 1.5] * world, [g] * world), world, n)
    assert d["signature"] != "grad_accumulation_reduced"


def test_the_formula_must_hold_within_the_checks_bound():
    g = np.random.default_rng(0).standard_normal((2, 8))
    wrong = 2 * g[0] + g[1] + 1e-6
    d = diagnose({**FIRST, "bound": 1e-7, "error": 1.0}, grad_evidence([wrong] * 2, [g] * 2), 2, 2)
    assert d["signature"] != "grad_accumulation_reduced"
    d = diagnose({**FIRST, "bound": 1e-5, "error": 1.0}, grad_evidence([wrong] * 2, [g] * 2), 2, 2)
    assert d["signature"] == "grad_accumulation_reduced"


def test_a_partial_sum_is_no_plan_rule_only_when_the_plan_has_none():
    g = np.random.default_rng(1).standard_normal((1, 8))
    halves = [g[0] * 0.3, g[0] * 0.7]  # partial: sums to the dense gradient
    none = {"rule": None, "sibling": "k_norm", "sibling_rule": "k", "sibling_style": "s"}
    ruled = {"rule": "norm", "style": "replicate", "on": "norm"}
    first = {**FIRST, "bound": 1e-9, "error": 1.0}
    assert diagnose(first, grad_evidence(halves, [g, g], none), 2)["signature"] == "no_plan_rule"
    assert diagnose(first, grad_evidence(halves, [g, g], ruled), 2)["signature"] == "partial_sum"
    assert diagnose(first, grad_evidence(halves, [g, g]), 2)["signature"] == "partial_sum"


def test_the_new_signatures_have_causes():
    assert {"grad_accumulation_reduced", "no_plan_rule"} <= set(CAUSES)


# ---------------------------------------------------------------------- plan rules, findings


def test_rules_match_as_transformers_matches_them():
    rules = {
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "model.layers.*.mlp.experts": "moe_tp_experts",
        "model.layers.0.mlp.w2.weight": "rowwise",
    }
    assert generic("model.layers.12.mlp.w2.weight") == "model.layers.*.mlp.w2.weight"
    hit = covering("model.layers.3.self_attn.q_proj.weight", rules)
    assert (hit["rule"], hit["style"]) == ("model.layers.*.self_attn.q_proj", "colwise")
    # an ancestor module's style handles what is inside it
    assert covering("model.layers.1.mlp.experts.down_proj", rules)["style"] == "moe_tp_experts"
    # a concrete key covers its own layer only
    assert covering("model.layers.0.mlp.w2.weight", rules)["rule"] is not None
    assert covering("model.layers.1.mlp.w2.weight", rules)["rule"] is None
    # no rule: the closest sibling's, by name
    miss = covering("model.layers.2.self_attn.q_norm.weight", rules)
    assert miss["rule"] is None and miss["sibling"] == "k_norm"
    assert miss["sibling_style"] == "replicated_with_grad_allreduce"
    assert covering("norm.weight", rules) == {"rule": None}


def test_plan_rules_must_be_a_mapping_of_strings():
    with pytest.raises(UsageError, match="plan_rules must be a mapping"):
        Case(
            name="bad",
            build_dense=lambda dtype: None,
            build_tp=lambda group, dtype: None,
            plan=None,
            load_tp=lambda *a: None,
            make_batch=lambda g, dtype: None,
            plan_rules={"layers.*.q_norm": 3},
        )


def test_findings_match_by_mechanism_and_point_at_files_that_exist():
    root = Path(__file__).resolve().parents[3]
    accumulation = {
        "signature": "grad_accumulation_reduced",
        "evidence": {"style": "replicated_with_grad_allreduce"},
    }
    assert finding_for(accumulation)["doc"] == ACCUMULATION_DOC
    assert finding_for({**accumulation, "evidence": {"style": "my_reduce"}}) is None
    unruled = {"signature": "no_plan_rule", "evidence": {"plan_styles": ["colwise", "rowwise"]}}
    assert finding_for(unruled)["doc"] == "docs/findings/hf-moe-missing-norm-rules.md"
    assert finding_for({**unruled, "evidence": {"plan_styles": ["colwise", "mine"]}}) is None
    assert finding_for({"signature": "partial_sum", "evidence": {}}) is None
    assert finding_for(None) is None
    assert (root / ACCUMULATION_DOC).is_file()
    assert {f.signature for f in FINDINGS} == {
        "grad_accumulation_reduced",
        "no_plan_rule",
        "op_on_shard",
    }
    assert all((root / f.doc).is_file() for f in FINDINGS)


# ---------------------------------------------------------------------- op_on_shard


def _op(module: str, op: str = "mean", at: str = "/x/site-packages/pkg/m.py:7") -> dict:
    return {
        "module": module,
        "op": op,
        "kind": "split" if op == "chunk" else "reduction",
        "dim": -1,
        "at": at,
        "tp_size": 4,
        "dense_size": 8,
    }


def _act(name: str, stage: str = "forward") -> FirstDivergence:
    return FirstDivergence(CheckId.parse(name), stage, 1, [0, 1], error=1.0, bound=1e-6)


def test_an_op_on_a_shard_is_named_where_it_runs_in_the_divergent_output():
    ops = [_op("model.layers.0.mlp"), _op("model.layers.0.mlp.experts", "chunk")]
    other = _op("model.layers.1.mlp")
    # in the parent's own code (between its children), in the module itself, in a module in it
    down = mechanisms.op_on_shard(_act("act:model.layers.0.mlp.down_proj"), ops + [other])
    assert down[0] == "op_on_shard"
    # with the modules where the same operation ran on a shard (each layer's)
    assert down[1]["ops"] == [
        {**ops[0], "in_modules": ["model.layers.0.mlp", "model.layers.1.mlp"]}
    ]
    assert "pkg/m.py:7" in down[2] and "statistic of the rank's shard" in down[2]
    experts = mechanisms.op_on_shard(_act("act:model.layers.0.mlp.experts"), ops)
    # the parent's mean and its own chunk
    assert [{k: v for k, v in op.items() if k != "in_modules"} for op in experts[1]["ops"]] == ops
    assert "packed_colwise" in mechanisms.op_on_shard(_act("act:model.layers.0.mlp"), ops[1:])[2]
    # not a sibling's code, a later layer's, or a backward check
    assert mechanisms.op_on_shard(_act("act:model.layers.0.self_attn.o_proj"), ops) is None
    assert mechanisms.op_on_shard(_act("act:model.layers.1.mlp.down_proj"), ops) is None
    assert mechanisms.op_on_shard(_act("actgrad:model.layers.0.mlp", "backward"), ops) is None
    # the model's output: the model's own code only
    assert mechanisms.op_on_shard(_act("output"), ops) is None
    assert mechanisms.op_on_shard(_act("output"), [*ops, _op("")])[1]["ops"][0]["module"] == ""
    assert mechanisms.op_on_shard(_act("act:model.layers.0.mlp"), []) is None


def test_op_on_shard_only_names_a_mismatch():
    first = _act("act:down")
    assert diagnose(first, [{}, {}], 2, shard_ops=[_op("")])["signature"] == "op_on_shard"
    assert diagnose(first, [{}, {}], 2)["signature"] == "mismatch"
    # a collective signature read from the tensors comes first
    ref = np.arange(1.0, 5.0)
    ev = [
        {
            ("forward", 1, CheckId("act", "down")): {
                "tp": k * ref,
                "ref": ref,
                "placement": "replicate",
            }
        }
        for k in (0.3, 0.7)
    ]
    assert diagnose(first, ev, 2, shard_ops=[_op("")])["signature"] == "partial_sum"
    assert "op_on_shard" in CAUSES


def test_a_model_code_finding_matches_the_file_and_the_operation():
    gemma = "/v/lib/python3.11/site-packages/transformers/models/gemma3n/modeling_gemma3n.py:970"
    inkling = "/v/site-packages/transformers/models/inkling2_loop/modeling_inkling2_loop.py:810"
    found = finding_for({"signature": "op_on_shard", "evidence": {"ops": [_op("m", at=gemma)]}})
    assert found["doc"] == "docs/findings/hf-gemma3n-activation-sparsity.md"
    # Inkling2's chunk of its experts' gate_up on tpcheck's in-memory build: no transformers
    # defect (from_pretrained de-interleaves its checkpoint after sharding it; docs/hf.md)
    split = {"signature": "op_on_shard", "evidence": {"ops": [_op("m", "chunk", inkling)]}}
    assert finding_for(split) is None
    # another operation at that file, or the same operation in other code: no finding
    assert (
        finding_for({"signature": "op_on_shard", "evidence": {"ops": [_op("m", "chunk", gemma)]}})
        is None
    )
    assert finding_for({"signature": "op_on_shard", "evidence": {"ops": [_op("m")]}}) is None
