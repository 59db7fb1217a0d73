"""The passes of every side through the model, on this rank: the training forward and backward of a
micro-batch (the dense side and the float64 truth first, capturing the module outputs, then the TP
side, whose outputs are compared as they are produced), its input gradients, and the forward
without autograd (`no_grad_forward`, also the eval-mode forward's: buffers.py); and what they share
with the forward-only check (forward_only.py): a module's one output tensor, rank 0's extra threads
for its float64 passes, and the sink of the TP side's captured module outputs.

A TP output that is no placement of the dense one (activations.py: another number of dims, a dim
larger than the dense one) is a failed check where it is produced: a module output at its module,
and the run goes on; the model's output (`compare_output`) at `output`, and the run stops after that
forward on every rank (`Stopped`): the loss, the backward
and the optimizer would compute from a tensor the dense model does not have (a loss against the
dense-shaped target fails to compute at all), so nothing after it is checked, and the report says
so.

Each function takes the case's `Sides` (sides.py): nothing here holds state across micro-batches
but the manifest's count of the dense outputs (`Sides.produced`)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from tpcheck.checker.checkid import LOSS, NO_GRAD_OUTPUT, OUTPUT, CheckId
from tpcheck.checker.rank import activations, capture
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.discover import Discovery
from tpcheck.checker.rank.loading import cast, leaf, map_tensors
from tpcheck.checker.rank.rng import training_rng
from tpcheck.checker.rank.rounding import consult
from tpcheck.checker.rank.tolerance import Bound
from tpcheck.checker.sourcelines import defined_at
from tpcheck.checker.usercode import require_graph
from tpcheck.errors import UsageError
from tpcheck.plan import Replicate

if TYPE_CHECKING:
    from tpcheck.checker.rank.sides import Sides


def one_tensor(out, model: nn.Module, side: str) -> torch.Tensor:
    """A module's forward output, which must be one tensor: the checker compares it and hands it to
    the loss. Anything else is refused naming the module's forward and what it returned."""
    if isinstance(out, torch.Tensor):
        return out
    what = (
        f"a {type(out).__name__} of {len(out)}"
        if isinstance(out, (tuple, list, dict))
        else type(out).__name__
    )
    raise UsageError(
        f"the {side} module's forward ({defined_at(model.forward)}) returned {what}, not a tensor: "
        "tpcheck compares one output tensor and hands it to the loss; return that tensor (a model "
        "that returns a tuple, a dict or a ModelOutput: wrap it in a module whose forward returns "
        "the output you train on, its logits say)"
    )


@contextlib.contextmanager
def others_wait(more: int):
    """Around rank 0's float64 passes: every other rank is then blocked at the TP side's first
    collective, so rank 0 may compute on their CPUs too (`more` threads, the pool's
    `threads_while_others_wait`; one thread per rank is otherwise all a rank has). The truth's
    float64 sums may then be ordered differently, which moves a bound by ~1e-16 of itself; the
    compared sides never run on more threads than the rank's own."""
    mine = torch.get_num_threads()
    if more <= mine:
        yield
        return
    torch.set_num_threads(more)
    try:
        yield
    finally:
        torch.set_num_threads(mine)


class NoGrad:
    """Stands for a float64 input on ranks that hold no float64 model."""

    grad = None


class Stopped(Exception):
    """The TP model's output of `step` is no placement of the dense output (`why`): its failed
    check is recorded (`check_id`), and the run stops after that forward, with the checks made so
    far (engine.py); `note` says what was not checked."""

    def __init__(self, step: int, check_id: CheckId, why: str) -> None:
        super().__init__(why)
        self.step, self.check_id, self.why = step, check_id, why
        self.note = (
            f"the loss, the backward and the optimizer of step {step} and every step after it: "
            f"the run stopped at the TP model's output ({check_id}): {why}"
        )


def compare_output(
    s: Sides, step: int, check_id: CheckId, out_tp: torch.Tensor, out_d, out_t
) -> str | None:
    """The TP model's output against the dense one's through `Case.output_placement`; None, or,
    when it is no placement of the dense output (`activations.unmappable`), why: its failed check
    (`no_placement`) is recorded at its place, and the ranks meet at a ledger checkpoint before the
    caller releases what it holds and raises `Stopped` (the same forward gives every rank the same
    shape; a rank that went on instead is a hang named at that checkpoint, never a checker
    collective paired with the model's)."""
    group, placement = s.group, s.case.output_placement
    why = activations.unmappable(out_tp, out_d, placement, group.rank, group.world_size)
    if why is None:
        bound = s.twin.bound_for(out_d)
        s.cmp.compare(
            "forward", step, check_id, out_tp.detach(), out_d, out_t, placement, bound=bound
        )
        return None
    s.cmp.record_layout(step, check_id, s.cmp.next_seq(), why)
    s.sync(
        f"the forward of step {step}, whose output ({check_id}) is no placement of the dense one"
    )
    return why


class TPActivations:
    """The capture sink of the TP side's module outputs and gradients in one micro-batch: each
    compared as it is produced, against the dense side's copy (and the truth's bound or copy). While
    the activation placements are being inferred (the first micro-batch of a case, for the outputs
    the case does not name), every tensor is held instead, a copy (a loss may work in place on the
    logits) with its place in execution order, and compared in `release` once the placements are
    known; an output that is no placement of the dense one fails there, at its place."""

    def __init__(
        self,
        cmp: Comparator,
        step: int,
        rec_d: capture.Recorder,
        rec_t: capture.Recorder,
        discovery: Discovery,
        pass_: str = "",
    ) -> None:
        self.cmp, self.step, self.rec_d, self.rec_t, self.discovery = (
            cmp,
            step,
            rec_d,
            rec_t,
            discovery,
        )
        self.pass_ = pass_  # the pass of a decoding run ("decode2") its checks belong to
        self.held: list | None = [] if discovery.acts_pending else None
        self.structures: dict[str, str] = {}  # what each TP module returned

    def note(self, name: str, what: str) -> None:
        self.structures.setdefault(name, what)

    def __call__(self, stage: str, name: str, t: torch.Tensor) -> None:
        if self.held is not None:
            self.held.append((stage, name, t.clone(), self.cmp.next_seq()))
        else:
            self._compare(stage, name, t)

    def release(self) -> None:
        """After the micro-batch: the placements inferred from the held tensors (discover.py), then
        the held tensors that got one compared, each under the place it was produced in."""
        if self.held is None:
            return
        self.discovery.infer_activations(self.rec_d, self.held, self.structures)
        failed = dict(self.discovery.failed)
        for stage, name, t, seq in self.held:
            if name in self.discovery.plan.activations:
                self._compare(stage, name, t, seq)
            elif stage == "forward" and name in failed:
                self.cmp.record_layout(
                    self.step, CheckId("act", name, self.pass_), seq, failed.pop(name)
                )

    def _compare(self, stage: str, name: str, t: torch.Tensor, seq: int | None = None) -> None:
        d = self.rec_d.take(stage, name)
        tr = self.rec_t.take(stage, name) if self.rec_t is not self.rec_d else d
        if d is not None and not self._no_placement(stage, name, t, d, seq):
            label = "act" if stage == "forward" else "actgrad"
            # calibrated as the truth produced it
            given = {"bound": tr} if isinstance(tr, Bound) else {}
            self.cmp.compare(
                stage,
                self.step,
                CheckId(label, name, self.pass_),
                t,
                d,
                None if given else tr,
                self.discovery.plan.activations[name],
                seq=seq,
                **given,
            )

    def _no_placement(self, stage: str, name: str, t: torch.Tensor, d, seq: int | None) -> bool:
        """Whether the output of module `name` (a placement the case names, or one inferred) is
        no placement of the dense output (`activations.unmappable`): then its forward fails at
        its module (`Discovery.failed` says why), and its gradient, of the same shape, is not
        compared (its forward's check names the module)."""
        group = self.cmp.group
        placement = self.discovery.plan.activations[name]
        why = activations.unmappable(t, d, placement, group.rank, group.world_size)
        if why is None:
            return False
        if stage == "forward":
            self.discovery.failed.setdefault(name, why)
            at = seq if seq is not None else self.cmp.next_seq()
            self.cmp.record_layout(self.step, CheckId("act", name, self.pass_), at, why)
        return True


# ------------------------------------------------------------------------ the training forward


def forward_backward(s: Sides, step: int, micro: int, batch) -> None:
    """One micro-batch: the dense and truth passes, then the TP forward, output, loss and
    backward, its module outputs compared as they are produced; then a ledger sync, the random
    draws' checks and the input gradients. The replicas of every micro-batch are compared across
    ranks with the step's grads (one checker all-reduce for all of them)."""
    case, group, cmp = s.case, s.group, s.cmp
    inputs, target = batch
    wanted = case.grad_input_names(inputs)  # the forward inputs whose gradients are checked
    book = s.draws.book()
    rec_d, rec_t, (kw_d, out_d, loss_d), (kw_t, out_t, loss_t) = _reference_passes(
        s, inputs, target, wanted, book, step
    )
    s.produced.update(
        (step, n) for (st, n), ts in rec_d.tensors.items() if st == "forward" for _ in ts
    )
    acts = TPActivations(cmp, step, rec_d, rec_t, s.discovery)
    handles = (
        capture.attach(s.tp, s.discovery.capture_names(), acts, s.discovery.tp_modules)
        if s.settings.capture
        else []
    )
    kw_tp = s.tp_inputs(inputs, wanted)
    with training_rng(s.device, s.settings.seed, step, micro):
        noting = s.shard_ops.side("tp", s.tp, s.discovery.tp_modules)
        with s.tap.tp_phase("forward"), noting, s.draws.tp_masks(book, s.tp):
            out_tp = one_tensor(s.tp(**kw_tp), s.tp, "TP")
        # compared before the loss sees it: a loss may work in place on its input (Megatron's
        # vocab-parallel cross-entropy subtracts the max from the logits)
        if (why := compare_output(s, step, OUTPUT, out_tp, out_d, out_t)) is not None:
            capture.detach_all(handles)
            acts.release()  # the module outputs held: their checks come before the output's
            raise Stopped(step, OUTPUT, why)
        require_graph(out_tp, "TP", s.tp)
        target_local = map_tensors(
            lambda t: case.target_placement.shard(cast(t, s.dtype), group.rank, group.world_size),
            target,
        )
        with s.tap.tp_phase("forward"):
            loss_tp = case.compute_tp_loss(out_tp, target_local, group) / s.settings.micro_batches
        bound = s.twin.bound_for(loss_d)
        cmp.compare("loss", step, LOSS, loss_tp.detach(), loss_d, loss_t, Replicate(), bound=bound)
        with s.tap.tp_phase("backward"):
            loss_tp.backward()
    capture.detach_all(handles)
    s.sync(f"forward and backward of step {step}")
    acts.release()
    s.draws.check(step, book, f"the random draws of step {step}")
    _compare_input_grads(s, step, wanted, kw_tp, kw_d, kw_t)


def _reference_passes(s: Sides, inputs: dict, target, wanted: tuple, book, step: int = 0):
    """The dense pass (drawing the micro-batch's masks into `book`) and the float64 truth's
    (replaying them), each capturing the activations: (dense recorder, truth recorder, (inputs,
    output, loss) of the dense side, the same of the truth). Where the truth is the dense model
    (a float64 run) it is the dense side's; on a rank that holds none, inputs without gradients
    and no output or loss."""
    rec_d = capture.Recorder()
    rec_t = capture.Calibrating(rec_d, s.truth_bound)
    twin = s.twin.snapshot(s.dense, s.twin_wanted)
    with s.draws.watching(book):
        dense = _reference_pass(
            s, s.dense, s.dtype, inputs, target, rec_d, wanted, s.draws.masks(book.draw, s.dense)
        )
    if s.truth is s.dense:
        return rec_d, rec_d, dense, dense
    if s.truth is None:
        return rec_d, rec_t, dense, ({k: NoGrad for k in dense[0]}, None, None)
    with others_wait(s.wait_threads):
        truth = _reference_pass(
            s,
            s.truth,
            torch.float64,
            inputs,
            target,
            rec_t,
            wanted,
            s.draws.masks(book.replay, s.truth),
        )

    def run(m, rec, masks):
        kw, out, loss = _reference_pass(s, m, s.dtype, inputs, target, rec, wanted, masks)
        return {"output": out, "loss": loss, **{f"grad:{k}": kw[k].grad for k in wanted}}

    sides = {"output": (dense[1], truth[1]), "loss": (dense[2], truth[2])}
    sides.update({f"grad:{k}": (dense[0][k].grad, truth[0][k].grad) for k in wanted})
    consult(s, step, twin, book, run, rec_d, rec_t, sides)
    return rec_d, rec_t, dense, truth


def _reference_pass(
    s: Sides, model: nn.Module, dtype: torch.dtype, inputs, target, recorder, wanted, masks
):
    handles = (
        capture.attach(model, s.discovery.capture_names(), recorder) if s.settings.capture else []
    )
    kw = {k: leaf(cast(v, dtype), k in wanted) for k, v in inputs.items()}
    with s.shard_ops.side("dense" if model is s.dense else None, model), masks:
        out = one_tensor(model(**kw), model, "dense")
    require_graph(out, "dense", model)
    # as the model produced it: a loss may work in place on its input
    produced = capture.snapshot(out)
    loss = (
        s.case.loss(out, map_tensors(lambda t: cast(t, dtype), target)) / s.settings.micro_batches
    )
    loss.backward()
    capture.detach_all(handles)
    return kw, produced, loss.detach()


def _compare_input_grads(s: Sides, step: int, wanted: tuple, kw_tp: dict, kw_d: dict, kw_t: dict):
    """The gradients of the forward inputs in `wanted`, TP against dense; an input that gets one
    on one side only, or on neither when the case names it in `grad_inputs`, is
    refused naming it."""
    case = s.case
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
        s.cmp.compare(
            "backward",
            step,
            CheckId("grad", k),
            kw_tp[k].grad,
            kw_d[k].grad,
            kw_t[k].grad,
            case.input_placements.get(k, Replicate()),
            bound=s.twin.bound_for(kw_d[k].grad),  # rounding.py, where the float64 run strays
        )


def no_grad_forward(s: Sides, step: int, inputs: dict, check_id: CheckId = NO_GRAD_OUTPUT) -> None:
    """The forward without autograd on every side, its output compared (`name`): TP code may
    take another path when no gradient is needed (local matmuls and a plain all-reduce instead
    of DTensor's autograd-aware ops), and that path is the one inference and evaluation run."""
    book = s.draws.book()
    with torch.no_grad():
        with s.draws.watching(book), s.draws.masks(book.draw, s.dense):
            out_d = one_tensor(
                s.dense(**{k: cast(v, s.dtype) for k, v in inputs.items()}), s.dense, "dense"
            )
        if s.truth is s.dense:
            out_t = out_d
        elif s.truth is not None:
            with s.draws.masks(book.replay, s.truth), others_wait(s.wait_threads):
                out_t = one_tensor(
                    s.truth(**{k: cast(v, torch.float64) for k, v in inputs.items()}),
                    s.truth,
                    "dense",
                )
        else:
            out_t = None
        with (
            s.tap.tp_phase("forward"),
            training_rng(s.device, s.settings.seed, step, -1),
            s.draws.tp_masks(book, s.tp),
        ):
            out_tp = one_tensor(s.tp(**s.tp_inputs(inputs)), s.tp, "TP")
    if (why := compare_output(s, step, check_id, out_tp, out_d, out_t)) is not None:
        raise Stopped(step, check_id, why)
    s.draws.check(step, book, "the forward without autograd")
