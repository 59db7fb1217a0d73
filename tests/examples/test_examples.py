"""Every example: its correct cases are equivalent and its planted bug is flagged at the documented
first-divergent tensor. One launch per example file (a pool per world size serves all its cases)."""

import pytest

from tpcheck.api import check
from tpcheck.checker.casefile import file_spec

from paths import REPO, example

EX = REPO / "examples"


def _run(targets_and_worlds):
    specs = [file_spec(str(EX / t), w) for t, w in targets_and_worlds]
    return {r["name"]: r for r in check(specs)}


def _first(result):
    f = result["first_divergence"]
    return f["stage"], f["step"], f["name"]


def test_own_module():
    r = _run(
        [("own_module.py:correct", 2), ("own_module.py:correct", 4), ("own_module.py:buggy", 2)]
    )
    assert (
        r["own_mlp/tp2/float32"]["verdict"] == r["own_mlp/tp4/float32"]["verdict"] == "equivalent"
    )
    bad = r["own_mlp_bias_before_reduce/tp2/float32"]
    assert bad["verdict"] == "not equivalent"
    assert _first(bad) == ("forward", 1, "output")


def test_dtensor_llama():
    r = _run(
        [("dtensor_llama.py:tp", 2), ("dtensor_llama.py:sp", 2), ("dtensor_llama.py:buggy", 2)]
    )
    assert r["dtensor_llama/tp2/float32"]["verdict"] == "equivalent"
    assert r["dtensor_llama_sp/tp2/float32"]["verdict"] == "equivalent"
    bad = r["dtensor_llama_global_heads/tp2/float32"]
    # per-module checks of a DTensor plan: the module after
    # the wrong reshape is named, not only the output
    assert bad["verdict"] == "not equivalent" and _first(bad) == (
        "forward",
        1,
        "act:layers.0.attention.wo",
    )


def test_megatron_mlp():
    pytest.importorskip(
        "megatron.core", reason="megatron-core not installed (pip install 'tpcheck[megatron]')"
    )
    names = ["gated_mlp", "column", "row", "embedding", "cross_entropy", "buggy"]
    r = _run([(f"megatron_mlp.py:{n}", 2) for n in names])
    good = [v for k, v in r.items() if "contiguous" not in k]
    assert len(good) == 5 and all(v["verdict"] == "equivalent" for v in good), [
        v["summary"] for v in good
    ]
    bad = r["megatron_gated_mlp_contiguous_fc1/tp2/float32"]
    assert bad["verdict"] == "not equivalent"
    assert _first(bad) == ("weights", 0, "param:layer.linear_fc1.weight")


def test_own_loader():
    """The user's own loading is what is checked: a correct loader and the rank-0 bias layout are
    equivalent; loader bugs fail at the weights stage of step 0, naming the loader."""
    names = [
        "correct",
        "bias_on_rank0",
        "bias_on_rank1",
        "every_rank_loads_shard_0",
        "bias_broadcast_to_rank0_only",
    ]
    r = _run([(f"own_loader.py:{n}", w) for n in names for w in (2, 4)])
    for w in (2, 4):
        assert r[f"own_loader/tp{w}/float32"]["verdict"] == "equivalent"
        assert r[f"own_loader_bias_on_rank0/tp{w}/float32"]["verdict"] == "equivalent"
        assert r[f"own_loader_bias_on_rank1/tp{w}/float32"]["verdict"] == "equivalent"
        for bug, signature, param in (
            ("shard0", "rank0_shard", "fc1.weight"),
            ("bias_rank0_only", "replicas_differ", "fc2.bias"),
        ):
            bad = r[f"own_loader_{bug}/tp{w}/float32"]
            assert bad["verdict"] == "not equivalent" and _first(bad) == (
                "weights",
                0,
                f"param:{param}",
            )
            assert bad["diagnosis"]["signature"] == signature
            assert (
                "as loaded by your load_tp (" in bad["summary"]
                and "own_loader.py:" in bad["summary"]
            )


def test_bias_on_rank0_needs_its_placement():
    """The same module with the bias planned Replicate():
    refused, naming the rank and the placement."""
    import dataclasses

    from tpcheck.checker.casefile import register

    mod = example("own_loader")

    case = dataclasses.replace(mod.bias_on_rank0, name="bias_on_rank0_replicate", plan=mod.PLAN)
    (result,) = check([file_spec(register(case), 2)])
    assert result["verdict"] == "invalid"
    assert (
        "no gradient on rank 1 of the TP side" in result["summary"]
        and "AppliedOnRank(r)" in result["summary"]
    )


def test_bias_applied_on_rank1_is_bounded_from_rank0():
    """AppliedOnRank(1): rank 1 alone compares the bias's gradient and update, with the bound rank 0
    computes from the float64 truth and sends it. Inferred with no plan written; a doubled gradient
    on rank 1 is caught there, at the bound the correct twin passes (the same in bfloat16); a bound
    that never arrives (rank 1 comparing without one) makes no verdict."""
    names = ["bias_on_rank1", "bias_on_rank1_no_plan", "bias_grad_doubled_on_rank1"]
    r = _run([(f"own_loader.py:{n}", 2) for n in names])
    ok, inferred = (
        r["own_loader_bias_on_rank1/tp2/float32"],
        r["own_loader_bias_on_rank1_no_plan/tp2/float32"],
    )
    assert ok["verdict"] == inferred["verdict"] == "equivalent", (
        ok["summary"],
        inferred["summary"],
    )
    assert "'fc2.bias': AppliedOnRank(rank=1)" in inferred["inferred_plan"]
    checks = [c for c in ok["checks"] if c["name"] == "grad:fc2.bias"]
    assert {c["rank"] for c in checks} == {0, 1}
    on1 = next(c for c in checks if c["rank"] == 1)
    assert on1["kind"] == "calibrated" and on1["bound"] > 0 and on1["placement"] == "this rank only"
    on0 = next(c for c in checks if c["rank"] == 0)
    # rank 0 applies nothing: its gradient must be absent/zero
    assert on0["bound"] == 0 and on0["error"] == 0
    bad = r["own_loader_bias_grad_doubled_on_rank1/tp2/float32"]
    assert bad["verdict"] == "not equivalent"
    assert _first(bad) == ("grads", 1, "grad:fc2.bias") and bad["first_divergence"]["ranks"] == [1]
    assert bad["first_divergence"]["bound"] == on1["bound"]


def test_own_loader_without_a_plan():
    """No plan written: inferred from what the loader put on each rank, printed as code; a loader
    that forgot the rank offset is caught at the weights stage as with a written plan (`rank0_shard`
    at fc1.weight, on every rank but 0), the plan inferred as the shards they are and the
    misloaded parameters said."""
    r = _run([(f"own_loader.py:{n}", w) for n in ("no_plan", "no_plan_shard0") for w in (2, 4)])
    for w in (2, 4):
        ok = r[f"own_loader_no_plan/tp{w}/float32"]
        assert ok["verdict"] == "equivalent", ok["summary"]
        assert ok["inferred_plan"] == (
            "Plan(params={\n    'fc1.weight': Shard(0),\n    'fc1.bias': Shard(0),\n"
            "    'fc2.weight': Shard(1),\n    'fc2.bias': Replicate(),\n"
            "}, activations={\n    'fc1': Shard(2),\n})\n"
            "# not checked: fc2: the TP model does not call it (its parameters used "
            "directly?)"
        )
        assert "act:fc1" in {c["name"] for c in ok["checks"]}
        bad = r[f"own_loader_no_plan_shard0/tp{w}/float32"]
        assert bad["verdict"] == "not equivalent", bad["summary"]
        assert _first(bad) == ("weights", 0, "param:fc1.weight")
        assert bad["first_divergence"]["ranks"] == list(range(1, w))
        assert bad["diagnosis"]["signature"] == "rank0_shard"
        assert bad["inferred_plan"].startswith("Plan(params={\n    'fc1.weight': Shard(0),\n")
        assert "# loaded wrong: fc1.weight: Shard(0), but rank" in bad["inferred_plan"]


def test_own_dropout():
    """A user's TP block with dropout: the correct cases (nn.Dropout, a bernoulli mask, SDPA's
    dropout_p) are equivalent at world 2 and 4; the RNG placement bugs are caught at their module
    with their signature, while every value compared still agrees."""
    names = [
        "correct",
        "bernoulli",
        "attention",
        "seeded_by_rank",
        "not_forked",
        "attention_not_forked",
    ]
    r = _run([(f"own_dropout.py:{n}", w) for n in names for w in (2, 4)])
    for w in (2, 4):
        for good in ("own_dropout", "own_dropout_bernoulli", "own_dropout_attention"):
            assert r[f"{good}/tp{w}/float32"]["verdict"] == "equivalent", r[
                f"{good}/tp{w}/float32"
            ]["summary"]
        for bug, signature, where in (
            ("seeded_by_rank", "rng_diverged", "rng:drop_out"),
            ("not_forked", "rng_not_forked", "rng:drop_hidden"),
            ("attention_not_forked", "rng_not_forked", "rng:(model): sdpa #1"),
        ):
            bad = r[f"own_dropout_{bug}/tp{w}/float32"]
            assert bad["verdict"] == "not equivalent"
            assert (
                _first(bad) == ("forward", 1, where) and bad["diagnosis"]["signature"] == signature
            )
            assert all(c["passed"] for c in bad["checks"] if c["kind"] != "rng")  # the values agree
    # the correct block also runs its forward without
    # autograd (no_grad_forward), masks replayed there too
    assert any(c["name"] == "output:no_grad" for c in r["own_dropout/tp2/float32"]["checks"])


def test_bias_applied_on_rank1_without_its_bound_is_no_verdict(monkeypatch):
    """Checker mutant: rank 0 never sends the bound of the tensor rank 1 alone compares. The check
    has no bound, so the case has no verdict (error), never a pass."""
    import importlib

    params = importlib.import_module("tpcheck.checker.rank.params")
    monkeypatch.setattr(params, "owner_bound", lambda *args: None)
    r = _run([("own_loader.py:bias_on_rank1", 2)])
    result = r["own_loader_bias_on_rank1/tp2/float32"]
    assert result["verdict"] == "error", result["summary"]
    assert "grad:fc2.bias" in result["summary"]
