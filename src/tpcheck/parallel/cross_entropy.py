"""Vocab-parallel cross-entropy (Megatron style): the loss of vocab-sharded logits without ever
gathering the full logits.

Rank r holds logits `[..., V/tp]` for vocabulary ids r*V/tp .. (r+1)*V/tp - 1 (the output of a
column-parallel LM head). Per token the loss needs three global quantities, and each is a reduction
over the vocabulary, so each is computed locally and combined across ranks:

* the max logit (a stabilizer for exp): every rank's local max, all-gathered ([tp, n], tiny) and
  maxed. `TPGroup` offers only summing all-reduces; the all-gather gives the same value, identical
  on every rank;
* sum of exp(logit - max), the target's (shifted) logit (only the rank owning the target id
  contributes, the others add 0) and, for label smoothing, the sum of shifted logits: stacked into
  ONE summing all-reduce.

loss_i = (1 - eps) * (lse_i - x_i[target]) + eps * (lse_i - mean_j x_i[j]), the smoothing spread
over the GLOBAL vocabulary (as `F.cross_entropy(label_smoothing=eps)`), averaged over tokens whose
label is not `ignore_index`. The loss is the same scalar on every rank (computed from all-reduced
values), and the backward needs no collective: each rank's logits grad is softmax - smoothed one-hot
on its own vocabulary block. Arithmetic is done in float32 at least (as Megatron),
whatever the logits dtype.
"""

from __future__ import annotations

import torch

from tpcheck.parallel.group import TPGroup


def _all_reduce(x: torch.Tensor, group: TPGroup, site: str) -> torch.Tensor:
    if group.world_size == 1:
        return x
    return group.collective("all_reduce", x, site=site, phase="forward")


def _global_max(local_max: torch.Tensor, group: TPGroup, site: str) -> torch.Tensor:
    """[n] per rank -> [n], the max over ranks (all-gather + max: identical on every rank)."""
    if group.world_size == 1:
        return local_max
    maxes = group.collective("all_gather", local_max[None], site=site, phase="forward")  # [tp, n]
    return maxes.max(dim=0).values


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, ignore_index, smoothing, site):
        v_local = logits.shape[-1]
        vocab, start = v_local * group.world_size, group.rank * v_local
        compute = torch.promote_types(logits.dtype, torch.float32)
        x = logits.detach().reshape(-1, v_local).to(compute)  # [n, V/tp]
        labels = labels.reshape(-1)  # [n]
        shifted = x - _global_max(x.max(dim=-1).values, group, f"{site}.max")[:, None]  # [n, V/tp]
        exp = shifted.exp()
        valid = labels != ignore_index
        # this rank owns the target id
        mine = valid & (labels >= start) & (labels < start + v_local)
        idx = torch.where(mine, labels - start, torch.zeros_like(labels))  # masked to 0 elsewhere
        target = shifted.gather(1, idx[:, None]).squeeze(1) * mine  # [n], 0 on other ranks
        stats = torch.stack([exp.sum(dim=-1), target, shifted.sum(dim=-1)])  # [3, n]
        sum_exp, target, sum_shifted = _all_reduce(stats, group, f"{site}.sum")
        lse = sum_exp.log()
        per_token = (1.0 - smoothing) * (lse - target) + smoothing * (lse - sum_shifted / vocab)
        count = valid.sum()
        loss = (per_token * valid).sum() / count
        ctx.save_for_backward(exp / sum_exp[:, None], idx, mine, valid, count)
        ctx.smoothing, ctx.vocab, ctx.shape, ctx.dtype = (
            smoothing,
            vocab,
            logits.shape,
            logits.dtype,
        )
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine, valid, count = ctx.saved_tensors
        eps = ctx.smoothing
        g = softmax - eps / ctx.vocab  # [n, V/tp]
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows[mine], idx[mine]] -= 1.0 - eps
        # not a float32 1/count
        g = g * (valid[:, None].to(g.dtype) / count.to(g.dtype)) * grad.to(g.dtype)
        return g.reshape(ctx.shape).to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    labels: torch.Tensor,
    group: TPGroup,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    site: str = "cross_entropy",
) -> torch.Tensor:
    """Mean cross-entropy over non-ignored tokens of vocab-sharded logits `[..., V/tp]` and
    replicated integer `labels` `[...]` (global vocabulary ids). Equals
    `F.cross_entropy` of the full logits.

    forward: all-gather of per-token local maxima (site `{site}.max`) and one all-reduce of
    [sum-exp, target logit, sum of logits] (site `{site}.sum`); backward: no collective.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if tuple(labels.shape) != tuple(logits_local.shape[:-1]):
        raise ValueError(
            f"labels of shape {list(labels.shape)} do not match logits {list(logits_local.shape)} "
            "(expected labels of the logits' shape without the vocab dim)"
        )
    return _VocabParallelCrossEntropy.apply(
        logits_local, labels, group, ignore_index, label_smoothing, site
    )
