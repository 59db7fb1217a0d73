"""What the checker is handed: a `Case` (what is checked), its `RunSettings` (how it is run:
checker/settings.py) and its `Injection` (what a fault changes, empty for a real check); and the
`CaseSpec`, the small picklable name of a case that travels to rank processes.

The engine knows no layer: it builds the dense module, builds the TP module, loads TP weights from
the dense ones through the plan, feeds both the same batches (TP inputs placed by
`input_placements`), and compares through the plan. Who turns a CaseSpec into a Case (a built-in
block, a user's case file, a registered Case, plus a fault) is not the checker's business: the
launcher is handed a resolver (`tpcheck.resolve`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck.checker.devices import check_device
from tpcheck.checker.settings import RunSettings
from tpcheck.checker.sourcelines import user_frame
from tpcheck.checker.vocabulary import VERDICTS_EXPECTED, Verdict
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Placement, Plan, Replicate, as_placement

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]  # (forward kwargs, target)
# (op, site, phase, x, perform) -> tensor: replaces one collective (see parallel/group.py's Tap)
Interceptor = Callable[
    [str, str, str, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor
]


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


# the names a module's `reset_parameters` gives its generator, when it does not annotate it
GENERATOR_NAMES = ("g", "gen", "generator", "rng")
DEFAULT_INIT = "tpcheck's default init"
_OWN_INIT = (
    "give the Case an init of your own, `init=lambda module, generator: ...` drawing the weights "
    "from the generator (docs/case-files.md)"
)


def seeded_init(module: nn.Module, g: torch.Generator) -> None:
    """The default `Case.init`: the module's own `reset_parameters(generator)` when its first
    argument is a generator (annotated `torch.Generator`, or named as in `GENERATOR_NAMES`: the
    built-in blocks), else every parameter drawn from `g` in `named_parameters()` order --
    matrices N(0, 1/fan_in) (fan_in: the last dim), vectors named `*weight` (norm gains) 1 + N(0,
    0.1^2), other vectors (biases) N(0, 0.1^2). Random, not torch's zeros and ones, so that a bias
    added twice or a gain applied on one rank shows. A `reset_parameters` that takes no generator
    (`reset_parameters(self)`, `reset_parameters(self, init_std=None)`) is not called: it would
    draw from the global RNG or take the generator for something else. A failure is a UsageError
    naming tpcheck's default init, the module's class and the fix."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset) and takes_generator(reset):
        try:
            reset(g)
        except Exception as e:  # noqa: BLE001 - the module's code, reported at its line
            raise UsageError(
                f"{DEFAULT_INIT} called {type(module).__name__}.reset_parameters(generator) "
                f"({user_frame(e, None)}), which raised {type(e).__name__}: {e}; fix it, or "
                f"{_OWN_INIT}"
            ) from None
        return
    with torch.no_grad():
        for name, p in module.named_parameters():
            try:
                p.copy_(_seeded_value(name, p, g))
            except Exception as e:  # noqa: BLE001 - a parameter tpcheck cannot write
                raise UsageError(
                    f"{DEFAULT_INIT} could not draw {type(module).__name__}'s parameter {name!r} "
                    f"({type(p).__name__} {list(p.shape)} {p.dtype} on {p.device}): "
                    f"{type(e).__name__}: {e}; {_OWN_INIT}"
                ) from None


def takes_generator(reset: Callable) -> bool:
    """Whether `reset` (a module's bound `reset_parameters`) takes a generator as its first
    argument: annotated `torch.Generator` (or an Optional of it), or unannotated and named as in
    `GENERATOR_NAMES`."""
    try:
        params = list(inspect.signature(reset).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or params[0].kind not in positional:
        return False
    annotation = params[0].annotation
    if annotation is inspect.Parameter.empty:
        return params[0].name in GENERATOR_NAMES
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return "Generator" in text


def _seeded_value(name: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The default init's value of parameter `name` (see `seeded_init`), in `p`'s dtype."""
    noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
    if p.dim() >= 2:
        value = noise / math.sqrt(max(p.shape[-1], 1))
    elif name.rsplit(".", 1)[-1] == "weight":
        value = 1 + 0.1 * noise
    else:
        value = 0.1 * noise
    return value.to(p.dtype)


# the names of a forward input holding the position of the first token a call feeds (Meta's
# llama: `start_pos`, an int; gpt-fast: `input_pos`, the positions) set by `default_decode_inputs`
POSITION_INPUTS = ("start_pos", "input_pos", "cache_position", "position_ids", "positions")
MAX_DECODE_STEPS = 256


def default_decode_inputs(
    prompt_inputs: dict[str, torch.Tensor], next_tokens: torch.Tensor, position: int
) -> dict[str, torch.Tensor]:
    """The forward inputs of one decode pass (`Case.decode_inputs` when none is given): the prompt's
    inputs with the first one (the tokens, `[batch, seq]`) replaced by `next_tokens` `[batch, 1]`
    and each input named in `POSITION_INPUTS` set to `position`, in its own form: a 0-dim tensor
    stays one (`start_pos`), one with a position per token becomes `[position]` (`[1, position]`
    for `[batch, seq]` position ids). Every other input is handed on as it is. A prompt with no
    such input is refused: its model cannot be told where the new token goes."""
    names = list(prompt_inputs)
    placed = [n for n in names[1:] if n in POSITION_INPUTS]
    if not placed:
        raise UsageError(
            f"decoding needs the position of the new token, but the forward inputs {names} have "
            f"none of {list(POSITION_INPUTS)}: give Case(decode_inputs=...) a function "
            "(prompt_inputs, next_tokens, position) -> the forward kwargs of one decode pass"
        )
    out = dict(prompt_inputs)
    out[names[0]] = next_tokens.to(prompt_inputs[names[0]].dtype)
    for n in placed:
        old = prompt_inputs[n]
        value = torch.tensor(position, dtype=old.dtype, device=old.device)
        out[n] = (
            value
            if old.dim() == 0
            else value.reshape([1] * old.dim()).expand(*old.shape[:-1], 1).clone()
        )
    return out


@dataclass(frozen=True, kw_only=True)
class Injection:
    """What a planted fault (or a robustness test) changes on the TP side; empty for a real check.

    tamper(tp_module, group): called on every rank after the TP module is built and loaded.
    intercept(group) -> Interceptor: handed every collective the TP module issues (through the tap).
    load_plan: the plan the TP side loads its weights with, when it differs from `Case.plan` (a TP
        implementation with its own checkpoint loading); the checks always use `Case.plan`.
    tp_optimizer(tp_params, group, default_factory) -> Optimizer: the TP side's own optimizer over
        `tp_params.named_parameters()` (the TP module, or its float32 masters under master weights).
    """

    tamper: Callable[[nn.Module, TPGroup], None] | None = None
    intercept: Callable[[TPGroup], Interceptor] | None = None
    load_plan: Plan | None = None
    tp_optimizer: Callable | None = None


@dataclass(frozen=True, kw_only=True)
class Case:
    """What is checked: one dense module and its TP twin, how to feed them and how they relate.

    build_dense(dtype) -> dense module; its parameters are initialised by `init(module, generator)`
        (default `seeded_init`: the module's `reset_parameters(generator)` when it takes a
        generator, else seeded random values).
    plan: how each dense parameter lives on the ranks; None with `load_tp`:
    inferred from what it loads
        (checker/rank/plan_inference.py).
    build_tp(group, dtype) -> TP module whose parameters are named as in the
    dense one (or renamed by
        `plan.tp_names`); the engine fills them from the dense weights through `plan`, unless:
    load_tp(tp_module, dense_state_dict, group): the user's own loading (a checkpoint loader),
        called instead, with the dense weights as full float32 tensors (float64 in a float64 run);
        what it loads is checked bitwise against the plan's shards at the weights stage and is not
        overwritten. Called once per rank, before the optimizers are built (a loader that replaces
        parameters is followed): each later step restarts the TP module by writing the dense
        weights into its parameters in place through the plan, so what the loader derived from
        the weights (a transposed or pre-cast copy, FP8 scales) goes stale as in training.
    make_batch(generator, dtype) -> ({forward kwarg: dense tensor}, target); the
    target may be a tensor or
        a dict/list/tuple of them (labels and a mask, say), handed to the loss as it is.
    loss(out, target) -> scalar for the dense side; tp_loss(out_local, target,
    group) for the TP side
        (defaults to `loss`, valid when the TP output is placed `Replicate`).
    input_placements: how each forward input reaches the TP module (default Replicate; Shard(0) for
        sequence parallelism). output_placement: how the TP output relates to the dense one;
        target_placement: which part of the target the TP loss sees.
    grad_inputs: forward inputs whose gradients are checked (each must get one); None (the default):
        every floating-point input that gets a gradient on the dense side.
    expected_collectives: (phase, op, site) the TP module should issue per micro-batch (forward,
        backward) and per step (optimizer); None when unknown. The ledger is checked against it.
    activations: placements of module outputs to check, for a case whose plan is
    inferred (plan=None);
        a written plan carries its own (`Plan.activations`). Either way the outputs not named are
        inferred from the first micro-batch where the layout decides it
        (checker/rank/activations.py).
    tp_names: for a case whose plan is inferred (plan=None), the TP parameter name of a dense
        parameter where they differ: a dict {dense name: TP name}, or a function of the dense name
        returning the TP name. A written plan carries its own (`Plan.tp_names`). Names that
        differ by wrapper prefixes only (`module.`, `_orig_mod.`, `_fsdp_wrapped_module.`,
        `_checkpoint_wrapped_module.`, `tp_wrapped_module.`) need none (checker/rank/names.py).
    dropout: placements of random masks whose part on each rank tpcheck cannot
    tell from the shapes, by
        the draw's label (an `nn.Dropout` module's name, else "module: dropout #n"); see
        checker/rank/masks.py: every mask is drawn once in the dense layout and
        each rank gets its part.
    no_grad_forward: also run each step's first micro-batch without autograd (torch.no_grad) on both
        sides and compare that output ("output:no_grad"): for TP code that takes another path when
        no gradient is needed (HuggingFace's local-matmul inference path).
    dense_optimizer(named_params) -> torch.optim.Optimizer: the update rule both sides are held to,
        over `[(name, parameter), ...]` (torch optimizers take named parameters; a rule with no
        weight decay on biases builds its groups from the names); None: `run`'s optimizer and lr.
        It steps the dense model, the float64 truth and the replay of the rule on the TP side's
        inputs, so it must be an element-wise torch optimizer (SGD, Adam, AdamW, ...).
    tp_optimizer(tp_module, group) -> your TP optimizer: anything with `step()` (and `zero_grad()`),
        e.g. a wrapper that keeps float32 master copies and steps an inner torch optimizer
        (Megatron's Float16OptimizerWithFloat16Params, apex, DeepSpeed) or one over a flat buffer.
        tpcheck finds the state through it where it can (checker/rank/training.py); None: tpcheck
        steps the TP module with `dense_optimizer`'s rule (float32 masters under
        `run.master_weights`). Your optimizer owns its masters: tpcheck makes none on the TP side.
    tp_clip_grad_norm(tp_module, max_norm, group) -> total norm: your TP gradient clipping, run
        before the TP optimizer steps when `run.clip_grad_norm` is set; None: tpcheck's TP-aware
        clipping (each sharded element counted once over the ranks, each replicated one once).
    grad_of: where the TP side's gradients are (the framework's accumulator its optimizer steps
        on): "main_grad" (any attribute name) or a function (parameter) -> its gradient or None;
        None: `.grad`, or `main_grad` where found (checker/rank/grad_source.py).
    setup(group): run on every rank before the TP module is built (state your TP code keeps in
        module globals or environment variables: a parallel-state initializer, say). tpcheck
        builds, on every rank, the dense model (float32, then a copy in the working dtype), the
        float64 truth (rank 0), then `setup(group)`, then `build_tp(group, dtype)`.
    decode_steps: incremental decoding through the model's own KV cache (checked forward only,
        checker/rank/forward_only.py): each step's batch is the prompt (the prefill), then
        `decode_steps` passes of one new token each, the same tokens for every side (greedy from
        the dense side's logits, which must be batch-first `[batch, seq, vocab]`), every module
        output and the logits compared at each ("output:decode2"). Each step starts from the
        module's buffers (and tensor attributes) as built: tpcheck copies them back, so a cache
        kept there starts empty. 0: no decoding.
    decode_inputs(prompt_inputs, next_tokens, position) -> forward kwargs of one decode pass:
        `next_tokens` `[batch, 1]`, `position` the index of that token in its sequence. None:
        `default_decode_inputs` (the first input replaced by the new tokens, `start_pos` /
        `input_pos` set to the position).
    plan_rules: the TP code's own plan as its rules, pattern -> style (transformers'
        `{"model.layers.*.self_attn.q_proj": "colwise", ...}`, `*` standing for a layer index), read
        only to name things in a diagnosis (which rule, if any, covers a parameter whose gradient
        is wrong); never used to compute the verdict. None: the TP code has no such plan.
    run: how it is run (RunSettings); inject: what a planted fault changes (Injection).
    """

    name: str
    build_dense: Callable[[torch.dtype], nn.Module]
    build_tp: Callable[[TPGroup, torch.dtype], nn.Module]
    plan: Plan | None
    make_batch: Callable[[torch.Generator, torch.dtype], Batch]
    init: Callable[[nn.Module, torch.Generator], None] = seeded_init
    load_tp: Callable[[nn.Module, dict[str, torch.Tensor], TPGroup], None] | None = None
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse_loss
    tp_loss: Callable[[torch.Tensor, torch.Tensor, TPGroup], torch.Tensor] | None = None
    input_placements: dict[str, Placement] = field(default_factory=dict)
    output_placement: Placement = Replicate()
    target_placement: Placement = Replicate()
    grad_inputs: tuple[str, ...] | None = None
    expected_collectives: tuple | None = None
    activations: dict[str, Placement] = field(default_factory=dict)
    tp_names: dict[str, str] | Callable[[str], str] | None = None
    dropout: dict[str, Placement] = field(default_factory=dict)
    no_grad_forward: bool = False
    dense_optimizer: Callable[[list], torch.optim.Optimizer] | None = None
    tp_optimizer: Callable[[nn.Module, TPGroup], object] | None = None
    tp_clip_grad_norm: Callable[[nn.Module, float, TPGroup], object] | None = None
    grad_of: str | Callable[[nn.Parameter], torch.Tensor | None] | None = None
    setup: Callable[[TPGroup], None] | None = None
    decode_steps: int = 0
    decode_inputs: Callable[[dict, torch.Tensor, int], dict] | None = None
    plan_rules: Mapping[str, str] | None = None
    run: RunSettings = RunSettings()
    inject: Injection = Injection()

    def __post_init__(self) -> None:
        if self.plan is None and self.load_tp is None:
            raise UsageError(
                f"Case {self.name!r} has no plan: give plan=Plan(...), or give load_tp (your own "
                "loading) and tpcheck infers the plan from what it loads"
            )
        if self.plan is not None and self.activations:
            raise UsageError(
                f"Case {self.name!r}: activations are given twice; with a written plan, put them "
                "in Plan(activations=...)"
            )
        self._check_tp_names()
        self._check_plan_rules()
        self._check_grad_of()
        if not isinstance(self.dropout, dict):
            raise UsageError(
                f"Case {self.name!r}: dropout must be a dict {{draw label: placement}}, not "
                f"{type(self.dropout).__name__}"
            )
        object.__setattr__(
            self,
            "dropout",
            {
                label: as_placement(p, f"Case {self.name!r} dropout[{label!r}]")
                for label, p in self.dropout.items()
            },
        )
        for hook in ("dense_optimizer", "tp_optimizer", "tp_clip_grad_norm", "setup"):
            value = getattr(self, hook)
            if value is not None and not callable(value):
                raise UsageError(
                    f"Case {self.name!r}: {hook} must be a function (see docs/case-files.md), not "
                    f"{type(value).__name__} {value!r}"
                )
        d = self.decode_steps
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_DECODE_STEPS:
            raise UsageError(
                f"Case {self.name!r}: decode_steps must be an integer in 0..{MAX_DECODE_STEPS}, "
                f"got {d!r} (a cache bug shows within a few decode steps)"
            )
        if self.decode_inputs is not None and not callable(self.decode_inputs):
            raise UsageError(
                f"Case {self.name!r}: decode_inputs must be a function (prompt_inputs, "
                f"next_tokens, position) -> forward kwargs, not {type(self.decode_inputs).__name__}"
            )
        for name, cls in (("run", RunSettings), ("inject", Injection), ("plan", Plan)):
            if name == "plan" and self.plan is None:
                continue
            if not isinstance(getattr(self, name), cls):
                raise UsageError(
                    f"Case {self.name!r}: {name} must be a tpcheck {cls.__name__}, not "
                    f"{type(getattr(self, name)).__name__}"
                )

    def make_rule(self, settings: RunSettings, named_params) -> torch.optim.Optimizer:
        """The update rule over `named_params` ((name, parameter) pairs): `dense_optimizer`, else
        the run settings' optimizer."""
        named = list(named_params)
        if self.dense_optimizer is None:
            return settings.make_optimizer([p for _, p in named])
        return self.dense_optimizer(named)

    def _check_tp_names(self) -> None:
        """`tp_names`: with plan=None only, a dict of str -> str or a function."""
        names = self.tp_names
        if names is None:
            return
        if self.plan is not None:
            raise UsageError(
                f"Case {self.name!r}: tp_names are given with a written plan; put them in "
                "Plan(tp_names=...)"
            )
        if callable(names):
            return
        bad = (
            type(names).__name__
            if not isinstance(names, dict)
            else next(
                (f"{k!r}: {v!r}" for k, v in names.items() if not (type(k) is type(v) is str)),
                None,
            )
        )
        if bad is not None:
            raise UsageError(
                f"Case {self.name!r}: tp_names must be a dict {{dense name: TP name}} (str to "
                f"str) or a function of the dense name, not {bad}"
            )

    def _check_grad_of(self) -> None:
        """`grad_of`: None, an attribute name or a function."""
        g = self.grad_of
        if g is not None and not callable(g) and not (isinstance(g, str) and g.isidentifier()):
            raise UsageError(
                f"Case {self.name!r}: grad_of must name the attribute holding each parameter's "
                f"gradient ('main_grad') or be a function (parameter) -> its gradient, not "
                f"{type(g).__name__} {g!r}"
            )

    def _check_plan_rules(self) -> None:
        """`plan_rules`: None or a mapping of str -> str."""
        rules = self.plan_rules
        if rules is None:
            return
        bad = (
            type(rules).__name__
            if not isinstance(rules, Mapping)
            else next(
                (f"{k!r}: {v!r}" for k, v in rules.items() if not (type(k) is type(v) is str)),
                None,
            )
        )
        if bad is not None:
            raise UsageError(
                f"Case {self.name!r}: plan_rules must be a mapping {{pattern: style}} (str to "
                f"str), your TP code's own plan, not {bad}"
            )

    def grad_input_names(self, inputs: dict) -> tuple[str, ...]:
        """The forward inputs whose gradients are checked, for a batch's `inputs`."""
        if self.grad_inputs is None:
            return tuple(
                k
                for k, v in inputs.items()
                if isinstance(v, torch.Tensor) and v.is_floating_point()
            )
        unknown = [k for k in self.grad_inputs if k not in inputs]
        if unknown:
            raise UsageError(
                f"grad_inputs names {unknown} but make_batch gives the forward inputs "
                f"{sorted(inputs)}; list those whose gradients to check, or leave grad_inputs "
                "out (every floating input)"
            )
        return tuple(self.grad_inputs)

    def compute_tp_loss(
        self, out_local: torch.Tensor, target: torch.Tensor, group: TPGroup
    ) -> torch.Tensor:
        if self.tp_loss is not None:
            return self.tp_loss(out_local, target, group)
        return self.loss(out_local, target)


@dataclass(frozen=True, kw_only=True)
class CaseSpec:
    """The picklable name of a case. `block` names what is checked as the report writes it: a
    built-in block name, "file:PATH[:NAME]" (a case file), "registered:ID" (a Case registered in
    this process) or "hf:ARCH" (a HuggingFace architecture); `target` is the same as a typed value,
    the one way code reads it.

    run: how it runs, one `RunSettings` (dtype, steps, micro-batches, optimizer, lr, seed, capture,
    master weights); None: the case's own (a case file's `Case.run`, `RunSettings()` for a built-in
    block). When given it is what runs, whole: the Case the resolver builds carries it, and the
    report names the settings the ranks ran (`RankPayload.run`), never a copy of them.
    `with_run(...)` changes some of them. overrides: ModelConfig field overrides of a built-in
    block. `device`: where every rank computes, "cpu" (gloo) or "cuda" (one GPU per rank, NCCL;
    checker/devices.py). `expected`: the verdict this case should get; None means "equivalent"
    without a fault, "not equivalent" with one (the resolver fills in a fault's own).
    """

    block: str = "mlp"
    preset: str = "seed"
    world_size: int = 2
    run: RunSettings | None = None
    sequence_parallel: bool = False
    fault: str | None = None
    overrides: tuple[tuple[str, object], ...] = ()
    label: str = ""
    expected: Verdict | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.run is not None and not isinstance(self.run, RunSettings):
            raise UsageError(
                f"CaseSpec(run={self.run!r}): run must be a tpcheck.RunSettings (or None: the "
                "case's own settings), e.g. CaseSpec(block='mlp', "
                "run=RunSettings(dtype='bfloat16', steps=2))"
            )

    @property
    def settings(self) -> RunSettings:
        """The run settings of a built-in block: `run`, else the defaults. (A case file's own
        settings are known once its Case is built: `Resolver.build(spec).run`.)"""
        return self.run if self.run is not None else RunSettings()

    def with_run(self, **changes) -> CaseSpec:
        """This spec with some run settings changed (`RunSettings` fields; validated)."""
        unknown = sorted(set(changes) - set(RUN_FIELDS))
        if unknown:
            raise UsageError(
                f"{unknown} are not run settings; the run settings are {list(RUN_FIELDS)}"
            )
        return dataclasses.replace(self, run=dataclasses.replace(self.settings, **changes))

    @property
    def target(self) -> Target:
        """What the spec names, typed (`block` read once)."""
        return Target.parse(self.block)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        parts = [self.block, self.preset, f"tp{self.world_size}"]
        # a case file's own: not known here
        if self.run is not None or not self.target.user:
            run = self.settings
            parts.append(run.dtype)
            if not run.master_weights and run.dtype in ("bfloat16", "float16"):
                parts.append("pure")
            if not run.train:
                parts.append("forward_only")
            if run.warmup:
                parts.append(f"warmup{run.warmup}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.fault:
            parts.append(self.fault)
        if self.device != "cpu":
            parts.append(str(self.device))
        return "/".join(parts)

    @property
    def expected_verdict(self) -> Verdict:
        if self.expected is not None:
            return self.expected
        return "equivalent" if self.fault is None else "not equivalent"

    def validate(self) -> None:
        """What can be checked without building anything; raises UsageError naming the value and the
        fix. (Block, preset and fault names are the resolver's to check; the run settings
        validate themselves.)"""
        check_world_size(self.world_size)
        check_device(self.device, self.world_size)
        if self.expected is not None and self.expected not in VERDICTS_EXPECTED:
            raise UsageError(
                f"expected verdict {self.expected!r} is not one of {list(VERDICTS_EXPECTED)}"
            )


# what `CaseSpec.with_run` may set
RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunSettings))
TargetKind = Literal["block", "file", "registered", "hf"]
# how each kind of target but a built-in block is written in a spec's `block` (and the report)
PREFIXES: dict[str, str] = {"file": "file:", "registered": "registered:", "hf": "hf:"}


@dataclass(frozen=True)
class Target:
    """What a spec names: a built-in block (`name` its name), a case file (`name`
    "PATH[:NAME]"), a Case registered in this process (`name` its id) or a HuggingFace architecture
    (`name` its model type). `str()` is the spec's `block`, as the report writes it; `parse` its
    inverse, the one place a `block` is read."""

    kind: TargetKind
    name: str

    def __str__(self) -> str:
        return PREFIXES.get(self.kind, "") + self.name

    @classmethod
    def parse(cls, block: str) -> Target:
        for kind, prefix in PREFIXES.items():
            if block.startswith(prefix):
                return cls(kind, block[len(prefix) :])  # type: ignore[arg-type]
        return cls("block", block)

    @property
    def user(self) -> bool:
        """A user's own Case (a case file, or registered): its run settings are its own."""
        return self.kind in ("file", "registered")


# Each rank is a process on this machine. Beyond ~8 ranks per core, gloo's rendezvous and
# collectives are slow enough to trip the collective timeout, and a false "hang" is worse than a
# clear refusal. (Under torchrun the ranks are torchrun's business: this limit
# is not applied there.)
MAX_WORLD_SIZE = 64
RANKS_PER_CPU = 8


def max_world_size() -> int:
    return min(MAX_WORLD_SIZE, RANKS_PER_CPU * (os.cpu_count() or 1))


def check_world_size(world: int) -> None:
    limit = max_world_size()
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= limit:
        raise UsageError(
            f"world size {world} is outside 1..{limit}: each rank is a process on this machine "
            f"({os.cpu_count()} CPUs, at most {RANKS_PER_CPU} ranks per CPU and {MAX_WORLD_SIZE} "
            "in all); choose a smaller world size or run under torchrun on more machines"
        )


class Resolver(Protocol):
    """Turns CaseSpecs into Cases: handed to the launcher (tpcheck.resolve provides the default one,
    which knows the built-in blocks, case files, registered Cases and the fault catalogue)."""

    def prepare(self, spec: CaseSpec) -> CaseSpec:
        """The spec as it will run (e.g. a fault's own
        sequence parallelism and expected verdict)."""

    def validate(self, spec: CaseSpec) -> None:
        """In the parent, before any rank: raise UsageError naming the bad value and the fix."""

    def build(self, spec: CaseSpec) -> Case:
        """On every rank: the Case to run."""
