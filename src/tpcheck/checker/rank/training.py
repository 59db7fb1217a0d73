"""The user's own training step on the TP side: their optimizer (found through its wrappers) and
their gradient clipping, each held to the dense rule.

The optimizer. `Case(tp_optimizer=...)` hands the TP module to the user's factory; what comes back
may be a torch optimizer, or a wrapper that keeps its state elsewhere: float32 master copies of the
module's weights stepped by an inner torch optimizer and cast back (Megatron's
Float16OptimizerWithFloat16Params, apex, DeepSpeed), or an inner optimizer over one flat buffer that
holds every weight. `UserOptimizer` looks for the torch optimizers inside it (the object itself, its
attributes, a few levels down) and maps what they step to the module's parameters, once, right after
it is built, when every stepped tensor still equals its parameter: the parameter itself, a tensor of
the same shape and values (a master copy), or a segment of a flat buffer. Where that works the
inner optimizer's state is the TP side's state, checked bitwise against the replay of the dense rule
on the very tensors and gradients the inner optimizer was handed (a step pre-hook copies them), and
the masters restart from the dense side's at each step like tpcheck's own. Where nothing maps, the
state is reported "not observable (your optimizer keeps it elsewhere)", never compared as zeros, and
the update is not held bitwise to the rule (an optimizer that is no torch optimizer may round
otherwise: a textbook AdamW differs from torch's in 37 of 4,096 elements by 1 ulp); the weights
after each step are then what is checked, against the dense ones.

Clipping. With `RunSettings(clip_grad_norm=...)` the dense side (and the float64 truth) clip with
`torch.nn.utils.clip_grad_norm_`; the TP side with the case's `tp_clip_grad_norm` or `clip_tp`
below, on the TP gradients where its framework keeps them (`.grad`, or `main_grad`: grad_source.py).
The two total norms are compared (`clip:grad_norm`, stage optimizer), and the numbers the
diagnosis needs to name a norm of the local shards only, or replicated parameters counted once per
rank, are kept with its evidence. The norm alone is not the yardstick: every clipped gradient is
then compared with the dense side's clipped by the dense rule (optimizer_stage.py's `clip`), each
with the factor the TP clipping scaled it by, so that a clipping that scales the sharded gradients
and leaves the replicated ones (a norm weight, a row-parallel bias) is named.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from tpcheck.checker.checkid import CLIP_NORM, CheckId
from tpcheck.checker.payload import evidence_key
from tpcheck.checker.rank.stepped import check_found, map_stepped, settle_ties
from tpcheck.errors import UsageError
from tpcheck.plan import Plan, Replicate, copies

if TYPE_CHECKING:
    from tpcheck.checker.rank.sides import Sides

UNOBSERVABLE = "not observable (your optimizer keeps it elsewhere)"
CLIP_SITE = "clip"  # the site of the default clipping's all-reduce, in the ledger


def find_optimizers(obj, depth: int = 3) -> list[torch.optim.Optimizer]:
    """The torch optimizers reachable from `obj`: itself, its attributes, and lists, tuples and
    dicts of them, `depth` levels down; each once, outermost first."""
    found: list[torch.optim.Optimizer] = []
    seen: set[int] = set()
    level = [obj]
    for _ in range(depth + 1):
        nxt = []
        for o in level:
            if id(o) in seen or isinstance(o, (torch.Tensor, nn.Module, str, bytes, int, float)):
                continue
            seen.add(id(o))
            if isinstance(o, torch.optim.Optimizer):
                found.append(o)
            if isinstance(o, dict):
                nxt.extend(o.values())
            elif isinstance(o, (list, tuple)):
                nxt.extend(o)
            elif hasattr(o, "__dict__") and not isinstance(o, type):
                nxt.extend(v for k, v in vars(o).items() if k not in ("state", "param_groups"))
        level = nxt
    return found


class UserOptimizer:
    """The user's TP optimizer, seen as tpcheck's `Masters` is (checker/rank/optimizer.py): what it
    steps by parameter name (`params`), whether those are copies of the module's weights
    (`masters`), the state of each (`state_of`), and the inputs of the replay (`replay_inputs`,
    taken by a pre-hook as the inner optimizer steps)."""

    replay_after_step = True

    def __init__(self, module: nn.Module, optimizer, grad_of=None, refresh=None) -> None:
        self.module, self.optimizer = module, optimizer
        # hands the module's gradients to the parameters the optimizer holds, where those are
        # the framework's own (DTensors over the shards: adapters/dtensor.py `as_held`)
        self.refresh = refresh
        self.grad_of = grad_of or (lambda p: p.grad)  # where the module's gradients are read
        self._own = dict(module.named_parameters())
        self.inner = inner = find_optimizers(optimizer)
        self.found = map_stepped(module, inner)
        check_found(self.found, self._own)
        self.masters = any(not s.holds(self._own[n]) for n, s in self.found.items())
        self.params = {
            n: self.found[n].value if n in self.found else p for n, p in self._own.items()
        }
        self._taken: tuple[dict, dict] | None = None
        for opt in inner:
            opt.register_step_pre_hook(self._take)

    def named_parameters(self):
        return iter((n, self.found[n].value) for n in self.found)

    def steps_module_weights(self) -> bool:
        """Whether a torch optimizer found inside steps the module's own parameters, every one it
        steps (no master copies kept apart)."""
        return bool(self.found) and not self.masters

    def _take(self, *_args) -> None:
        """The inner optimizer is about to step: the tensors it steps and their grads, copied
        (copies that tied by value first bound by their gradients: stepped.py)."""
        if any(s.ties for s in self.found.values()):
            settle_ties(self.found, {n: self.grad_of(self._own[n]) for n in self.found})
            self.params.update((n, s.value) for n, s in self.found.items())  # in place: shared
        values = {n: s.value.clone() for n, s in self.found.items()}
        grads = {n: None if s.grad is None else s.grad.clone() for n, s in self.found.items()}
        if self._taken is not None:  # several inner optimizers: one pre-hook each
            values, grads = {**self._taken[0], **values}, {**self._taken[1], **grads}
        self._taken = (values, grads)

    def take_grads(self) -> None:
        """Before the TP step: the module's weights and grads (read where its framework keeps
        them: `grad_of`), for an optimizer with nothing found (the replay then runs on those).
        Where the optimizer holds the framework's parameters, they get this step's gradients."""
        self._taken = None
        if self.refresh is not None:
            self.refresh()
        if not self.found:
            grads = {n: self.grad_of(p) for n, p in self._own.items()}
            self._taken = (
                {n: p.detach().clone() for n, p in self._own.items()},
                {n: None if g is None else g.detach().clone() for n, g in grads.items()},
            )

    def write_back(self) -> None:
        """Nothing: the user's optimizer writes its own weights."""

    def replay_inputs(self) -> tuple[dict, dict]:
        if self._taken is None:
            raise UsageError(
                "your tp_optimizer's step() did not step the torch optimizer found inside it "
                f"({type(self.optimizer).__name__}): tpcheck could not see what it stepped"
            )
        return self._taken

    def state_of(self, name: str, opt) -> dict | None:
        """The state of parameter `name` (tensors), or None: not observable."""
        s = self.found.get(name)
        return None if s is None else s.state()

    def update_observable(self) -> bool:
        """Whether the update can be held bitwise to the replay: only through a torch optimizer
        found inside (the same kernels). An optimizer that is none (a hand-written AdamW rounds 37
        of 4,096 elements 1 ulp away from torch's) is held to the dense weights after the step."""
        return bool(self.found)

    def check_copy_back(self, s: Sides, step: int) -> None:
        """After the step, each module weight must be its master rounded to the module's dtype
        (the wrapper's copy back), bitwise."""
        if not self.masters:
            return
        plan = s.plan
        for name, _ in s.dense.named_parameters():
            tp_name = plan.tp_name(name)
            stepped = self.found.get(tp_name)
            p = self._own.get(tp_name)
            if stepped is None or p is None or stepped.holds(p):
                continue
            s.cmp.compare_local(
                "optimizer",
                step,
                CheckId("weight", name),
                p.detach(),
                stepped.value.to(p.dtype),
                plan.params[name],
                "bitwise: your optimizer's master, rounded into the module's weight",
            )


def check_masters(tp_side: UserOptimizer, dense_side, settings) -> None:
    """A user's optimizer with float32 masters is held to a dense side with masters: refused in a
    16-bit run without them (pure 16-bit parameters on the dense side), naming the setting."""
    if tp_side.masters and not dense_side.masters and settings.dtype in ("bfloat16", "float16"):
        raise UsageError(
            f"your tp_optimizer ({type(tp_side.optimizer).__name__}) steps float32 master copies "
            f"of the module's {settings.dtype} weights, but the run has master_weights=False (the "
            "dense side steps pure 16-bit parameters): run with master_weights=True (the default)"
        )


def no_masters_note(optimizer, dtype: str) -> str:
    """The report's note (after "not checked: ") when the dense side follows a user's optimizer
    without masters."""
    return (
        f"float32 master weights: your tp_optimizer ({type(optimizer).__name__}) steps the "
        f"module's {dtype} weights directly, and so does the dense side here (as with "
        "master_weights=False)"
    )


# the choices of a torch optimizer that change its rounding, not its rule
IMPLEMENTATION = ("fused", "foreach")


def implementation(inner: list, rule: torch.optim.Optimizer) -> dict:
    """The implementation flags (`fused`, `foreach`) the user's torch optimizers picked where they
    differ from the rule's: only when every one is of the rule's own class and all agree (its
    kernels round differently, so the rule and its bitwise replay must run the same ones); {}
    otherwise (another class: the replay holds it to the rule's arithmetic)."""
    if not inner or any(type(o) is not type(rule) for o in inner):
        return {}
    picked = {}
    for key in IMPLEMENTATION:
        if key not in rule.defaults:
            continue
        values = {bool(g.get(key)) for o in inner for g in o.param_groups}
        if len(values) == 1 and (v := values.pop()) != bool(rule.defaults.get(key)):
            picked[key] = v
    return picked


def implementation_note(rule: torch.optim.Optimizer, picked: dict) -> str:
    """The report's note (after "not checked: ") when the rule runs the user's kernels."""
    said = ", ".join(f"{k}={v}" for k, v in sorted(picked.items()))
    return (
        f"the rule's default kernels: your tp_optimizer's {type(rule).__name__} runs {said}, "
        "and so do the dense rule, its replay and the float64 truth (kernels round differently; "
        "the rule is the same)"
    )


def follow(opt: torch.optim.Optimizer, picked: dict) -> torch.optim.Optimizer:
    """`opt` running the implementation `picked` (its defaults and every parameter group)."""
    if picked.get("fused"):
        picked = {**picked, "foreach": False}  # torch refuses both
    for target in (opt.defaults, *opt.param_groups):
        target.update(picked)
    return opt


def restart_masters(masters, source, plan: Plan, group) -> None:
    """Each step's restart of what one TP optimizer steps apart from the module (float32 masters,
    tpcheck's or found in the user's optimizer): the plan's shard of the dense side's."""
    mine = dict(masters.named_parameters())
    with torch.no_grad():
        for name, p in source.named_parameters():
            t = mine.get(plan.tp_name(name))
            if t is not None and plan.params[name].held_on(group.rank, group.world_size):
                t.copy_(plan.params[name].shard(p.detach(), group.rank, group.world_size))


UNREPLAYED = (
    "not compared bitwise (no torch optimizer found inside yours: its arithmetic may round "
    "differently from the rule's); the weights after each step are checked against the dense ones"
)


def notes(unobserved: dict[str, dict]) -> list[str]:
    """The report's notes on what a user's optimizer kept out of sight (`what` -> parameters)."""
    out = []
    for what, names in unobserved.items():
        listed = ", ".join(list(names)[:4]) + (", ..." if len(names) > 4 else "")
        why = UNOBSERVABLE if what == "state" else UNREPLAYED
        out.append(f"optimizer {what} of {len(names)} parameter(s) ({listed}): {why}")
    return out


def zero_grad(opt) -> None:
    """`opt.zero_grad(set_to_none=True)`, or the user's `zero_grad()` when it takes no argument."""
    fn = getattr(opt, "zero_grad", None)
    if fn is None:
        return
    try:
        fn(set_to_none=True)
    except TypeError:
        fn()


# ------------------------------------------------------------------------------ clipping


def clip_tp(
    module: nn.Module,
    max_norm: float,
    group,
    plan: Plan,
    shapes: dict[str, tuple[int, ...]],
    grad_of=None,
) -> torch.Tensor:
    """tpcheck's TP-aware `clip_grad_norm_`: the squared norm of every element counted once over
    the ranks (a sharded parameter's shard on each rank, summed by one all-reduce, an element
    several ranks hold -- GQA's KV heads replicated over ranks -- divided among them; a replicated
    one once; one held or applied on one rank where its gradient is), then every gradient scaled
    by `max_norm / (norm + 1e-6)` where that is below 1, as torch's. `shapes`: the dense ones;
    `grad_of`: where the gradients are (scaled in place there)."""
    grads = _grads_by_dense_name(module, plan, grad_of)
    summed = torch.zeros((), dtype=torch.float32, device=group.device)
    replicated = torch.zeros((), dtype=torch.float32, device=group.device)
    for name, g in grads.items():
        placement = plan.params[name]
        if placement.replicated and placement.applied_on is None:
            replicated = replicated + g.float().pow(2).sum()
            continue
        sq = g.float().pow(2).reshape(-1)
        held = copies(placement, shapes[name], group.world_size)
        if held is not None:  # each element's square shared among the ranks that hold it
            idx = placement.index_map(shapes[name], group.rank, group.world_size).reshape(-1)
            sq = sq / held[idx].to(sq.device, sq.dtype)
        summed = summed + sq.sum()
    if group.world_size > 1:
        summed = group.collective("all_reduce", summed, site=CLIP_SITE, phase="optimizer")
    total = (summed + replicated).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads.values():
        g.mul_(coef.to(g.dtype))
    return total


def expected_collectives(case) -> tuple | None:
    """The case's expected collectives, with the default clipping's all-reduce where it runs."""
    expected = case.expected_collectives
    if expected is None or case.run.clip_grad_norm is None or case.tp_clip_grad_norm is not None:
        return expected
    return (*expected, ("optimizer", "all_reduce", CLIP_SITE))


def _grads_by_dense_name(module: nn.Module, plan: Plan, grad_of=None) -> dict[str, torch.Tensor]:
    """Each TP gradient (`grad_of(p)`, default `.grad`) by dense name, where there is one."""
    tp_names = {plan.tp_name(n): n for n in plan.params}
    grads = {n: p.grad if grad_of is None else grad_of(p) for n, p in module.named_parameters()}
    return {tp_names[n]: g for n, g in grads.items() if g is not None and n in tp_names}


def clip_grads(s: Sides, step: int) -> float:
    """The step's gradient clipping on every side, and the check of the two total norms
    (`clip:grad_norm`), with the numbers that name a TP norm of local shards only or of replicated
    parameters counted once per rank (`clip_diagnosis` in checker/verdict/diagnose.py). Returns
    the dense side's clip coefficient (torch's: max_norm / (norm + 1e-6), at most 1)."""
    max_norm = s.settings.clip_grad_norm
    parts = _norm_parts(s)
    dense_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in s.dense.parameters() if p.grad is not None], max_norm
    )
    truth_norm = dense_norm
    if s.truth is not None and s.truth is not s.dense:
        truth_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in s.truth.parameters() if p.grad is not None], max_norm
        )
    elif s.truth is None:
        truth_norm = None
    clip = s.case.tp_clip_grad_norm
    with s.tap.tp_phase("optimizer"):
        if clip is None:
            shapes = {n: tuple(p.shape) for n, p in s.dense.named_parameters()}
            tp_norm = clip_tp(s.tp, max_norm, s.group, s.plan, shapes, s.grad_of)
        else:  # the module as the framework holds it (DTensor parameters stay DTensors)
            held = s.tp.as_held() if hasattr(s.tp, "as_held") else s.tp
            tp_norm = clip(held, max_norm, s.group)
    tp_norm = _as_norm(tp_norm)
    check = s.cmp.compare(
        "optimizer",
        step,
        CLIP_NORM,
        tp_norm.to(dense_norm.dtype).reshape(()),
        dense_norm.detach().reshape(()),
        None if truth_norm is None else truth_norm.detach().reshape(()),
        Replicate(),
    )
    s.cmp.evidence.annotate(
        evidence_key(check.stage, check.step, check.id),
        "clip",
        {**parts, "world": s.group.world_size},
    )
    return min(1.0, max_norm / (float(dense_norm) + 1e-6))


def tp_grads(s: Sides) -> dict[str, torch.Tensor]:
    """A copy of every TP gradient on this rank, by dense name (before the clipping scales them)."""
    grads = _grads_by_dense_name(s.tp, s.plan, s.grad_of)
    return {n: g.detach().clone() for n, g in grads.items()}


def keep_clip_scales(s: Sides, step: int, before: dict[str, torch.Tensor], coef: float) -> None:
    """Beside each `clipped:` check's evidence: the factor the TP clipping scaled each of this
    rank's gradients by (`<after, before> / <before, before>`), the dense coefficient `coef`, and
    the parameters whose gradient it left unscaled while `coef` is below 1 (the diagnosis names
    them: checker/verdict/clipping.py)."""
    after = _grads_by_dense_name(s.tp, s.plan, s.grad_of)
    scales = {}
    for name, g in before.items():
        if name not in after:
            continue
        b, a = g.double().reshape(-1), after[name].detach().double().reshape(-1)
        norm = float(b @ b)
        if norm > 0 and math.isfinite(norm):
            scales[name] = float(a @ b) / norm
    tol = max(1e-3, 2 * float(torch.finfo(s.dtype).eps))
    unscaled = (
        sorted(n for n, k in scales.items() if abs(k - 1.0) <= tol) if coef < 1 - 4 * tol else []
    )
    info = {"coef": coef, "scales": scales, "unscaled": unscaled, "tol": tol}
    for name in before:
        key = evidence_key("optimizer", step, CheckId("clipped", name))
        s.cmp.evidence.annotate(key, "clip_scales", info)


def _as_norm(value) -> torch.Tensor:
    if hasattr(value, "full_tensor"):  # a DTensor norm (replicated after its reduction)
        value = value.full_tensor()
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        return value.detach().reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return torch.tensor(float(value), dtype=torch.float64)  # a Python float is a double
    raise UsageError(
        f"your tp_clip_grad_norm returned {type(value).__name__} {value!r}; expected the total "
        "gradient norm (a one-element tensor or a number), as torch.nn.utils.clip_grad_norm_ "
        "returns it"
    )


def _norm_parts(s: Sides) -> dict[str, float]:
    """From the dense gradients before clipping, the squared norms a TP norm could have summed:
    `correct` (every element once), `local` (this rank's own squares: no all-reduce),
    `replicated_world` (every rank's own squares summed: replicated parameters, and elements
    several ranks hold, counted once per rank holding them)."""
    plan, rank, world = s.plan, s.group.rank, s.group.world_size
    correct = local = summed = 0.0
    for name, p in s.dense.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().double()
        placement = plan.params[name]
        full = float(g.pow(2).sum())
        correct += full
        if placement.applied_on is not None:  # its gradient on one rank only
            local += full if placement.applied_on == rank else 0.0
            summed += full
            continue
        mine = [float(placement.shard(g, r, world).pow(2).sum()) for r in range(world)]
        local += mine[rank]
        summed += sum(mine)
    return {"correct": correct, "local": local, "replicated_world": summed}
