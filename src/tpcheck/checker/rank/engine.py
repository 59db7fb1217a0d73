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

The engine holds the Case as it was handed and reads the plan from `Discovery` (checker/rank/
discover.py: a written plan, or the one inferred, step by step, for a case with none written).
Around this step loop: the random masks and the RNG placement check (checker/rank/rng.py, over
masks.py), the tensors applied on one rank only (applied_on.py), the evidence a rank sends
(evidence.py), the warm-up forwards before the first step, never compared (warmup.py).

Order of a step: for each micro-batch (the first preceded, with `Case.no_grad_forward`, by a forward
of every side without autograd, its output compared), dense and float64 forward/backward (capturing
the activations named in `plan.activations`), then the TP forward/backward, whose captured tensors
are compared as they are produced (local comparisons only, no collective inside the model's forward;
in the first micro-batch they are held until the placements of the module outputs the case does
not name are inferred), then a ledger sync and the RNG placement checks of the micro-batch's
random draws (rng.py), then the input gradients; then finalize_grads, (with an inferred plan, after
step 1: the parameters applied on one rank), grads, the checker's own collective (the replica
comparisons of the whole step), the replay of the dense optimizer rule on the TP side's inputs, the
optimizer steps, update and state against the replay, weights, buffers (buffers.py: at step 0 too),
and (but at the last step) the release of the step's evidence of the checks that passed on every
rank (evidence.py). At the last step, after its micro-batches, the forward in eval mode
(buffers.py: `eval_forward`).

A case that does not train (`RunSettings(train=False)`, no TP parameter that requires grad, or
`Case.decode_steps`) builds no optimizer and, after the weights, runs forward_only.py's loop instead
of these steps: every side's forward without autograd, and the decode passes through its KV cache.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time

import torch
from torch import nn

from tpcheck.checker.case import Case
from tpcheck.checker.payload import Check, RankPayload
from tpcheck.checker.rank import capture, evidence, training
from tpcheck.checker.rank.buffers import BufferChecks, eval_forward
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.discover import Discovery
from tpcheck.checker.rank.forward_only import ForwardOnly
from tpcheck.checker.rank.grad_evidence import GradEvidence
from tpcheck.checker.rank.ledger import CollectiveTap, sync_ledgers
from tpcheck.checker.rank.loading import (
    cast,
    check_names,
    leaf,
    load_from_dense,
    map_tensors,
    restart_in_place,
)
from tpcheck.checker.rank.manifest import manifest
from tpcheck.checker.rank.optimizer import AdaptiveSlack, Masters, Replay
from tpcheck.checker.rank.params import compare_params, compare_replay, compare_weights
from tpcheck.checker.rank.precision import keep_float64
from tpcheck.checker.rank.rng import RandomDraws, training_rng
from tpcheck.checker.rank.shard_ops import ShardOps
from tpcheck.checker.rank.sides import NoGrad, TPActivations, one_tensor, others_wait
from tpcheck.checker.rank.tolerance import Bound
from tpcheck.checker.rank.warmup import warm_up
from tpcheck.checker.sync import Rendezvous
from tpcheck.checker.usercode import defined_at, require_graph
from tpcheck.checker.vocabulary import NO_GRAD_OUTPUT
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.layers import finalize_grads
from tpcheck.plan import Plan, Replicate


def _in_float64(value, dtype: torch.dtype = torch.float64):
    """An optimizer state entry for the float64 truth: moment tensors in float64 (in `dtype`: the
    truth parameter's, float32 for a module the case keeps so), the rest (a scalar step tensor, a
    number) copied as they are."""
    if not torch.is_tensor(value):
        return value
    return (
        value.detach().clone().to(dtype)
        if value.is_floating_point() and value.dim()
        else value.clone()
    )


class Engine:
    """One case on one rank: the three models, their optimizers, and the comparator."""

    def __init__(
        self, case: Case, group: TPGroup, rendezvous: Rendezvous, wait_threads: int = 1
    ) -> None:
        assert isinstance(group.tap, CollectiveTap), (
            "the engine runs the TP side through the checker's tap"
        )
        self.case, self.group, self.tap, self.rendezvous = case, group, group.tap, rendezvous
        self.settings = case.run
        # threads for rank 0's float64 passes while the others wait
        self.wait_threads = wait_threads
        self.dtype = case.run.torch_dtype
        self.device = group.device
        self.cmp = Comparator(group, self.tap, self.dtype, case.run.dtype, case.run.uses_masters)
        # what a user's optimizer keeps out of sight: "state"/"update" -> parameter names
        self.unobserved: dict[str, dict] = {}
        # (step, module): the dense side's outputs captured (the manifest's count; manifest.py)
        self.produced: collections.Counter = collections.Counter()
        self.shard_ops = ShardOps(case.run.capture)  # reductions and splits of step 1: shard_ops.py
        try:
            self._build()
        except Exception as e:  # noqa: BLE001 - tell the other ranks before they issue a collective
            rendezvous.setup_failed(
                f"{type(e).__name__}: {e}" if not isinstance(e, UsageError) else str(e)
            )
            raise
        rendezvous.setup_done()
        self.discovery = Discovery(case, group, rendezvous, self.dense, self.tp)

    @property
    def plan(self) -> Plan:
        """The plan as known so far: written, or inferred as the run reveals it (discover.py)."""
        return self.discovery.plan

    def _build(self) -> None:
        case, group = self.case, self.group
        self.gen = torch.Generator().manual_seed(self.settings.seed)
        # the dense side's dropout masks and the checks of the TP side's draws (checker/rank/rng.py)
        self.draws = RandomDraws(
            self.settings.seed, case.dropout, self.cmp, self.rendezvous, self.device
        )
        self.first_batch = self._batch()  # drawn before the weights, as the seed
        master = case.build_dense(torch.float32)  # on the CPU, where the seeded init draws
        case.init(master, self.gen)
        self.dense = self._copy_of(master, self.dtype)
        if self.dtype == torch.float64:
            self.truth = self.dense
        else:
            self.truth = self._copy_of(self.dense, torch.float64) if group.rank == 0 else None
        if case.plan is not None:
            case.plan.check_against(self.dense, group.world_size)
        if case.inject.intercept is not None:
            self.tap.interceptor = case.inject.intercept(group)
        if case.setup is not None:
            case.setup(group)
        self.tp = case.build_tp(group, self.dtype)
        self._load_tp(master, case.plan, case.inject.load_plan)  # from the float32 master
        self.tp.to(self.device)
        if case.inject.tamper is not None:
            case.inject.tamper(self.tp, group)
        self.forward_only = ForwardOnly.of(case, self.tp)  # no optimizer: forward_only.py
        self.grad_evidence = GradEvidence()  # per-micro-batch grads, plan rules: grad_evidence.py
        if self.forward_only is None:
            self._build_optimizers()

    def _build_optimizers(self) -> None:
        """What each optimizer steps (the modules' own parameters, or their float32 masters; the
        user's TP optimizer, seen through it: training.py), the three optimizers over the case's
        rule, the replay of the rule on the TP side's inputs, and the allowance after adaptive
        steps (checker/rank/optimizer.py)."""
        case, group, rule = self.case, self.group, self._rule
        self.dense_master = Masters.of(self.dense, self.settings)
        self.opt_dense = rule(self.dense_master.named_parameters())
        if case.tp_optimizer is not None:
            self.opt_tp = case.tp_optimizer(self.tp, group)
            self.tp_master = training.UserOptimizer(self.tp, self.opt_tp)
            training.check_masters(self.tp_master, self.dense_master, self.settings)
        else:
            self.tp_master = Masters.of(self.tp, self.settings)
            self.opt_tp = (
                case.inject.tp_optimizer(self.tp_master.owner, group, self.settings.make_optimizer)
                if case.inject.tp_optimizer is not None
                else rule(self.tp_master.named_parameters())
            )
        has_truth = self.truth is not None and self.truth is not self.dense
        self.opt_truth = rule(self.truth.named_parameters()) if has_truth else None
        self.replay = Replay(self.tp_master.params, rule)
        adaptive = "betas" in self.opt_dense.defaults
        self.slack = (
            AdaptiveSlack(self.opt_dense, self.replay, self.opt_truth) if adaptive else None
        )

    def _rule(self, named_params) -> torch.optim.Optimizer:
        return self.case.make_rule(self.settings, named_params)

    def _load_tp(self, dense: nn.Module, plan: Plan | None, load_plan: Plan | None = None) -> None:
        """The TP module's weights from the dense ones, once, before the optimizers are built: the
        user's own `load_tp` when the case has one (checked at the weights stage, never overwritten;
        its names held to a written `plan`), else through `load_plan` (a fault's own
        loading) or `plan`."""
        if self.case.load_tp is None:
            load_from_dense(self.tp, dense, load_plan or plan, self.group)
            return
        if plan is not None:
            check_names(self.tp, dense, plan, self.group)
        # full tensors in float32 (float64 in a float64 run: the truth's own precision)
        full = torch.float64 if self.dtype == torch.float64 else torch.float32
        state = {name: p.detach().to(full).clone() for name, p in dense.named_parameters()}
        with torch.no_grad():
            self.case.load_tp(self.tp, state, self.group)

    def _copy_of(self, src: nn.Module, dtype: torch.dtype) -> nn.Module:
        """A dense model in `dtype` with `src`'s weights, on this rank's device."""
        model = self.case.build_dense(dtype)
        with torch.no_grad():
            for (_, p), (_, q) in zip(model.named_parameters(), src.named_parameters()):
                p.copy_(q.to(dtype))
        return model.to(self.device)

    def _batch(self):
        """The next batch: drawn by `make_batch` from the case's generator (on the CPU, so every
        device draws the same values), then on this rank's device."""
        inputs, target = self.case.make_batch(self.gen, self.dtype)
        move = lambda t: t.to(self.device)  # noqa: E731
        return map_tensors(move, inputs), map_tensors(move, target)

    def sync(self, where: str) -> None:
        sync_ledgers(self.tap, self.rendezvous, where)

    # ------------------------------------------------------------------ the run

    def run(self) -> list[Check]:
        load_tp = self.case.load_tp
        compare_weights(self, f"your load_tp ({defined_at(load_tp)})" if load_tp else None)
        self.buffers = BufferChecks.start(self)
        self.sync("loading the weights")
        self.cmp.flush_replicas()
        if self.forward_only is not None:
            self.forward_only.run(self)
            return self.cmp.checks
        self.warmed_up = warm_up(self)  # RunSettings.warmup: forwards before step 1, not compared
        for step in range(1, self.settings.steps + 1):
            self._step(step)
        return self.cmp.checks

    def _step(self, step: int) -> None:
        self._zero_grads()
        if step > 1:
            self._tp_from_dense()
        self._truth_from_dense(self.dense.named_parameters())
        for micro in range(self.settings.micro_batches):
            batch = self.first_batch if step == 1 and micro == 0 else self._batch()
            if micro == 0 and self.case.no_grad_forward:
                self._no_grad_forward(step, batch[0])
            self._forward_backward(step, micro, batch)
            self.grad_evidence.take(self)
        if step == self.settings.steps:
            eval_forward(self, step, batch[0])
        with self.tap.tp_phase("optimizer"):
            if hasattr(self.tp, "finalize_grads"):
                self.tp.finalize_grads()
            else:
                finalize_grads(self.tp, self.group)
        self.sync(f"finalize_grads of step {step}")
        if step == 1:
            self.discovery.infer_applied_on(self.tp)
        compare_params(
            self,
            step,
            "grads",
            dict(self.dense.named_parameters()),
            dict(self.tp.named_parameters()),
            lambda p: p.grad,
        )
        self.grad_evidence.annotate(self, step)
        self.cmp.flush_replicas()
        training.clip_grads(self, step)
        self.dense_master.take_grads()
        self.tp_master.take_grads()
        # the dense rule on the TP side's own weights and grads (as the user's optimizer was handed
        # them: after its step)
        if not self.tp_master.replay_after_step:
            self.replay.run(*self.tp_master.replay_inputs())
        self._truth_from_dense(self.dense_master.params.items(), self.opt_dense)
        for opt in self._optimizers():
            with self.tap.tp_phase("optimizer") if opt is self.opt_tp else contextlib.nullcontext():
                opt.step()
        if self.tp_master.replay_after_step:
            self.replay.run(*self.tp_master.replay_inputs())
        self.dense_master.write_back()
        self.tp_master.write_back()
        self.sync(f"optimizer step {step}")
        compare_replay(self, step)
        compare_params(
            self, step, "optimizer", self.dense_master.params, self.tp_master.params, lambda p: p
        )
        self.tp_master.check_copy_back(self, step)
        self.buffers.compare(step)
        self.cmp.flush_replicas()
        if step < self.settings.steps:  # the last step's are chosen with the whole run's
            self._release_evidence(step)

    def _forward_backward(self, step: int, micro: int, batch) -> None:
        case, group, cmp = self.case, self.group, self.cmp
        inputs, target = batch
        wanted = case.grad_input_names(inputs)  # the forward inputs whose gradients are checked
        book = self.draws.book()
        rec_d, rec_t, (kw_d, out_d, loss_d), (kw_t, out_t, loss_t) = self._reference_passes(
            inputs, target, wanted, book
        )
        self.produced.update(
            (step, n) for (s, n), ts in rec_d.tensors.items() if s == "forward" for _ in ts
        )
        acts = TPActivations(cmp, step, rec_d, rec_t, self.discovery)
        handles = (
            capture.attach(self.tp, self.discovery.capture_names(), acts, self.discovery.tp_modules)
            if self.settings.capture
            else []
        )
        kw_tp = self._tp_inputs(inputs, wanted)
        with training_rng(self.device, self.settings.seed, step, micro):
            noting = self.shard_ops.side("tp", self.tp, self.discovery.tp_modules)
            with self.tap.tp_phase("forward"), noting, self.draws.tp_masks(book, self.tp):
                out_tp = one_tensor(self.tp(**kw_tp), self.tp, "TP")
            # compared before the loss sees it: a loss may work in place on its input (Megatron's
            # vocab-parallel cross-entropy subtracts the max from the logits)
            cmp.compare(
                "forward", step, "output", out_tp.detach(), out_d, out_t, case.output_placement
            )
            require_graph(out_tp, "TP", self.tp)
            target_local = map_tensors(
                lambda t: case.target_placement.shard(
                    cast(t, self.dtype), group.rank, group.world_size
                ),
                target,
            )
            with self.tap.tp_phase("forward"):
                loss_tp = (
                    case.compute_tp_loss(out_tp, target_local, group) / self.settings.micro_batches
                )
            cmp.compare("loss", step, "loss", loss_tp.detach(), loss_d, loss_t, Replicate())
            with self.tap.tp_phase("backward"):
                loss_tp.backward()
        capture.detach_all(handles)
        self.sync(f"forward and backward of step {step}")
        acts.release()
        self.draws.check(step, book, f"the random draws of step {step}")
        self._compare_input_grads(step, wanted, kw_tp, kw_d, kw_t)
        # the replicas of every micro-batch are compared across ranks with the step's grads (one
        # checker all-reduce for all of them); each replica check keeps the place of
        # its tensor in the order

    def _reference_passes(self, inputs: dict, target, wanted: tuple, book):
        """The dense pass (drawing the micro-batch's masks into `book`) and the float64 truth's
        (replaying them), each capturing the activations: (dense recorder, truth recorder, (inputs,
        output, loss) of the dense side, the same of the truth). Where the truth is the dense model
        (a float64 run) it is the dense side's; on a rank that holds none, inputs without gradients
        and no output or loss."""
        rec_d = capture.Recorder()
        rec_t = capture.Calibrating(rec_d, self._truth_bound)
        with self.draws.watching(book):
            dense = self._reference_pass(
                self.dense,
                self.dtype,
                inputs,
                target,
                rec_d,
                wanted,
                self.draws.masks(book.draw, self.dense),
            )
        if self.truth is self.dense:
            return rec_d, rec_d, dense, dense
        if self.truth is None:
            return rec_d, rec_t, dense, ({k: NoGrad for k in dense[0]}, None, None)
        with others_wait(self.wait_threads):
            truth = self._reference_pass(
                self.truth,
                torch.float64,
                inputs,
                target,
                rec_t,
                wanted,
                self.draws.masks(book.replay, self.truth),
            )
        return rec_d, rec_t, dense, truth

    def _reference_pass(
        self, model: nn.Module, dtype: torch.dtype, inputs, target, recorder, wanted, masks
    ):
        case = self.case
        handles = (
            capture.attach(model, self.discovery.capture_names(), recorder)
            if self.settings.capture
            else []
        )
        kw = {k: leaf(cast(v, dtype), k in wanted) for k, v in inputs.items()}
        with self.shard_ops.side("dense" if model is self.dense else None, model), masks:
            out = one_tensor(model(**kw), model, "dense")
        require_graph(out, "dense", model)
        # as the model produced it: a loss may work in place on its input
        produced = capture.snapshot(out)
        loss = (
            case.loss(out, map_tensors(lambda t: cast(t, dtype), target))
            / self.settings.micro_batches
        )
        loss.backward()
        capture.detach_all(handles)
        return kw, produced, loss.detach()

    def _compare_input_grads(
        self, step: int, wanted: tuple, kw_tp: dict, kw_d: dict, kw_t: dict
    ) -> None:
        """The gradients of the forward inputs in `wanted`, TP against dense; an input that gets one
        on one side only, or on neither when the case names it in `grad_inputs`, is
        refused naming it."""
        case = self.case
        for k in wanted:
            if kw_tp[k].grad is None or kw_d[k].grad is None:
                if case.grad_inputs is None and kw_tp[k].grad is None and kw_d[k].grad is None:
                    # a floating input that no gradient reaches (a mask, say): nothing to check
                    continue
                side = (
                    "either side"
                    if kw_tp[k].grad is None and kw_d[k].grad is None
                    else "the TP side only"
                    if kw_tp[k].grad is None
                    else "the dense side only"
                )
                raise UsageError(
                    f"forward input {k!r} got no gradient on {side}: is it used in forward? "
                    "(grad_inputs lists the inputs whose gradients are checked)"
                )
            self.cmp.compare(
                "backward",
                step,
                f"grad:{k}",
                kw_tp[k].grad,
                kw_d[k].grad,
                kw_t[k].grad,
                case.input_placements.get(k, Replicate()),
            )

    def _zero_grads(self) -> None:
        for opt in self._optimizers():
            training.zero_grad(opt)
        # under master weights the optimizers hold the masters
        for model in (self.dense, self.tp, self.truth):
            if model is not None:
                model.zero_grad(set_to_none=True)

    def _release_evidence(self, step: int) -> None:
        """The evidence of `step`'s checks that passed on every rank goes back to the budget (one
        store exchange: evidence.py `needed_evidence`), for the later steps' tensors."""
        kept = self.cmp.evidence
        step_checks = [c for c in self.cmp.checks if c.step == step]
        kept.release(step, evidence.needed_evidence(step_checks, kept, self.rendezvous))

    def _tp_from_dense(self) -> None:
        """Every step after the first starts the TP side from the dense side's weights (and
        masters), written into its parameters in place through the plan (loading.py's
        `restart_in_place`; never through the user's `load_tp`, which loads once): each step is then
        checked from the same weights, so its forward, grads and update are held to the rounding of
        that step's own arithmetic. Nothing is lost: the previous step's update was compared with
        the dense rule element by element (the replay) and the weights with the dense ones. The TP
        optimizer's state and anything the TP module keeps besides its parameters (caches derived
        from the weights, buffers) are not touched: stale as in training, where nothing rebuilds
        them."""
        restart_in_place(self.tp, self.dense, self.plan, self.group)
        if self.tp_master.masters:
            source = self.dense_master if self.dense_master.masters else self.dense
            training.restart_masters(self.tp_master, source, self.plan, self.group)

    def _truth_from_dense(
        self, dense_params, dense_opt: torch.optim.Optimizer | None = None
    ) -> None:
        """The float64 truth restarts from the dense side at every step: its weights (before the
        forward: the weights the dense module computes with; before the optimizer step: what the
        dense optimizer steps, and that optimizer's state, in float64). So the dense side's distance
        to the truth is the rounding of this step's arithmetic only, never the dense trajectory's
        own drift (16-bit weights cannot follow lr-sized updates exactly: without the restart the
        reference's "error" after one step is of the order of the update itself, and every bound
        after it is vacuous)."""
        if self.opt_truth is None:
            return
        truth = dict(self.truth.named_parameters())
        with torch.no_grad():
            for name, p in dense_params:
                t = truth[name]
                t.copy_(p.detach().double())
                if dense_opt is not None and (state := dense_opt.state.get(p)):
                    self.opt_truth.state[t] = {k: _in_float64(v, t.dtype) for k, v in state.items()}

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.opt_dense, self.opt_tp, self.opt_truth) if o is not None]

    def _truth_bound(self, dense: torch.Tensor, truth: torch.Tensor) -> Bound | None:
        """The bound of a captured tensor, calibrated when the truth produces it against the dense
        side's copy (what `Comparator.compare` would calibrate later), so that no float64 copy is
        held; None (keep the copy) where the truth is not finite, for the comparison to name
        the bad reference."""
        bound = self.cmp.calibrated(dense, truth)
        return bound if math.isfinite(bound.value) else None

    def _tp_inputs(self, inputs: dict, wanted: tuple = ()) -> dict:
        """The TP side's forward inputs: each placed as
        `input_placements` says (Replicate by default)."""
        case, group = self.case, self.group
        return {
            k: leaf(
                case.input_placements.get(k, Replicate()).shard(
                    cast(v, self.dtype), group.rank, group.world_size
                ),
                k in wanted,
            )
            for k, v in inputs.items()
        }

    def _no_grad_forward(self, step: int, inputs: dict, name: str = NO_GRAD_OUTPUT) -> None:
        """The forward without autograd on every side, its output compared (`name`): TP code may
        take another path when no gradient is needed (local matmuls and a plain all-reduce instead
        of DTensor's autograd-aware ops), and that path is the one inference and evaluation run."""
        book = self.draws.book()
        with torch.no_grad():
            with self.draws.watching(book), self.draws.masks(book.draw, self.dense):
                out_d = one_tensor(
                    self.dense(**{k: cast(v, self.dtype) for k, v in inputs.items()}),
                    self.dense,
                    "dense",
                )
            if self.truth is self.dense:
                out_t = out_d
            elif self.truth is not None:
                with self.draws.masks(book.replay, self.truth), others_wait(self.wait_threads):
                    out_t = one_tensor(
                        self.truth(**{k: cast(v, torch.float64) for k, v in inputs.items()}),
                        self.truth,
                        "dense",
                    )
            else:
                out_t = None
            with (
                self.tap.tp_phase("forward"),
                training_rng(self.device, self.settings.seed, step, -1),
                self.draws.tp_masks(book, self.tp),
            ):
                out_tp = one_tensor(self.tp(**self._tp_inputs(inputs)), self.tp, "TP")
        self.cmp.compare("forward", step, name, out_tp, out_d, out_t, self.case.output_placement)
        self.draws.check(step, book, "the forward without autograd")


def run_case_on_rank(
    case: Case, group: TPGroup, rendezvous: Rendezvous, wait_threads: int = 1
) -> RankPayload:
    """Run `case` on this rank; returns its checks, ledger and evidence for the launcher.
    `wait_threads`: the intra-op threads rank 0 may use for its float64 passes while the other
    ranks wait for it."""
    t0 = time.perf_counter()
    with keep_float64(case.run.dtype == "float64"):  # a float64 run's own casts stay float64
        engine = Engine(case, group, rendezvous, wait_threads)
        checks = engine.run()
    kept = engine.cmp.evidence
    sent = kept.sent(evidence.needed_evidence(checks, kept, rendezvous))
    return RankPayload(
        status="ok",
        rank=group.rank,
        checks=checks,
        evidence=sent,
        expected_collectives=training.expected_collectives(case),
        inferred_plan=engine.discovery.as_code(),
        notes=training.notes(engine.unobserved) + engine.draws.notes() + engine.buffers.notes,
        forward_only=engine.forward_only.as_json() if engine.forward_only else None,
        warmed_up=engine.warmed_up,
        activations=engine.discovery.record(),
        shard_ops=engine.shard_ops.differing(),
        manifest=manifest(engine),
        ledger=list(engine.tap.ledger),
        seconds=time.perf_counter() - t0,
    )
