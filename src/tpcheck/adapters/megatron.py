"""Check real Megatron-Core layers (optional extra `tpcheck[megatron]`, megatron-core==0.16.1) on CPU/gloo.

Cases: `column_case` (ColumnParallelLinear), `row_case` (RowParallelLinear), `embedding_case`
(VocabParallelEmbedding), `cross_entropy_case` (vocab_parallel_cross_entropy after a column-parallel
head), `gated_mlp_case` (the gated MLP built from a TransformerConfig), each against a dense twin
with the same parameter names.

Running Megatron-Core on CPU needs three things, done by `init_megatron(group)` on every rank:
- `torch.cuda.current_device` is replaced by a function returning the CPU device (its layers ask for
  it when they allocate weights; a process-wide monkeypatch, only on the rank processes);
- the config sets `use_cpu_initialization=True, gradient_accumulation_fusion=False`;
- `parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)` on the rank's existing
  gloo group (once per process: a rank pool serves one world size).
Megatron's layers return `(output, bias)`; `Unpack` keeps the output (bias is None when
`skip_bias_add=False`). Megatron's collectives do not pass through a TPGroup, so the case ledger holds
only the checker's own; every tensor is still compared on every rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck.check.case import Case, RunSettings
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Fused, Plan, Replicate, Shard

try:  # imported at module load, so a case file importing this pays it once, before the ranks fork
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mtp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # pragma: no cover - depends on the optional extra
    MEGATRON_ERROR: str | None = f"megatron-core is not importable ({e}); pip install 'tpcheck[megatron]'"
else:
    MEGATRON_ERROR = None


def available() -> bool:
    return MEGATRON_ERROR is None


def init_megatron(group: TPGroup) -> None:
    """CPU patch + Megatron's global parallel state over this rank's gloo group (idempotent)."""
    if MEGATRON_ERROR:
        raise ImportError(MEGATRON_ERROR)
    torch.cuda.current_device = lambda: torch.device("cpu")
    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have == group.world_size:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=group.world_size)


def config(world: int, dtype: torch.dtype, hidden: int, ffn: int, **kw) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=4,
                             tensor_model_parallel_size=world, params_dtype=dtype, use_cpu_initialization=True,
                             gradient_accumulation_fusion=False, **kw)


class Unpack(nn.Module):
    """Megatron layers return (output, bias): keep the output; parameters appear as `layer.*`."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


def init_normal(model: nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def hidden_batch(seq: int, batch: int, hidden: int, out: int | None = None):
    def make(g, dtype):
        x = torch.randn(seq, batch, hidden, generator=g)
        return {"x": x.to(dtype)}, torch.randn(seq, batch, out or hidden, generator=g).to(dtype)

    return make


def _fields(kw: dict) -> dict:
    return {"init": init_normal, "run": RunSettings(steps=2), **kw}


def column_case(hidden: int = 16, out: int = 32, seq: int = 4, batch: int = 2, **kw) -> Case:
    """ColumnParallelLinear(bias, gather_output=True): weight and bias Shard(0), output replicated."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = config(group.world_size, dtype, hidden, out)
        return Unpack(mtp.ColumnParallelLinear(hidden, out, config=cfg, init_method=cfg.init_method, bias=True,
                                               gather_output=True))

    return Case(name="megatron_column", build_dense=lambda dtype: Unpack(nn.Linear(hidden, out, dtype=dtype)),
                build_tp=build_tp, plan=Plan(params={"layer.weight": Shard(0), "layer.bias": Shard(0)}),
                make_batch=hidden_batch(seq, batch, hidden, out), **_fields(kw))


def row_case(hidden: int = 32, out: int = 16, seq: int = 4, batch: int = 2, **kw) -> Case:
    """RowParallelLinear(bias, input_is_parallel=False): weight Shard(1), bias replicated."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = config(group.world_size, dtype, out, hidden)
        return Unpack(mtp.RowParallelLinear(hidden, out, config=cfg, init_method=cfg.init_method, bias=True,
                                            input_is_parallel=False, skip_bias_add=False))

    return Case(name="megatron_row", build_dense=lambda dtype: Unpack(nn.Linear(hidden, out, dtype=dtype)),
                build_tp=build_tp, plan=Plan(params={"layer.weight": Shard(1), "layer.bias": Replicate()}),
                make_batch=hidden_batch(seq, batch, hidden, out), **_fields(kw))


def embedding_case(vocab: int = 64, hidden: int = 16, seq: int = 4, batch: int = 2, **kw) -> Case:
    """VocabParallelEmbedding: weight Shard(0) (a vocab range per rank, masked lookup + all-reduce)."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = config(group.world_size, dtype, hidden, 4 * hidden)
        return mtp.VocabParallelEmbedding(vocab, hidden, init_method=cfg.init_method, config=cfg)

    def make(g, dtype):
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        return {"input_": tokens}, torch.randn(batch, seq, hidden, generator=g).to(dtype)

    return Case(name="megatron_vocab_embedding", build_dense=lambda dtype: _Embedding(vocab, hidden, dtype),
                build_tp=build_tp, plan=Plan(params={"weight": Shard(0)}), make_batch=make, grad_inputs=(),
                **_fields(kw))


class _Embedding(nn.Embedding):
    def __init__(self, vocab, hidden, dtype):
        super().__init__(vocab, hidden, dtype=dtype)

    def forward(self, input_):  # Megatron's argument name
        return super().forward(input_)


class _Head(nn.Module):
    """Dense twin of a column-parallel LM head: logits [s, b, vocab]."""

    def __init__(self, hidden, vocab, dtype, parallel=None):
        super().__init__()
        self.layer = parallel if parallel is not None else nn.Linear(hidden, vocab, bias=False, dtype=dtype)

    def forward(self, x):
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


def cross_entropy_case(hidden: int = 16, vocab: int = 64, seq: int = 4, batch: int = 2, **kw) -> Case:
    """vocab_parallel_cross_entropy on column-parallel logits [s, b, vocab/tp] vs F.cross_entropy."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = config(group.world_size, dtype, hidden, 4 * hidden)
        return _Head(hidden, vocab, dtype, mtp.ColumnParallelLinear(
            hidden, vocab, config=cfg, init_method=cfg.init_method, bias=False, gather_output=False))

    def make(g, dtype):
        x = torch.randn(seq, batch, hidden, generator=g)
        return {"x": x.to(dtype)}, torch.randint(0, vocab, (seq, batch), generator=g)

    def loss(logits, target):
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    def tp_loss(logits_local, target, group):
        return mtp.vocab_parallel_cross_entropy(logits_local, target).mean()

    return Case(name="megatron_vocab_cross_entropy", build_dense=lambda dtype: _Head(hidden, vocab, dtype),
                build_tp=build_tp, plan=Plan(params={"layer.weight": Shard(0)}), make_batch=make, loss=loss,
                tp_loss=tp_loss, output_placement=Shard(2), **_fields(kw))


class DenseGatedMLP(nn.Module):
    """Dense twin of Megatron's gated MLP: fc1 [gate; up] = [2*ffn, h], silu(gate) * up, fc2 [h, ffn]."""

    def __init__(self, hidden: int, ffn: int, dtype=None) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x):
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)  # [s, b, ffn] each
        return self.linear_fc2(F.silu(gate) * up)


def gated_mlp_case(hidden: int = 16, ffn: int = 32, seq: int = 4, batch: int = 2, **kw) -> Case:
    """megatron.core MLP with gated_linear_unit=True: rank r's fc1 holds [gate_r; up_r] (Fused)."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = config(group.world_size, dtype, hidden, ffn, gated_linear_unit=True, activation_func=F.silu,
                     add_bias_linear=False)
        subs = MLPSubmodules(linear_fc1=mtp.ColumnParallelLinear, linear_fc2=mtp.RowParallelLinear)
        return Unpack(MLP(cfg, subs))

    plan = Plan(params={"layer.linear_fc1.weight": Fused(0, (ffn, ffn)), "layer.linear_fc2.weight": Shard(1)})
    return Case(name="megatron_gated_mlp", build_dense=lambda dtype: Unpack(DenseGatedMLP(hidden, ffn, dtype)),
                build_tp=build_tp, plan=plan, make_batch=hidden_batch(seq, batch, hidden), **_fields(kw))
