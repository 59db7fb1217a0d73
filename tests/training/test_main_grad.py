"""Gradients kept where the TP code's framework keeps them (case_files/main_grad_style.py):
Megatron's `main_grad`, a float32 view of one flat grad buffer that a post-accumulate hook adds
`.grad` into before freeing it, stepped by an optimizer wrapper over float32 masters. tpcheck finds
`main_grad` (and says so in the notes) or reads where `Case(grad_of=...)` says; the grads checks,
the clipping and the replay see what the framework's optimizer steps on. An accumulator left
unzeroed between steps is caught at step 2's gradients, a parameter whose hook is missing at step
1's; checker mutants of the new paths lose what they catch."""

import pytest
import torch
from torch import nn

from tpcheck import Case, CaseSpec, RunSettings, check
from tpcheck.checker.rank import grad_source, optimizer_stage, training
from tpcheck.checker.rank.grad_source import GradSource
from tpcheck.errors import UsageError

from paths import REPO

FILE = REPO / "tests" / "training" / "case_files" / "main_grad_style.py"
GRID = [(world, dtype) for world in (2, 4) for dtype in ("float32", "bfloat16")]
FOUND = "your TP module keeps them in `main_grad` (6 parameter(s)"


def spec(name, world=2, dtype="float32", steps=2, **run):
    return CaseSpec(
        block=f"file:{FILE}:{name}",
        world_size=world,
        run=RunSettings(dtype=dtype, steps=steps, **run),
    )


def first(r):
    return r["first_divergence"] or {}


BUGS = [
    spec("main_grad_not_zeroed"),
    spec("main_grad_not_zeroed", 4, "bfloat16"),
    spec("main_grad_bias_hook_missing"),
    spec("main_grad_bias_hook_missing", 4, "bfloat16"),
]
OTHERS = [
    spec("zeroed_by_module"),
    spec("grad_views", dtype="bfloat16"),
    spec("rule_on_main_grad"),
    spec("rule_on_main_grad", dtype="bfloat16"),
    spec("main_grad", clip_grad_norm=0.05),
]


@pytest.fixture(scope="module")
def results():
    specs = [spec("main_grad", w, d) for w, d in GRID] + BUGS + OTHERS
    return dict(zip(specs, check(specs)))


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", GRID)
def test_main_grad_is_found_and_the_case_is_equivalent(results, world, dtype):
    r = results[spec("main_grad", world, dtype)]
    assert r["verdict"] == "equivalent", r["summary"]
    names = {c["name"] for c in r["checks"]}
    # the gradients, and the replay of the wrapper's inner AdamW on what it was handed
    assert {"grad:fc2.bias", "state:fc1.weight.exp_avg", "update:fc2.weight"} <= names
    assert {c["step"] for c in r["checks"] if c["name"] == "grad:norm.weight"} == {1, 2}
    assert any(FOUND in n for n in r["notes"]), r.get("notes")
    assert "not checked: the gradients in `.grad`" in r["summary"]


@pytest.mark.slow
def test_an_accumulator_left_unzeroed_is_caught_at_step_2(results):
    for s in BUGS[:2]:
        r = results[s]
        assert r["verdict"] == "not equivalent", r["summary"]
        assert (first(r)["stage"], first(r)["step"]) == ("grads", 2), first(r)
        assert first(r)["name"].startswith("grad:")
        assert r["diagnosis"]["signature"] == "mismatch", r["summary"]
        assert all(c["passed"] for c in r["checks"] if c["step"] == 1)
    twin = results[spec("main_grad")]  # the same wrapper zeroing `main_grad` in zero_grad()
    assert twin["verdict"] == "equivalent", twin["summary"]


@pytest.mark.slow
def test_a_missing_accumulation_hook_is_caught_at_its_parameter(results):
    for s in BUGS[2:]:
        r = results[s]
        assert r["verdict"] == "not equivalent", r["summary"]
        assert (first(r)["stage"], first(r)["step"], first(r)["name"]) == (
            "grads",
            1,
            "grad:fc2.bias",
        )
        assert r["diagnosis"]["signature"] == "not_applied", r["summary"]
        assert any("fc2.bias also kept a `.grad`" in n for n in r["notes"]), r.get("notes")
    twin = results[spec("main_grad", 4, "bfloat16")]
    assert twin["verdict"] == "equivalent", twin["summary"]
    assert not any("also kept a `.grad`" in n for n in twin["notes"])


@pytest.mark.slow
def test_a_module_zeroing_its_own_buffer_and_a_named_place(results):
    """Megatron's split (the module's zero_grad_buffer() zeroes the buffer, the optimizer only
    `.grad`) with `grad_of="main_grad"`; segments kept apart from the parameters with a function.
    Named places are not noted."""
    for s in OTHERS[:2]:
        r = results[s]
        assert r["verdict"] == "equivalent", r["summary"]
        assert not any(FOUND in n for n in r.get("notes") or ()), r["notes"]
        assert "update:fc1.weight" in {c["name"] for c in r["checks"]}


@pytest.mark.slow
def test_tpchecks_own_optimizer_steps_on_main_grad_and_zeroes_it(results):
    for s in OTHERS[2:4]:
        r = results[s]
        assert r["verdict"] == "equivalent", r["summary"]
        assert any(FOUND in n for n in r["notes"])
        stepped = {
            c["step"]
            for c in r["checks"]
            if c["name"] == "param:fc1.weight" and c["stage"] == "optimizer"
        }
        assert stepped == set(range(1, s.run.steps + 1))


@pytest.mark.slow
def test_the_clipping_scales_main_grad(results):
    r = results[OTHERS[4]]
    assert r["verdict"] == "equivalent", r["summary"]
    names = {c["name"] for c in r["checks"]}
    assert {"clip:grad_norm", "clipped:fc1.weight"} <= names


def test_without_the_finding_the_case_is_refused_naming_grad_of(monkeypatch):
    """Checker mutant: `main_grad` never found; the case is refused as before the fix, and the
    refusal says how to name the place."""
    monkeypatch.setattr(grad_source, "_holds", lambda p: False)
    (r,) = check([spec("main_grad")])
    assert r["verdict"] == "invalid", r["summary"]
    assert "got no gradient on rank" in r["summary"] and "Case(grad_of=...)" in r["summary"]


def test_a_checker_zeroing_main_grad_itself_loses_the_unzeroed_accumulator(monkeypatch):
    """Checker mutant: tpcheck zeroes the accumulator under the user's optimizer too; the user's
    missing zeroing is then hidden."""
    zero = optimizer_stage.zero_grads

    def zeroing_all(s, opts):
        zero(s, opts)
        s.grad_of.zero(s.tp)

    monkeypatch.setattr(optimizer_stage, "zero_grads", zeroing_all)
    (r,) = check([spec("main_grad_not_zeroed")])
    assert r["verdict"] == "equivalent", r["summary"]


def test_a_clipping_that_reads_dot_grad_is_caught(monkeypatch):
    """Checker mutant: the TP-aware clipping reads `.grad` (empty under main_grad): its norm is
    then not the dense side's."""
    by_name = training._grads_by_dense_name
    monkeypatch.setattr(
        training, "_grads_by_dense_name", lambda module, plan, grad_of=None: by_name(module, plan)
    )
    (r,) = check([spec("main_grad", clip_grad_norm=0.05)])
    assert r["verdict"] == "not equivalent", r["summary"]
    assert (first(r)["stage"], first(r)["step"], first(r)["name"]) == (
        "optimizer",
        1,
        "clip:grad_norm",
    )


# ------------------------------------------------------------------ where the gradients are read


def _module():
    m = nn.Linear(3, 2)
    m(torch.ones(1, 3)).sum().backward()
    return m


def test_main_grad_is_read_only_where_grad_was_moved():
    m = _module()
    source = GradSource()
    source.settle(m)  # every `.grad` still there, no `main_grad`: `.grad`
    assert not source.elsewhere and source.notes() == []
    assert source(m.weight) is m.weight.grad

    m = _module()
    m.weight.main_grad, m.bias.main_grad = m.weight.grad.clone(), m.bias.grad.clone()
    m.weight.grad = None  # moved; the bias kept its `.grad` beside its `main_grad`
    source = GradSource()
    source.settle(m)
    assert source(m.weight) is m.weight.main_grad and source(m.bias) is m.bias.main_grad
    assert source.found == ["weight", "bias"] and source.left == ["bias"]
    source.zero(m)
    assert not m.weight.main_grad.any() and m.bias.grad.any()


def test_a_named_place_is_read_and_checked_for_its_shape():
    m = _module()
    m.weight.acc, m.bias.acc = torch.ones(2, 3), torch.ones(2)
    source = GradSource("acc")
    source.settle(m)
    assert source(m.weight) is m.weight.acc and source.notes() == []
    flat = torch.zeros(8)
    wrong = GradSource(lambda p: flat)
    with pytest.raises(UsageError, match=r"'weight' \(shape \[2, 3\]\) read from your "):
        wrong.settle(m)


@pytest.mark.parametrize("value", [3, "main grad", ""])
def test_a_grad_of_that_is_neither_a_name_nor_a_function_is_refused(value):
    with pytest.raises(UsageError, match="grad_of must name the attribute"):
        Case(
            name="c",
            build_dense=nn.Linear,
            build_tp=nn.Linear,
            plan=None,
            load_tp=lambda *a: None,
            make_batch=lambda g, d: ({}, None),
            grad_of=value,
        )
