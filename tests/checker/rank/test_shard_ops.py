"""The operations that read a whole dimension (checker/rank/shard_ops.py) and the diagnosis they
name (`op_on_shard`, verdict/mechanisms.py), on TP code written as public codebases write it: one
module class, dense with no group and tensor-parallel with one, the same source lines on both
sides. Two bugs of that shape: a statistic of a sharded dimension (Gemma3n's activation-sparsity
cutoff, mean + k·std of each token's gate features) computed per shard, and a packed [gate; up]
weight split into halves after a contiguous column-parallel shard (Inkling2's experts). Each
correct twin passes; a checker that notes nothing (the mutant) leaves both `mismatch`."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, Shard
from tpcheck.api import check
from tpcheck.checker.casefile import file_spec, register
from tpcheck.checker.rank import shard_ops
from tpcheck.checker.rank.shard_ops import OpSizes, ShardOps

from paths import example

SEQ, BATCH, HIDDEN, FFN = 4, 2, 16, 32
STD_MULTIPLIER = 1.645  # the 95th percentile: most features are cut


# the column- and row-parallel pair's collectives, as examples/own_module.py writes them
OWN = example("own_module")


class RowParallelLinear(nn.Linear):
    """A row-parallel Linear (vLLM's, Megatron's): its partial sums all-reduced inside."""

    def __init__(self, n_in, n_out, pg=None, dtype=None):
        super().__init__(n_in, n_out, bias=False, dtype=dtype)
        self.pg = pg

    def forward(self, x):
        out = super().forward(x)
        return out if self.pg is None else OWN.ReduceFromTP.apply(out, self.pg)


class SparseMLP(nn.Module):
    """x + down(gelu(sparse(gate(x))) * up(x)); the cutoff keeps what exceeds mean + 1.645·std of
    each token's gate features. Dense with no group; with one, gate and up column-parallel and
    down row-parallel. `packed`: gate and up are one Linear [gate; up] split by `chunk(2)`.
    `exact`: the mean and std of the features gathered from the group (the fix)."""

    def __init__(self, group=None, dtype=None, packed=False, exact=False):
        super().__init__()
        self.pg = None if group is None else group.pg
        self.packed, self.exact = packed, exact
        ffn = FFN // (1 if group is None else group.world_size)
        if packed:
            self.gate_up = nn.Linear(HIDDEN, 2 * ffn, bias=False, dtype=dtype)
        else:
            self.gate = nn.Linear(HIDDEN, ffn, bias=False, dtype=dtype)
            self.up = nn.Linear(HIDDEN, ffn, bias=False, dtype=dtype)
        self.down = RowParallelLinear(ffn, HIDDEN, self.pg, dtype=dtype)

    def forward(self, x):
        h = x if self.pg is None else OWN.CopyToTP.apply(x, self.pg)
        if self.packed:
            gate, up = self.gate_up(h).chunk(2, dim=-1)  # split: the packed halves
            gate = F.silu(gate)
        else:
            gate, up = F.gelu(self._sparse(self.gate(h))), self.up(h)
        return x + self.down(gate * up)

    def _sparse(self, g):
        full = g
        if self.exact and self.pg is not None:
            # the fix: the statistic of every rank's features, gathered (the same arithmetic as
            # the dense model's; the gather's backward sums every rank's gradient)
            full = torch.cat(dist_nn.all_gather(g, group=self.pg), dim=-1)
        mean = full.mean(-1, keepdim=True)  # reduction: the statistic of the features
        std = full.std(-1, keepdim=True, unbiased=False)
        return F.relu(g - (mean + STD_MULTIPLIER * std))


def _line(marker: str) -> int:
    """The source line of SparseMLP marked with the comment `marker`."""
    lines, start = inspect.getsourcelines(SparseMLP)
    return start + next(i for i, text in enumerate(lines) if f"# {marker}" in text)


def _init(module, g):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _batch(g, dtype):
    return {"x": torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)}, torch.randn(
        SEQ, BATCH, HIDDEN, generator=g
    ).to(dtype)


def _case(name: str, packed: bool = False, exact: bool = False, packed_plan: bool = False):
    if packed:
        gate_up = Shard(0) if not packed_plan else _packed()
        params = {"gate_up.weight": gate_up, "down.weight": Shard(1)}
    else:
        params = {"gate.weight": Shard(0), "up.weight": Shard(0), "down.weight": Shard(1)}
    return register(
        Case(
            name=name,
            build_dense=lambda dtype: SparseMLP(None, dtype, packed=packed),
            build_tp=lambda group, dtype: SparseMLP(group, dtype, packed=packed, exact=exact),
            plan=Plan(params=params, activations=_ACTIVATIONS[packed]),
            make_batch=_batch,
            init=_init,
        )
    )


_ACTIVATIONS = {
    False: {"gate": Shard(2), "up": Shard(2), "down": Replicate()},
    True: {"down": Replicate()},
}


def _packed():
    from tpcheck.plan import Fused

    return Fused(0, (FFN, FFN))


@pytest.fixture(scope="module")
def results():
    cases = [
        _case("sparse_local_stat"),
        _case("sparse_exact", exact=True),
        _case("packed_contiguous", packed=True),
        _case("packed_per_part", packed=True, packed_plan=True),
    ]
    return {r["name"].split("/")[0]: r for r in check([file_spec(c, 2) for c in cases])}


def test_a_statistic_of_a_sharded_dimension_is_named_at_its_line(results):
    bad = results["sparse_local_stat"]
    assert bad["verdict"] == "not equivalent"
    # the first module output after the cutoff: down's (gate's passes, gathered)
    assert bad["first_divergence"]["name"] == "act:down"
    passed = {c["name"] for c in bad["checks"] if c["passed"] and c["step"] == 1}
    assert {"act:gate", "act:up"} <= passed
    d = bad["diagnosis"]
    assert d["signature"] == "op_on_shard", d
    ops = d["evidence"]["ops"]
    assert [(o["op"], o["dim"], o["tp_size"], o["dense_size"]) for o in ops[:2]] == [
        ("mean", -1, FFN // 2, FFN),
        ("std", -1, FFN // 2, FFN),
    ]
    assert ops[0]["at"].endswith(f"test_shard_ops.py:{_line('reduction')}")
    assert ops[0]["module"] == ""  # the model's own code, the parent of down
    assert f"test_shard_ops.py:{_line('reduction')}" in d["cause"]
    assert "statistic of the rank's shard" in d["cause"]
    # the fix, sums all-reduced before the statistic: equivalent, though its own sum still runs
    # over the shard (the note alone is no failure)
    assert results["sparse_exact"]["verdict"] == "equivalent", results["sparse_exact"]["summary"]


def test_a_packed_weight_split_after_a_contiguous_shard_is_named(results):
    bad = results["packed_contiguous"]
    assert bad["verdict"] == "not equivalent"
    d = bad["diagnosis"]
    # the split's input is gate_up's output, its weight sharded as one block: named at the weight
    # (checker/verdict/mechanisms.py `packed_shard`; test_packed_shard.py for the fused QKV)
    assert d["signature"] == "packed_shard", d
    ev = d["evidence"]
    assert (ev["weight"], ev["placement"], ev["parts"]) == ("gate_up.weight", "Shard(0)", [FFN] * 2)
    assert ev["suggested"] == f"Fused(0, ({FFN}, {FFN}))"
    assert ev["split_at"].endswith(f"test_shard_ops.py:{_line('split')}")
    assert "packed_colwise" in d["cause"]
    good = results["packed_per_part"]
    assert good["verdict"] == "equivalent", good["summary"]


def test_a_checker_that_notes_nothing_leaves_a_mismatch(monkeypatch):
    """The mutant: no operation noted (the forward not watched); the same bugs read `mismatch`."""
    monkeypatch.setattr(ShardOps, "differing", lambda self: [])
    cases = [_case("sparse_unwatched"), _case("packed_unwatched", packed=True)]
    for r in check([file_spec(c, 2) for c in cases]):
        assert r["verdict"] == "not equivalent"
        assert r["diagnosis"]["signature"] == "mismatch", r["diagnosis"]


class _Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 8)

    def forward(self, x):
        y = self.inner(x)
        a, b = y.chunk(2, dim=-1)
        s = torch.std(y, -1, True, True)  # dim, unbiased and keepdim, positional
        both = torch.max(a, b)  # elementwise: reads no dimension
        whole = y.sum()  # every element: no dimension named
        return torch.softmax(a, dim=-1) + b.topk(2).values.sum(-1, keepdim=True) + s + both + whole


def test_the_noted_operations_and_their_dimensions():
    m = _Probe()
    with OpSizes(m) as mode:
        m(torch.randn(3, 4))
    noted = {(op, dim): size for (module, _, _, op, dim), size in mode.sizes.items()}
    assert noted == {
        ("chunk", -1): 8,
        ("std", -1): 8,
        ("softmax", -1): 4,
        ("topk", -1): 4,
        ("sum", -1): 2,
    }
    assert {module for (module, *_), _ in mode.sizes.items()} == {""}


def test_calls_from_the_checker_are_not_the_models(monkeypatch):
    """An operation whose caller is the checker's own code (a capture hook comparing) is not
    noted; the model's own, through another of the checker's function modes, is."""
    m = nn.Linear(4, 8)
    # this test file stands in for tpcheck's own code
    kind = shard_ops.frame_kind
    monkeypatch.setattr(
        shard_ops, "frame_kind", lambda path: "tpcheck" if path == __file__ else kind(path)
    )
    with OpSizes(m) as mode:
        m(torch.randn(3, 4)).mean(-1)
    assert mode.sizes == {}


def test_the_sides_differ_only_where_the_tp_dimension_is_smaller():
    ops = ShardOps()
    ops.dense = {("m", "f.py", 3, "mean", -1): 8, ("m", "f.py", 4, "softmax", -1): 5}
    ops.tp = {
        ("m", "f.py", 3, "mean", -1): 4,
        ("m", "f.py", 4, "softmax", -1): 5,
        ("n", "f.py", 9, "sum", -1): 2,  # on the TP side only: nothing to compare
    }
    assert ops.differing() == [
        {
            "module": "m",
            "op": "mean",
            "kind": "reduction",
            "dim": -1,
            "at": "f.py:3",
            "tp_size": 4,
            "dense_size": 8,
        }
    ]
    assert ShardOps(enabled=False).differing() == []
