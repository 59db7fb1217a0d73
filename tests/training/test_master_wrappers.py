"""Float32 masters kept apart, as training scripts keep them (case_files/master_wrappers.py): a
wrapper whose inner AdamW steps master copies in parameter groups listed in another order than the
model's, the norms initialised at ones and zeros so that several masters tie by value; and a
hand-written AdamW with its masters and moments in a dict, where only the module's 16-bit weights
can be seen. Each correct one is equivalent at tp 2 and 4 in float32 and bfloat16; a weight decay
on every parameter (the norms' and biases' too) is caught at the first norm's update as `decay`, a
decay 10 times the rule's in the dict AdamW at the first weight it scales.

Checker mutants: masters that tied by value bound in order only (never settled by their
gradients) compare one norm's state with another's; the module's bfloat16 weights held to the dense
float32 masters fail on rounding alone. Each turns a correct case "not equivalent"."""

import pytest

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.rank import optimizer_stage, training

from paths import REPO

FILE = REPO / "tests" / "training" / "case_files" / "master_wrappers.py"
GRID = [(world, dtype) for world in (2, 4) for dtype in ("float32", "bfloat16")]
CORRECT = ("grouped_masters", "dict_adamw")
BUGS = {
    "grouped_masters_decay_everywhere": ("update:blocks.0.norm.weight", "decay"),
    "dict_adamw_wrong_decay": ("param:blocks.0.fc1.weight", "scaled"),
}


def spec(name, world=2, dtype="float32"):
    return CaseSpec(
        block=f"file:{FILE}:{name}", world_size=world, run=RunSettings(dtype=dtype, steps=3)
    )


@pytest.fixture(scope="module")
def results():
    specs = [spec(n, w, d) for n in (*CORRECT, *BUGS) for w, d in GRID]
    return dict(zip(specs, check(specs)))


@pytest.mark.slow
@pytest.mark.parametrize("name", CORRECT)
@pytest.mark.parametrize("world,dtype", GRID)
def test_masters_kept_apart_are_equivalent(results, name, world, dtype):
    r = results[spec(name, world, dtype)]
    assert r["verdict"] == "equivalent", r["summary"]
    names = {c["name"] for c in r["checks"]}
    if name == "grouped_masters":  # its inner AdamW found: every state entry held to the rule's
        assert {"state:blocks.1.norm.bias.exp_avg", "update:blocks.0.norm.weight"} <= names
    else:  # nothing to find: the module's weights after each step, the state said unobservable
        assert "param:blocks.1.norm.bias" in names and "not observable" in r["summary"]
    if dtype == "bfloat16":
        assert r["float64_run"]["verdict"] == "equivalent", r["summary"]


@pytest.mark.slow
@pytest.mark.parametrize("name", BUGS)
@pytest.mark.parametrize("world,dtype", GRID)
def test_a_wrong_decay_is_caught_at_the_step_with_its_signature(results, name, world, dtype):
    r = results[spec(name, world, dtype)]
    assert r["verdict"] == "not equivalent", r["summary"]
    first = r["first_divergence"]
    assert (first["name"], first["stage"], first["step"]) == (BUGS[name][0], "optimizer", 1)
    assert r["diagnosis"]["signature"] == BUGS[name][1], r["diagnosis"]


def _unsettled(monkeypatch):
    monkeypatch.setattr(training, "settle_ties", lambda found, grads: None)


def _masters_for_module_weights(monkeypatch):
    monkeypatch.setattr(optimizer_stage, "_stepped", lambda s, opts: lambda p: p)


@pytest.mark.parametrize(
    "mutant, name, dtype, first",
    [
        (_unsettled, "grouped_masters", "float32", "moment:blocks.0.norm.bias.exp_avg"),
        (_masters_for_module_weights, "dict_adamw", "bfloat16", "param:blocks.0.fc2_bias"),
    ],
    ids=["ties_bound_in_order", "module_weights_held_to_masters"],
)
def test_each_mutant_turns_a_correct_wrapper_not_equivalent(
    monkeypatch, mutant, name, dtype, first
):
    (real,) = check([spec(name, 2, dtype)])
    assert real["verdict"] == "equivalent", real["summary"]
    mutant(monkeypatch)
    (r,) = check([spec(name, 2, dtype)])
    assert r["verdict"] == "not equivalent", r["summary"]
    assert r["first_divergence"]["name"] == first, r["summary"]
