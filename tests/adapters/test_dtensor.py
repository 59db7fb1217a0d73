"""DTensor adapter: the plan derived from a parallelize_module plan, the torchtitan-style Llama plan
at world 4, and DTensor's collectives counted per phase (the functional collectives DTensor
calls) into the ledger."""

import sys
from collections import Counter

import pytest

from tpcheck.api import check
from tpcheck.checker.casefile import file_spec
from tpcheck.plan import Replicate, Shard

from paths import REPO

sys.path.insert(0, str(REPO / "examples"))


def test_derived_plan_follows_the_styles():
    from dtensor_llama import Llama, tp_plan
    from tpcheck.adapters.dtensor import derive_plan

    plan = derive_plan(Llama(), tp_plan(sp=True)).params
    assert plan["layers.1.attention.wq.weight"] == Shard(0)
    assert plan["layers.1.attention.wo.weight"] == Shard(1)
    assert plan["layers.0.feed_forward.w2.weight"] == Shard(1)
    assert plan["layers.0.ffn_norm.weight"] == Replicate()


def test_module_outputs_are_placed_as_their_styles_lay_them_out():
    from dtensor_llama import Llama, tp_plan
    from tpcheck.adapters.dtensor import derive_plan

    plain, sp = (
        derive_plan(Llama(), tp_plan(sp=False)).activations,
        derive_plan(Llama(), tp_plan(sp=True)).activations,
    )
    # ColwiseParallel: the local output, last dim sharded
    assert plain["layers.0.attention.wq"] == Shard(-1)
    assert plain["layers.0.attention.wo"] == Replicate()  # RowwiseParallel: reduced
    # RowwiseParallel(output_layouts=Shard(0)): reduce-scattered
    assert sp["layers.0.attention.wo"] == Shard(0)
    assert sp["layers.0.ffn_norm"] == Shard(0)  # SequenceParallel on the sequence dim


@pytest.mark.slow
@pytest.mark.parametrize("mb", [1, 2])
def test_llama_plan_world_4_and_collective_counts(mb):
    ex = str(REPO / "examples" / "dtensor_llama.py")
    results = check(
        [
            file_spec(f"{ex}:tp", 4, steps=1, micro_batches=mb),
            file_spec(f"{ex}:sp", 2, steps=1, micro_batches=mb),
        ]
    )
    assert [r["verdict"] for r in results] == ["equivalent", "equivalent"], [
        r["summary"] for r in results
    ]
    ledger = results[1]["ledger"]["per_rank"]["0"]
    counts = {
        phase: Counter({op: v["count"] for op, v in ops.items()}) for phase, ops in ledger.items()
    }
    # per layer and micro-batch: all-gather before attention and FFN, reduce-scatter after wo and w2
    # (forward), the transposes in backward, plus the norm weights' partial grads all-reduced (2 per
    # layer); the forward all-reduce is the SP loss's own (tpcheck's collective, not DTensor's).
    assert counts["forward"] == Counter(all_gather=4 * mb, reduce_scatter=4 * mb, all_reduce=mb)
    assert counts["backward"] == Counter(
        all_gather=4 * mb, reduce_scatter=4 * mb, all_reduce=4 * mb
    )


def test_dropout_in_a_dtensor_plan_replicated_region_passes_sequence_shards_are_not_forked():
    """A DTensor plan with hidden dropout after each block: without SP the dropout acts on the
    reduced, replicated output (every rank the same mask): equivalent. Under SP it acts on the local
    sequence shard that RowwiseParallel(output_layouts=Shard(0)) hands back, drawing from the
    default generator, seeded the same on every rank: the shards' masks are copies,
    `rng_not_forked` at that dropout."""
    from torch import nn

    import dtensor_llama as L
    from tpcheck import CaseSpec, RunSettings
    from tpcheck.checker.casefile import register

    class Block(L.Block):
        def __init__(self, dtype=None):
            super().__init__(dtype)
            self.drop = nn.Dropout(0.2)

        def forward(self, x):
            h = x + self.drop(self.attention(self.attention_norm(x)))
            return h + self.drop(self.feed_forward(self.ffn_norm(h)))

    class Model(L.Llama):
        def __init__(self, dtype=None):
            super().__init__(dtype)
            self.layers = nn.ModuleList(Block(dtype) for _ in range(L.LAYERS))

    specs = [
        CaseSpec(
            block=register(L._case(name, sp=sp, build_dense=Model)),
            world_size=2,
            run=RunSettings(steps=1),
        )
        for name, sp in (("dtensor_dropout", False), ("dtensor_dropout_sp", True))
    ]
    plain, sp = check(specs)
    assert plain["verdict"] == "equivalent", plain["summary"]
    assert {c["placement"] for c in plain["checks"] if c["kind"] == "rng"} == {"replicate"}
    assert sp["verdict"] == "not equivalent"
    assert (
        sp["first_divergence"]["name"] == "rng:layers.0.drop"
        and sp["diagnosis"]["signature"] == "rng_not_forked"
    )
    # the replayed values all agree
    assert all(c["passed"] for c in sp["checks"] if c["kind"] != "rng")
