"""The forward-only check: TP code that never trains (an inference s, a generation script) is
checked on what it computes, with the training check's bounds and controls, but no backward and no
optimizer.

Chosen by `RunSettings(train=False)` (`--forward-only`), and by itself when no TP parameter requires
grad or the case decodes (`Case.decode_steps`); the report says which (`ForwardOnly.reason`). After
the loaded weights (the engine's weights stage, as in training), each step takes a fresh batch and
runs every side (dense, rank 0's float64 truth, TP) under `torch.no_grad()`: every module output
(the plan's activations, or inferred for a case with no plan written), the output and, where the
batch has a target, the loss are compared on every rank, through the same `Comparator` (bounds,
controls, replicas across ranks) as training. The model may run its own forward under
`torch.inference_mode()` and hold weights that do not require grad.

Decoding (`Case.decode_steps`): the step's batch is the prompt (the prefill), then each decode pass
feeds every side the same next tokens, greedy from the dense side's logits (batch-first
`[batch, seq, vocab]`), through `Case.decode_inputs` (default `default_decode_inputs`), the prompt
taken to start at position 0. Each side decodes through its own KV cache, kept in the module. Every
step starts from each module's buffers and tensor attributes as they were built (copied back in
place; a cache reassigned by the model is replaced by a copy of the one built), so every decoding
run starts from an empty cache. A decode pass's checks carry its number: `output:decode2`,
`act:layers.0.attention.wo:decode2`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tpcheck.checker.case import Case, default_decode_inputs
from tpcheck.checker.checkid import LOSS, OUTPUT, decode_pass
from tpcheck.checker.rank import capture
from tpcheck.checker.rank.loading import cast, map_tensors
from tpcheck.checker.rank.passes import (
    Stopped,
    TPActivations,
    compare_output,
    one_tensor,
    others_wait,
)
from tpcheck.checker.rank.rng import training_rng
from tpcheck.checker.rank.rounding import consult
from tpcheck.checker.rank.warmup import warm_up
from tpcheck.errors import UsageError
from tpcheck.plan import Replicate

if TYPE_CHECKING:
    from tpcheck.checker.rank.sides import Sides

NO_GRAD = "no TP parameter requires grad"
ONE_SEQUENCE = (
    "the batch holds one distinct sequence: a bug that mixes the sequences of a batch cannot show "
    "(give make_batch several different sequences)"
)


def reason(case: Case, tp: nn.Module) -> str | None:
    """Why `case` is checked forward only (the report's note), or None: it trains. A TP module with
    no parameter at all has nothing to train either (an optimizer would refuse it)."""
    if not any(p.requires_grad for p in tp.parameters()):
        return NO_GRAD
    if not case.run.train:
        return "train=False (--forward-only)"
    if case.decode_steps:
        return f"the case decodes (decode_steps={case.decode_steps})"
    return None


class Buffers:
    """A module's buffers and tensor attributes (a cache kept as `self.cache_k = torch.zeros(...)`,
    Meta's llama) as built, to start every step from them."""

    def __init__(self, model: nn.Module) -> None:
        self.kept = []
        for mod in model.modules():
            for name, buf in mod._buffers.items():
                if buf is not None:
                    self.kept.append((mod, name, buf.detach().clone()))
            for name, value in vars(mod).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    self.kept.append((mod, name, value.detach().clone()))

    def restore(self) -> None:
        # under inference mode: a model may have replaced a buffer by an inference tensor
        with torch.inference_mode():
            for mod, name, saved in self.kept:
                now = getattr(mod, name, None)
                if (
                    isinstance(now, torch.Tensor)
                    and now.shape == saved.shape
                    and now.dtype == saved.dtype
                ):
                    now.copy_(saved)
                else:
                    setattr(mod, name, saved.clone())


class ForwardOnly:
    """The forward-only run of one case on one rank (after the weights stage), and what the report
    says of it (`as_json`)."""

    def __init__(self, reason: str, decode_steps: int) -> None:
        self.reason, self.decode_steps = reason, decode_steps
        self.notes: list[str] = []
        self.warmed_up = 0  # the TP module's warm-up forwards (warmup.py), once run

    @classmethod
    def of(cls, case: Case, tp: nn.Module) -> ForwardOnly | None:
        """The forward-only run of `case`, or None where it trains (`reason`)."""
        why = reason(case, tp)
        return cls(why, case.decode_steps) if why is not None else None

    def as_json(self) -> dict:
        return {"reason": self.reason, "decode_steps": self.decode_steps, "notes": self.notes}

    def run(self, s: Sides) -> int:
        """Every step: a fresh batch from the buffers as built, the prefill, the decode passes;
        returns the TP module's warm-up forwards (warmup.py)."""
        kept = [Buffers(m) for m in s.models()]
        # RunSettings.warmup: the buffers are restored as built before each step
        self.warmed_up = warmed_up = warm_up(s, train=False)
        for step in range(1, s.settings.steps + 1):
            inputs, target = s.first_batch if step == 1 else s.batch()
            for buffers in kept:
                buffers.restore()
            logits = self._pass(s, step, 0, inputs, target)
            for k in range(1, self.decode_steps + 1):
                logits = self._pass(s, step, k, self._decode_inputs(s, inputs, logits, k))
            s.cmp.flush_replicas()
        return warmed_up

    def _decode_inputs(self, s: Sides, prompt: dict, logits: torch.Tensor, k: int) -> dict:
        """The forward inputs of decode pass `k`: the greedy next tokens of the dense logits."""
        if logits.dim() != 3:
            raise UsageError(
                f"decoding needs batch-first logits [batch, seq, vocab]; the dense module returned "
                f"shape {list(logits.shape)} (a model with another layout: return its logits "
                "transposed from a wrapper, or set decode_steps=0)"
            )
        if k == 1:
            self.prompt_len = logits.shape[1]  # the prompt starts at position 0
            tokens = next(iter(prompt.values()))  # [batch, seq]
            one = tokens.dim() == 0 or bool((tokens == tokens[:1]).all())
            if one and ONE_SEQUENCE not in self.notes:
                self.notes.append(ONE_SEQUENCE)
        next_tokens = logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
        make = s.case.decode_inputs or default_decode_inputs
        out = make(dict(prompt), next_tokens, self.prompt_len + k - 1)
        if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) for v in out.values()):
            raise UsageError(
                f"decode_inputs returned {type(out).__name__}; expected the forward kwargs of one "
                "decode pass, {name: tensor}"
            )
        return out

    def _pass(self, s: Sides, step: int, k: int, inputs: dict, target=None) -> torch.Tensor:
        """One forward of every side, compared; returns the dense side's output."""
        cmp, pass_ = s.cmp, decode_pass(k)
        book = s.draws.book()
        rec_d = capture.Recorder()
        rec_t = capture.Calibrating(rec_d, s.truth_bound)
        names = s.discovery.capture_names() if s.settings.capture else set()
        twin = s.twin.snapshot(s.dense, s.twin_wanted)
        with torch.no_grad():
            with s.draws.watching(book):
                out_d, loss_d = _reference(
                    s,
                    s.dense,
                    s.dtype,
                    inputs,
                    target,
                    rec_d,
                    names,
                    s.draws.masks(book.draw, s.dense),
                )
            if s.truth is s.dense:
                rec_t, out_t, loss_t = rec_d, out_d, loss_d
            elif s.truth is None:
                out_t = loss_t = None
            else:
                with others_wait(s.wait_threads):
                    out_t, loss_t = _reference(
                        s,
                        s.truth,
                        torch.float64,
                        inputs,
                        target,
                        rec_t,
                        names,
                        s.draws.masks(book.replay, s.truth),
                    )
            output = str(OUTPUT.in_pass(pass_))
            sides = {output: (out_d, out_t), "loss": (loss_d, loss_t)}
            run = _twin_run(s, inputs, target, names, (output, "loss"))
            consult(s, step, twin, book, run, rec_d, rec_t, sides)
            acts = TPActivations(cmp, step, rec_d, rec_t, s.discovery, pass_)
            handles = capture.attach(s.tp, names, acts)
            with (
                training_rng(s.device, s.settings.seed, step, k),
                s.tap.tp_phase("forward"),
                s.shard_ops.side("tp", s.tp, s.discovery.tp_modules),  # outside the decisions' mode
                s.draws.tp_masks(book, s.tp),
            ):
                out_tp = one_tensor(s.tp(**s.tp_inputs(inputs)), s.tp, "TP")
            capture.detach_all(handles)
            if why := compare_output(s, step, OUTPUT.in_pass(pass_), out_tp, out_d, out_t):
                acts.release()  # the module outputs held: their checks come before the output's
                raise Stopped(step, OUTPUT.in_pass(pass_), why)
            if target is not None:
                self._loss(s, step, out_tp, target, loss_d, loss_t)
        where = f"the forward of step {step}" + (f", decode pass {k}" if k else "")
        s.sync(where)
        acts.release()
        s.draws.check(step, book, where)
        return out_d

    def _loss(self, s: Sides, step: int, out_tp, target, loss_d, loss_t) -> None:
        case, group = s.case, s.group
        target_local = map_tensors(
            lambda t: case.target_placement.shard(cast(t, s.dtype), group.rank, group.world_size),
            target,
        )
        with s.tap.tp_phase("forward"):
            loss_tp = case.compute_tp_loss(out_tp, target_local, group)
        bound = s.twin.bound_for(loss_d)
        s.cmp.compare(
            "loss", step, LOSS, loss_tp.detach(), loss_d, loss_t, Replicate(), bound=bound
        )


def _reference(s: Sides, model, dtype, inputs, target, recorder, names, masks):
    """A dense side's forward (the working dtype's or the truth's), capturing the module outputs:
    (its output as produced, its loss or None)."""
    handles = capture.attach(model, names, recorder)
    with s.shard_ops.side("dense" if model is s.dense else None, model), masks:
        out = one_tensor(model(**{k: cast(v, dtype) for k, v in inputs.items()}), model, "dense")
    capture.detach_all(handles)
    produced = capture.snapshot(out)  # a loss may work in place on its input
    loss = None
    if target is not None:
        loss = s.case.loss(out, map_tensors(lambda t: cast(t, dtype), target)).detach()
    return produced, loss


def _twin_run(s: Sides, inputs, target, names, keys):
    """The rounding twin's pass of a forward-only step (rounding.py): {output, loss} by name."""

    def run(model, recorder, masks):
        got = _reference(s, model, s.dtype, inputs, target, recorder, names, masks)
        return dict(zip(keys, got))

    return run
