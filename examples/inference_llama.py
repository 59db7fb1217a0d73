"""An inference-only Llama-style model, tensor-parallel the way inference code writes it.

    tpcheck verify examples/inference_llama.py:correct --world-size 2
    tpcheck verify examples/inference_llama.py:batch_mixing_hook --world-size 2   # exits 1
    tpcheck verify examples/inference_llama.py:decode_cache_offset --world-size 2  # exits 1

What the code looks like (Meta's llama reference, gpt-fast): tokens `[batch, seq]` in, logits
`[batch, seq, vocab]` out, `forward(tokens, start_pos)` under `torch.inference_mode()`; weights with
`requires_grad=False`; RoPE; grouped-query attention (4 heads, 2 KV heads); a KV cache kept in the
module's buffers, filled in place at `start_pos`. Tensor parallelism as inference engines write it:
wq/wk/wv and w1/w3 column-parallel (each rank holds its heads and its part of the FFN), wo and w2
row-parallel with the all-reduce of their partial sums done in a `register_forward_hook` on the
module (plain `torch.distributed`, no autograd function: nothing here is ever differentiated). The
dense twin is the same model at world 1 (no hooks).

tpcheck sees that no TP parameter requires grad and checks the forward only (said in the report):
the loaded weights, then for each step a prefill of a fresh batch of 3 different prompts and
`decode_steps` greedy decode steps through the model's own KV cache, every module output and the
logits compared at each of them (`output`, `output:decode1`, ...). Each step starts from the caches
as built (tpcheck copies the module's buffers back), so no step reads another's cache.

Planted bugs (the correct case passes at the same settings):
  - `batch_mixing_hook`: the row-parallel hook all-reduces a seq-first copy of the output
    (`transpose(0, 1).contiguous()`, a communication buffer laid out `[seq, batch, hidden]`) and
    hands back `buf.view(output.shape)` instead of transposing back: with one sequence the two
    layouts coincide, with several the sequences of the batch are mixed. Caught in the prefill of
    step 1 at `act:layers.0.attention.wo`.
  - `decode_cache_offset`: in the decode path (one new token) the new key and value are written to
    the cache one slot late (`start_pos + 1`). The step that writes them attends to its own fresh
    key and value, so the prefill and the first decode step are right; the second decode step
    reads the empty slot. Caught at decode step 2 (`...:decode2`).
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

DIM, HEADS, KV_HEADS, VOCAB, LAYERS, FFN = 32, 4, 2, 64, 2, 64
HEAD_DIM = DIM // HEADS
MAX_BATCH, MAX_SEQ = 4, 16
BATCH, PROMPT = 3, 6


def rope_tables(dtype):
    """cos and sin of the rotary angles, `[MAX_SEQ, HEAD_DIM]` (HF's rotate-half layout)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    angles = torch.outer(torch.arange(MAX_SEQ, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):  # x [b, s, heads, hd]; cos/sin [s, hd]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def all_reduce_hook(pg, bug=None):
    """The row-parallel layer's forward hook: the partial sums all-reduced in place."""

    def hook(module, args, output):
        if bug == "batch_mixing":
            buf = output.transpose(0, 1).contiguous()  # [s, b, h]: a seq-first buffer
            dist.all_reduce(buf, group=pg)
            return buf.view(output.shape)  # the bug: should be buf.transpose(0, 1)
        dist.all_reduce(output, group=pg)
        return output

    return hook


class RMSNorm(nn.Module):
    def __init__(self, dim, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, world, dtype=None, bug=None):
        super().__init__()
        self.n_heads, self.n_kv = HEADS // world, KV_HEADS // world  # this rank's heads
        self.bug = bug
        self.wq = nn.Linear(DIM, self.n_heads * HEAD_DIM, bias=False, dtype=dtype)
        self.wk = nn.Linear(DIM, self.n_kv * HEAD_DIM, bias=False, dtype=dtype)
        self.wv = nn.Linear(DIM, self.n_kv * HEAD_DIM, bias=False, dtype=dtype)
        self.wo = nn.Linear(self.n_heads * HEAD_DIM, DIM, bias=False, dtype=dtype)
        shape = (MAX_BATCH, MAX_SEQ, self.n_kv, HEAD_DIM)
        self.register_buffer("cache_k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape, dtype=dtype), persistent=False)

    def forward(self, x, start_pos, cos, sin):  # x [b, s, dim]
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, HEAD_DIM)
        k = self.wk(x).view(b, s, self.n_kv, HEAD_DIM)
        v = self.wv(x).view(b, s, self.n_kv, HEAD_DIM)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        at = start_pos + 1 if (self.bug == "decode_cache_offset" and s == 1) else start_pos
        self.cache_k[:b, at : at + s] = k
        self.cache_v[:b, at : at + s] = v
        # the cached prefix, then this call's own keys and values
        keys = torch.cat([self.cache_k[:b, :start_pos], k], dim=1)  # [b, start_pos + s, kv, hd]
        values = torch.cat([self.cache_v[:b, :start_pos], v], dim=1)
        rep = self.n_heads // self.n_kv
        keys, values = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
        # position i of this call sees every cached position and the new ones up to itself
        mask = torch.ones(s, start_pos + s, dtype=torch.bool).tril(diagonal=start_pos)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
        )  # [b, heads, s, hd]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, world, dtype=None):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN // world, bias=False, dtype=dtype)
        self.w3 = nn.Linear(DIM, FFN // world, bias=False, dtype=dtype)
        self.w2 = nn.Linear(FFN // world, DIM, bias=False, dtype=dtype)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, world, dtype=None, bug=None):
        super().__init__()
        self.attention_norm = RMSNorm(DIM, dtype)
        self.attention = Attention(world, dtype, bug)
        self.ffn_norm = RMSNorm(DIM, dtype)
        self.feed_forward = FeedForward(world, dtype)

    def forward(self, x, start_pos, cos, sin):
        h = x + self.attention(self.attention_norm(x), start_pos, cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole model; `group` None: the dense model (world 1, no collectives)."""

    def __init__(self, group=None, dtype=None, bug=None):
        super().__init__()
        world = group.world_size if group is not None else 1
        self.tok_embeddings = nn.Embedding(VOCAB, DIM, dtype=dtype)
        self.layers = nn.ModuleList(Layer(world, dtype, bug) for _ in range(LAYERS))
        self.norm = RMSNorm(DIM, dtype)
        self.output = nn.Linear(DIM, VOCAB, bias=False, dtype=dtype)
        cos, sin = rope_tables(dtype or torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if world > 1:
            hook_bug = "batch_mixing" if bug == "batch_mixing" else None
            for layer in self.layers:
                layer.attention.wo.register_forward_hook(all_reduce_hook(group.pg, hook_bug))
                layer.feed_forward.w2.register_forward_hook(all_reduce_hook(group.pg))
        self.requires_grad_(False)  # an inference engine's weights

    @torch.inference_mode()
    def forward(self, tokens, start_pos):  # tokens [b, s] -> logits [b, s, vocab]
        start_pos = int(start_pos)
        s = tokens.shape[1]
        cos, sin = (
            self.rope_cos[start_pos : start_pos + s],
            self.rope_sin[start_pos : start_pos + s],
        )
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, start_pos, cos, sin)
        return self.output(self.norm(h))


def init(model, g):
    """Seeded weights: matrices N(0, 1/fan_in), norm gains 1 + N(0, 0.1^2)."""
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise / math.sqrt(p.shape[-1]) if p.dim() == 2 else 1 + 0.1 * noise)


def make_batch(g, dtype, batch=BATCH):
    """A prompt of `batch` different sequences from position 0; no target (nothing is trained)."""
    tokens = torch.randint(0, VOCAB, (batch, PROMPT), generator=g)
    return {"tokens": tokens, "start_pos": torch.tensor(0)}, None


def _plan():
    params, acts = {"tok_embeddings.weight": Replicate(), "norm.weight": Replicate()}, {}
    params["output.weight"] = Replicate()
    for i in range(LAYERS):
        p = f"layers.{i}."
        for norm in ("attention_norm", "ffn_norm"):
            params[p + norm + ".weight"] = Replicate()
        for col in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
            params[p + col + ".weight"] = Shard(0)
            acts[p + col] = Shard(2)  # [b, s, heads/tp * hd]
        params[p + "feed_forward.w3.weight"] = Shard(0)
        acts[p + "feed_forward.w3"] = Shard(2)
        for row in ("attention.wo", "feed_forward.w2"):
            params[p + row + ".weight"] = Shard(1)
            acts[p + row] = Replicate()  # after the hook's all-reduce
        acts[p + "attention"] = acts[p[:-1]] = Replicate()
    acts["output"] = Replicate()
    return Plan(params=params, activations=acts)


PLAN = _plan()


def _case(name, bug=None, batch=BATCH, decode_steps=3):
    return Case(
        name=name,
        build_dense=lambda dtype: Transformer(None, dtype),
        build_tp=lambda group, dtype: Transformer(group, dtype, bug),
        plan=PLAN,
        make_batch=lambda g, dtype: make_batch(g, dtype, batch),
        init=init,
        decode_steps=decode_steps,
        run=RunSettings(steps=2),
    )


correct = _case("inference_llama")
batch_mixing_hook = _case("inference_llama_batch_mixing_hook", "batch_mixing")
decode_cache_offset = _case("inference_llama_decode_cache_offset", "decode_cache_offset")
# one sequence: the batch-mixing hook cannot show (the report says so), and passes
batch_mixing_hook_one_sequence = _case(
    "inference_llama_batch_mixing_hook_one_sequence", "batch_mixing", batch=1
)
