"""TP twins of the dense blocks. Parameter and submodule names match the dense ones, so the plan
maps them one to one and captured activations line up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpcheck.models.config import ModelConfig
from tpcheck.models.dense import (
    KVCache,
    RMSNorm,
    cached_attention,
    causal_attention,
    decode_forward,
    swiglu,
)
from tpcheck.parallel.collectives import copy_to_tp_region, gather_from_sequence_parallel_region
from tpcheck.parallel.embedding import VocabParallelEmbedding
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.layers import (
    ParallelModule,
    RowParallelLinear,
    divide,
    finalize_grads,
    label_sites,
    mark_partial_grad,
)
from tpcheck.parallel.random import ParallelDropout, RNGTracker

DEFAULT_RNG_SEED = 1234  # the model-parallel tracker's seed when the caller gives no tracker


def _tracker(group: TPGroup, rng: RNGTracker | None) -> RNGTracker:
    return rng if rng is not None else RNGTracker(group, DEFAULT_RNG_SEED, device=group.device)


def hidden_dropout(p: float, rng: RNGTracker, sequence_parallel: bool) -> torch.nn.Module:
    """Dropout of the residual stream: replicated without SP (nn.Dropout: the default generator, the
    same on every rank), sequence-sharded under SP (forked per rank, as Megatron's
    bias-dropout-add)."""
    return ParallelDropout(p, rng) if sequence_parallel else torch.nn.Dropout(p)


__all__ = [
    "ParallelSwiGLU",
    "ParallelMLP",
    "ParallelQKV",
    "ParallelAttention",
    "ParallelLayer",
    "ParallelLMHead",
    "ParallelLM",
    "ParallelCachedAttention",
    "ParallelDecodeLayer",
    "ParallelDecoder",
    "finalize_model_grads",
]


class ParallelSwiGLU(ParallelModule):
    """Column-parallel gate/up: rank r holds gate rows and up rows r*ffn/tp .. (r+1)*ffn/tp.
    weight: [2, ffn/tp, hidden] ("stacked") or [gate_r; up_r] = [2*ffn/tp, hidden] ("concat").
    Input replicated (or sequence-sharded under SP); output [s, b, ffn/tp]."""

    def __init__(
        self,
        cfg: ModelConfig,
        group: TPGroup,
        *,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        ffn_local = divide(cfg.ffn, group.world_size, "FFN width")
        shape = (
            (2, ffn_local, cfg.hidden)
            if cfg.gate_up_layout == "stacked"
            else (2 * ffn_local, cfg.hidden)
        )
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x_full = gather_from_sequence_parallel_region(x, self.group, self.site)  # [s, b, h]
        else:
            x_full = copy_to_tp_region(x, self.group, self.site)  # [s, b, h]
        w = self.weight
        w_gate, w_up = w.unbind(0) if w.dim() == 3 else w.chunk(2, dim=0)  # [ffn/tp, h] each
        return swiglu(x_full, w_gate, w_up)  # [s, b, ffn/tp]


class ParallelMLP(ParallelModule):
    """x + dropout(down(SwiGLU(RMSNorm(x)))) with gate/up column-parallel and down row-parallel; the
    dropout after the reduction (`hidden_dropout`: replicated, or forked per rank under SP).

    forward: 1 all-reduce (down); backward: 1 all-reduce (input grad of gate/up). Under sequence
    parallelism x is [s/tp, b, h]: all-gather before gate/up, reduce-scatter after down, and the
    norm weight and down bias grads are all-reduced in the optimizer phase (`finalize_grads`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        group: TPGroup,
        *,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        rng: RNGTracker | None = None,
    ) -> None:
        super().__init__(group)
        self.norm = RMSNorm(cfg.hidden, cfg.eps, dtype)
        if sequence_parallel:
            mark_partial_grad(self.norm.weight)
        self.gate_up = ParallelSwiGLU(cfg, group, sequence_parallel=sequence_parallel, dtype=dtype)
        self.down = RowParallelLinear(
            cfg.ffn, cfg.hidden, group, bias=True, sequence_parallel=sequence_parallel, dtype=dtype
        )
        self.dropout = hidden_dropout(cfg.dropout, _tracker(group, rng), sequence_parallel)
        label_sites(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [s, b, h] (or [s/tp, b, h] under SP)
        return x + self.dropout(self.down(self.gate_up(self.norm(x))))


# ------------------------------------------------------------ attention, transformer layer, tiny LM


class ParallelQKV(ParallelModule):
    """Fused QKV, column-parallel by heads. Dense weight [q; k; v] = [(heads + 2*kv) * d, hidden];
    rank r holds [q_r; k_r; v_r] = `Fused(0, (heads, kv, kv), (d, d, d))`:
    - query heads r*heads/tp .. (r+1)*heads/tp - 1;
    - kv_heads >= tp: kv heads r*kv/tp .. (r+1)*kv/tp - 1;
    - kv_heads < tp: the single kv head r // (tp // kv), replicated over tp // kv ranks. Each
      replica's grad is then partial (only its own query heads read it):
      `reduce_replica_grads` sums them.
    Input replicated (or sequence-sharded under SP); returns q `[s, b, heads/tp, d]`, k and v
    `[s, b, kv_local, d]`."""

    def __init__(
        self,
        cfg: ModelConfig,
        group: TPGroup,
        *,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        tp, kv, self.head_dim = group.world_size, cfg.num_kv_heads, cfg.head_dim
        self.n_q = divide(cfg.heads, tp, "attention heads")
        self.n_kv = kv // tp if kv >= tp else 1
        self.kv_replicas = 1 if kv >= tp else tp // kv  # ranks holding the same kv head
        self.kv_total = kv
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(
            torch.empty((self.n_q + 2 * self.n_kv) * self.head_dim, cfg.hidden, dtype=dtype)
        )

    def head_ids(self) -> tuple[list[int], list[int]]:
        """(global query heads, global kv heads) this rank holds, in local order."""
        r = self.group.rank
        kv_first = r // self.kv_replicas if self.kv_replicas > 1 else r * self.n_kv
        return list(range(r * self.n_q, (r + 1) * self.n_q)), list(
            range(kv_first, kv_first + self.n_kv)
        )

    def forward(self, x: torch.Tensor):
        if self.sequence_parallel:
            x_full = gather_from_sequence_parallel_region(x, self.group, self.site)  # [s, b, h]
        else:
            x_full = copy_to_tp_region(x, self.group, self.site)  # [s, b, h]
        s, b, _ = x_full.shape
        d = self.head_dim
        q, k, v = F.linear(x_full, self.weight).split(
            [self.n_q * d, self.n_kv * d, self.n_kv * d], dim=-1
        )
        return q.view(s, b, self.n_q, d), k.view(s, b, self.n_kv, d), v.view(s, b, self.n_kv, d)

    def reduce_replica_grads(self) -> None:
        """Optimizer phase: sum the grads of replicated kv rows over their replica ranks with ONE
        all-reduce over the group: a zero buffer [kv_heads, 2*d, hidden] in which each rank writes
        its k/v grad into its kv head's slot; replicas sum, other slots add zeros. Each rank takes
        its slot back, so replicas end bitwise equal."""
        if self.kv_replicas == 1 or self.weight.grad is None:
            return
        q_rows = self.n_q * self.head_dim
        grad = self.weight.grad
        slot = self.head_ids()[1][0]
        buf = torch.zeros(
            self.kv_total,
            grad.shape[0] - q_rows,
            grad.shape[1],
            dtype=grad.dtype,
            device=grad.device,
        )
        buf[slot] = grad[q_rows:]  # [2*d, hidden]: this rank's k and v rows
        summed = self.group.collective(
            "all_reduce", buf, site=f"{self.site}.weight", phase="optimizer"
        )
        grad[q_rows:] = summed[slot]


class ParallelAttention(ParallelModule):
    """x + dropout(o(attention(qkv(RMSNorm(x))))): qkv column-parallel by heads (`ParallelQKV`),
    each rank attends with its own heads, o row-parallel (no bias). The attention probabilities'
    dropout draws under `rng.fork()` (a rank's own heads: its own masks); the output's dropout from
    the default generator (replicated: the same mask on every rank), or forked under
    SP (sequence shards).

    forward: all-reduce at o; backward: all-reduce at qkv. Under SP x is [s/tp, b, h]: all-gather
    before qkv (RoPE then sees positions 0..s-1), reduce-scatter after o, the norm weight's grad
    all-reduced in the optimizer phase. With kv_heads < tp, one more optimizer
    all-reduce (qkv.weight).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        group: TPGroup,
        *,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        rng: RNGTracker | None = None,
    ) -> None:
        super().__init__(group)
        rng = _tracker(group, rng)
        self.theta = cfg.rope_theta
        self.norm = RMSNorm(cfg.hidden, cfg.eps, dtype)
        if sequence_parallel:
            mark_partial_grad(self.norm.weight)
        self.qkv = ParallelQKV(cfg, group, sequence_parallel=sequence_parallel, dtype=dtype)
        self.o = RowParallelLinear(
            cfg.heads * cfg.head_dim,
            cfg.hidden,
            group,
            bias=False,
            sequence_parallel=sequence_parallel,
            dtype=dtype,
        )
        # a rank's own heads: forked
        self.attn_dropout = ParallelDropout(cfg.attention_dropout, rng)
        self.dropout = hidden_dropout(cfg.dropout, rng, sequence_parallel)
        label_sites(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [s, b, heads/tp * d]
        ctx_local = causal_attention(*self.qkv(self.norm(x)), self.theta, self.attn_dropout)
        return x + self.dropout(self.o(ctx_local))  # [s, b, h] (or [s/tp, b, h] under SP)

    def finalize_grads(self) -> None:
        finalize_model_grads(self, self.group)


class ParallelLayer(ParallelModule):
    """The TP twin of DenseLayer: ParallelAttention then ParallelMLP."""

    def __init__(
        self,
        cfg: ModelConfig,
        group: TPGroup,
        *,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        rng: RNGTracker | None = None,
    ) -> None:
        super().__init__(group)
        rng = _tracker(group, rng)
        self.attention = ParallelAttention(
            cfg, group, sequence_parallel=sequence_parallel, dtype=dtype, rng=rng
        )
        self.mlp = ParallelMLP(
            cfg, group, sequence_parallel=sequence_parallel, dtype=dtype, rng=rng
        )
        label_sites(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attention(x))

    def finalize_grads(self) -> None:
        finalize_model_grads(self, self.group)


class ParallelLMHead(ParallelModule):
    """Column-parallel LM head, no bias: logits_local = x @ W_r^T, W_r = rows r*V/tp .. of [V, h]
    (`Shard(0)`, the same vocab rows as the vocab-parallel embedding). Output vocab-sharded
    [s, b, V/tp]. Tied: W is the embedding's shard, passed to forward (ignored when untied); the
    head then owns no parameter, as the dense LM has no head weight."""

    def __init__(
        self,
        hidden: int,
        vocab: int,
        group: TPGroup,
        *,
        tied: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        v_local = divide(vocab, group.world_size, "vocabulary size of the LM head")
        self.weight = (
            None if tied else torch.nn.Parameter(torch.empty(v_local, hidden, dtype=dtype))
        )
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            x_full = gather_from_sequence_parallel_region(x, self.group, self.site)  # [s, b, h]
        else:
            x_full = copy_to_tp_region(x, self.group, self.site)  # [s, b, h]
        # [s, b, V/tp]
        return F.linear(x_full, self.weight if self.weight is not None else tied_weight)


class ParallelLM(ParallelModule):
    """The TP twin of DenseLM: vocab-parallel embedding, ParallelLayers, final RMSNorm,
    column-parallel head. tokens [s, b] (replicated) -> vocab-sharded logits [s, b, V/tp]; pair with
    `vocab_parallel_cross_entropy`. Under SP the residual stream between embedding and head is
    [s/tp, b, h]. `layer(rng)` builds each layer (ParallelLayer)."""

    def __init__(
        self,
        cfg: ModelConfig,
        group: TPGroup,
        *,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        rng: RNGTracker | None = None,
        layer=None,
    ) -> None:
        super().__init__(group)
        sp, rng = sequence_parallel, _tracker(group, rng)
        self.embed = VocabParallelEmbedding(
            cfg.vocab, cfg.hidden, group, sequence_parallel=sp, dtype=dtype
        )
        self.embed_dropout = hidden_dropout(cfg.dropout, rng, sp)
        # layer(rng) builds each layer (ParallelLayer)
        layer = layer or (
            lambda rng: ParallelLayer(cfg, group, sequence_parallel=sp, dtype=dtype, rng=rng)
        )
        self.layers = torch.nn.ModuleList(layer(rng) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps, dtype)
        if sp:
            mark_partial_grad(self.norm.weight)
        self.head = ParallelLMHead(
            cfg.hidden, cfg.vocab, group, tied=cfg.tie_embeddings, sequence_parallel=sp, dtype=dtype
        )
        label_sites(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_dropout(self.embed(tokens))  # [s, b, h] (or [s/tp, b, h] under SP)
        for layer in self.layers:
            x = layer(x)
        # [s, b, V/tp]; the weight is used only if tied
        return self.head(self.norm(x), self.embed.weight)

    def finalize_grads(self) -> None:
        finalize_model_grads(self, self.group)


# ------------------------------------------------------------ incremental decoding with a KV cache


class ParallelCachedAttention(ParallelAttention):
    """The TP twin of DenseCachedAttention: forward(x, start); each rank caches the keys and values
    of its own kv heads (`cache`: `[cache_len, batch, kv_local, d]`), attends with its own query
    heads, and o's row-parallel all-reduce (site "o") sums the heads. No sequence parallelism: a
    decode pass feeds one token per sequence."""

    def __init__(
        self,
        cfg: ModelConfig,
        group: TPGroup,
        cache_len: int,
        *,
        dtype: torch.dtype | None = None,
        rng: RNGTracker | None = None,
    ) -> None:
        super().__init__(cfg, group, dtype=dtype, rng=rng)
        self.cache = KVCache(cache_len, cfg.batch, self.qkv.n_kv, cfg.head_dim, dtype)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        qkv = self.qkv(self.norm(x))  # q [s, b, heads/tp, d], k and v [s, b, kv_local, d]
        ctx_local = cached_attention(qkv, self.cache, start, self.theta, self.attn_dropout)
        return x + self.dropout(self.o(ctx_local))  # [s, b, h]


class ParallelDecodeLayer(ParallelModule):
    """The TP twin of DenseDecodeLayer: ParallelCachedAttention then ParallelMLP."""

    def __init__(
        self,
        cfg: ModelConfig,
        group: TPGroup,
        cache_len: int,
        *,
        dtype: torch.dtype | None = None,
        rng: RNGTracker | None = None,
    ) -> None:
        super().__init__(group)
        rng = _tracker(group, rng)
        self.attention = ParallelCachedAttention(cfg, group, cache_len, dtype=dtype, rng=rng)
        self.mlp = ParallelMLP(cfg, group, dtype=dtype, rng=rng)
        label_sites(self)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self.mlp(self.attention(x, start))


class ParallelDecoder(ParallelLM):
    """The TP twin of DenseDecoder: forward(tokens `[b, s]` replicated, start_pos) -> vocab-sharded
    logits `[b, s, V/tp]`, each rank's KV cache holding its own kv heads. Forward collectives per
    call: the embedding's all-reduce, then o's and down's all-reduce in every layer."""

    def __init__(
        self,
        cfg: ModelConfig,
        group: TPGroup,
        cache_len: int,
        *,
        dtype: torch.dtype | None = None,
        rng: RNGTracker | None = None,
    ) -> None:
        super().__init__(
            cfg,
            group,
            dtype=dtype,
            rng=rng,
            layer=lambda rng: ParallelDecodeLayer(cfg, group, cache_len, dtype=dtype, rng=rng),
        )

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x, self.embed.weight)  # the embedding's shard is used only if tied

    def forward(self, tokens: torch.Tensor, start_pos) -> torch.Tensor:
        return decode_forward(self, tokens, start_pos)


def finalize_model_grads(root: torch.nn.Module, group: TPGroup) -> None:
    """Optimizer phase, before the step: all-reduce the grads marked partial (SP), then sum the
    grads of replicated kv heads over their replicas. The same order on every rank."""
    finalize_grads(root, group)
    for module in root.modules():
        if isinstance(module, ParallelQKV):
            module.reduce_replica_grads()
