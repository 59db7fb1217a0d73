"""The per-rank engine: run one Case on this rank, step by step, and compare every tensor through
the plan. Nothing here knows a layer: shapes and layouts come from the plan.

Three models run on every rank: the dense model in the working dtype, a float64 copy of it (the
ground truth that calibrates tolerances, held on rank 0 only: it is the largest of the three) and the
TP model. All start from the same weights, and every step after the first restarts the TP model and
the truth from the dense model's weights (through the plan), so each step is checked on its own
arithmetic. Every rank measures its TP tensors against the dense ones; rank 0 also measures the dense
model's own error against float64, which sets each check's bound (the parent fills in the bounds of
the other ranks' checks from rank 0's, by `seq`). In a 16-bit run with master weights each side's
optimizer steps float32 masters (checker/rank/optimizer.py: `Masters`).

Order of a step: for each micro-batch (the first preceded, with `Case.no_grad_forward`, by a forward of
every side without autograd, its output compared), dense and float64 forward/backward (capturing the activations
named in `plan.activations`), then the TP forward/backward, whose captured tensors are compared as they
are produced (local comparisons only, no collective inside the model's forward), then a ledger sync and
the RNG placement checks of the micro-batch's random draws (dropout: each mask drawn by the dense side,
replayed by the truth and, part by part, by the TP side; checker/rank/masks.py); then grads, the checker's
own collective (the replica comparisons of the whole step), the replay of the dense optimizer rule on
the TP side's inputs, the optimizer steps, update and state against the replay, weights.
"""
from __future__ import annotations

import array
import base64
import contextlib
import dataclasses
import hashlib
import json
import math
import time

import torch
import torch.distributed as dist
from torch import nn

from tpcheck.checker.case import Case
from tpcheck.checker.devices import rng_states, seed_rng
from tpcheck.checker.payload import Check, RankPayload, evidence_key
from tpcheck.checker.rank import activations, capture
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.inference import infer_plan, plan_as_code
from tpcheck.checker.rank.ledger import CollectiveTap, sync_ledgers
from tpcheck.checker.rank.loading import cast, check_names, leaf, load_from_dense, map_tensors, maxdiff
from tpcheck.checker.rank.masks import DIFFER, REASONS, MaskBook, violations
from tpcheck.checker.rank.optimizer import AdaptiveSlack, Masters, Replay
from tpcheck.checker.rank.tolerance import Bound
from tpcheck.checker.sync import Rendezvous
from tpcheck.checker.usercode import defined_at
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.layers import finalize_grads
from tpcheck.plan import AppliedOnRank, Placement, Replicate

NONDETERMINISTIC = (
    "the dense model drew random numbers in its forward or backward other than through the calls tpcheck "
    "replays (F.dropout and nn.Dropout, F.scaled_dot_product_attention's dropout_p, torch.bernoulli and "
    "Tensor.bernoulli_): a mask drawn with torch.rand/rand_like, say. Its masks and the TP model's would differ "
    "and no tensor could be compared element by element; draw the mask with torch.bernoulli or F.dropout, or "
    "disable the randomness for the check, see docs/case-files.md#dropout")


def _in_float64(value):
    """An optimizer state entry for the float64 truth: moment tensors in float64, the rest (a scalar
    step tensor, a number) copied as they are."""
    if not torch.is_tensor(value):
        return value
    return value.detach().clone().double() if value.is_floating_point() and value.dim() else value.clone()


def _one_tensor(out, model: nn.Module, side: str) -> torch.Tensor:
    """A module's forward output, which must be one tensor: the checker compares it and hands it to the
    loss. Anything else is refused naming the module's forward and what it returned."""
    if isinstance(out, torch.Tensor):
        return out
    what = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list, dict)) else type(out).__name__
    raise UsageError(f"the {side} module's forward ({defined_at(model.forward)}) returned {what}, not a tensor: "
                     "tpcheck compares one output tensor and hands it to the loss; return that tensor (a model that "
                     "returns a tuple, a dict or a ModelOutput: wrap it in a module whose forward returns the output "
                     "you train on, its logits say)")


@contextlib.contextmanager
def others_wait(more: int):
    """Around rank 0's float64 passes: every other rank is then blocked at the TP side's first collective,
    so rank 0 may compute on their CPUs too (`more` threads, the pool's `threads_while_others_wait`; one
    thread per rank is otherwise all a rank has). The truth's float64 sums may then be ordered
    differently, which moves a bound by ~1e-16 of itself; the compared sides never run on more threads
    than the rank's own."""
    mine = torch.get_num_threads()
    if more <= mine:
        yield
        return
    torch.set_num_threads(more)
    try:
        yield
    finally:
        torch.set_num_threads(mine)


class _NoGrad:
    """Stands for a float64 input on ranks that hold no float64 model."""

    grad = None


class Engine:
    """One case on one rank: the three models, their optimizers, and the comparator."""

    def __init__(self, case: Case, group: TPGroup, rendezvous: Rendezvous, wait_threads: int = 1) -> None:
        assert isinstance(group.tap, CollectiveTap), "the engine runs the TP side through the checker's tap"
        self.case, self.group, self.tap, self.rendezvous = case, group, group.tap, rendezvous
        self.settings = case.run
        self.wait_threads = wait_threads  # threads for rank 0's float64 passes while the others wait
        self.dtype = case.run.torch_dtype
        self.device = group.device
        self.cmp = Comparator(group, self.tap, self.dtype, case.run.dtype)
        try:
            self._build()
        except Exception as e:  # noqa: BLE001 - tell the other ranks before they issue a collective
            rendezvous.setup_failed(f"{type(e).__name__}: {e}" if not isinstance(e, UsageError) else str(e))
            raise
        rendezvous.setup_done()
        self.plan_inferred = case.plan is None
        # activation placements inferred in the first micro-batch (no plan written, none named)
        self.acts_pending = case.plan is None and not case.activations and self.settings.capture
        self.act_candidates = activations.candidates(self.dense, self.tp) if self.acts_pending else set()
        self.acts_skipped: dict[str, str] = {}
        if case.plan is None:  # no plan written: inferred from what the user's loader put there
            plan = infer_plan(self.tp, self.dense, rendezvous, group.rank, group.world_size)
            plan = dataclasses.replace(plan, activations=dict(case.activations))
            plan.check_against(self.dense, group.world_size)
            self.case = dataclasses.replace(case, plan=plan, activations={})

    def _build(self) -> None:
        case, group = self.case, self.group
        self.gen = torch.Generator().manual_seed(self.settings.seed)
        # the dense side's dropout masks (checker/rank/masks.py): its own generator, the same on every rank
        self.mask_gen = torch.Generator().manual_seed(self.settings.seed + 1)
        # whether the model draws random masks: known after the first dense forward, which always runs under
        # the mask book; without draws the later forwards skip its interception (~10% of a tiny check), and a
        # draw after all is still refused by the dense side's RNG check (NONDETERMINISTIC)
        self.draws_random: bool | None = None
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
        self.tp = case.build_tp(group, self.dtype)
        self._load_tp(self.tp, master, case.inject.load_plan or case.plan)  # from the float32 master
        self.tp.to(self.device)
        if case.inject.tamper is not None:
            case.inject.tamper(self.tp, group)
        # what each optimizer steps: the modules' own parameters, or their float32 masters
        self.dense_master, self.tp_master = Masters.of(self.dense, self.settings), Masters.of(self.tp, self.settings)
        self.opt_dense = self.settings.make_optimizer(self.dense_master.parameters())
        if case.inject.tp_optimizer is not None:
            self.opt_tp = case.inject.tp_optimizer(self.tp_master.owner, group, self.settings.make_optimizer)
        else:
            self.opt_tp = self.settings.make_optimizer(self.tp_master.parameters())
        has_truth = self.truth is not None and self.truth is not self.dense
        self.opt_truth = self.settings.make_optimizer(self.truth.parameters()) if has_truth else None
        self.replay = Replay(self.tp_master.params, self.settings.make_optimizer)
        self.slack = AdaptiveSlack(self.opt_dense, self.replay, self.opt_truth) \
            if self.settings.optimizer != "sgd" else None

    def _load_tp(self, tp: nn.Module, dense: nn.Module, plan) -> None:
        """The TP module's weights from the dense ones: the user's own `load_tp` when the case has one
        (checked at the weights stage, never overwritten), else through the plan."""
        if self.case.load_tp is None:
            load_from_dense(tp, dense, plan, self.group)
            return
        if self.case.plan is not None:
            check_names(tp, dense, self.case.plan)
        state = {name: p.detach().float().clone() for name, p in dense.named_parameters()}
        with torch.no_grad():
            self.case.load_tp(tp, state, self.group)

    def _copy_of(self, src: nn.Module, dtype: torch.dtype) -> nn.Module:
        """A dense model in `dtype` with `src`'s weights, on this rank's device."""
        model = self.case.build_dense(dtype)
        with torch.no_grad():
            for (_, p), (_, q) in zip(model.named_parameters(), src.named_parameters()):
                p.copy_(q.to(dtype))
        return model.to(self.device)

    def _batch(self):
        """The next batch: drawn by `make_batch` from the case's generator (on the CPU, so every device
        draws the same values), then on this rank's device."""
        inputs, target = self.case.make_batch(self.gen, self.dtype)
        move = lambda t: t.to(self.device)  # noqa: E731
        return map_tensors(move, inputs), map_tensors(move, target)

    def sync(self, where: str) -> None:
        sync_ledgers(self.tap, self.rendezvous, where)

    # ------------------------------------------------------------------ the run

    def run(self) -> list[Check]:
        case = self.case
        tp_params = dict(self.tp.named_parameters())
        loader = f"as loaded by your load_tp ({defined_at(case.load_tp)})" if case.load_tp is not None else None
        for name, p in self.dense.named_parameters():
            check = self.cmp.compare("weights", 0, f"param:{name}", tp_params[case.plan.tp_name(name)].detach(),
                                     p.detach(), p.detach(), case.plan.params[name], exact=True)
            if loader:
                check.reason = f"bitwise: the plan's shard, {loader}"
        self.sync("loading the weights")
        self.cmp.flush_replicas()
        for step in range(1, self.settings.steps + 1):
            self._step(step)
        return self.cmp.checks

    def _step(self, step: int) -> None:
        for opt in self._optimizers():
            opt.zero_grad(set_to_none=True)
        for model in (self.dense, self.tp, self.truth):  # under master weights the optimizers hold the masters
            if model is not None:
                model.zero_grad(set_to_none=True)
        if step > 1:
            self._tp_from_dense()
        self._truth_from_dense(self.dense.named_parameters())
        for micro in range(self.settings.micro_batches):
            batch = self.first_batch if step == 1 and micro == 0 else self._batch()
            if micro == 0 and self.case.no_grad_forward:
                self._no_grad_forward(step, batch[0])
            self._forward_backward(step, micro, batch)
        with self.tap.tp_phase("optimizer"):
            if hasattr(self.tp, "finalize_grads"):
                self.tp.finalize_grads()
            else:
                finalize_grads(self.tp, self.group)
        self.sync(f"finalize_grads of step {step}")
        if step == 1 and self.plan_inferred:
            self._infer_applied_on()
        self._compare_params(step, "grads", dict(self.dense.named_parameters()), dict(self.tp.named_parameters()),
                             lambda p: p.grad)
        self.cmp.flush_replicas()
        self.dense_master.take_grads()
        self.tp_master.take_grads()
        self.replay.run(self.tp_master.params)  # the dense rule on the TP side's own weights and grads
        self._truth_from_dense(self.dense_master.params.items(), self.opt_dense)
        for opt in self._optimizers():
            with self.tap.tp_phase("optimizer") if opt is self.opt_tp else contextlib.nullcontext():
                opt.step()
        self.dense_master.write_back()
        self.tp_master.write_back()
        self.sync(f"optimizer step {step}")
        self._compare_replay(step, self.tp_master.params)
        self._compare_params(step, "optimizer", self.dense_master.params, self.tp_master.params, lambda p: p)
        self.cmp.flush_replicas()

    def _infer_applied_on(self) -> None:
        """With an inferred plan: a parameter inferred Replicate() that gets a gradient on one rank only
        is applied on that rank, AppliedOnRank(r) (a row-parallel bias added before the all-reduce). The
        values cannot tell the two apart, the first step's gradients can; the ranks agree through the
        store. A gradient that is zero rather than absent on the other ranks is not inferred (the
        grads stage then compares it as a replica)."""
        plan, group = self.case.plan, self.group
        if group.world_size == 1:
            return
        tp_params = dict(self.tp.named_parameters())
        names = [n for n, p in plan.params.items() if isinstance(p, Replicate)]
        mine = [n for n in names if tp_params[plan.tp_name(n)].grad is not None]
        said = [set(json.loads(t)) for t in self.rendezvous.exchange("applied", json.dumps(mine),
                                                                      label="inferring the plan")]
        applied = {}
        for name in names:
            holders = [r for r, got in enumerate(said) if name in got]
            if len(holders) == 1:
                applied[name] = AppliedOnRank(holders[0])
        if applied:
            plan = dataclasses.replace(plan, params={**plan.params, **applied})
            self.case = dataclasses.replace(self.case, plan=plan)

    def inferred_plan(self) -> str | None:
        """The plan of a case with no plan written, as inferred (parameters, then where the gradients
        appear, then the activations), as code; None for a written plan."""
        return plan_as_code(self.case.plan, self.acts_skipped) if self.plan_inferred else None

    def _owner_bound(self, step: int, stage: str, name: str, owner: int, p, truth_p, dense_val,
                     truth_val) -> Bound | None:
        """The bound for a tensor applied on a rank other than 0 (AppliedOnRank(r)): only rank r compares
        its gradient and update, only rank 0 holds the float64 truth that bounds them. Rank 0 computes the
        bound as rank r would (the truth relaxed as in `_compare_params`) and sends it through the store;
        rank r gets it, the others None."""
        group = self.group
        text = ""
        if truth_val is not None:
            truth = truth_val.detach()
            if stage == "optimizer" and self.slack is not None:
                truth = self.slack.relax_truth(p, truth_p, truth)
            text = json.dumps(dataclasses.asdict(self.cmp.calibrated(dense_val.detach(), truth, dense_val.dtype)))
        said = self.rendezvous.exchange("bound", text, label=f"the bound of {name} ({stage}, step {step})")
        return Bound(**json.loads(said[0])) if group.rank == owner and said[0] else None  # else: no verdict

    def _not_applied_here(self, step: int, stage: str, name: str, tp_val, dense_val, owner: int) -> None:
        """A tensor held on every rank but applied on `owner` only (AppliedOnRank): on the other ranks its
        gradient must be absent or zero (else it was applied here too); its weight is not stepped by the
        optimizer here, so it has nothing to compare after the step (each step restarts from the dense
        weights)."""
        if stage != "grads" or dense_val is None:
            return
        zeros = torch.zeros_like(dense_val)
        mine = tp_val.detach() if tp_val is not None else zeros.to(self.dtype)
        self.cmp.compare_local(stage, step, f"grad:{name}", mine, zeros.to(mine.dtype), _ALONE,
                               f"bitwise: zero, the tensor is applied on rank {owner} only")

    def _compare_replay(self, step: int, tp_params: dict) -> None:
        """The TP optimizer's state and update against the replay's, bitwise, parameter by parameter: the
        state first (a wrong moment is the cause, a wrong update its effect), tensors before the step
        count. State the TP optimizer lacks counts as zeros (nothing was accumulated)."""
        plan = self.case.plan
        for name in (n for n, _ in self.dense.named_parameters()):
            tp_name = plan.tp_name(name)
            p = tp_params[tp_name]
            if p.grad is None:
                continue
            placement = plan.params[name]
            own = self.opt_tp.state.get(p, {})
            for key, ref in sorted(self.replay.state(tp_name).items(), key=lambda kv: kv[1].dim() == 0):
                mine = own.get(key)
                if mine is None:
                    mine = torch.zeros_like(ref)
                elif not isinstance(mine, torch.Tensor) or mine.shape != ref.shape:
                    mine = torch.full_like(ref, float("nan"))  # misshapen state: never equal
                self.cmp.compare_local("optimizer", step, f"state:{name}.{key}", mine.detach(), ref, placement,
                                       f"bitwise: the TP optimizer's {key} against the replay's",
                                       weights=self.replay.before[tp_name])
            self.cmp.compare_local("optimizer", step, f"update:{name}", p.detach() - self.replay.before[tp_name],
                                   self.replay.update(tp_name), placement,
                                   "bitwise: the dense update rule replayed on this rank's TP weights and grads",
                                   weights=self.replay.params[tp_name].detach())

    def _tp_from_dense(self) -> None:
        """Every step after the first starts the TP side from the dense side's weights (and masters),
        through the plan, as the first step does: each step is then checked from the same weights, so its
        forward, grads and update are held to the rounding of that step's own arithmetic. Nothing is
        lost: the previous step's update was compared with the dense rule element by element (the
        replay) and the weights with the dense ones; the TP optimizer's state and anything the TP module
        keeps besides its parameters (caches, buffers) are not touched."""
        self._load_tp(self.tp, self.dense, self.case.plan)
        if self.tp_master.masters:
            load_from_dense(self.tp_master, self.dense_master, self.case.plan, self.group)

    def _truth_from_dense(self, dense_params, dense_opt: torch.optim.Optimizer | None = None) -> None:
        """The float64 truth restarts from the dense side at every step: its weights (before the forward:
        the weights the dense module computes with; before the optimizer step: what the dense optimizer
        steps, and that optimizer's state, in float64). So the dense side's distance to the truth is the
        rounding of this step's arithmetic only, never the dense trajectory's own drift (16-bit weights
        cannot follow lr-sized updates exactly: without the restart the reference's "error" after one
        step is of the order of the update itself, and every bound after it is vacuous)."""
        if self.opt_truth is None:
            return
        truth = dict(self.truth.named_parameters())
        with torch.no_grad():
            for name, p in dense_params:
                t = truth[name]
                t.copy_(p.detach().double())
                if dense_opt is not None and (state := dense_opt.state.get(p)):
                    self.opt_truth.state[t] = {k: _in_float64(v) for k, v in state.items()}

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.opt_dense, self.opt_tp, self.opt_truth) if o is not None]

    def _capture_names(self) -> set[str]:
        """The module outputs captured: the plan's activations, or, while they are being inferred, every
        module both models have (checker/rank/activations.py)."""
        return self.act_candidates if self.acts_pending else set(self.case.plan.activations)

    def _infer_activations(self, rec_d: capture.Recorder, held: list) -> None:
        """The activation placements of a case with no plan written, from the first micro-batch's shapes and
        whether each output is the same on every rank (checker/rank/activations.py); the ranks agree through the
        store. The inferred plan then carries them, and says which outputs are not checked and why."""
        mine = activations.seen([(stage, name, t) for stage, name, t, _ in held])
        said = activations.exchange(self.rendezvous, mine)
        dense = {name: q[0] for (stage, name), q in rec_d.tensors.items() if stage == "forward" and q}
        dense_shapes = {name: tuple(t.shape) for name, t in dense.items()}
        partial = set()
        if names := activations.differing(dense_shapes, said):  # summed over the ranks: partial sums?
            first = {}
            for stage, name, t, _ in held:
                if stage == "forward":
                    first.setdefault(name, t)
            both = torch.cat([first[n].double().reshape(-1).cpu() for n in names])  # gloo: a checker collective
            self.tap.performing(("all_reduce", "checker:activations", "forward"), dist.all_reduce, both,
                                group=self.group.pg)
            sums = both.split([dense[n].numel() for n in names])
            partial = {n for n, summed in zip(names, sums) if activations.is_partial_sum(summed, dense[n].reshape(-1).cpu())}
        placed, skipped = activations.decide(dense_shapes, said, self.case.plan, self.group.world_size, partial,
                                             activations.row_split_linears(self.dense, self.case.plan))
        plan = dataclasses.replace(self.case.plan, activations=placed)
        self.case = dataclasses.replace(self.case, plan=plan)
        self.acts_skipped = skipped
        self.acts_pending = False

    def _reference_pass(self, model: nn.Module, dtype: torch.dtype, inputs, target, recorder, wanted, masks):
        case = self.case
        handles = capture.attach(model, self._capture_names(), recorder) if self.settings.capture else []
        kw = {k: leaf(cast(v, dtype), k in wanted) for k, v in inputs.items()}
        with masks:
            out = _one_tensor(model(**kw), model, "dense")
        produced = capture.snapshot(out)  # as the model produced it: a loss may work in place on its input
        loss = case.loss(out, map_tensors(lambda t: cast(t, dtype), target)) / self.settings.micro_batches
        loss.backward()
        capture.detach_all(handles)
        return kw, produced, loss.detach()

    def _truth_bound(self, dense: torch.Tensor, truth: torch.Tensor) -> Bound | None:
        """The bound of a captured tensor, calibrated when the truth produces it against the dense side's
        copy (what `Comparator.compare` would calibrate later), so that no float64 copy is held; None (keep
        the copy) where the truth is not finite, for the comparison to name the bad reference."""
        bound = self.cmp.calibrated(dense, truth)
        return bound if math.isfinite(bound.value) else None

    def _tp_inputs(self, inputs: dict, wanted: tuple = ()) -> dict:
        """The TP side's forward inputs: each placed as `input_placements` says (Replicate by default)."""
        case, group = self.case, self.group
        return {k: leaf(case.input_placements.get(k, Replicate()).shard(cast(v, self.dtype), group.rank,
                                                                          group.world_size), k in wanted)
                for k, v in inputs.items()}

    def _no_grad_forward(self, step: int, inputs: dict) -> None:
        """The forward without autograd on every side, its output compared ("output:no_grad"): TP code may
        take another path when no gradient is needed (local matmuls and a plain all-reduce instead of
        DTensor's autograd-aware ops), and that path is the one inference and evaluation run."""
        book = MaskBook(self.mask_gen, self.case.dropout)
        with torch.no_grad():
            rng = rng_states(self.device)
            with self._masks(book.draw, self.dense):
                out_d = _one_tensor(self.dense(**{k: cast(v, self.dtype) for k, v in inputs.items()}), self.dense,
                                    "dense")
            self._drew(book, rng)
            if self.truth is self.dense:
                out_t = out_d
            elif self.truth is not None:
                with self._masks(book.replay, self.truth), others_wait(self.wait_threads):
                    out_t = _one_tensor(self.truth(**{k: cast(v, torch.float64) for k, v in inputs.items()}),
                                        self.truth, "dense")
            else:
                out_t = None
            with self.tap.tp_phase("forward"), self._training_rng(step, -1), self._tp_masks(book):
                out_tp = _one_tensor(self.tp(**self._tp_inputs(inputs)), self.tp, "TP")
        self.cmp.compare("forward", step, "output:no_grad", out_tp, out_d, out_t, self.case.output_placement)
        self._check_draws(step, book, "the forward without autograd")

    @contextlib.contextmanager
    def _training_rng(self, step: int, micro: int):
        """The default generators (the CPU's, and the GPU's on "cuda") as a training script leaves them for
        the TP side: seeded the same on every rank (what a replicated region draws from), whatever the
        checker drew before; restored after."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            seed_rng(self.device, (self.settings.seed + 7919 * step + 104729 * (micro + 2)) % 2**63)
            yield

    def _tp_masks(self, book: MaskBook):
        if self.draws_random is False:
            return contextlib.nullcontext()
        return book.tp(self.tp, self.group.rank, self.group.world_size, self.cmp.next_seq)

    def _masks(self, role, model: nn.Module):
        """The dense side's draws (`book.draw`) or the truth's replay, unless the model draws nothing."""
        return contextlib.nullcontext() if self.draws_random is False else role(model)

    def _drew(self, book: MaskBook, rng_before: tuple) -> None:
        """After a dense forward: random draws other than the replayed ones are refused; the first forward
        tells whether the model draws at all."""
        if not all(map(torch.equal, rng_before, rng_states(self.device))):
            raise UsageError(NONDETERMINISTIC)
        if self.draws_random is None:
            self.draws_random = bool(book.draws)

    def _check_draws(self, step: int, book: MaskBook, where: str) -> None:
        """The RNG placement checks of one forward's random draws (checker/rank/masks.py): every rank's draws are
        exchanged through the rendezvous store (not a collective) and each of this rank's is held to its
        region's rule against the others'; a draw that did not match the dense side's fails as it is. Only
        where the dense side drew (the same on every rank, so every rank exchanges or none does)."""
        if not book.draws:
            for d in book.tp_draws:
                self.cmp.record_rng(step, f"rng:{d.label}", d.seq, 1, d.problem or "", d.placement,
                                    {"rule": d.rule, "ranks": [], "problem": d.problem})
            return
        said = self.rendezvous.exchange("rng", json.dumps([d.as_json() for d in book.tp_draws]), label=where)
        everyone = [json.loads(text) for text in said]
        me = self.group.rank
        for k, d in enumerate(book.tp_draws):
            short = [r for r, theirs in enumerate(everyone) if len(theirs) <= k]
            problem = d.problem or (f"rank(s) {short} drew fewer random masks in this forward than rank {me}"
                                    if short else None)
            if problem or d.rule is None:
                self.cmp.record_rng(step, f"rng:{d.label}", d.seq, 1 if problem else 0, problem or
                                    "one rank: no RNG placement to check", d.placement,
                                    {"rule": d.rule, "ranks": short, "problem": problem})
                continue
            states, masks = [t[k][2] for t in everyone], [t[k][3] for t in everyone]
            bad = violations(d.rule, states, masks, me)
            self.cmp.record_rng(step, f"rng:{d.label}", d.seq, len(bad), REASONS[d.rule], d.placement,
                                {"rule": d.rule, "ranks": bad, "problem": None})
            self._rng_control(step, d, states, masks)
        if len(book.tp_draws) < len(book.draws):  # masks the dense side applied and the TP side never drew
            missed = book.draws[len(book.tp_draws)]
            problem = (f"the dense side drew {len(book.draws)} random mask(s) in this forward, the TP side "
                       f"{len(book.tp_draws)} on rank {me}: none where the dense side drew at {missed.label}")
            self.cmp.record_rng(step, f"rng:{missed.label}", self.cmp.next_seq(), 1, problem, "?",
                                {"rule": None, "ranks": [], "problem": problem})

    def _rng_control(self, step: int, d, states: list, masks: list) -> None:
        """The self-test of the RNG rule, once per step: the exchanged draws with one rank's planted to break
        the rule (a copy of this rank's draw on a sharded region, another state on a replicated one) go
        through `violations` and are recorded like the real check; it must fail."""
        key = ("forward", step, "rng")
        if key in self.cmp.controlled:
            return
        self.cmp.controlled.add(key)
        me, other = self.group.rank, (self.group.rank + 1) % len(states)
        states, masks = list(states), list(masks)
        if d.rule == DIFFER:
            states[other], masks[other] = states[me], masks[me]
        else:
            states[other] = states[other] + "~"
        bad = violations(d.rule, states, masks, me)
        self.cmp.record_rng(step, f"control:rng:{d.label}", d.seq, len(bad), REASONS[d.rule], d.placement,
                            {"rule": d.rule, "ranks": bad, "problem": None}, control=True)

    def _forward_backward(self, step: int, micro: int, batch) -> None:
        case, group, cmp = self.case, self.group, self.cmp
        inputs, target = batch
        wanted = case.grad_input_names(inputs)  # the forward inputs whose gradients are checked
        rec_d = capture.Recorder()
        rec_t = capture.Calibrating(rec_d, self._truth_bound)
        book = MaskBook(self.mask_gen, case.dropout)
        rng = rng_states(self.device)
        kw_d, out_d, loss_d = self._reference_pass(self.dense, self.dtype, inputs, target, rec_d, wanted,
                                                   self._masks(book.draw, self.dense))
        self._drew(book, rng)
        if self.truth is self.dense:
            (kw_t, out_t, loss_t), rec_t = (kw_d, out_d, loss_d), rec_d
        elif self.truth is None:
            kw_t, out_t, loss_t = {k: _NoGrad for k in kw_d}, None, None
        else:
            with others_wait(self.wait_threads):
                kw_t, out_t, loss_t = self._reference_pass(self.truth, torch.float64, inputs, target, rec_t, wanted,
                                                           self._masks(book.replay, self.truth))

        def compare_act(stage: str, name: str, t: torch.Tensor, seq: int | None = None) -> None:
            d = rec_d.take(stage, name)
            tr = rec_t.take(stage, name) if rec_t is not rec_d else d
            if d is not None:
                label = "act" if stage == "forward" else "actgrad"
                given = {"bound": tr} if isinstance(tr, Bound) else {}  # calibrated as the truth produced it
                check = cmp.compare(stage, step, f"{label}:{name}", t, d, None if given else tr,
                                    self.case.plan.activations[name], **given)
                if seq is not None:  # held until the placements were inferred: its place in execution order
                    check.seq = seq

        # while the activation placements are being inferred (first micro-batch of a case with no plan
        # written): every TP tensor is held, a copy (a loss may work in place on the logits), with its place
        held = [] if self.acts_pending else None

        def on_tp_tensor(stage: str, name: str, t: torch.Tensor) -> None:
            if held is not None:
                held.append((stage, name, t.clone(), cmp.next_seq()))
            else:
                compare_act(stage, name, t)

        names = self._capture_names()
        handles = capture.attach(self.tp, names, on_tp_tensor) if self.settings.capture else []
        kw_tp = self._tp_inputs(inputs, wanted)
        with self._training_rng(step, micro):
            with self.tap.tp_phase("forward"), self._tp_masks(book):
                out_tp = _one_tensor(self.tp(**kw_tp), self.tp, "TP")
            # compared before the loss sees it: a loss may work in place on its input (Megatron's
            # vocab-parallel cross-entropy subtracts the max from the logits)
            cmp.compare("forward", step, "output", out_tp.detach(), out_d, out_t, case.output_placement)
            target_local = map_tensors(lambda t: case.target_placement.shard(cast(t, self.dtype), group.rank,
                                                                             group.world_size), target)
            with self.tap.tp_phase("forward"):
                loss_tp = case.compute_tp_loss(out_tp, target_local, group) / self.settings.micro_batches
            cmp.compare("loss", step, "loss", loss_tp.detach(), loss_d, loss_t, Replicate())
            with self.tap.tp_phase("backward"):
                loss_tp.backward()
        capture.detach_all(handles)
        self.sync(f"forward and backward of step {step}")
        if held is not None:
            self._infer_activations(rec_d, held)
            for stage, name, t, seq in held:
                if name in self.case.plan.activations:
                    compare_act(stage, name, t, seq)
        self._check_draws(step, book, f"the random draws of step {step}")
        for k in wanted:
            if kw_tp[k].grad is None or kw_d[k].grad is None:
                if case.grad_inputs is None and kw_tp[k].grad is None and kw_d[k].grad is None:
                    continue  # a floating input that no gradient reaches (a mask, say): nothing to check
                side = "either side" if kw_tp[k].grad is None and kw_d[k].grad is None else \
                    "the TP side only" if kw_tp[k].grad is None else "the dense side only"
                raise UsageError(f"forward input {k!r} got no gradient on {side}: is it used in forward? "
                                 "(grad_inputs lists the inputs whose gradients are checked)")
            cmp.compare("backward", step, f"grad:{k}", kw_tp[k].grad, kw_d[k].grad, kw_t[k].grad,
                        case.input_placements.get(k, Replicate()))
        # the replicas of every micro-batch are compared across ranks with the step's grads (one checker
        # all-reduce for all of them); each replica check keeps the place of its tensor in the order

    def _compare_params(self, step: int, stage: str, dense_params: dict, tp_params: dict, get) -> None:
        """Every parameter's `get(p)` (its grad, or itself after the step) on the TP side against the
        dense side's; after the step these are what the optimizers stepped (float32 masters under
        master weights, compared with float32's bound)."""
        plan, group = self.case.plan, self.group
        truth_params = dict(self.truth.named_parameters()) if self.truth is not None else {}
        for name, p in dense_params.items():
            tp_p = tp_params[plan.tp_name(name)]
            tp_val, dense_val = get(tp_p), get(p)
            truth_val = get(truth_params[name]) if truth_params else None
            owner = plan.params[name].applied_on
            sent = self._owner_bound(step, stage, name, owner, p, truth_params.get(name), dense_val, truth_val) \
                if owner not in (None, 0) and dense_val is not None and self.truth is not self.dense else None
            if owner is not None and owner != group.rank:
                self._not_applied_here(step, stage, name, tp_val, dense_val, owner)
                continue
            if tp_val is None or dense_val is None:
                if (tp_val is None) != (dense_val is None):
                    if tp_val is None:
                        hint = ("; if the TP module applies it on one rank only (a row-parallel bias added before "
                                "the all-reduce), place it AppliedOnRank(r) in the plan, r the rank that applies it"
                                if plan.params[name].replicated else "; is it used in the TP forward?")
                        raise UsageError(f"parameter {name!r} got no gradient on rank {group.rank} of the TP side, "
                                         f"but does on the dense side{hint}")
                    raise UsageError(f"parameter {name!r} got a gradient on rank {group.rank} of the TP side but none "
                                     "on the dense side: is it used in the dense forward?")
                continue
            tp_val, truth_val = tp_val.detach(), truth_val.detach() if truth_val is not None else None
            raw = tp_val
            placement = _ALONE if owner is not None and stage != "weights" else plan.params[name]
            if stage == "optimizer" and self.slack is not None:
                tp_val, truth_val = self.slack.apply(name, plan.params[name], group.rank, group.world_size,
                                                     plan.tp_name(name), p, truth_params.get(name), tp_val, truth_val)
            label = "grad" if stage == "grads" else "param"
            check = self.cmp.compare(stage, step, f"{label}:{name}", tp_val, dense_val.detach(), truth_val,
                                     placement, dtype=dense_val.dtype, bound=sent)
            if tp_val is not raw:
                raw_error = maxdiff(raw, placement.shard(dense_val.detach(), group.rank, group.world_size))
                check.raw_error = raw_error if raw_error != check.error else None


class _Alone(Placement):
    """The whole tensor on this rank, compared here only (no replica check across ranks): the gradient
    and update of a tensor applied on one rank (AppliedOnRank)."""

    def shard(self, dense, rank, world):
        return dense

    def may_share(self, world: int) -> bool:
        return False

    def __str__(self) -> str:
        return "this rank only"


_ALONE = _Alone()


def run_case_on_rank(case: Case, group: TPGroup, rendezvous: Rendezvous, wait_threads: int = 1) -> RankPayload:
    """Run `case` on this rank; returns its checks, ledger and evidence for the launcher. `wait_threads`:
    the intra-op threads rank 0 may use for its float64 passes while the other ranks wait for it."""
    t0 = time.perf_counter()
    engine = Engine(case, group, rendezvous, wait_threads)
    checks = engine.run()
    evidence = engine.cmp.evidence_for(needed_evidence(checks, engine.cmp.evidence, rendezvous))
    return RankPayload(status="ok", rank=group.rank, checks=checks, evidence=evidence,
                       expected_collectives=case.expected_collectives, inferred_plan=engine.inferred_plan(),
                       ledger=list(engine.tap.ledger), seconds=time.perf_counter() - t0)


def needed_evidence(checks: list[Check], kept: dict, rendezvous: Rendezvous) -> set[str] | None:
    """The evidence keys the parent can need: those of every check that fails on some rank (the diagnosis
    reads the first one's tensors on every rank) and the weights stage's (a loaded bias can explain an
    offset), out of all this rank kept; None (send everything) when the ranks cannot tell. Sending only
    these saves pickling ~1,300 small arrays per tiny case. A rank other than 0 cannot judge its
    calibrated checks, whose bound rank 0 computes: one store exchange carries rank 0's bounds and the
    other ranks' errors for them, in check order, with a digest of that order (AppliedOnRank(r) makes the
    orders differ: then everything is sent)."""
    judged = [c for c in checks if not c.control and c.stage != "replicas" and c.bound is not None]
    failing = {(c.stage, c.step, c.name) for c in checks if not c.control and c.bound is not None
               and not c.error <= c.bound}
    if rendezvous.rank == 0:  # the checks whose bound the other ranks take from here
        mine = [c for c in judged if c.kind == "calibrated"]
        values = [c.bound for c in mine]
    else:
        mine = [c for c in checks if not c.control and c.stage != "replicas" and c.bound is None]
        values = [c.error for c in mine]
    digest = hashlib.blake2b("\n".join(evidence_key(c.stage, c.step, c.name) for c in mine).encode(), digest_size=16).hexdigest()
    said = [json.loads(t) for t in rendezvous.exchange("evidence", json.dumps({
        "failing": sorted(failing), "digest": digest,
        "values": base64.b64encode(array.array("d", values).tobytes()).decode()}),
        label="choosing the evidence to send")]
    if any(s["digest"] != digest for s in said):
        return None
    bounds = array.array("d", base64.b64decode(said[0]["values"]))
    for other in said:
        failing.update(tuple(f) for f in other["failing"])
    for other in said[1:]:
        errors = array.array("d", base64.b64decode(other["values"]))
        failing.update((c.stage, c.step, c.name) for c, e, b in zip(mine, errors, bounds) if not e <= b)
    keys = {k for k in kept if k.startswith("weights|")}
    for stage, step, name in failing:
        if stage == "replicas":  # the replicated tensor's own evidence, under the stage it was compared in
            keys.update(k for k in kept if k.endswith(evidence_key("", step, name)))
        else:
            keys.add(evidence_key(stage, step, name))
    return keys
