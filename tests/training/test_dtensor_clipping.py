"""A DTensor trainer's own clipping sees the module as the framework holds it: DTensor parameters
with DTensor gradients over the ranks' shards (`LocalShards.as_held`), so torch's
`clip_grad_norm_(model.parameters(), ...)` and the torchtitan way (`get_total_norm`,
`full_tensor()`, `clip_grads_with_norm_`) take the global norm, as in the real run: equivalent.
Through the plain local shards tpcheck steps, the same clipping took each rank's own norm and was
reported `clip_local_norm`. A trainer that clips the local gradients by their own norm is still
caught, `clip_local_norm` at `clip:grad_norm`. The user's TP optimizer is handed the module the
same way: the DTensor parameters, stepped in place over the shards, given each step's gradients."""

import pytest

from tpcheck import check, exit_code
from tpcheck.adapters import dtensor
from tpcheck.checker.casefile import file_spec

from paths import REPO

FILE = REPO / "tests" / "training" / "case_files" / "dtensor_trainer.py"
CORRECT = ("torch_clip", "titan_clip")


def spec(name, world=2, dtype="float32"):
    return file_spec(f"{FILE}:{name}", world, dtype=dtype)


def _assert_pair(results, names):
    by = dict(zip(names, results))
    for name in CORRECT:
        assert by[name]["verdict"] == "equivalent", (name, by[name]["summary"])
        assert {"clip:grad_norm", "clipped:layers.0.ffn_norm.weight"} <= {
            c["name"] for c in by[name]["checks"]
        }
    bad = by["local_clip"]
    assert bad["verdict"] == "not equivalent", bad["summary"]
    first = bad["first_divergence"]
    assert (first["stage"], first["step"], first["name"]) == ("optimizer", 1, "clip:grad_norm")
    assert bad["diagnosis"]["signature"] == "clip_local_norm", bad["diagnosis"]
    assert exit_code([by[n] for n in CORRECT]) == 0 and exit_code([bad]) == 1


NAMES = (*CORRECT, "local_clip")


@pytest.mark.slow
def test_torch_and_torchtitan_clipping_of_dtensors_pass_a_local_norm_is_caught():
    _assert_pair(check([spec(n) for n in NAMES]), NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", [(4, "float32"), (2, "bfloat16"), (4, "bfloat16")])
def test_the_same_at_world_4_and_in_bfloat16(world, dtype):
    _assert_pair(check([spec(n, world, dtype) for n in NAMES]), NAMES)


def test_through_the_local_shards_torchs_clipping_took_the_local_norm(monkeypatch):
    """The mutant: the user's clipping handed the plain local shards (no `as_held`)."""
    monkeypatch.delattr(dtensor.LocalShards, "as_held")
    (r,) = check([spec("torch_clip")])
    assert r["verdict"] == "not equivalent", r["summary"]
    assert r["diagnosis"]["signature"] == "clip_local_norm", r["diagnosis"]


def grid(fast):
    """tp 2 and 4, float32 and bfloat16: `fast` in make test, the others slow."""
    every = [(w, d) for w in (2, 4) for d in ("float32", "bfloat16")]
    return [c if c == fast else pytest.param(*c, marks=pytest.mark.slow) for c in every]


@pytest.mark.parametrize("world,dtype", grid((2, "float32")))
def test_a_dtensor_trainers_own_fused_adamw_is_followed_and_a_wrong_decay_caught(world, dtype):
    """The trainer's optimizer as DTensor trainers build it, `AdamW(model.parameters(),
    fused=True)` beside torch's clipping: the rule, its replay and the truth run the fused kernels
    too (said in the notes), equivalent; the same with a weight decay of 0.1 (the rule's 0.01) is
    caught at the first step's update, as `decay` in float32 (in bfloat16 the optimizer steps the
    16-bit weights themselves, and their rounding hides the difference's proportionality to the
    weights: read as `mismatch`)."""
    names = ("torch_clip_fused_adamw", "torch_clip_fused_adamw_decay")
    good, bad = check([spec(n, world, dtype) for n in names])
    assert good["verdict"] == "equivalent", good["summary"]
    assert any("fused=True" in n for n in good["notes"]), good["notes"]
    assert bad["verdict"] == "not equivalent", bad["summary"]
    first = bad["first_divergence"]
    assert (first["step"], first["name"].split(":")[0]) == (1, "update"), first
    if dtype == "float32":
        assert bad["diagnosis"]["signature"] == "decay", bad["diagnosis"]


@pytest.mark.parametrize("world,dtype", grid((2, "bfloat16")))
def test_a_trainers_optimizer_gets_the_dtensor_parameters(world, dtype):
    """The user's tp_optimizer is handed the module as the framework holds it: a trainer that
    groups its parameters by `p.placements` (decay on the sharded, none on the replicated) is
    equivalent to the dense rule that groups them by dimension."""
    (r,) = check([spec("decay_by_placement", world, dtype)])
    assert r["verdict"] == "equivalent", r["summary"]


def test_through_the_local_shards_the_trainers_optimizer_cannot_read_placements(monkeypatch):
    """The mutant: the user's optimizer handed the plain local shards."""
    from tpcheck.checker.rank import optimizer_stage

    monkeypatch.setattr(optimizer_stage, "held_by_framework", lambda tp: None)
    (r,) = check([spec("decay_by_placement")])
    assert r["verdict"] != "equivalent", r["summary"]
    assert "placements" in r["summary"], r["summary"]
