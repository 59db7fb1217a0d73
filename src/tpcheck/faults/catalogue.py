"""Declarative fault entries: real TP bug classes, each injected into our own blocks on purpose.

An entry names the bug class in one sentence, where it is injected, and what the checker must say:
the stage of the first divergent tensor and the signature computed from its numbers (see
checker/verdict/diagnose.py). `inject(case, spec) -> case` turns a correct Case
into the faulty one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from tpcheck.checker.case import Case, CaseSpec
from tpcheck.errors import UsageError
from tpcheck.faults import injectors as inj

MLP_BLOCKS = ("mlp", "layer", "lm")
DROPOUT = (("dropout", 0.1), ("attention_dropout", 0.1))  # the config of a block with dropout
CLIP_NORM = 0.05  # below the blocks' gradient norms: the clipping acts, on the twin too
# every block that trains (the decode block is checked forward only: no loss, grads or optimizer)
ALL_BLOCKS = ("mlp", "attention", "layer", "lm", "embedding", "cross_entropy")


@dataclass(frozen=True)
class Fault:
    name: str
    bug_class: str
    where: str
    expected_stage: str  # stage of the first divergent check ("hang" for a hang)
    expected_signature: str
    inject: Callable[[Case, CaseSpec], Case]
    blocks: tuple[str, ...] = MLP_BLOCKS
    worlds: tuple[int, ...] = (2, 3, 4, 6, 8)
    sequence_parallel: bool | None = None  # True: only under SP (the spec is switched to SP)
    overrides: tuple[tuple[str, object], ...] = ()  # config the block is built with for this fault
    # an AdamW bug: with SGD (no state, no decay) there is nothing to see
    adaptive_only: bool = False
    # working dtypes in which the bug changes anything (e.g. 1 - lr * wd rounds to 1 in bfloat16)
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")
    # a gradient-accumulation bug shows with 2 or more micro-batches only
    min_micro_batches: int = 1
    micro_batches: int | None = None  # the fault runs with this many (None: the spec's own)
    # the run clips gradients at this total norm (a clipping bug), its correct twin too
    clip_grad_norm: float | None = None
    # False: in 16 bits the bug acts on float32 master
    # weights only (pure 16-bit parameters round it away)
    pure_16bit: bool = True

    def applies(
        self,
        block: str,
        world: int,
        optimizer: str = "adamw",
        dtype: str = "float32",
        micro_batches: int = 2,
        master_weights: bool = True,
    ) -> bool:
        pure = not master_weights and dtype in ("bfloat16", "float16")
        return (
            block in self.blocks
            and world in self.worlds
            and dtype in self.dtypes
            and (optimizer == "adamw" or not self.adaptive_only)
            and micro_batches >= self.min_micro_batches
            and (self.pure_16bit or not pure)
        )

    def prepare(self, spec: CaseSpec) -> CaseSpec:
        """The spec as this fault runs: its name, its sequence parallelism, its config overrides,
        its micro-batches where it names a number and, for a fault caught as a hang, that expected
        verdict (any fault is otherwise expected "not equivalent"; idempotent)."""
        sp = spec.sequence_parallel if self.sequence_parallel is None else self.sequence_parallel
        # a value the spec sets wins (e.g. its own dropout)
        given = {key for key, _ in spec.overrides}
        missing = tuple(o for o in self.overrides if o[0] not in given)
        expected = "hang" if self.expected_signature == "hang" else spec.expected
        micro = spec.settings.micro_batches if self.micro_batches is None else self.micro_batches
        run = {"micro_batches": micro}
        if self.clip_grad_norm is not None:
            run["clip_grad_norm"] = self.clip_grad_norm
        return dataclasses.replace(
            spec.with_run(**run),
            fault=self.name,
            sequence_parallel=sp,
            overrides=spec.overrides + missing,
            expected=expected,
        )


def _entries() -> list[Fault]:
    i = inj
    return [
        Fault(
            "missing_forward_reduce",
            "The row-parallel output is used without the all-reduce: each rank "
            "keeps its partial sum.",
            "forward all-reduce of the down projection (site 'down')",
            "forward",
            "partial_sum",
            i.intercept("all_reduce", "down", "forward", i.skip),
            sequence_parallel=False,
        ),
        Fault(
            "missing_backward_reduce",
            "The column-parallel input grad is not all-reduced: forward is bit-identical, "
            "grads are partial.",
            "backward all-reduce entering the TP region (site 'gate_up')",
            "backward",
            "partial_sum",
            i.intercept("all_reduce", "gate_up", "backward", i.skip),
            sequence_parallel=False,
        ),
        Fault(
            "reduced_twice",
            "The row-parallel partial sums are all-reduced twice: the output is "
            "tp times too large.",
            "forward all-reduce of the down projection, issued twice",
            "forward",
            "scaled_by_world",
            i.intercept("all_reduce", "down", "forward", i.twice),
            sequence_parallel=False,
        ),
        Fault(
            "bias_before_reduce",
            "The row-parallel bias is added to each rank's partial sum before the "
            "all-reduce: counted tp times.",
            "RowParallelLinear 'down' forward",
            "forward",
            "offset",
            i.bias_before_reduce("down"),
            sequence_parallel=False,
            # the seed's bias, 0.01 N(0, 1), counted tp
            # times is about one bfloat16 ulp of the output
            dtypes=("float32", "float16", "float64"),
        ),
        Fault(
            "collective_on_temporary",
            "The all-reduce runs on a contiguous copy of a non-contiguous grad and "
            "its result is dropped.",
            "backward all-reduce at 'gate_up' applied to a temporary",
            "backward",
            "partial_sum",
            i.intercept("all_reduce", "gate_up", "backward", i.on_temporary),
            sequence_parallel=False,
        ),
        Fault(
            "batch_mixing_reduce",
            "The row-parallel all-reduce runs on a batch-first copy of the output and is "
            "viewed back without the transpose: one sequence passes, a batch of several has "
            "its sequences mixed.",
            "forward all-reduce of the down projection on a [batch, seq, hidden] copy, viewed "
            "back as [seq, batch, hidden]",
            "forward",
            "permuted",
            i.intercept("all_reduce", "down", "forward", i.batch_mixing),
            blocks=(*MLP_BLOCKS, "decode"),
            sequence_parallel=False,
        ),
        Fault(
            "decode_cache_offset",
            "The decode path writes the new key and value to the KV cache one slot late: the "
            "prefill and the first decode pass are right, the second reads a slot never written.",
            "the TP model's KV-cache write in a one-token (decode) call",
            "forward",
            "mismatch",
            i.cache_write_one_slot_late,
            blocks=("decode",),
        ),
        Fault(
            "naive_fused_split",
            "A fused [gate; up] (or [q; k; v]) weight is split contiguously instead of per part.",
            "weight loading of fused weights (Shard instead of Fused)",
            "weights",
            "permuted",
            i.naive_fused_split,
            overrides=(("gate_up_layout", "concat"),),
        ),
        Fault(
            "wrong_shard_dim",
            "A row-parallel weight is split along the wrong dim and viewed as the "
            "expected shard shape.",
            "weight loading of row-parallel weights (dim 0 instead of 1)",
            "weights",
            "permuted",
            i.load_with(lambda p: i.WrongDim(p, 0), i.is_row_parallel_weight),
            worlds=(2, 4, 8),
        ),
        Fault(
            "every_rank_loads_shard_0",
            "Every rank loads rank 0's shard: the rank offset is missing from "
            "the checkpoint loader.",
            "weight loading of every sharded weight",
            "weights",
            "rank0_shard",
            i.load_with(lambda p: i.FromRank(p, 0), i.not_replicated),
        ),
        Fault(
            "stale_shard",
            "One rank's weight shard is off by 1e-3 relative (a stale or mis-converted "
            "checkpoint shard).",
            "rank 1's first sharded weight as loaded",
            "weights",
            "scaled",
            i.perturb_first_shard(1, 1e-3),
        ),
        Fault(
            "kv_head_by_rank",
            "With fewer KV heads than ranks, rank r loads KV head r % kv instead "
            "of r // (world // kv).",
            "weight loading of the fused QKV weight's replicated KV part",
            "weights",
            "permuted",
            i.kv_head_by_rank,
            blocks=("attention", "layer", "lm"),
            worlds=(4, 8),
        ),
        Fault(
            "embedding_without_mask",
            "The vocab-parallel embedding does not zero the rows of token ids other ranks own.",
            "VocabParallelEmbedding forward, before the reduction",
            "forward",
            "mismatch",
            i.embedding_without_mask,
            blocks=("embedding", "lm"),
        ),
        Fault(
            "smoothing_over_local_vocab",
            "Label smoothing in the vocab-parallel cross-entropy uses the local "
            "vocabulary, not the global one.",
            "the all-reduce of the sum of logits in the cross-entropy forward",
            "loss",
            "replicas_differ",
            i.smoothing_over_local_vocab,
            blocks=("cross_entropy",),
        ),
        Fault(
            "sp_norm_grad_not_reduced",
            "Under sequence parallelism the norm weight grad is not all-reduced: each "
            "rank saw a sequence shard.",
            "optimizer-phase all-reduce of 'norm.weight' grads",
            "grads",
            "partial_sum",
            i.intercept("all_reduce", "norm.weight", "optimizer", i.skip),
            sequence_parallel=True,
        ),
        Fault(
            "gather_wrong_dim",
            "The sequence-parallel all-gather gathers the batch dim and views it as the sequence.",
            "forward all-gather at 'gate_up' under sequence parallelism",
            "forward",
            "permuted",
            i.intercept("all_gather", "gate_up", "forward", i.gather_wrong_dim),
            sequence_parallel=True,
        ),
        Fault(
            "loss_divided_by_tp",
            "The loss is divided by the TP size as if the ranks were data-parallel replicas.",
            "the TP loss",
            "loss",
            "scaled_by_1/world",
            i.divide_loss_by_world,
        ),
        Fault(
            "optimizer_differs_across_ranks",
            "A replicated parameter is updated with a rank-dependent learning rate: "
            "replicas drift apart.",
            "the TP optimizer's parameter groups",
            "optimizer",
            "replicas_differ",
            i.replicated_lr_by_rank,
        ),
        Fault(
            "lr_times_world_on_last_rank",
            "The last rank steps its sharded parameters with lr x world (a learning rate scaled "
            "for the wrong parallel size).",
            "the TP optimizer's parameter groups on the last rank",
            "optimizer",
            "scaled_by_world",
            i.lr_times_world_on_last_rank,
            blocks=ALL_BLOCKS,
        ),
        Fault(
            "weight_decay_twice_on_sharded",
            "Sharded parameters get the decoupled weight decay twice per step (a wrapper "
            "decays what it shards).",
            "after each TP optimizer step, on sharded parameters",
            "optimizer",
            "decay",
            i.weight_decay_twice_on_sharded,
            blocks=ALL_BLOCKS,
            adaptive_only=True,
            pure_16bit=False,
        ),  # on pure 16-bit parameters 1 - lr * wd rounds to 1: a no-op
        Fault(
            "adam_l2_instead_of_adamw",
            "The TP side uses Adam with an L2 penalty in the gradient instead of "
            "AdamW's decoupled decay.",
            "the TP optimizer",
            "optimizer",
            "decay",
            i.adam_l2_instead_of_adamw,
            blocks=ALL_BLOCKS,
            adaptive_only=True,
        ),
        Fault(
            "tp_betas_differ",
            "The TP side's AdamW uses betas (0.9, 0.95) where the dense side uses (0.9, 0.999).",
            "the TP optimizer's hyperparameters",
            "optimizer",
            "scaled",
            i.tp_betas_differ,
            blocks=ALL_BLOCKS,
            adaptive_only=True,
        ),
        Fault(
            "state_reset_on_sharded",
            "The optimizer state of sharded parameters is dropped before every step "
            "(rebuilt on resharding).",
            "before each TP optimizer step, on sharded parameters",
            "optimizer",
            "mismatch",
            i.state_reset_on_sharded,
            blocks=ALL_BLOCKS,
            adaptive_only=True,
        ),
        Fault(
            "replicated_on_rank0_only",
            "Replicated parameters are in the optimizer on rank 0 only: the other "
            "ranks never update them.",
            "the TP optimizer's parameters on ranks > 0",
            "optimizer",
            "not_applied",
            i.replicated_on_rank0_only,
            blocks=("mlp", "attention", "layer", "lm"),
        ),
        Fault(
            "partial_sum_off_by_3pct",
            "The last rank's partial sum enters the row-parallel reduction 3% too "
            "large (one rank's shard off).",
            "forward all-reduce of the down projection, last rank's input",
            "forward",
            "mismatch",
            i.intercept(
                "all_reduce",
                "down",
                "forward",
                i.scale_partial(1.03),
                ranks=lambda r, w: r == w - 1,
            ),
            sequence_parallel=False,
            dtypes=("float32", "float16", "float64"),
        ),  # bfloat16 sees 10-20% (docs/tolerances.md)
        Fault(
            "norm_eps_differs",
            "The TP model's RMSNorm uses eps 1e-5 where the dense model uses 1e-6.",
            "every RMSNorm of the TP module",
            "forward",
            "mismatch",
            i.norm_eps(1e-5),
            blocks=("mlp", "attention", "layer", "lm"),
            dtypes=("float32", "float64"),
        ),  # a 5e-6 relative change: below 16-bit resolution
        Fault(
            "weight_cached_at_first_forward",
            "The gate/up projection keeps computing with the weights of its first "
            "forward (a stale cache).",
            "the column-parallel gate/up module",
            "forward",
            "mismatch",
            i.weight_cached_at_first_forward("gate_up"),
            dtypes=("float32", "float16", "float64"),
        ),  # one lr-1e-3 update: under a bfloat16 ulp of most weights
        Fault(
            "microbatch_losses_summed",
            "The TP side sums the micro-batch losses instead of averaging them: its grads are "
            "micro-batches times too large.",
            "the TP loss under gradient accumulation",
            "loss",
            "scaled_by_micro_batches",
            i.sum_microbatch_losses,
            blocks=ALL_BLOCKS,
            worlds=(2, 4, 8),
            min_micro_batches=2,
            micro_batches=3,
        ),  # 3: a sum over micro-batches stays apart from a sum over 2 or 4 ranks
        Fault(
            "grads_reduced_every_microbatch",
            "The partial grads of replicated parameters are all-reduced by a hook after every "
            "micro-batch, so what earlier micro-batches accumulated is summed "
            "over the ranks again.",
            "post-accumulate-grad hooks on the sequence-parallel norm weights",
            "grads",
            "grad_accumulation_reduced",
            i.reduce_grads_every_microbatch,
            blocks=("mlp", "attention", "layer", "lm"),
            sequence_parallel=True,
            min_micro_batches=2,
        ),
        Fault(
            "rng_not_forked",
            "The sharded region's dropout draws from a generator seeded the same on every rank "
            "(the model-parallel RNG not forked per rank): the masks of different shards "
            "are copies, correlated dropout.",
            "the model-parallel RNG tracker of the attention-probability dropout (and, under SP, "
            "of the hidden dropout)",
            "forward",
            "rng_not_forked",
            i.rng_not_forked,
            blocks=("attention", "layer", "lm"),
            overrides=DROPOUT,
        ),
        Fault(
            "rng_diverged",
            "The replicated region's dropout (after the row-parallel all-reduce) draws from a "
            "generator seeded by rank: the replicas draw different masks and drift apart.",
            "the hidden dropout after the row-parallel output",
            "forward",
            "rng_diverged",
            i.rng_diverged,
            blocks=("mlp", "attention", "layer", "lm"),
            overrides=DROPOUT,
            sequence_parallel=False,
        ),
        Fault(
            "clip_local_norm",
            "Gradient clipping takes the norm of each rank's own shards "
            "(torch.nn.utils.clip_grad_norm_ on the TP module): each rank clips by its own factor.",
            "the TP side's gradient clipping",
            "optimizer",
            "clip_local_norm",
            i.clip_with(i.clip_local_norm),
            clip_grad_norm=CLIP_NORM,
        ),
        Fault(
            "clip_replicated_counted",
            "Gradient clipping sums every parameter's squared norm over the ranks: the "
            "replicated ones (norm gains, the row-parallel bias) count tp times.",
            "the TP side's gradient clipping",
            "optimizer",
            "clip_replicated_counted",
            i.clip_with(i.clip_all_summed),
            clip_grad_norm=CLIP_NORM,
            dtypes=("float32", "float64"),
        ),  # 16 bits: the replicas' share of the norm is under the 8-ulp floor of a scalar's bound
        Fault(
            "collective_on_some_ranks",
            "A collective is issued on some ranks only (a rank-dependent branch): "
            "the others wait forever.",
            "forward all-reduce of the down projection skipped on ranks > 0",
            "hang",
            "hang",
            i.intercept("all_reduce", "down", "forward", i.skip, ranks=lambda r, w: r > 0),
            sequence_parallel=False,
        ),
    ]


CATALOGUE: dict[str, Fault] = {f.name: f for f in _entries()}


def get_fault(name: str) -> Fault:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise UsageError(
            f"unknown fault {name!r}; `tpcheck faults` lists them: {sorted(CATALOGUE)}"
        ) from None


def check_applies(spec: CaseSpec) -> Fault:
    """The spec's fault, or UsageError naming where it applies and the spec's block, world size,
    optimizer and dtype that it does not fit."""
    fault, run = get_fault(spec.fault), spec.settings
    if not fault.applies(
        spec.block, spec.world_size, run.optimizer, run.dtype, run.micro_batches, run.master_weights
    ):
        micro = (
            f" with >= {fault.min_micro_batches} micro-batches"
            if fault.min_micro_batches > 1
            else ""
        )
        masters = "" if fault.pure_16bit else " (16-bit: with master weights)"
        raise UsageError(
            f"fault {fault.name!r} applies to block(s) {list(fault.blocks)} at world sizes "
            f"{list(fault.worlds)}{' with AdamW' if fault.adaptive_only else ''} in "
            f"{list(fault.dtypes)}{masters}{micro}, not {spec.block!r} at {spec.world_size} with "
            f"{run.optimizer} in "
            f"{run.dtype}{'' if run.master_weights else ' without master weights'} with "
            f"{run.micro_batches} micro-batch(es)"
        )
    return fault


def apply_fault(case: Case, spec: CaseSpec) -> Case:
    fault = check_applies(spec)
    if fault.sequence_parallel is not None and spec.sequence_parallel != fault.sequence_parallel:
        need = "with" if fault.sequence_parallel else "without"
        raise UsageError(f"fault {fault.name!r} needs a case {need} sequence parallelism (--sp)")
    return fault.inject(case, spec)


__all__ = ["CATALOGUE", "Fault", "apply_fault", "check_applies", "get_fault"]
