"""Small injectors the catalogue is built from. Each returns a function `(case, spec) -> case`.

Sites match by suffix, so a fault written for the MLP's 'down' also hits 'layers.0.mlp.down'."""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F

from tpcheck.checker.case import Case, CaseSpec
from tpcheck.models.dense import KVCache
from tpcheck.models.parallel import DEFAULT_RNG_SEED
from tpcheck.parallel.collectives import (
    all_reduce_grad_,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
)
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.random import ParallelDropout, RNGTracker
from tpcheck.plan import Fused, Placement, Plan, Replicate, Shard


def site_matches(site: str, suffix: str) -> bool:
    return site == suffix or site.endswith("." + suffix)


def injected(case: Case, **changes) -> Case:
    """`case` with its Injection's fields replaced."""
    return dataclasses.replace(case, inject=dataclasses.replace(case.inject, **changes))


def intercept(op: str, site: str, phase: str, action, ranks=lambda rank, world: True):
    """Replace the collective `op` at `site` in `phase` (on the ranks `ranks` selects) by
    `action(x, perform)`; every other collective runs as usual."""

    def interceptor(group: TPGroup):
        def hook(op_, site_, phase_, x, perform):
            if (
                op_ == op
                and phase_ == phase
                and site_matches(site_, site)
                and ranks(group.rank, group.world_size)
            ):
                return action(x, perform)
            return perform(x)

        return hook

    return lambda case, spec: injected(case, intercept=interceptor)


def skip(x, perform):
    """The collective is not issued: its input passes through."""
    return x


def twice(x, perform):
    return perform(perform(x))


def on_temporary(x, perform):
    """Reduce a non-contiguous copy and drop the result: the input passes through, the ledger shows
    the collective (Megatron's old bug with non-contiguous tensors)."""
    perform(x.transpose(0, 1).contiguous())
    return x


def batch_mixing(x, perform):
    """All-reduce a batch-first copy of [s, b, h] and view the result back as [s, b, h] without
    transposing: with one sequence the two layouts hold the same order, with several the rows of
    different sequences trade places (inference code's all-reduce in a forward hook on a buffer
    reshaped for communication)."""
    return perform(x.transpose(0, 1).contiguous()).view(x.shape)


def gather_wrong_dim(x, perform):
    """All-gather the batch dim of [s/tp, b, h] then
    view it as the sequence: right shape, wrong rows."""
    out = perform(x.transpose(0, 1).contiguous())  # [tp*b, s/tp, h]
    return out.reshape(x.shape[0] * out.shape[0] // x.shape[1], x.shape[1], x.shape[2])


def bias_before_reduce(site: str):
    """Row-parallel layers at `site` add their bias to the partial sums: counted tp times."""

    def forward(self, x_local):
        partial = F.linear(x_local, self.weight, self.bias)
        return reduce_from_tp_region(partial, self.group, self.site)

    def tamper(module, group):
        for name, m in module.named_modules():
            if site_matches(name, site) and getattr(m, "bias", None) is not None:
                m.forward = types.MethodType(forward, m)

    return lambda case, spec: injected(case, tamper=tamper)


def cache_write_one_slot_late(case: Case, spec: CaseSpec) -> Case:
    """The TP model's KV caches write the key and value of a one-token call (a decode pass) at
    position start + 1 instead of start; the prefill writes right. The pass that writes them
    attends to its own fresh key and value, so the first decode pass is right and the second
    reads the slot that was never written."""

    def write(self, k, v, start):
        KVCache.write(self, k, v, start + 1 if k.shape[0] == 1 else start)

    def tamper(module, group):
        for m in module.modules():
            if isinstance(m, KVCache):
                m.write = types.MethodType(write, m)

    return injected(case, tamper=tamper)


def divide_loss_by_world(case: Case, spec: CaseSpec) -> Case:
    def tp_loss(out, target, group):
        return case.compute_tp_loss(out, target, group) / group.world_size

    return dataclasses.replace(case, tp_loss=tp_loss)


def replicated_lr_by_rank(case: Case, spec: CaseSpec) -> Case:
    """Replicated parameters get a rank-dependent learning rate (a per-rank schedule bug)."""
    replicated = {case.plan.tp_name(n) for n, p in case.plan.params.items() if p.replicated}

    def make(tp, group, default):
        opt = default([p for n, p in tp.named_parameters() if n not in replicated])
        rest = [p for n, p in tp.named_parameters() if n in replicated]
        opt.add_param_group(
            {"params": rest, "lr": case.run.learning_rate * (1.0 + 0.5 * group.rank)}
        )
        return opt

    return injected(case, tp_optimizer=make)


def embedding_without_mask(case: Case, spec: CaseSpec) -> Case:
    """Vocab-parallel embeddings mask foreign token ids to row 0 but do not zero those output rows:
    every rank adds its row 0 for the tokens it does not own."""
    from tpcheck.parallel.embedding import VocabParallelEmbedding

    def forward(self, tokens):
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_start + self.vocab_local)
        partial = F.embedding(
            torch.where(outside, torch.zeros_like(tokens), tokens - self.vocab_start), self.weight
        )
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group, self.site)
        return reduce_from_tp_region(partial, self.group, self.site)

    def tamper(module, group):
        for m in module.modules():
            if isinstance(m, VocabParallelEmbedding):
                m.forward = types.MethodType(forward, m)

    return injected(case, tamper=tamper)


def smoothing_over_local_vocab(case: Case, spec: CaseSpec) -> Case:
    """Vocab-parallel cross-entropy spreads label smoothing over the local vocabulary: the sum of
    logits is not reduced and is divided by the local vocabulary size (Megatron's old bug)."""

    def interceptor(group: TPGroup):
        def hook(op, site, phase, x, perform):
            if (
                op == "all_reduce"
                and site.endswith(".sum")
                and phase == "forward"
                and x.dim() == 2
                and len(x) == 3
            ):
                out = perform(x).clone()
                out[2] = x[2] * group.world_size  # local sum / (V / tp) == this rank's mean logit
                return out
            return perform(x)

        return hook

    return injected(case, intercept=interceptor)


# ------------------------------------------------------------------ wrong loading (load_plan)


@dataclasses.dataclass(frozen=True)
class FromRank(Placement):
    """Every rank loads what rank `source` should hold."""

    inner: Placement
    source: int = 0

    def shard(self, dense, rank, world):
        return self.inner.shard(dense, self.source, world)


@dataclasses.dataclass(frozen=True)
class Perturbed(Placement):
    """Rank `rank` loads its shard scaled by (1 + rel): a stale or mis-converted checkpoint shard.
    The TP side loads from the float32 master weights, so the perturbation survives a cast to
    bfloat16 where it crosses a rounding boundary (about one element in five for rel = 1e-3)."""

    inner: Placement
    rank: int = 1
    rel: float = 1e-3

    def shard(self, dense, rank, world):
        local = self.inner.shard(dense, rank, world)
        return local * (1.0 + self.rel) if rank == self.rank % world else local


def perturb_first_shard(rank: int = 1, rel: float = 1e-3):
    def inject(case: Case, spec: CaseSpec) -> Case:
        name = next(n for n, p in case.plan.params.items() if not p.replicated)
        return load_with(lambda p: Perturbed(p, rank, rel), lambda n, p: n == name)(case, spec)

    return inject


@dataclasses.dataclass(frozen=True)
class KVByRank(Fused):
    """A replicated KV head indexed by rank (mod the
    number of heads) instead of rank // replicas."""

    def replica_unit(self, rank: int, world: int, units: int) -> int:
        return rank % units

    def __str__(self) -> str:  # the checks still name the right placement; this one only loads
        return "fused(kv head by rank)"


def kv_head_by_rank(case: Case, spec: CaseSpec) -> Case:
    def replicated_part(name: str, p: Placement) -> bool:
        return isinstance(p, Fused) and any(n < spec.world_size for n in p.units)

    return load_with(lambda p: KVByRank(p.dim, p.units, p.unit_size), replicated_part)(case, spec)


@dataclasses.dataclass(frozen=True)
class WrongDim(Placement):
    """Split along dim `used`, then viewed as the shape the right placement gives."""

    right: Placement
    used: int = 0

    def shard(self, dense, rank, world):
        shape = self.right.shard(dense, rank, world).shape
        return Shard(self.used).shard(dense, rank, world).reshape(shape)


def load_with(rewrite, needs=lambda name, p: True):
    """The TP side loads its weights with rewrite(placement)
    for the (name, placement) `needs` selects."""

    def inject(case: Case, spec: CaseSpec) -> Case:
        params = {n: rewrite(p) if needs(n, p) else p for n, p in case.plan.params.items()}
        return injected(case, load_plan=Plan(params=params, tp_names=case.plan.tp_names))

    return inject


def naive_fused_split(case: Case, spec: CaseSpec) -> Case:
    """Fused weights ([gate; up], [q; k; v]) split contiguously instead of per part. The catalogue
    entry builds the block with the concatenated [gate; up] layout (its `overrides`), so every block
    with an MLP has a fused weight to split; parts replicated over ranks (kv_heads < world) are left
    alone (the shapes would not even match)."""

    def splittable(name: str, p: Placement) -> bool:
        return isinstance(p, Fused) and all(n >= spec.world_size for n in p.units)

    return load_with(lambda p: Shard(p.dim), splittable)(case, spec)


def is_row_parallel_weight(name: str, p: Placement) -> bool:
    """2-D weights sharded on their input dim: the MLP's down and attention's output projection."""
    parts = name.split(".")
    return (
        type(p) is Shard
        and p.dim == 1
        and parts[-1] == "weight"
        and len(parts) > 1
        and parts[-2] in ("down", "o", "o_proj", "out_proj")
    )


def not_replicated(name: str, p: Placement) -> bool:
    return not isinstance(p, Replicate)


__all__ = [
    "intercept",
    "skip",
    "twice",
    "on_temporary",
    "gather_wrong_dim",
    "bias_before_reduce",
    "divide_loss_by_world",
    "replicated_lr_by_rank",
    "load_with",
    "naive_fused_split",
    "FromRank",
    "WrongDim",
    "injected",
    "is_row_parallel_weight",
    "not_replicated",
    "perturb_first_shard",
    "Perturbed",
    "KVByRank",
    "kv_head_by_rank",
    "embedding_without_mask",
    "smoothing_over_local_vocab",
    "lr_times_world_on_last_rank",
    "weight_decay_twice_on_sharded",
    "lr_scaled_on_last_rank",
    "adam_l2_instead_of_adamw",
    "tp_betas_differ",
    "state_reset_on_sharded",
    "replicated_on_rank0_only",
    "scale_partial",
    "norm_eps",
    "weight_cached_at_first_forward",
    "sum_microbatch_losses",
    "reduce_grads_every_microbatch",
]


# ------------------------------------------------------------------ optimizer bugs (tp_optimizer)


def _sharded(case: Case) -> set[str]:
    return {case.plan.tp_name(n) for n, p in case.plan.params.items() if not p.replicated}


def _with_group(default, params: list, special: list, **overrides) -> torch.optim.Optimizer:
    """default(params) where the parameters in `special` form a group with `overrides`."""
    normal = [p for p in params if not any(p is s for s in special)]
    if not normal:
        opt = default(special)
        opt.param_groups[0].update(overrides)
        return opt
    opt = default(normal)
    if special:
        opt.add_param_group({"params": special, **overrides})
    return opt


def lr_scaled_on_last_rank(factor):
    """The last rank steps its sharded parameters with lr x factor(world) (a per-rank learning rate
    scaled for the wrong parallel size, or slightly off)."""

    def inject(case: Case, spec: CaseSpec) -> Case:
        sharded, lr = _sharded(case), case.run.learning_rate

        def make(tp, group, default):
            params = [p for _, p in tp.named_parameters()]
            last = group.rank == group.world_size - 1
            special = [p for n, p in tp.named_parameters() if last and n in sharded]
            return _with_group(default, params, special, lr=lr * factor(group.world_size))

        return injected(case, tp_optimizer=make)

    return inject


lr_times_world_on_last_rank = lr_scaled_on_last_rank(lambda world: world)


def weight_decay_twice_on_sharded(case: Case, spec: CaseSpec) -> Case:
    """Sharded parameters get the decoupled weight decay a second time after each step (a wrapper
    that also decays the parameters it shards)."""
    sharded, lr = _sharded(case), case.run.learning_rate

    def make(tp, group, default):
        opt = default([p for _, p in tp.named_parameters()])
        targets = [p for n, p in tp.named_parameters() if n in sharded]
        decay = opt.defaults.get("weight_decay", 0.0)

        def again(optimizer, args, kwargs):
            with torch.no_grad():
                for p in targets:
                    if p.grad is not None:
                        p.mul_(1 - lr * decay)

        opt.register_step_post_hook(again)
        return opt

    return injected(case, tp_optimizer=make)


def adam_l2_instead_of_adamw(case: Case, spec: CaseSpec) -> Case:
    """The TP side uses Adam with an L2 penalty added to the gradient instead of AdamW's decoupled
    weight decay (same lr and decay coefficient)."""
    lr = case.run.learning_rate

    def make(tp, group, default):
        decay = default([torch.nn.Parameter(torch.zeros(1))]).defaults.get("weight_decay", 0.0)
        return torch.optim.Adam([p for _, p in tp.named_parameters()], lr=lr, weight_decay=decay)

    return injected(case, tp_optimizer=make)


def tp_betas_differ(case: Case, spec: CaseSpec) -> Case:
    """The TP side's AdamW uses betas (0.9, 0.95) where the dense side uses (0.9, 0.999)."""

    def make(tp, group, default):
        opt = default([p for _, p in tp.named_parameters()])
        for g in opt.param_groups:
            g["betas"] = (0.9, 0.95)
        return opt

    return injected(case, tp_optimizer=make)


def state_reset_on_sharded(case: Case, spec: CaseSpec) -> Case:
    """The optimizer state of sharded parameters is dropped before every step (a resharding or
    checkpoint path that rebuilds it)."""
    sharded = _sharded(case)

    def make(tp, group, default):
        opt = default([p for _, p in tp.named_parameters()])
        targets = [p for n, p in tp.named_parameters() if n in sharded]

        def reset(optimizer, args, kwargs):
            for p in targets:
                optimizer.state.pop(p, None)

        opt.register_step_pre_hook(reset)
        return opt

    return injected(case, tp_optimizer=make)


def replicated_on_rank0_only(case: Case, spec: CaseSpec) -> Case:
    """Replicated parameters are in the optimizer on
    rank 0 only: the other ranks never update them."""
    replicated = {case.plan.tp_name(n) for n, p in case.plan.params.items() if p.replicated}

    def make(tp, group, default):
        keep = [p for n, p in tp.named_parameters() if group.rank == 0 or n not in replicated]
        return default(keep)

    return injected(case, tp_optimizer=make)


# ---------------------------------------------------------------- small numeric bugs (at the bound)


def scale_partial(factor: float):
    """An interceptor action: this rank's partial sum enters the reduction scaled by `factor` (a
    rank whose shard is slightly off: a stale or mis-converted weight, a wrong scaling constant)."""

    def action(x, perform):
        return perform(x * factor)

    return action


def norm_eps(eps: float):
    """Every RMSNorm of the TP module uses `eps` (the dense one uses the config's)."""

    def tamper(module, group):
        for m in module.modules():
            if hasattr(m, "eps") and hasattr(m, "weight") and type(m).__name__ == "RMSNorm":
                m.eps = eps

    return lambda case, spec: injected(case, tamper=tamper)


def weight_cached_at_first_forward(site: str):
    """Modules at `site` compute with the weights they saw at their first forward (a cache that is
    never refreshed after an optimizer step); their gradients still reach the live parameters."""

    def tamper(module, group):
        for name, m in module.named_modules():
            if site_matches(name, site):
                _cache_first_weights(m)

    return lambda case, spec: injected(case, tamper=tamper)


def _cache_first_weights(m) -> None:
    forward, cache = m.forward, {}

    def stale_forward(*args, **kwargs):
        params = dict(m.named_parameters(recurse=False))
        if not cache:
            cache.update({n: p.detach().clone() for n, p in params.items()})
        live = {n: p.data for n, p in params.items()}
        try:
            for n, p in params.items():
                p.data = cache[n]
            return forward(*args, **kwargs)
        finally:
            for n, p in params.items():
                p.data = live[n]

    m.forward = stale_forward


# ------------------------------------------------------------------ gradient accumulation


def sum_microbatch_losses(case: Case, spec: CaseSpec) -> Case:
    """The TP side's loss is not averaged over the micro-batches (the engine divides each
    micro-batch's loss by their number on both sides; this TP loss undoes it: the sum)."""
    micro = case.run.micro_batches

    def tp_loss(out, target, group):
        return case.compute_tp_loss(out, target, group) * micro

    return dataclasses.replace(case, tp_loss=tp_loss)


def reduce_grads_every_microbatch(case: Case, spec: CaseSpec) -> Case:
    """Parameters whose grads are partial sums over the ranks (`partial_grad`: sequence-parallel
    norm weights) are all-reduced by a post-accumulate-grad hook after every micro-batch instead of
    once after the last: from the second micro-batch on, the grad already reduced is summed over the
    ranks again. The module's finalize_grads becomes a no-op (the hook did the reducing)."""

    def tamper(module, group):
        for name, p in module.named_parameters():
            if getattr(p, "partial_grad", False):
                p.register_post_accumulate_grad_hook(
                    lambda param, site=name: all_reduce_grad_(param, group, site)
                )
        module.finalize_grads = lambda: None

    return injected(case, tamper=tamper)


def rng_not_forked(case: Case, spec: CaseSpec) -> Case:
    """The sharded regions' model-parallel generator seeded the same on every rank: the dropout
    masks of different shards (a rank's attention heads; the sequence shards under
    SP) are then copies."""

    def tamper(tp, group: TPGroup) -> None:
        for module in tp.modules():
            if isinstance(module, ParallelDropout):
                module.tracker.seed(DEFAULT_RNG_SEED, by_rank=False)

    return injected(case, tamper=tamper)


def rng_diverged(case: Case, spec: CaseSpec) -> Case:
    """The replicated region's dropout (after the row-parallel all-reduce) drawn from the
    rank-seeded model-parallel generator: the replicas draw different masks and drift apart."""

    def tamper(tp, group: TPGroup) -> None:
        tracker = RNGTracker(group, DEFAULT_RNG_SEED, device=group.device)
        for module in list(tp.modules()):
            for name, child in list(module.named_children()):
                if type(child) is torch.nn.Dropout:
                    setattr(module, name, ParallelDropout(child.p, tracker))

    return injected(case, tamper=tamper)


# ---------------------------------------------------------------- clipping bugs (tp_clip_grad_norm)


def clip_with(clip):
    """The TP side clips its gradients with `clip(tp_module, max_norm, group)`."""
    return lambda case, spec: dataclasses.replace(case, tp_clip_grad_norm=clip)


def _scale_grads(module, total, max_norm):
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total


def clip_local_norm(module, max_norm, group):
    """torch's clipping on the TP module: the norm of this rank's shards (and replicas) only."""
    return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)


def clip_all_summed(module, max_norm, group):
    """Every parameter's squared norm summed over the ranks, the replicated ones world times."""
    sq = torch.zeros((), device=group.device)
    for p in module.parameters():
        if p.grad is not None:
            sq = sq + p.grad.float().pow(2).sum()
    sq = group.collective("all_reduce", sq, site="clip", phase="optimizer")
    return _scale_grads(module, sq.sqrt(), max_norm)
