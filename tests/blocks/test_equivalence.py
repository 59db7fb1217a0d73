"""The MLP block against its dense twin at world sizes
1, 2, 4; the seed's faults caught on every rank."""

import pytest

from tpcheck import CaseSpec, RunSettings, check


def _failing_ranks(result, name, step=1):
    return sorted(
        {
            c["rank"]
            for c in result["checks"]
            if c["name"] == name and c["step"] == step and not c["passed"]
        }
    )


def test_equivalent_at_world_sizes_1_2_4():
    results = check([CaseSpec(block="mlp", preset="seed", world_size=w) for w in (1, 2, 4)])
    for r in results:
        assert r["verdict"] == "equivalent", r["summary"]
        ranks = {c["rank"] for c in r["checks"]}
        assert ranks == set(range(r["world_size"]))  # every rank was checked
        stages = {c["stage"] for c in r["checks"]}
        assert {"weights", "forward", "loss", "backward", "grads", "optimizer"} <= stages
        # every parameter is checked after every step (3 AdamW steps): against the dense model, its
        # AdamW moments (exp_avg, exp_avg_sq) against the dense optimizer's, and its update and
        # AdamW state (exp_avg, exp_avg_sq, step) against the replay of the dense rule
        post = {(c["name"], c["step"]) for c in r["checks"] if c["stage"] == "optimizer"}
        params = ("norm.weight", "gate_up.weight", "down.weight", "down.bias")
        assert post == {
            (name, step)
            for p in params
            for step in (1, 2, 3)
            for name in (
                f"param:{p}",
                f"update:{p}",
                f"state:{p}.exp_avg",
                f"state:{p}.exp_avg_sq",
                f"state:{p}.step",
                f"moment:{p}.exp_avg",
                f"moment:{p}.exp_avg_sq",
            )
        }
        assert all("bound" in c and c["reason"] for c in r["checks"])


@pytest.mark.parametrize("world", [2, 4])
def test_seed_faults_caught_on_every_rank(world):
    fwd, bwd = check(
        [
            CaseSpec(block="mlp", preset="seed", world_size=world, fault=f)
            for f in ("missing_forward_reduce", "missing_backward_reduce")
        ]
    )
    assert fwd["verdict"] == "not equivalent" and fwd["as_expected"]
    assert fwd["first_divergence"]["stage"] == "forward"
    assert _failing_ranks(fwd, "output") == list(range(world))
    assert bwd["verdict"] == "not equivalent" and bwd["as_expected"]
    assert bwd["first_divergence"]["stage"] == "backward"
    # the first forward is untouched by a missing backward reduce
    assert not _failing_ranks(bwd, "output")
    assert _failing_ranks(bwd, "grad:x") == list(range(world))


def test_world_size_3_and_6_divide_the_seed_ffn():
    results = check(
        [
            CaseSpec(block="mlp", preset="seed", world_size=w, run=RunSettings(steps=1))
            for w in (3, 6)
        ]
    )
    assert [r["verdict"] for r in results] == ["equivalent", "equivalent"]
