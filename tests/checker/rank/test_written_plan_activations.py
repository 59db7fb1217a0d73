"""A written plan never diagnoses worse than none: the module outputs a written `Plan(params=...)`
does not name are inferred and checked exactly as with no plan written, so a bug is named at its
module either way; a module output that is no placement of the dense one fails at that module.

The code under test is tests/checker/rank/megatron_style_layer.py: a Llama-like decoder layer
written Megatron-style with plain torch.distributed (column/row parallel linears, f and g as
autograd Functions), once with a written plan and no activations, once with `plan=None` and a
loader."""

import dataclasses
from pathlib import Path

import pytest

from tpcheck import CaseSpec, Plan, Replicate, RunSettings, Shard, check
from tpcheck.checker.casefile import file_spec, register
from tpcheck.checker.rank import activations, discover

LAYER = Path(__file__).with_name("megatron_style_layer.py")

# the planted bug -> the module whose output gradient is a partial sum first
NAMED = {"mlp": "post_attention_layernorm", "attn": "input_layernorm"}


def _run(*names: str) -> dict[str, dict]:
    return {
        r["name"].split("/")[0]: r for r in check([file_spec(f"{LAYER}:{n}", 2) for n in names])
    }


def _first(r: dict) -> tuple:
    f = r["first_divergence"]
    return f["stage"], f["step"], f["name"]


@pytest.fixture(scope="module")
def layer() -> dict[str, dict]:
    """Every case of the layer, written plan and none, correct and buggy, in one pool."""
    return _run(
        "written",
        "no_plan",
        "written_no_f_mlp",
        "no_plan_no_f_mlp",
        "written_no_f_attn",
        "no_plan_no_f_attn",
        "written_flat_down",
        "no_plan_flat_down",
    )


def test_the_correct_layer_with_a_written_plan_checks_every_module_output(layer):
    """Equivalent, and the module outputs the plan is silent about are checked as plan=None checks
    them: the same placements, recorded as inferred."""
    ok, none = layer["written"], layer["no_plan"]
    assert ok["verdict"] == none["verdict"] == "equivalent", (ok["summary"], none["summary"])
    record = ok["activations"]
    assert record["written"] == {} and record["not_checked"] == {}
    assert record["no_placement"] == {}
    assert record["inferred"] == none["activations"]["inferred"]
    assert record["inferred"]["post_attention_layernorm"] == "Replicate()"
    assert record["inferred"]["mlp.gate_proj"] == "Shard(2)"  # column-parallel: this rank's slice
    names = {c["name"] for c in ok["checks"]}
    assert {"act:mlp.down_proj", "actgrad:post_attention_layernorm", "actgrad:input_layernorm"} <= (
        names
    )
    assert "inferred_plan" not in ok  # the parameters were written: nothing to paste


@pytest.mark.parametrize("bug", ["mlp", "attn"])
def test_a_missing_backward_all_reduce_is_named_at_its_module_with_a_written_plan(layer, bug):
    """f with no backward all-reduce before the MLP (or the attention): the written plan's case is
    diagnosed as plan=None's is -- the gradient of the norm's output before that sublayer, a
    partial sum -- not as a replicated input gradient that differs with no module named."""
    written, none = layer[f"written_no_f_{bug}"], layer[f"no_plan_no_f_{bug}"]
    module = NAMED[bug]
    for r in (written, none):
        assert r["verdict"] == "not equivalent"
        assert _first(r) == ("backward", 1, f"actgrad:{module}"), r["summary"]
        assert r["diagnosis"]["signature"] == "partial_sum", r["summary"]
        assert r["diagnosis"]["location"] == module
    assert written["first_divergence"]["ranks"] == none["first_divergence"]["ranks"] == [0, 1]


def test_checker_mutant_no_inference_under_a_written_plan_names_no_module(monkeypatch):
    """Mutant: the module outputs of a written plan are not inferred (the rule before: only with no
    plan written). The same bug is then seen only at the layer's input gradient, replicas that
    differ, no module named -- what the inference for written plans adds."""
    monkeypatch.setattr(
        discover,
        "infers_activations",
        lambda case: case.plan is None and not case.activations and case.run.capture,
    )
    r = _run("written_no_f_mlp")["written_no_f_mlp"]
    assert r["verdict"] == "not equivalent"
    assert _first(r) == ("backward", 1, "grad:hidden_states"), r["summary"]
    assert r["diagnosis"]["location"] == "hidden_states"
    assert not any(c["name"].startswith(("act:", "actgrad:")) for c in r["checks"])


def test_written_activations_are_kept_and_the_others_inferred():
    """A plan that names one module output: that placement is kept as written (and said so), the
    others inferred; the printed record tells the two apart."""
    base = _case("written")
    plan = Plan(params=base.plan.params, activations={"mlp": Replicate(), "mlp.up_proj": Shard(2)})
    named = dataclasses.replace(base, name="written_some_acts", plan=plan)
    (r,) = check([CaseSpec(block=register(named), world_size=2, run=RunSettings(steps=1))])
    assert r["verdict"] == "equivalent", r["summary"]
    record = r["activations"]
    assert record["written"] == {"mlp": "Replicate()", "mlp.up_proj": "Shard(2)"}
    assert "mlp" not in record["inferred"] and "mlp.up_proj" not in record["inferred"]
    assert record["inferred"]["mlp.gate_proj"] == "Shard(2)"
    names = [c["name"] for c in r["checks"] if c["rank"] == 0 and c["stage"] == "forward"]
    assert names.count("act:mlp") == names.count("act:mlp.gate_proj") == 2  # 2 micro-batches


def test_capture_off_checks_no_module_output():
    named = dataclasses.replace(_case("written"), name="written_no_capture")
    spec = CaseSpec(block=register(named), world_size=2, run=RunSettings(steps=1, capture=False))
    (r,) = check([spec])
    assert r["verdict"] == "equivalent", r["summary"]
    assert not any(c["name"].startswith(("act:", "actgrad:")) for c in r["checks"])
    assert "activations" not in r


# ---- a module output that is no placement of the dense one


def test_a_flattened_module_output_fails_at_its_module_with_the_shapes(layer):
    """down_proj returns [s*b, h] = [12, 32] where the dense one returns [s, b, h] = [6, 2, 32] (and
    the MLP unflattens it in the wrong order): the first failure is that module, in the forward of
    step 1, saying both shapes -- with the plan written and with none."""
    for name in ("written_flat_down", "no_plan_flat_down"):
        r = layer[name]
        assert r["verdict"] == "not equivalent"
        assert _first(r) == ("forward", 1, "act:mlp.down_proj"), r["summary"]
        assert r["first_divergence"]["ranks"] == [0, 1]
        shapes = "its output [12, 32] is no placement of the dense [6, 2, 32]"
        assert r["diagnosis"]["signature"] == "no_placement"
        assert r["diagnosis"]["location"] == "mlp.down_proj"
        assert (
            f"act:mlp.down_proj (forward, step 1) on rank(s) [0, 1]: no_placement: {shapes}"
            in (r["summary"])
        )
        assert r["activations"]["no_placement"] == {"mlp.down_proj": shapes}
    assert (
        "# failed: mlp.down_proj: its output [12, 32]"
        in layer["no_plan_flat_down"]["inferred_plan"]
    )


def test_checker_mutant_an_output_no_placement_skipped_moves_the_blame(monkeypatch):
    """Mutant: an output that is no placement of the dense one is skipped (the rule before). The
    bug is then first seen at the next module, the MLP's output, with its tokens permuted: the
    module that laid its output out wrong is not named."""
    decide = activations.decide

    def skipping(*args, **kwargs):
        placed, skipped, failed = decide(*args, **kwargs)
        return activations.Decision(placed, {**skipped, **failed}, {})

    monkeypatch.setattr(activations, "decide", skipping)
    r = _run("written_flat_down")["written_flat_down"]
    assert r["verdict"] == "not equivalent"
    assert _first(r) == ("forward", 1, "act:mlp"), r["summary"]
    assert r["diagnosis"]["signature"] != "no_placement"


def _case(name):
    from tpcheck.checker.casefile import load_module

    return getattr(load_module(str(LAYER)), name)


def test_the_report_and_the_printed_plan_say_which_activations_were_written_and_inferred(layer):
    """The report validates with `activations`; `verify --print-plan` prints a written plan's module
    outputs marked written / inferred, and the page shows them; a case with no plan written keeps
    its inferred plan."""
    import json

    from tpcheck import exit_code
    from tpcheck.cli.execute import plans_text
    from tpcheck.report.html import render_html
    from tpcheck.report.schema import build_report, load_schema
    from tpcheck.report.validate import first_error

    cases = [layer["written"], layer["no_plan"], layer["written_flat_down"]]
    report = build_report(cases, exit_code=exit_code(cases))
    assert first_error(json.loads(json.dumps(report)), load_schema()) is None
    text = plans_text(cases)
    assert (
        "# written/tp2/float32: plan written in the case file; its module outputs "
        "(0 written, 11 inferred, 0 not checked):\nactivations={\n"
    ) in text
    assert "    'mlp.gate_proj': Shard(2),  # inferred\n" in text
    assert "# no_plan/tp2/float32\nPlan(params={" in text
    assert "# failed: mlp.down_proj: its output [12, 32] is no placement" in text
    page = render_html(report)
    assert page.count("<h4>Module outputs (plan written; ") == 2
    assert page.count("<h4>Plan inferred") == 1


def test_an_inferred_plan_marks_the_activations_the_case_named_and_those_inferred():
    """plan=None with `Case.activations`: the printed plan says which placement was written and
    which inferred, and still evaluates to the plan; with none named it carries no marks."""
    from tpcheck.checker.rank.plan_inference import plan_as_code

    plan = Plan(params={"w": Shard(0)}, activations={"fc1": Shard(2), "fc2": Replicate()})
    code = plan_as_code(plan, {"fc3": "why"}, written={"fc1"}, no_placement={"fc4": "shapes"})
    assert "    'fc1': Shard(2),  # written\n    'fc2': Replicate(),  # inferred\n" in code
    assert code.endswith("\n# not checked: fc3: why\n# failed: fc4: shapes")
    assert eval(code, {"Plan": Plan, "Shard": Shard, "Replicate": Replicate}) == plan
    assert "#" not in plan_as_code(plan)
