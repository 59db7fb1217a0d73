"""What every side's pass shares, in the training step and in the forward-only check
(forward_only.py): a module's one output tensor, rank 0's extra threads for its float64 passes, and
the sink of the TP side's captured module outputs, each compared as it is produced."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tpcheck.checker.rank import capture
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.discover import Discovery
from tpcheck.checker.rank.tolerance import Bound
from tpcheck.checker.usercode import defined_at
from tpcheck.errors import UsageError


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
        suffix: str = "",
    ) -> None:
        self.cmp, self.step, self.rec_d, self.rec_t, self.discovery = (
            cmp,
            step,
            rec_d,
            rec_t,
            discovery,
        )
        self.suffix = suffix  # after each check's name: the pass of a decoding run (":decode2")
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
                self.cmp.record_layout(self.step, f"act:{name}{self.suffix}", seq, failed.pop(name))

    def _compare(self, stage: str, name: str, t: torch.Tensor, seq: int | None = None) -> None:
        d = self.rec_d.take(stage, name)
        tr = self.rec_t.take(stage, name) if self.rec_t is not self.rec_d else d
        if d is not None:
            label = "act" if stage == "forward" else "actgrad"
            # calibrated as the truth produced it
            given = {"bound": tr} if isinstance(tr, Bound) else {}
            self.cmp.compare(
                stage,
                self.step,
                f"{label}:{name}{self.suffix}",
                t,
                d,
                None if given else tr,
                self.discovery.plan.activations[name],
                seq=seq,
                **given,
            )
