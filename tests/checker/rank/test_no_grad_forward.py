"""Two Case fields for TP code nobody annotated: `activations` (module outputs to check when the
plan is inferred) and `no_grad_forward` (the forward without autograd, compared as `output:no_grad`:
TP code may take another path for inference). And an error raised in the code under
test names its line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tpcheck import Case
from tpcheck.api import check
from tpcheck.checker.casefile import file_spec, register
from tpcheck.checker.verdict.failures import raised_in
from tpcheck.errors import UsageError
from tpcheck.plan import Shard

from paths import example

EX = example("own_loader")


class InferenceSkipsReduce(EX.TPBlock):
    """The planted bug: without autograd (inference), the
    row-parallel partial sums are not all-reduced."""

    def forward(self, x):
        if torch.is_grad_enabled():
            return super().forward(x)
        h_local = F.gelu(self.fc1(x))
        return x + F.linear(h_local, self.fc2.weight) + self.fc2.bias


def _case(name, build_tp=EX.TPBlock, **fields):
    base = EX.no_plan
    return register(
        dataclasses.replace(
            base,
            name=name,
            build_tp=lambda group, dtype: build_tp(group, dtype),
            activations={"fc1": Shard(2)},
            **fields,
        )
    )


def _checks(result, prefix):
    return [c for c in result["checks"] if c["name"].startswith(prefix)]


def test_no_grad_forward_catches_an_inference_only_bug_and_the_correct_twin_passes():
    good = _case("no_grad_good", no_grad_forward=True)
    bad = _case("no_grad_bad", InferenceSkipsReduce, no_grad_forward=True)
    # the checker mutant
    blind = _case("no_grad_blind", InferenceSkipsReduce, no_grad_forward=False)
    results = {
        r["name"].split("/")[0]: r for r in check([file_spec(t, 2) for t in (good, bad, blind)])
    }
    ok = results["no_grad_good"]
    assert ok["verdict"] == "equivalent", ok["summary"]
    assert _checks(ok, "output:no_grad") and {c["name"] for c in _checks(ok, "act:")} == {"act:fc1"}
    caught = results["no_grad_bad"]
    assert caught["verdict"] == "not equivalent"
    # every step's forward without autograd; the last step's in eval mode is one too
    failed = {(c["name"], c["step"]) for c in caught["checks"] if not c["passed"]}
    assert {name for name, _ in failed} == {"output:no_grad", "output:eval"}
    assert caught["first_divergence"]["name"] == "output:no_grad"
    # each rank holds its own partial sum
    assert caught["diagnosis"]["signature"] == "replicas_differ"
    # without the no-grad forward only the eval-mode forward sees it, at the last step: the checks
    # are what see it
    blind = results["no_grad_blind"]
    last = blind["spec"]["steps"]
    assert {(c["name"], c["step"]) for c in blind["checks"] if not c["passed"]} == {
        ("output:eval", last)
    }


class AlwaysSkipsReduce(EX.TPBlock):
    """A bug in both paths: the row-parallel partial sums are never all-reduced."""

    def forward(self, x):
        h_local = F.gelu(self.fc1(x))
        return x + F.linear(h_local, self.fc2.weight) + self.fc2.bias


def _check(name, step=1, stage="forward", seq=0, passed=False):
    from tpcheck.checker.checkid import CheckId
    from tpcheck.checker.payload import Check

    return Check(
        stage=stage,
        step=step,
        id=CheckId.parse(name),
        rank=0,
        error=1.0,
        diff_vs_dense=1.0,
        bound=0.5,
        kind="calibrated",
        reason="",
        passed=passed,
        seq=seq,
    )


def test_a_bug_in_the_training_forward_too_is_named_there_not_at_the_output_without_autograd():
    """The output without autograd is compared first (before its micro-batch's training forward);
    where that forward fails too, its failure is the first divergence: it names a module (here
    the output of the block, which the activation checks reach). A failure without autograd alone
    stays first; a later step's training forward never stands in for it."""
    from tpcheck.checker.verdict.divergence import first_divergence as _first

    (r,) = check([file_spec(_case("both_paths", AlwaysSkipsReduce, no_grad_forward=True), 2)])
    assert r["verdict"] == "not equivalent"
    failed = [c["name"] for c in r["checks"] if not c["passed"]]
    # compared first, and failing: the rule, not the order, makes the output the first divergence
    assert failed.index("output:no_grad") < failed.index("output")
    assert r["first_divergence"]["name"] == "output", r["first_divergence"]
    alone = [_check("output:no_grad"), _check("output", step=2), _check("output:eval", step=2)]
    assert _first(alone).name == "output:no_grad"
    both = [_check("output:no_grad"), _check("act:fc2"), _check("output")]
    assert _first(both).name == "act:fc2"
    assert _first([_check("output:eval", 2), _check("output", 2)]).name == "output"


def test_a_decision_made_without_autograd_yields_to_the_training_forward_that_fails_too():
    """Inkling2's shape: the pass without autograd compares the output and the routers' top-k on
    the way; its layer-1 router flips (seq 56) before the training forward's layer-0 output fails
    (seq 60). The first divergence is that output: it names the layer where the bug acts. Without
    the step's checks (the pass's extent unknown: a checker mutant), the router is named."""
    from tpcheck.checker.verdict.divergence import first_divergence as _first

    checks = [
        _check("routing:layers.0.gate.topk#1", seq=55, passed=True),
        _check("routing:layers.1.gate.topk#1", seq=56),
        _check("output:no_grad", seq=57),
        _check("routing:layers.0.gate.topk#1", seq=59, passed=True),
        _check("act:layers.0", seq=60),
        _check("routing:layers.1.gate.topk#1", seq=61),
    ]
    failed = [c for c in checks if not c.passed]
    assert _first(failed, checks).name == "act:layers.0"
    assert _first(failed).name == "routing:layers.1.gate.topk#1"
    # the pass without autograd alone failing: its first failure stays first
    alone = [c for c in failed if c.seq <= 57]
    assert _first(alone, checks).name == "routing:layers.1.gate.topk#1"


def test_activations_are_refused_beside_a_written_plan():
    with pytest.raises(UsageError, match="activations are given twice"):
        dataclasses.replace(EX.correct, activations={"fc1": Shard(2)})


def test_an_error_names_the_line_of_the_code_under_test():
    tb = """Traceback (most recent call last):
  File "/x/site-packages/torch/nn/modules/module.py", line 1789, in _call_impl
    return forward_call(*args, **kwargs)
  File "/x/site-packages/transformers/models/doge/modeling_doge.py", line 181, in eager_attention_forward
    attn_weights = attn_weights + attention_mask
  File "/x/site-packages/torch/_ops.py", line 875, in __call__
    return self._op(*args, **kwargs)
RuntimeError: boom"""  # noqa: E501 - a real traceback's lines
    assert raised_in(tb) == (
        "transformers/models/doge/modeling_doge.py:181 in eager_attention_forward: "
        "attn_weights = attn_weights + attention_mask"
    )
    assert (
        raised_in('  File "/x/site-packages/torch/a.py", line 1, in f\n    g()\nValueError') is None
    )


def test_case_is_a_dataclass_with_the_new_fields():
    fields = {f.name for f in dataclasses.fields(Case)}
    assert {"activations", "no_grad_forward"} <= fields
