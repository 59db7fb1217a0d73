"""The manifest: what this rank must have compared, written from the plan, the run settings and the
dense model, never from what the comparator recorded (the self-test holds one against the other:
checker/verdict/result.py `missing_checks`; a check missing from the manifest is a failure of the
checker, so a comparison path that silently stops, a step, a micro-batch, a rank or the replicas it
skips, cannot end in "equivalent").

Entries are [stage, step, name, count]: the count is how many checks of that name the rank makes in
that step (one per micro-batch for the forward and the loss). Training, on every step: the output
and the loss of every micro-batch (and the output of the forward without autograd where the case
has one), the plan's module outputs (`act:<module>`) as often as the dense module produced one
when they are captured, every parameter's gradient that the dense side has, every parameter the
optimizers step, the total gradient norm where the run clips; the weights as loaded (step 0); and
at stage "replicas" each of these this rank holds a copy of that another rank holds too (compared
bitwise across ranks).
Forward only: the output of the prefill and of every decode pass, every step.
A run that stopped at a TP output no placement maps (passes.py `Stopped`) owes the steps before
that one, and that output's check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpcheck.checker.checkid import (
    CLIP_NORM,
    LOSS,
    NO_GRAD_OUTPUT,
    OUTPUT,
    CheckId,
    decode_pass,
)
from tpcheck.plan import Placement, copies

if TYPE_CHECKING:
    from tpcheck.checker.rank.forward_only import ForwardOnly
    from tpcheck.checker.rank.optimizer import Optimizers
    from tpcheck.checker.rank.passes import Stopped
    from tpcheck.checker.rank.sides import Sides


def manifest(
    s: Sides, forward_only: ForwardOnly | None, opts: Optimizers | None, stopped: Stopped | None
) -> list[list]:
    """What this rank must have compared (module docstring), in the payload's form: a case checked
    `forward_only`, or trained by `opts`; `stopped`: where the run stopped, if it did."""
    out = _weights(s)
    steps = range(1, stopped.step if stopped is not None else s.settings.steps + 1)
    if forward_only is not None:
        names = [OUTPUT.in_pass(decode_pass(k)) for k in range(forward_only.decode_steps + 1)]
        out += [["forward", step, name, 1] for step in steps for name in names]
    else:
        for step in steps:
            out += _forward(s, step) + _params(s, opts, step)
    if stopped is not None:
        out.append(["forward", stopped.step, stopped.check_id, 1])
    return out


def _shared(s: Sides, placement: Placement, shape: tuple[int, ...]) -> bool:
    """Whether another rank holds a copy of what this rank holds of a tensor (a replica check)."""
    world = s.group.world_size
    return world > 1 and (placement.replicated or copies(placement, shape, world) is not None)


def _weights(s: Sides) -> list[list]:
    out = []
    for name, p in s.dense.named_parameters():
        out.append(["weights", 0, CheckId("param", name), 1])
        placement = s.plan.params[name]
        if placement.held_on(s.group.rank, s.group.world_size):
            if _shared(s, placement, tuple(p.shape)):
                out.append(["replicas", 0, CheckId("param", name), 1])
    return out


def _forward(s: Sides, step: int) -> list[list]:
    """The forward and loss checks of `step`: one per micro-batch each (the forward without
    autograd once), with their replica checks."""
    case, micro = s.case, s.settings.micro_batches
    out = [["forward", step, OUTPUT, micro], ["loss", step, LOSS, micro]]
    if s.group.world_size > 1:
        out.append(["replicas", step, LOSS, micro])
    shared_output = s.group.world_size > 1 and case.output_placement.replicated
    if shared_output:
        out.append(["replicas", step, OUTPUT, micro])
    if case.no_grad_forward:
        out.append(["forward", step, NO_GRAD_OUTPUT, 1])
        if shared_output:
            out.append(["replicas", step, NO_GRAD_OUTPUT, 1])
    if s.settings.capture:
        for module, placement in s.plan.activations.items():
            # as often as the dense module produced an output (a mixture's expert that no token
            # was routed to in a micro-batch is not called there, on either side)
            if not (count := s.produced[(step, module)]):
                continue
            out.append(["forward", step, CheckId("act", module), count])
            # an output no placement maps fails at its module, with no copy to compare
            failed = module in s.discovery.failed
            if s.group.world_size > 1 and placement.replicated and not failed:
                out.append(["replicas", step, CheckId("act", module), count])
    return out


def _params(s: Sides, opts: Optimizers, step: int) -> list[list]:
    """The parameter checks of `step`: the gradients the dense side has (the last step's: every
    step trains the same parameters), what the optimizers step, the gradient norm when clipping."""
    rank, world, out = s.group.rank, s.group.world_size, []
    for name, p in s.dense.named_parameters():
        placement = s.plan.params[name]
        if not placement.held_on(rank, world):
            continue
        owner = placement.applied_on
        alone = owner is not None  # compared whole on its owner, zero elsewhere: no replica check
        shared = not alone and _shared(s, placement, tuple(p.shape))
        if p.grad is not None:
            out.append(["grads", step, CheckId("grad", name), 1])
            if shared:
                out.append(["replicas", step, CheckId("grad", name), 1])
        if name in opts.dense_master.params and (owner is None or owner == rank):
            out.append(["optimizer", step, CheckId("param", name), 1])
            if shared:
                out.append(["replicas", step, CheckId("param", name), 1])
    if s.settings.clip_grad_norm is not None:
        out.append(["optimizer", step, CLIP_NORM, 1])
    return out
