"""The forward-only check (checker/rank/forward_only.py): `RunSettings(train=False)`, or chosen by
itself when no TP parameter requires grad. The weights, every module output, the output and the
loss of each step are compared on every rank with the training check's bounds and controls; no
backward, grads or optimizer stage; the report says why. Plus the pieces of decoding that need no
ranks: the default decode inputs and the caches restored between steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.case import Case, default_decode_inputs
from tpcheck.checker.casefile import file_spec, register
from tpcheck.checker.rank.forward_only import NO_GRAD, Buffers
from tpcheck.errors import UsageError

from paths import example

MOD = example("own_module")
LOADER = example("own_loader")
TRAINED = {"backward", "grads", "optimizer"}


class InferenceTP(MOD.TPBlock):
    """own_module's TP block as an inference engine holds it: weights that do not require grad, the
    forward under `torch.inference_mode()`."""

    def __init__(self, group, dtype=None, bias_before_reduce=False):
        super().__init__(group, dtype, bias_before_reduce=bias_before_reduce)
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, x):
        return super().forward(x)


class NoGradTP(InferenceTP):
    """The same under `torch.no_grad()` instead."""

    @torch.no_grad()
    def forward(self, x):
        return MOD.TPBlock.forward(self, x)


def _register(name, base, **fields):
    return file_spec(register(dataclasses.replace(base, name=name, **fields)), 2)


def _by_name(results):
    return {r["name"].split("/")[0]: r for r in results}


def _first(r):
    f = r["first_divergence"]
    return f["stage"], f["step"], f["name"]


def _stages(r):
    return {c["stage"] for c in r["checks"]}


def test_train_false_checks_the_forward_of_a_training_module_and_catches_its_bug():
    forward = RunSettings(steps=2, train=False)
    r = _by_name(
        check(
            [
                _register("fo_good", MOD.correct, run=forward),
                _register("fo_bad", MOD.buggy, run=forward),
            ]
        )
    )
    ok, bad = r["fo_good"], r["fo_bad"]
    assert ok["verdict"] == "equivalent", ok["summary"]
    assert ok["forward_only"]["reason"] == "train=False (--forward-only)"
    assert "; forward only: train=False" in ok["summary"]
    # the batch has a target: the loss is compared too; nothing of training
    assert _stages(ok) == {"weights", "forward", "loss", "replicas"}
    assert {c["step"] for c in ok["checks"] if c["name"] == "loss"} == {1, 2}
    assert ok["self_test"]["controls"] and not ok["self_test"]["failures"]
    assert bad["verdict"] == "not equivalent"
    assert _first(bad) == ("forward", 1, "output")
    assert not TRAINED & _stages(bad)


def test_inference_code_is_checked_forward_only_by_itself_and_says_so():
    """Weights with requires_grad=False and a forward under inference_mode / no_grad: today's
    training check could not run them; forward only is chosen and said, the bug still caught."""
    r = _by_name(
        check(
            [
                _register("inf_mode", MOD.correct, build_tp=lambda g, d: InferenceTP(g, d)),
                _register("inf_no_grad", MOD.correct, build_tp=lambda g, d: NoGradTP(g, d)),
                _register(
                    "inf_bad",
                    MOD.correct,
                    build_tp=lambda g, d: InferenceTP(g, d, bias_before_reduce=True),
                ),
            ]
        )
    )
    for name in ("inf_mode", "inf_no_grad"):
        ok = r[name]
        assert ok["verdict"] == "equivalent", ok["summary"]
        assert ok["forward_only"] == {"reason": NO_GRAD, "decode_steps": 0, "notes": []}
        assert f"forward only: {NO_GRAD}" in ok["summary"]
        assert ok["spec"]["train"] is False
        assert not TRAINED & _stages(ok)
    bad = r["inf_bad"]
    assert bad["verdict"] == "not equivalent" and _first(bad) == ("forward", 1, "output")
    assert bad["diagnosis"]["signature"] == "offset"  # the bias counted twice


def test_a_built_in_block_forward_only_expects_only_its_forward_collectives():
    spec = CaseSpec(block="mlp", preset="tiny", world_size=2, run=RunSettings(steps=2, train=False))
    fault = dataclasses.replace(spec, fault="missing_forward_reduce")
    ok, bad = check([spec, fault])
    assert ok["verdict"] == "equivalent", ok["summary"]
    assert ok["name"] == "mlp/tiny/tp2/float32/forward_only"
    expected = ok["ledger"]["expected"]
    assert expected and {e["phase"] for e in expected} == {"forward"}
    assert all(e["count"] == 2 for e in expected)  # once per step: one forward pass each
    assert not ok["ledger"]["problems"]
    # activations compared, every stage of a step's forward
    assert any(c["name"].startswith("act:") for c in ok["checks"])
    assert bad["verdict"] == "not equivalent" and bad["first_divergence"]["stage"] == "forward"
    assert bad["diagnosis"]["signature"] == "partial_sum"
    assert [p["kind"] for p in bad["ledger"]["problems"]] == ["missing"]


def test_an_inferred_plan_forward_only_infers_and_compares_the_activations():
    """plan=None: the parameter placements from the loader, the activations from the first forward
    (as in training), then every step's module outputs compared."""
    (ok,) = check([_register("fo_no_plan", LOADER.no_plan, run=RunSettings(steps=2, train=False))])
    assert ok["verdict"] == "equivalent", ok["summary"]
    assert "activations={\n    'fc1': Shard(2),\n}" in ok["inferred_plan"]
    acts = {(c["step"], c["name"]) for c in ok["checks"] if c["name"].startswith("act:")}
    assert acts == {(1, "act:fc1"), (2, "act:fc1")}


# ----------------------------------------------------------------------------- no ranks needed


def test_train_must_be_a_bool():
    with pytest.raises(UsageError, match="train 'no' must be True or False"):
        RunSettings(train="no")


@pytest.mark.parametrize("bad", [-1, 1.5, True, 10_000])
def test_decode_steps_must_be_a_small_count(bad):
    with pytest.raises(UsageError, match="decode_steps must be an integer"):
        dataclasses.replace(MOD.correct, decode_steps=bad)


def test_decode_inputs_must_be_callable():
    with pytest.raises(UsageError, match="decode_inputs must be a function"):
        dataclasses.replace(MOD.correct, decode_steps=2, decode_inputs=3)


def test_the_default_decode_inputs_place_the_new_tokens_and_their_position():
    tokens = torch.randint(0, 9, (3, 5))
    nxt = torch.tensor([[1], [2], [3]])
    meta = default_decode_inputs({"tokens": tokens, "start_pos": torch.tensor(0)}, nxt, 5)
    assert torch.equal(meta["tokens"], nxt) and meta["start_pos"].dim() == 0
    assert int(meta["start_pos"]) == 5
    fast = default_decode_inputs({"idx": tokens, "input_pos": torch.arange(5)}, nxt, 7)
    assert fast["input_pos"].tolist() == [7]
    mask = torch.ones(3, 5)
    hf = default_decode_inputs(
        {"input_ids": tokens, "position_ids": torch.arange(5).expand(3, 5), "mask": mask}, nxt, 6
    )
    assert hf["position_ids"].tolist() == [[6], [6], [6]] and hf["mask"] is mask
    with pytest.raises(UsageError, match=r"the forward inputs \['x'\] have none of"):
        default_decode_inputs({"x": tokens}, nxt, 5)


class Cached(nn.Module):
    """A cache as a buffer (gpt-fast) and as a plain attribute (Meta's llama), the latter
    reassigned by the forward (`self.cache_v = self.cache_v.to(x)`)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache_k", torch.zeros(2, 3), persistent=False)
        self.cache_v = torch.zeros(2, 3)

    @torch.inference_mode()
    def forward(self, x):
        self.cache_k[0] = x
        self.cache_v = self.cache_v.to(torch.float64)
        self.cache_v[1] = x
        return self.cache_k.sum() + self.cache_v.sum()


def test_the_caches_start_every_step_from_the_module_as_built():
    m = Cached()
    kept = Buffers(m)
    held = m.cache_k
    m(torch.ones(3))
    assert float(m.cache_k.sum()) == 3 and m.cache_v.dtype == torch.float64
    kept.restore()
    assert m.cache_k is held and float(m.cache_k.sum()) == 0  # in place: references stay valid
    assert m.cache_v.dtype == torch.float32 and float(m.cache_v.sum()) == 0
    assert float(m(2 * torch.ones(3))) == 12  # the cache works after the restore


def test_case_has_the_new_fields():
    fields = {f.name for f in dataclasses.fields(Case)}
    assert {"decode_steps", "decode_inputs"} <= fields


def test_the_catalogues_batch_mixing_reduce_is_caught_forward_only_and_needs_a_batch():
    """The built-in blocks' batch-mixing all-reduce (faults/catalogue.py), checked forward only:
    caught in the forward of step 1 at the module after the reduction; with one sequence per batch
    the same bug passes (the two layouts coincide): why a batch of several is the default."""
    from tpcheck.faults import CATALOGUE

    fault = CATALOGUE["batch_mixing_reduce"]
    spec = fault.prepare(
        CaseSpec(block="mlp", preset="tiny", world_size=2, run=RunSettings(steps=2, train=False))
    )
    one = dataclasses.replace(spec, overrides=(("batch", 1),), label="one_sequence")
    bad, blind = check([spec, one])
    assert bad["verdict"] == "not equivalent" and _first(bad) == ("forward", 1, "act:down")
    assert bad["diagnosis"]["signature"] == "permuted"
    assert bad["forward_only"]["reason"] == "train=False (--forward-only)"
    assert blind["verdict"] == "equivalent", blind["summary"]


class Scale(nn.Module):
    """No parameter at all: nothing to train (an optimizer refuses an empty parameter list)."""

    def __init__(self, group=None, dtype=None):
        super().__init__()

    def forward(self, x):
        return 2 * x


def test_a_module_without_parameters_runs_forward_only_and_a_decode_without_positions_is_refused():
    plain = Case(
        name="no_params",
        build_dense=lambda dtype: Scale(),
        build_tp=lambda group, dtype: Scale(group),
        plan=MOD.Plan(params={}),
        make_batch=MOD.make_batch,
    )
    trains, decodes = check(
        [
            file_spec(register(plain), 2),
            # own_module's input is hidden states: nothing says where a new token goes
            _register("decode_no_position", MOD.correct, decode_steps=2),
        ]
    )
    assert trains["verdict"] == "equivalent", trains["summary"]
    assert trains["forward_only"]["reason"] == NO_GRAD and "output" in {
        c["name"] for c in trains["checks"]
    }
    assert decodes["verdict"] == "invalid"
    assert "the forward inputs ['x'] have none of" in decodes["summary"]
    assert "Case(decode_inputs=...)" in decodes["summary"]


def _own_decode_inputs(prompt, next_tokens, position):
    return {"tokens": next_tokens, "start_pos": torch.tensor(position)}


def _broken_decode_inputs(prompt, next_tokens, position):
    raise ValueError("no such position")


def test_a_cases_own_decode_inputs_are_used_and_their_errors_name_them():
    llama = example("inference_llama")
    own, broken = check(
        [
            _register("own_decode", llama.correct, decode_inputs=_own_decode_inputs),
            _register("broken_decode", llama.correct, decode_inputs=_broken_decode_inputs),
        ]
    )
    assert own["verdict"] == "equivalent", own["summary"]
    assert "output:decode3" in {c["name"] for c in own["checks"]}
    assert broken["verdict"] == "invalid"
    assert "in your decode_inputs (tests/checker/rank/test_forward_only.py:" in broken["summary"]
    assert "ValueError: no such position" in broken["summary"]


def test_every_built_in_block_is_equivalent_forward_only_with_its_forward_collectives():
    from tpcheck.blocks import BLOCKS

    forward = RunSettings(steps=2, train=False)
    specs = [
        CaseSpec(block=b, preset="tiny", world_size=2, sequence_parallel=sp, run=forward)
        for b in BLOCKS
        for sp in ((False, True) if BLOCKS[b].sequence_parallel else (False,))
    ]
    for spec, r in zip(specs, check(specs)):
        assert r["verdict"] == "equivalent", (spec.name, r["summary"])
        assert not r["ledger"]["problems"], (spec.name, r["ledger"]["problems"])
        assert not TRAINED & _stages(r) and r["self_test"]["controls"]
