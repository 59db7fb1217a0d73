"""A trainer's own torch optimizer over the TP module, in the implementation it picked: fused
kernels or foreach, stepping the module's 16-bit weights directly (no float32 masters). Where the
rule leaves a choice to the implementation, the dense side follows the user's (the kernels it runs,
whether masters exist) and the report says so; the rule itself (lr, betas, weight decay) is never
followed: a wrong weight decay in a fused AdamW is caught at the update. A fused CPU AdamW over a
column shard assigned as a view of the dense weight (not contiguous) steps it wrongly in torch
2.13: caught at that parameter's update."""

import pytest
import torch

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.rank import training

from paths import REPO

FILE = REPO / "tests" / "training" / "case_files" / "megatron_style.py"
GRID = [(world, dtype) for world in (2, 4) for dtype in ("float32", "bfloat16")]
CORRECT = ("fused_adamw", "foreach_adamw")


def spec(name, world, dtype):
    return CaseSpec(
        block=f"file:{FILE}:{name}", world_size=world, run=RunSettings(dtype=dtype, steps=2)
    )


@pytest.fixture(scope="module")
def results():
    names = (*CORRECT, "fused_adamw_wrong_decay")
    specs = [spec(n, w, d) for n in names for w, d in GRID]
    specs += [spec("fused_adamw_strided_shards", w, "float32") for w in (2, 4)]
    return dict(zip(specs, check(specs)))


@pytest.mark.slow
@pytest.mark.parametrize("name", CORRECT)
@pytest.mark.parametrize("world,dtype", GRID)
def test_a_fused_or_foreach_adamw_is_followed_and_said(results, name, world, dtype):
    r = results[spec(name, world, dtype)]
    assert r["verdict"] == "equivalent", r["summary"]
    flag = "fused=True" if name.startswith("fused") else "foreach=True"
    assert f"runs {flag}, and so do the dense rule, its replay" in r["summary"], r["summary"]
    masters = "steps the module's bfloat16 weights directly" in r["summary"]
    assert masters == (dtype == "bfloat16"), r["summary"]
    # the bitwise replay ran: every parameter's update and state compared
    names = {c["name"] for c in r["checks"]}
    assert {"update:fc2.weight", "state:fc2.weight.exp_avg", "moment:norm.bias.exp_avg"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", GRID)
def test_the_rule_is_never_followed_a_wrong_weight_decay_is_caught(results, world, dtype):
    r = results[spec("fused_adamw_wrong_decay", world, dtype)]
    assert r["verdict"] == "not equivalent", r["summary"]
    first = r["first_divergence"]
    assert (first["stage"], first["step"], first["name"].split(":")[0]) == (
        "optimizer",
        1,
        "update",
    ), first
    if dtype == "float32":  # in bfloat16 the weights round the decay's share away
        assert r["diagnosis"]["signature"] == "decay", r["diagnosis"]


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 4))
def test_a_fused_adamw_over_a_strided_shard_is_caught_at_its_update(results, world):
    r = results[spec("fused_adamw_strided_shards", world, "float32")]
    assert r["verdict"] == "not equivalent", r["summary"]
    first = r["first_divergence"]
    assert (first["stage"], first["step"], first["name"]) == (
        "optimizer",
        1,
        "update:fc2.weight",
    ), first
    failed = {c["name"] for c in r["checks"] if not c["passed"]}
    assert failed == {"update:fc2.weight", "param:fc2.weight"}, failed


def _stepped(p0, grads, **kw):
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kw)
    return p, opt


def _run(p, opt, grads):
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach().clone()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_the_followed_rule_rounds_as_the_users_kernels_do(dtype):
    """On 65,536 elements the fused kernel and the single-tensor one differ (by rounding); the rule
    made to follow the user's fused AdamW gives its result to the bit."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(65536, generator=g).to(dtype)
    grads = [torch.randn(65536, generator=g).to(dtype) for _ in range(3)]
    users = _run(*_stepped(p0, grads, fused=True), grads)
    plain = _run(*_stepped(p0, grads), grads)
    assert not torch.equal(users, plain)  # the difference following removes
    p, rule = _stepped(p0, grads)
    _, user_opt = _stepped(p0, grads, fused=True)
    picked = training.implementation([user_opt], rule)
    assert picked == {"fused": True}
    assert torch.equal(_run(p, training.follow(rule, picked), grads), users)


def test_only_the_rules_own_class_is_followed():
    """Another optimizer class (an SGD beside an AdamW rule), or users' optimizers that disagree,
    leave the rule as it is."""
    p = torch.nn.Parameter(torch.zeros(3))
    rule = torch.optim.AdamW([p])
    assert training.implementation([torch.optim.SGD([p], lr=0.1, foreach=True)], rule) == {}
    both = [torch.optim.AdamW([p], fused=True), torch.optim.AdamW([p], fused=False)]
    assert training.implementation(both, rule) == {}
    assert training.implementation([torch.optim.AdamW([p])], rule) == {}
