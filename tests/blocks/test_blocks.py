"""The transformer blocks against their dense twins: attention, layer, the tiny LM, the
vocab-parallel embedding and cross-entropy, at world sizes 1, 2, 4, with and without sequence
parallelism, float32 and bfloat16, 3 AdamW steps (CaseSpec defaults); GQA/MQA with kv_heads below
the world size; a naive contiguous split of fused weights caught while the
interleaved layout passes."""

import dataclasses

import pytest
import torch

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.blocks import BLOCKS
from tpcheck.blocks.attention import attention_plan
from tpcheck.blocks.mlp import mlp_plan
from tpcheck.checker.pool.spawn import run_on_ranks
from tpcheck.models.config import preset
from tpcheck.models.dense import DenseAttention
from tpcheck.models.parallel import ParallelAttention
from tpcheck.plan import Plan, Shard

# the MLP has its own suite (test_equivalence), the decode block too (never trained, no SP:
# tests/faults/test_decode_block.py)
BLOCK_NAMES = tuple(b for b in BLOCKS if b not in ("mlp", "decode"))


def _matrix(worlds):
    return [
        CaseSpec(
            block=b, preset="tiny", world_size=w, run=RunSettings(dtype=dt), sequence_parallel=sp
        )
        for b in BLOCK_NAMES
        for w in worlds
        for sp in (False, True)
        for dt in ("float32", "bfloat16")
    ]


def _assert_equivalent(results):
    for r in results:
        assert r["verdict"] == "equivalent", f"{r['name']}: {r['summary']}"
        assert {c["rank"] for c in r["checks"]} == set(range(r["world_size"]))  # every rank checked
        assert {c["step"] for c in r["checks"] if c["stage"] == "optimizer"} == {1, 2, 3}
        assert r["ledger"]["problems"] == [], f"{r['name']}: {r['ledger']['problems']}"


def _count(result, phase, op, site):
    return sum(
        1
        for e in result["ledger"]["expected"]
        if (e["phase"], e["op"], e["site"]) == (phase, op, site)
    )


def test_blocks_at_world_sizes_1_and_2():
    tied = [
        CaseSpec(
            block="lm",
            preset="tiny",
            world_size=2,
            sequence_parallel=sp,
            overrides=(("tie_embeddings", True),),
            label=f"lm-tied-sp{sp}",
        )
        for sp in (False, True)
    ]
    _assert_equivalent(check(_matrix((1, 2)) + tied))


def test_gqa_at_world_size_4():
    gqa = [
        CaseSpec(
            block="attention",
            preset="tiny",
            world_size=4,
            overrides=(("heads", 8), ("kv_heads", kv), ("hidden", 64)),
            label=f"gqa-kv{kv}",
        )
        for kv in (1, 2, 4, 8)
    ]
    gqa_sp = CaseSpec(
        block="attention",
        preset="tiny",
        world_size=4,
        run=RunSettings(dtype="bfloat16"),
        sequence_parallel=True,
        overrides=(("heads", 8), ("kv_heads", 1), ("hidden", 64)),
        label="mqa-sp-bf16",
    )
    results = check(gqa + [gqa_sp])
    _assert_equivalent(results)
    by_name = {r["name"]: r for r in results}
    # kv heads replicated (kv < 4): exactly one optimizer
    # all-reduce of the qkv grads per step; else none
    for kv in (1, 2, 4, 8):
        observed = by_name[f"gqa-kv{kv}"]["ledger"]["per_rank"]["0"].get("optimizer", {})
        assert observed.get("all_reduce", {}).get("count", 0) == (3 if kv < 4 else 0)


@pytest.mark.slow
def test_blocks_at_world_size_4():
    results = check(_matrix((4,)))
    _assert_equivalent(results)
    by_name = {r["name"]: r for r in results}
    assert _count(
        by_name["lm/tiny/tp4/float32"], "optimizer", "all_reduce", "layers.1.attention.qkv.weight"
    )


def test_vocab_not_divisible_by_world_size_is_invalid():
    (r,) = check([CaseSpec(block="lm", preset="tiny", world_size=2, overrides=(("vocab", 63),))])
    assert r["verdict"] == "invalid" and "63" in r["summary"]


def _replica_grads(group, kv):
    """Rank-local qkv grads of an MQA/GQA attention, before and after the replica reduction, and the
    dense grad of the rows this rank holds."""
    cfg = preset("tiny").replace(heads=8, kv_heads=kv, hidden=64)
    g = torch.Generator().manual_seed(3)
    dense = DenseAttention(cfg)
    dense.reset_parameters(g)
    tp = ParallelAttention(cfg, group)
    plan = attention_plan(cfg)
    with torch.no_grad():
        for name, p in tp.named_parameters():
            p.copy_(
                plan.params[name].shard(
                    dict(dense.named_parameters())[name], group.rank, group.world_size
                )
            )
    x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g)
    dense(x).pow(2).sum().backward()
    tp(x).pow(2).sum().backward()
    before = tp.qkv.weight.grad.clone()
    tp.finalize_grads()
    want = plan.params["qkv.weight"].shard(dense.qkv.weight.grad, group.rank, group.world_size)
    return before, tp.qkv.weight.grad.clone(), want, tp.qkv.n_q * cfg.head_dim


@pytest.mark.parametrize("kv", [1, 2])
def test_replicated_kv_grads_are_summed_and_bitwise_equal(kv):
    out = run_on_ranks(_replica_grads, 4, kv)
    q_rows = out[0][3]
    for before, after, want, _ in out:
        torch.testing.assert_close(after, want, rtol=1e-4, atol=1e-5)
        # partial before
        assert not torch.allclose(before[q_rows:], want[q_rows:], rtol=1e-3, atol=1e-4)
    replicas = 4 // kv  # ranks r sharing kv head r // replicas hold bitwise-equal k/v grads
    for r in range(4):
        first = out[r - r % replicas][1][q_rows:]
        assert torch.equal(out[r][1][q_rows:], first)


def _naive(base: str, name: str, make_plan, fused: str):
    """The block with its plan's fused weight split contiguously (Shard(0)) instead of per part."""

    def plan(cfg, sp):
        right = make_plan(cfg, sp)
        return Plan(params={**right.params, fused: Shard(0)}, activations=right.activations)

    return dataclasses.replace(BLOCKS[base], name=name, plan=plan)


def test_naive_contiguous_split_of_fused_weights_is_caught(monkeypatch):
    # registered before check() forks the ranks, which inherit it
    monkeypatch.setitem(
        BLOCKS,
        "attention_naive_qkv",
        _naive("attention", "attention_naive_qkv", attention_plan, "qkv.weight"),
    )
    monkeypatch.setitem(
        BLOCKS, "mlp_naive_gate_up", _naive("mlp", "mlp_naive_gate_up", mlp_plan, "gate_up.weight")
    )
    concat = (("gate_up_layout", "concat"),)
    naive_att, good_att, naive_mlp, good_mlp = check(
        [
            CaseSpec(block="attention_naive_qkv", preset="tiny", world_size=2),
            CaseSpec(block="attention", preset="tiny", world_size=2),
            CaseSpec(block="mlp_naive_gate_up", preset="tiny", world_size=2, overrides=concat),
            CaseSpec(block="mlp", preset="tiny", world_size=2, overrides=concat),
        ]
    )
    for naive in (naive_att, naive_mlp):
        assert naive["verdict"] == "not equivalent", naive["summary"]
        # the weights load consistently with the (wrong) plan: the math, not the loading, diverges
        assert all(c["passed"] for c in naive["checks"] if c["stage"] == "weights")
        assert naive["first_divergence"]["stage"] == "forward"
        assert naive["first_divergence"]["ranks"] == [0, 1]
    assert good_att["verdict"] == "equivalent", good_att["summary"]
    assert good_mlp["verdict"] == "equivalent", good_mlp["summary"]


def _nudge_kv_grad_on_rank1(module, group):
    """After the replica all-reduce, rank 1's gradient of its (replicated) k/v rows moves by a few
    ulps: far inside any calibrated bound, but two ranks holding the same kv head
    must agree bitwise."""
    if group.rank != 1:
        return
    qkv, finalize = module.qkv, module.finalize_grads
    q_rows = qkv.n_q * qkv.weight.shape[0] // (qkv.n_q + 2 * qkv.n_kv)

    def finalize_then_nudge():
        finalize()
        with torch.no_grad():
            qkv.weight.grad[q_rows:] *= 1 + 4 * torch.finfo(qkv.weight.dtype).eps

    module.finalize_grads = finalize_then_nudge


def test_gqa_kv_replicas_are_compared_bitwise(monkeypatch):
    """kv_heads < world: ranks share a KV head, and their copies of it (weights, grads, updates) are
    compared bitwise across ranks like any replicated tensor."""
    from tpcheck.checker.case import Injection

    base = BLOCKS["attention"]

    class Nudged(type(base)):
        def case(self, spec, cfg):
            case = super().case(spec, cfg)
            return dataclasses.replace(case, inject=Injection(tamper=_nudge_kv_grad_on_rank1))

    monkeypatch.setitem(
        BLOCKS,
        "attention_nudged_kv",
        Nudged(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}),
    )
    gqa = (("heads", 8), ("kv_heads", 2), ("hidden", 64))
    nudged, correct = check(
        [
            CaseSpec(block=b, preset="tiny", world_size=4, run=RunSettings(steps=1), overrides=gqa)
            for b in ("attention_nudged_kv", "attention")
        ]
    )
    assert correct["verdict"] == "equivalent", correct["summary"]
    replica_checks = [
        c
        for c in correct["checks"]
        if c["stage"] == "replicas" and c["name"].endswith("qkv.weight")
    ]
    # the fused qkv weight (not a replicated placement) gets replica checks too
    assert replica_checks
    assert nudged["verdict"] == "not equivalent", nudged["summary"]
    first = nudged["first_divergence"]
    assert (first["stage"], first["name"]) == ("replicas", "grad:qkv.weight"), nudged["summary"]
    assert nudged["diagnosis"]["signature"] == "replicas_differ"
