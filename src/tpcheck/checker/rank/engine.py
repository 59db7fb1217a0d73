"""The per-rank engine: run one Case on this rank, step by step, and compare every tensor through
the plan. Nothing here knows a layer: shapes and layouts come from the plan.

Three models run on every rank: the dense model in the working dtype, a float64 copy of it (the
ground truth that calibrates tolerances, held on rank 0 only: it is the largest of the three) and
the TP model. All start from the same weights, and every step after the first restarts the TP model
and the truth from the dense model's weights (through the plan; the TP parameters written in place,
the user's loader run once, so state derived from the weights goes stale as in training), so each
step is checked on its own arithmetic. Every rank measures its TP tensors against the dense ones;
rank 0 also measures the dense model's own error against float64, which sets each check's bound (the
parent fills in the bounds of the other ranks' checks from rank 0's, by `seq`). In a 16-bit run with
master weights each side's optimizer steps float32 masters (checker/rank/optimizer.py: `Masters`).

The engine is the step loop over stages, each a module beside it that receives the case's `Sides`
(sides.py: the three models, the comparator, the discovered plan, the settings; built once) and,
for the optimizer stages, its `Optimizers` (optimizer_stage.py): the weights and parameters
(params.py), the passes of every side (passes.py), the optimizer stage (optimizer_stage.py), the
buffers and the eval-mode forward (buffers.py), the warm-up forwards before the first step, never
compared (warmup.py), the forward-only run (forward_only.py), the manifest (manifest.py). No stage
imports the engine. The plan is read from `Discovery` (discover.py: a written plan, or the one
inferred, step by step, for a case with none written); around the loop: the random masks and the
RNG placement check (rng.py, over masks.py), the tensors applied on one rank only (applied_on.py),
the evidence a rank sends (evidence.py).

Order of a step: for each micro-batch (the first preceded, with `Case.no_grad_forward`, by a forward
of every side without autograd, its output compared), dense and float64 forward/backward (capturing
the activations named in `plan.activations`), then the TP forward/backward, whose captured tensors
are compared as they are produced (local comparisons only, no collective inside the model's forward;
in the first micro-batch they are held until the placements of the module outputs the case does
not name are inferred), then a ledger sync and the RNG placement checks of the micro-batch's
random draws (rng.py), then the input gradients; then finalize_grads, (after step 1: where the TP
side's gradients are read, `.grad` or the framework's accumulator, grad_source.py; with an inferred
plan, the parameters applied on one rank), grads, the checker's own collective (the replica
comparisons of the whole step), the clipping and the clipped gradients against the dense side's,
the replay of the dense optimizer rule on the TP side's inputs, the optimizer steps, update and
state against the replay, the optimizer moments against the dense optimizer's, weights, buffers
(buffers.py: at step 0 too), and (but at the last step) the release of the step's evidence of the
checks that passed on every rank (evidence.py). At the last step, after its micro-batches, the
forward in eval mode (buffers.py: `eval_forward`).

A case that does not train (`RunSettings(train=False)`, no TP parameter that requires grad, or
`Case.decode_steps`) builds no optimizer and, after the weights, runs forward_only.py's loop instead
of these steps: every side's forward without autograd, and the decode passes through its KV cache.
"""

from __future__ import annotations

import time

from tpcheck.checker.case import Case
from tpcheck.checker.payload import Check, RankPayload
from tpcheck.checker.rank import (
    case_threads,
    evidence,
    frozen,
    optimizer_stage,
    passes,
    shard_ops,
    torch_collectives,
    training,
)
from tpcheck.checker.rank.buffers import BufferChecks, eval_forward
from tpcheck.checker.rank.forward_only import ForwardOnly
from tpcheck.checker.rank.grad_evidence import GradEvidence
from tpcheck.checker.rank.manifest import manifest
from tpcheck.checker.rank.params import compare_params, compare_weights
from tpcheck.checker.rank.precision import keep_float64
from tpcheck.checker.rank.sides import Sides, build_sides
from tpcheck.checker.rank.warmup import warm_up
from tpcheck.checker.sourcelines import defined_at
from tpcheck.checker.sync import Rendezvous
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.layers import finalize_grads


class Engine:
    """One case on one rank: its sides, their optimizers, the step loop."""

    def __init__(self, sides: Sides) -> None:
        self.sides = sides
        self.forward_only = ForwardOnly.of(sides.case, sides.tp)  # no optimizer: forward_only.py
        self.grad_evidence = GradEvidence()  # per-micro-batch grads, plan rules: grad_evidence.py
        # parameters the TP side keeps frozen are frozen on the dense side too (frozen.py)
        self.frozen = frozen.follow_tp(sides) if self.forward_only is None else []
        self.opts = optimizer_stage.build(sides) if self.forward_only is None else None
        self.warmed_up = 0
        self.buffers: BufferChecks | None = None
        self.stopped: passes.Stopped | None = None  # a TP output no placement maps: passes.py

    def run(self) -> list[Check]:
        s = self.sides
        load_tp = s.case.load_tp
        compare_weights(s, f"your load_tp ({defined_at(load_tp)})" if load_tp else None)
        self.buffers = BufferChecks.start(s)
        s.sync("loading the weights")
        s.cmp.flush_replicas()
        try:
            if self.forward_only is not None:
                self.warmed_up = self.forward_only.run(s)
                return s.cmp.checks
            self.warmed_up = warm_up(s, train=True)  # RunSettings.warmup: not compared
            for step in range(1, s.settings.steps + 1):
                self._step(step)
        except passes.Stopped as stop:  # every rank stops at the same output (passes.py)
            self.stopped = stop
            if self.forward_only is not None:
                self.warmed_up = self.forward_only.warmed_up
            s.cmp.flush_replicas()
        return s.cmp.checks

    def _step(self, step: int) -> None:
        s, opts = self.sides, self.opts
        optimizer_stage.zero_grads(s, opts)
        if step > 1:
            optimizer_stage.restart_tp(s, opts)
        optimizer_stage.restart_truth(s, opts, s.dense.named_parameters())
        for micro in range(s.settings.micro_batches):
            batch = s.first_batch if step == 1 and micro == 0 else s.batch()
            if micro == 0 and s.case.no_grad_forward:
                passes.no_grad_forward(s, step, batch[0])
            passes.forward_backward(s, step, micro, batch)
            self.grad_evidence.take(s)
        if step == s.settings.steps:
            eval_forward(s, step, batch[0])
        with s.tap.tp_phase("optimizer"):
            if hasattr(s.tp, "finalize_grads"):
                s.tp.finalize_grads()
            else:
                finalize_grads(s.tp, s.group)
        s.sync(f"finalize_grads of step {step}")
        if step == 1:
            s.grad_of.settle(s.tp)
            s.discovery.infer_applied_on(s.tp, s.grad_of)
        dense, tp = dict(s.dense.named_parameters()), dict(s.tp.named_parameters())
        compare_params(s, opts, step, "grads", dense, tp, lambda p: p.grad, tp_get=s.grad_of)
        self.grad_evidence.annotate(s, step)
        s.cmp.flush_replicas()
        optimizer_stage.stage(s, opts, step)
        self.buffers.compare(step)
        s.cmp.flush_replicas()
        if step < s.settings.steps:  # the last step's are chosen with the whole run's
            self._release_evidence(step)

    def _release_evidence(self, step: int) -> None:
        """The evidence of `step`'s checks that passed on every rank goes back to the budget (one
        store exchange: evidence.py `needed_evidence`), for the later steps' tensors."""
        cmp = self.sides.cmp
        step_checks = [c for c in cmp.checks if c.step == step]
        kept = cmp.evidence
        kept.release(step, evidence.needed_evidence(step_checks, kept, self.sides.rendezvous))

    def payload(self, checks: list[Check], seconds: float) -> RankPayload:
        """What this rank sends the parent: its checks, the evidence the failures need, and what
        the report says of the run."""
        s, opts = self.sides, self.opts
        kept = s.cmp.evidence
        unobserved = opts.unobserved if opts is not None else {}
        return RankPayload(
            status="ok",
            rank=s.group.rank,
            checks=checks,
            evidence=kept.sent(evidence.needed_evidence(checks, kept, s.rendezvous)),
            expected_collectives=training.expected_collectives(s.case),
            inferred_plan=s.discovery.as_code(),
            notes=self.frozen
            + (opts.notes if opts is not None else [])
            + training.notes(unobserved)
            + s.grad_of.notes()
            + s.draws.notes()
            + s.twin.notes
            + self.buffers.notes
            + torch_collectives.replaced()
            + ([self.stopped.note] if self.stopped is not None else []),
            forward_only=self.forward_only.as_json() if self.forward_only else None,
            warmed_up=self.warmed_up,
            activations=s.discovery.record(),
            shard_ops=shard_ops.packed(
                s.shard_ops.differing(),
                s.plan,
                {n: tuple(p.shape) for n, p in s.dense.named_parameters()},
            ),
            code_paths=s.shard_ops.sites if s.group.rank == 0 else None,
            manifest=manifest(s, self.forward_only, opts, self.stopped),
            ledger=list(s.tap.ledger),
            seconds=seconds,
        )


def run_case_on_rank(
    case: Case, group: TPGroup, rendezvous: Rendezvous, wait_threads: int = 1
) -> RankPayload:
    """Run `case` on this rank; returns its checks, ledger and evidence for the launcher.
    `wait_threads`: the intra-op threads rank 0 may use for its float64 passes while the other
    ranks wait for it."""
    t0 = time.perf_counter()
    # a float64 run's own casts stay float64; torch.distributed's collectives as the case found
    # them afterwards (a replacement made by its setup or build_tp does not outlive it)
    with (
        keep_float64(case.run.dtype == "float64") as float64_mode,
        torch_collectives.kept(),
        case_threads.watched(),
    ):
        engine = Engine(build_sides(case, group, rendezvous, wait_threads))
        if float64_mode is not None:  # the models built: the code's accumulators keep float64
            float64_mode.factories = True
        checks = engine.run()
        payload = engine.payload(checks, time.perf_counter() - t0)
        if left := case_threads.running():  # never into the next case: the pool is replaced
            payload.notes.append(case_threads.note(left))
            payload.threads_left = len(left)
        return payload
