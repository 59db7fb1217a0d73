"""Per-rank layouts of the transformer blocks, pinned without processes: a module is built for rank
r of a world-w group (`TPGroup(rank=r, world_size=w)`, no process group) and
compared with the plan."""

import pytest
import torch

from tpcheck.blocks import BLOCKS, config_for
from tpcheck.blocks.attention import attention_plan
from tpcheck.blocks.lm import lm_plan
from tpcheck.checker.case import CaseSpec
from tpcheck.errors import UsageError
from tpcheck.models.config import preset
from tpcheck.models.parallel import ParallelAttention, ParallelLM, ParallelQKV
from tpcheck.parallel.embedding import VocabParallelEmbedding
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Shard
from tpcheck.resolve import RESOLVER
from tpcheck.seed_compat import describe_blocks


def _cfg(heads=8, kv=2):
    return preset("tiny").replace(heads=heads, kv_heads=kv, hidden=64)


def _labelled_qkv(cfg):
    """Dense [q; k; v] whose every row holds part * 1000 + head (part 0 = q, 1 = k, 2 = v)."""
    d, kv = cfg.head_dim, cfg.num_kv_heads
    labels = (
        [0 * 1000 + h for h in range(cfg.heads)]
        + [1000 + h for h in range(kv)]
        + [2000 + h for h in range(kv)]
    )
    return (
        torch.tensor(labels, dtype=torch.float64)
        .repeat_interleave(d)[:, None]
        .expand(-1, cfg.hidden)
    )


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("kv", [1, 2, 4, 8])
def test_rank_holds_the_heads_the_docstring_says(world, kv):
    cfg = _cfg(kv=kv)
    placement = attention_plan(cfg).params["qkv.weight"]
    dense = _labelled_qkv(cfg)
    for r in range(world):
        qkv = ParallelQKV(cfg, TPGroup(rank=r, world_size=world))
        q_heads, kv_heads = qkv.head_ids()
        # the docstring: query heads r*heads/tp ..; kv heads
        # r*kv/tp .. or the one kv head r // (tp // kv)
        assert q_heads == list(range(r * 8 // world, (r + 1) * 8 // world))
        want_kv = (
            list(range(r * kv // world, (r + 1) * kv // world))
            if kv >= world
            else [r // (world // kv)]
        )
        assert kv_heads == want_kv
        local = placement.shard(dense, r, world)
        assert local.shape == qkv.weight.shape
        d = cfg.head_dim
        q, k, v = local[:, 0].split([qkv.n_q * d, qkv.n_kv * d, qkv.n_kv * d])
        # the module reads q_r, k_r, v_r where the plan put them
        assert q[::d].long().tolist() == q_heads
        assert (k[::d] - 1000).long().tolist() == kv_heads
        assert (v[::d] - 2000).long().tolist() == kv_heads
        # every local query head attends with a kv head of its own group: j // (heads // kv)
        group = cfg.heads // kv
        assert [kv_heads[j // (qkv.n_q // qkv.n_kv)] for j in range(qkv.n_q)] == [
            h // group for h in q_heads
        ]


def test_naive_contiguous_split_puts_other_heads_on_a_rank():
    cfg, world = _cfg(kv=2), 2
    dense = _labelled_qkv(cfg)
    # rows 0 .. 47 of [q; k; v]: query heads 0-5, no k or v
    naive = Shard(0).shard(dense, 0, world)[:, 0]
    good = attention_plan(cfg).params["qkv.weight"].shard(dense, 0, world)[:, 0]
    assert naive.shape == good.shape  # same shape: only the values tell (the checker does)
    assert set(naive.long().tolist()) == set(range(6))
    assert set(good.long().tolist()) == {0, 1, 2, 3, 1000, 2000}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_vocab_parallel_embedding_masks_other_ranks_ids(world):
    """The partial outputs (interceptor: no communication) of all ranks sum to the dense lookup, and
    each rank's rows for ids it does not own are exactly zero."""
    vocab, hidden = 16, 4
    weight = torch.randn(vocab, hidden)
    tokens = torch.tensor([[0, 15], [4, 7], [8, 12]])
    total = torch.zeros(3, 2, hidden)
    for r in range(world):
        # keep the partial
        group = TPGroup(rank=r, world_size=world, tap=lambda op, site, phase, x, perform: x)
        emb = VocabParallelEmbedding(vocab, hidden, group)
        with torch.no_grad():
            emb.weight.copy_(Shard(0).shard(weight, r, world))
            partial = emb(tokens)
        owned = (tokens // (vocab // world)) == r
        assert torch.equal(partial[~owned], torch.zeros_like(partial[~owned]))
        total += partial
    assert torch.equal(total, weight[tokens])


@pytest.mark.parametrize("tied", [False, True])
def test_lm_plan_matches_every_rank_module(tied):
    cfg = preset("tiny").replace(tie_embeddings=tied)
    plan = lm_plan(cfg)
    for world in (1, 2, 4):
        for r in range(world):
            tp = ParallelLM(cfg, TPGroup(rank=r, world_size=world))
            names = {n for n, _ in tp.named_parameters()}
            assert names == set(plan.params)  # same names as the dense LM, no head weight when tied
            assert ("head.weight" in names) is not tied


def test_sites_are_qualified_names():
    att = ParallelAttention(preset("tiny"), TPGroup(rank=0, world_size=2))
    assert (att.qkv.site, att.o.site) == ("qkv", "o")
    lm = ParallelLM(preset("tiny"), TPGroup(rank=0, world_size=2))
    assert lm.layers[1].attention.qkv.site == "layers.1.attention.qkv"
    assert lm.layers[0].mlp.down.site == "layers.0.mlp.down"


def test_vocab_not_divisible_is_a_usage_error():
    with pytest.raises(UsageError, match="vocabulary 63"):
        config_for(CaseSpec(block="lm", preset="tiny", world_size=2, overrides=(("vocab", 63),)))


def test_attention_needs_heads():
    with pytest.raises(UsageError, match="heads=0"):
        RESOLVER.build(CaseSpec(block="attention", preset="seed", world_size=1))


def test_inspect_lists_every_block_with_shapes_and_collectives():
    blocks = describe_blocks("tiny", 4)
    for name, block in BLOCKS.items():
        for key in (name, f"{name}/sp") if block.sequence_parallel else (name,):
            assert blocks[key]["params"] and blocks[key]["collectives"]["forward"]
    qkv = blocks["attention"]["params"]["qkv.weight"]
    # 1 q head + the shared k, v
    assert qkv["dense"] == [64, 32] and qkv["rank_local"][3] == [24, 32]
    # kv 2 < tp 4
    assert "all_reduce at qkv.weight" in blocks["attention"]["collectives"]["optimizer"]
    assert blocks["lm/sp"]["params"]["embed.weight"]["rank_local"][0] == [16, 32]
    # the decode block has no SP variant, and only forward collectives (it is never trained)
    assert "decode/sp" not in blocks and not blocks["decode"]["collectives"]["backward"]
