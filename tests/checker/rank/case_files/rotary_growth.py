"""A Llama-style attention block under sequence parallelism whose rotary cos/sin caches grow lazily.

The rotary embedding is written as HF's, GPT-NeoX's and Megatron's rotary caches are: `inv_freq`,
`cos` and `sin` are non-persistent buffers, the caches start with `initial` positions (0: an empty
`[0, head_dim]` cache) and are rebuilt in the forward when a longer sequence comes
(`seq_len > self.cos.shape[0]`), so both caches change shape during the run. The dense block is
x + o_proj(attention(rotary(q), rotary(k), v)), causal, activations [seq, batch, hidden]; every
TP block below holds seq/tp tokens per rank (input and output `Shard(0)`).

Megatron-style (`TPAttention`, tensor + sequence parallel): each rank all-gathers the tokens before
the column-parallel q/k/v projections (its heads) and reduce-scatters the row-parallel o_proj's
partial sums back to its tokens; its rotary cache is built for every position of the gathered
sequence (the whole dense cache on every rank: `Replicate()`).
Cases: `correct_empty` (the caches start empty), `correct_short` (they start with 2 positions);
`wrong_base_empty` / `wrong_base_short`: the planted bug, a TP rotary embedding that rebuilds its
caches from the default base (10000) instead of the model's rope_theta (500000) the constructor
used, as a port that recomputes the frequencies in its cache-growing path does.

`eager_tp`: the TP caches built for the whole sequence in the constructor, the dense ones grown
lazily from empty (equal from step 1 on). `grown_past`: TP caches grown one position past the
sequence, a shape no placement of the dense cache has.

Ulysses-style (`UlyssesAttention`, DeepSpeed-Ulysses sequence parallelism, the weights whole on
every rank): each rank projects and rotates its own tokens, so its rotary cache holds the rows of
its own positions (rank r: positions r*seq/tp ... (r+1)*seq/tp - 1, a `Shard(0)` of the dense
cache once grown), then an all-to-all gives it every token of heads/tp heads for the attention and
a second one its tokens back; the weights' gradients are summed over the ranks (`finalize_grads`).
Cases: `ulysses_empty`, `ulysses_short`; `ulysses_no_offset_empty` / `ulysses_no_offset_short`:
the planted bug, the cache rebuilt from the local sequence length alone, positions 0 ...
seq/tp - 1 on every rank (the rank's position offset forgotten).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, HEADS = 8, 2, 32, 4
HEAD_DIM = HIDDEN // HEADS
ROPE_THETA, DEFAULT_BASE = 500000.0, 10000.0


def inv_freq(dim, base):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class RotaryEmbedding(nn.Module):
    """cos/sin caches [positions, head_dim] in the module's dtype, rebuilt for a longer sequence."""

    def __init__(self, dim, initial=0, base=ROPE_THETA, dtype=None):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(dim, base), persistent=False)
        self.register_buffer("cos", torch.empty(0, dim, dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(0, dim, dtype=dtype), persistent=False)
        self.start = 0  # the first position the caches hold
        if initial:
            self._set_cache(initial, self.inv_freq)

    def _set_cache(self, seq_len, freqs, start=0):
        self.start = start
        t = torch.arange(start, start + seq_len, dtype=torch.float32, device=freqs.device)
        angles = torch.outer(t, freqs.float())
        emb = torch.cat([angles, angles], dim=-1)  # [seq_len, dim]
        self.cos = emb.cos().to(self.cos.dtype)
        self.sin = emb.sin().to(self.sin.dtype)

    def forward(self, x, seq_len):
        if seq_len > self.cos.shape[0]:
            self._set_cache(seq_len, self.inv_freq)
        return self.cos[:seq_len].to(x.dtype), self.sin[:seq_len].to(x.dtype)


class DefaultBaseRotaryEmbedding(RotaryEmbedding):
    """The planted bug: the growing path recomputes the frequencies from the default base."""

    def forward(self, x, seq_len):
        if seq_len > self.cos.shape[0]:
            self._set_cache(seq_len, inv_freq(self.cos.shape[1], DEFAULT_BASE))
        return self.cos[:seq_len].to(x.dtype), self.sin[:seq_len].to(x.dtype)


class LocalRotaryEmbedding(RotaryEmbedding):
    """The caches of this rank's positions only: block `block` of `seq_len` positions, rebuilt when
    more tokens or other positions come. `offset=False`: the planted bug, block 0 on every rank."""

    def __init__(self, dim, initial, block, offset=True, dtype=None):
        super().__init__(dim, initial, dtype=dtype)
        self.block = block if offset else 0

    def forward(self, x, seq_len):  # seq_len: this rank's tokens
        start = self.block * seq_len
        if seq_len > self.cos.shape[0] or start != self.start:
            self._set_cache(seq_len, self.inv_freq, start)
        return self.cos[:seq_len].to(x.dtype), self.sin[:seq_len].to(x.dtype)


class PastRotaryEmbedding(RotaryEmbedding):
    """Grows its caches one position past the sequence (a shape no placement of the dense cache
    has; the rows it uses are right)."""

    def forward(self, x, seq_len):
        if seq_len > self.cos.shape[0]:
            self._set_cache(seq_len + 1, self.inv_freq)
        return self.cos[:seq_len].to(x.dtype), self.sin[:seq_len].to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x, cos, sin):  # x [s, b, heads, d], cos/sin [s, d]
    return x * cos[:, None, None] + rotate_half(x) * sin[:, None, None]


class GatherFromSP(torch.autograd.Function):
    """forward: all-gather of the sequence shards (dim 0); backward: the sum over ranks of the
    gradient, this rank's tokens of it (each rank's is a partial sum over its heads)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(parts, x.contiguous(), group=pg)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.pg)
        world, rank = dist.get_world_size(ctx.pg), dist.get_rank(ctx.pg)
        return grad.chunk(world, dim=0)[rank].contiguous(), None


class ReduceScatterToSP(torch.autograd.Function):
    """forward: the sum over ranks of the partial sums, this rank's tokens of it; backward:
    all-gather of the sequence shards of the gradient."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        out = x.contiguous().clone()
        dist.all_reduce(out, group=pg)
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        return out.chunk(world, dim=0)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.pg))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.pg)
        return torch.cat(parts, dim=0), None


class AllToAll(torch.autograd.Function):
    """Ulysses' all-to-all, written with all_gather: forward, every rank's tensor concatenated
    along dim `gather` and this rank's block of dim `split` kept; backward, the same the other way
    round."""

    @staticmethod
    def forward(ctx, x, pg, gather, split):
        ctx.pg, ctx.dims = pg, (gather, split)
        return _swap(x, pg, gather, split)

    @staticmethod
    def backward(ctx, grad):
        gather, split = ctx.dims
        return _swap(grad, ctx.pg, split, gather), None, None, None


def _swap(x, pg, gather, split):
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=pg)
    return torch.cat(parts, dim=gather).chunk(world, dim=split)[rank].contiguous()


def causal_attention(q, k, v):  # [s, b, heads, d] each -> [s, b, heads, d]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)


class DenseAttention(nn.Module):
    def __init__(self, dtype=None, initial=0):
        super().__init__()
        self.heads = HEADS
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(HEAD_DIM, initial, dtype=dtype)

    def attend(self, x):  # [s, b, h] -> [s, b, heads * d]
        s, b, _ = x.shape
        q, k, v = (p(x).view(s, b, self.heads, HEAD_DIM) for p in self.projections())
        cos, sin = self.rotary_emb(v, s)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return causal_attention(q, k, v).reshape(s, b, self.heads * HEAD_DIM)

    def projections(self):
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x):  # [s, b, h]
        return x + self.o_proj(self.attend(x))


class TPAttention(DenseAttention):
    """Sequence parallel: x and the output hold this rank's seq/tp tokens; q/k/v column-parallel,
    o_proj row-parallel; the rotary cache built for every position of the gathered sequence."""

    def __init__(self, group, dtype=None, initial=0, rotary=RotaryEmbedding):
        nn.Module.__init__(self)
        self.pg, self.heads = group.pg, HEADS // group.world_size
        local = self.heads * HEAD_DIM
        self.q_proj = nn.Linear(HIDDEN, local, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(HIDDEN, local, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(HIDDEN, local, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(local, HIDDEN, bias=False, dtype=dtype)
        self.rotary_emb = rotary(HEAD_DIM, initial, dtype=dtype)

    def forward(self, x):  # [s/tp, b, h]: this rank's tokens
        full = GatherFromSP.apply(x, self.pg)  # [s, b, h]
        partial = F.linear(self.attend(full), self.o_proj.weight)  # [s, b, h], partial sums
        return x + ReduceScatterToSP.apply(partial, self.pg)


class ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce of the partial sums; backward: identity."""

    @staticmethod
    def forward(ctx, x, pg):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class UlyssesAttention(DenseAttention):
    """Sequence parallel, Ulysses-style: x and the output hold this rank's seq/tp tokens, every
    weight whole; the rotary caches hold the rows of this rank's positions."""

    def __init__(self, group, dtype=None, initial=0, offset=True):
        super().__init__(dtype)
        self.pg = group.pg
        self.rotary_emb = LocalRotaryEmbedding(HEAD_DIM, initial, group.rank, offset, dtype)

    def forward(self, x):  # [s/tp, b, h]: this rank's tokens
        n, b, _ = x.shape
        q, k, v = (p(x).view(n, b, HEADS, HEAD_DIM) for p in self.projections())
        cos, sin = self.rotary_emb(v, n)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (AllToAll.apply(t, self.pg, 0, 2) for t in (q, k, v))  # [s, b, heads/tp, d]
        out = AllToAll.apply(causal_attention(q, k, v), self.pg, 2, 0)  # [s/tp, b, heads, d]
        return x + self.o_proj(out.reshape(n, b, HIDDEN))

    def finalize_grads(self):
        """Each rank's gradients of the whole weights are its tokens' share: summed."""
        for p in self.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.pg)


def sp_mse(out_local, target_local, group):
    """The dense MSE from sequence shards: the local squared errors over every token, summed."""
    n = out_local.numel() * group.world_size
    return ReduceFromTP.apply(((out_local - target_local) ** 2).sum() / n, group.pg)


def init(module, g):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def make_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    target = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    return {"x": x.to(dtype)}, target.to(dtype)


PLAN = Plan(
    params={
        "q_proj.weight": Shard(0),
        "k_proj.weight": Shard(0),
        "v_proj.weight": Shard(0),
        "o_proj.weight": Shard(1),
    }
)

WHOLE = Plan(params={name: Replicate() for name in PLAN.params})


def _case(name, initial, rotary=RotaryEmbedding, tp_initial=None):
    def build_tp(group, dtype):
        return TPAttention(group, dtype, initial if tp_initial is None else tp_initial, rotary)

    return _sp_case(name, initial, PLAN, build_tp)


def _ulysses_case(name, initial, offset=True):
    def build_tp(group, dtype):
        return UlyssesAttention(group, dtype, initial, offset)

    return _sp_case(name, initial, WHOLE, build_tp)


def _sp_case(name, initial, plan, build_tp):
    return Case(
        name=name,
        build_dense=lambda dtype: DenseAttention(dtype, initial),
        build_tp=build_tp,
        plan=plan,
        make_batch=make_batch,
        init=init,
        tp_loss=sp_mse,
        input_placements={"x": Shard(0)},
        output_placement=Shard(0),
        target_placement=Shard(0),
        run=RunSettings(steps=2),
    )


correct_empty = _case("rotary_growth_empty", initial=0)
correct_short = _case("rotary_growth_short", initial=2)
wrong_base_empty = _case("rotary_wrong_base_empty", initial=0, rotary=DefaultBaseRotaryEmbedding)
wrong_base_short = _case("rotary_wrong_base_short", initial=2, rotary=DefaultBaseRotaryEmbedding)
eager_tp = _case("rotary_eager_tp", initial=0, tp_initial=SEQ)
grown_past = _case("rotary_grown_past", initial=0, rotary=PastRotaryEmbedding)
ulysses_empty = _ulysses_case("ulysses_growth_empty", initial=0)
ulysses_short = _ulysses_case("ulysses_growth_short", initial=2)
ulysses_no_offset_empty = _ulysses_case("ulysses_no_offset_empty", initial=0, offset=False)
ulysses_no_offset_short = _ulysses_case("ulysses_no_offset_short", initial=2, offset=False)
