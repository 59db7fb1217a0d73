"""Check a `torch.distributed.tensor.parallel.parallelize_module` plan against the dense module.

    case = dtensor_case(name="llama", build_dense=MyModel, tp_plan={"layers.*.attention.wq":
                        ColwiseParallel(), ...}, make_batch=make_batch)

The TP side is `parallelize_module(copy_of_dense, DeviceMesh(device, ranks), tp_plan)` on the ranks'
existing group (gloo on the CPU, NCCL with --device cuda). Its parameters are DTensors, so the
engine sees it through `LocalShards`: a module whose parameters are plain tensors, each the local
shard of one DTensor parameter, named as the dense parameter. Every forward rebuilds the DTensors
from them (`DTensor.from_local`, no copy, no communication) and calls the parallelized module with
them (`torch.func.functional_call`); gradients flow back to the local shards through `from_local`'s
backward, which redistributes a grad to the parameter's own placement (a replicated norm weight's
partial grad under sequence parallelism is all-reduced there). AdamW and SGD are elementwise, so
stepping the local shards is exactly what a DTensor optimizer computes.

Per-module checks: the output of every module the plan parallelizes is compared with the dense
module's, placed as the style lays it out (ColwiseParallel: sharded on the last dim;
RowwiseParallel: replicated, or its `output_layouts`; SequenceParallel: sharded on the sequence
dim), so a plan bug names its module, not only the model's output.

The tpcheck plan is derived from the DTensor placements: `Shard(d)` -> `Shard(d)`, `Replicate` ->
`Replicate`. It is derived once without a process group, from torch's documented style rules
(Colwise: Linear weight/bias Shard(0), Embedding weight Shard(1); Rowwise: Linear weight Shard(1),
bias Replicate, Embedding weight Shard(0); everything else replicated), and on every rank the real
DTensor placements are checked against it (a custom ParallelStyle that places differently is an
error naming the parameter; pass `placements=` for it).

Collectives: DTensor's collectives do not pass through a TPGroup, so the functional collectives it
calls are counted (`_CollectiveCount`), per phase, into the case's ledger (site "dtensor"): forward
= during the module's forward; backward = from the output's gradient to the end of the backward
pass. The checker compares the ledgers of all ranks like any other, and reports them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from tpcheck.checker.case import Case
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Placement, Plan, Replicate, Shard

_MESHES: dict[tuple[int, str], object] = {}


def device_mesh(group: TPGroup):
    """A 1-D mesh on the rank's device over its existing default group (gloo on the CPU, NCCL on
    GPUs); one per world size and device per process."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (group.world_size, group.device.type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(group.device.type, list(range(group.world_size)))
    return _MESHES[key]


# ------------------------------------------------------------------------------ the plan


def _style_placements(style, module: nn.Module) -> dict[str, Placement]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    local = {n: Replicate() for n, _ in module.named_parameters(recurse=False)}
    if isinstance(style, ColwiseParallel):
        dim = 1 if isinstance(module, nn.Embedding) else 0
        local.update({n: Shard(dim) for n in local})
    elif isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Embedding):
            local["weight"] = Shard(0)
        elif "weight" in local:
            local["weight"] = Shard(1)
    return local


def _matches(pattern: str, name: str) -> bool:
    a, b = pattern.split("."), name.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(a, b))


def _output_placement(style) -> Placement | None:
    """How the output of a module under `style` lies on this rank, as tpcheck compares it: the
    style's output layout (ColwiseParallel: Shard(-1); RowwiseParallel: Replicate unless told;
    SequenceParallel: Shard(sequence dim)). None for a style whose output tpcheck does not know,
    or a Partial one."""
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if isinstance(style, SequenceParallel):
        layout = style.sequence_sharding
    elif isinstance(style, (ColwiseParallel, RowwiseParallel)):
        layout = style.output_layouts
    else:
        return None
    layout = layout[0] if isinstance(layout, tuple) else layout
    if isinstance(layout, DShard):
        return Shard(layout.dim)
    if isinstance(layout, DReplicate):
        return Replicate()
    return None


def derive_plan(
    dense: nn.Module, tp_plan: dict, placements: dict[str, Placement] | None = None
) -> Plan:
    """{dense parameter: tpcheck placement} for `parallelize_module(dense, mesh, tp_plan)`, and the
    output placement of every module the plan parallelizes (its per-module check)."""
    params: dict[str, Placement] = {n: Replicate() for n, _ in dense.named_parameters()}
    activations: dict[str, Placement] = {}
    for pattern, style in tp_plan.items():
        hits = [(n, m) for n, m in dense.named_modules() if _matches(pattern, n)]
        if not hits:
            raise UsageError(
                f"the DTensor plan's key {pattern!r} matches no submodule of the dense model; "
                f"modules are {[n for n, _ in dense.named_modules() if n][:12]}..."
            )
        for name, module in hits:
            for pname, placement in _style_placements(style, module).items():
                params[f"{name}.{pname}" if name else pname] = placement
            if name and (out := _output_placement(style)) is not None:
                activations[name] = out
    params.update(placements or {})
    return Plan(params=params, activations=activations)


def from_dtensor_placements(placements, ndim: int, name: str) -> Placement:
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    (p,) = placements  # a 1-D mesh
    if isinstance(p, DShard):
        return Shard(p.dim % ndim)
    if isinstance(p, DReplicate):
        return Replicate()
    raise UsageError(
        f"parameter {name!r} is placed {p} by the DTensor plan; tpcheck compares Shard and "
        "Replicate parameters only"
    )


# ------------------------------------------------------------------------------ the TP side


class LocalShards(nn.Module):
    """The engine's view of a parallelized module: plain local parameters under the dense names.

    The parallelized module is held outside the module tree (its DTensor parameters stay hidden);
    `forward` feeds it DTensors made from the local shards. With a plan, each DTensor's placement is
    checked against it; without one (a plan inferred from the values), any placement is taken."""

    def __init__(self, parallel: nn.Module, mesh, group: TPGroup, plan: Plan | None) -> None:
        super().__init__()
        object.__setattr__(self, "parallel", parallel)
        self.mesh, self.group = mesh, group
        self.specs: dict[str, tuple] = {}  # name -> (placements, global shape, global stride)
        self.shards = nn.ParameterDict()
        for name, p in parallel.named_parameters():
            if hasattr(p, "to_local"):
                seen = (
                    from_dtensor_placements(p.placements, p.dim(), name)
                    if plan is not None
                    else None
                )
                if plan is not None and str(seen) != str(plan.params[name]):
                    raise UsageError(
                        f"parameter {name!r}: the DTensor plan placed it {seen}, the derived plan "
                        f"says {plan.params[name]}; pass placements={{{name!r}: "
                        f"{seen!r}}} to dtensor_case"
                    )
                self.specs[name] = (p.placements, p.shape, p.stride())
                local = p.to_local()
            else:
                local = p
            self.shards[name.replace(".", "__")] = nn.Parameter(local.detach().clone())
        # an open counting mode from a step's first forward to the end of its backward
        self.comm = None

    def as_held(self) -> nn.Module:
        """The parallelized module as the framework holds it, for the user's own clipping and
        optimizer (`Case(tp_clip_grad_norm=...)`, `Case(tp_optimizer=...)`): each DTensor
        parameter a DTensor over this rank's local shard, its gradient a DTensor over the shard's
        gradient (no copy: the same storage), every other parameter the shard itself. A norm over
        its gradients is the global one, as in the real run (torch's `clip_grad_norm_` reduces
        DTensor norms over the mesh), scaling them in place scales the shards' gradients, and an
        optimizer stepping them steps the shards. The DTensor parameters are made once (an
        optimizer holds them from step to step); each call hands them the shards' gradients of
        the moment."""
        from torch.distributed.tensor import DTensor

        kept = self.__dict__.setdefault("_held", {})
        for name, local in self.named_parameters():
            owner, _, leaf = name.rpartition(".")
            module = self.parallel.get_submodule(owner)
            if name not in self.specs:
                module._parameters[leaf] = local
                continue
            placements, shape, stride = self.specs[name]

            def held(t, placements=placements, shape=shape, stride=stride):
                return DTensor.from_local(
                    t, self.mesh, placements, run_check=False, shape=shape, stride=stride
                )

            p = kept.get(name)
            if p is None or p._local_tensor.data_ptr() != local.data_ptr():
                p = kept[name] = nn.Parameter(held(local.detach()), local.requires_grad)
            p.grad = None if local.grad is None else held(local.grad)
            module._parameters[leaf] = p
        return self.parallel

    def capture_modules(self):
        """The parallelized module's submodules, under
        the dense names: their outputs are checked."""
        return self.parallel.named_modules()

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ):
        for key, p in self.shards.items():
            yield prefix + key.replace("__", "."), p

    def train(self, mode: bool = True):
        """The parallelized module (outside the module tree) follows: `eval()` puts its modules in
        eval mode (no dropout, a norm's running statistics), the next `train()` gives each back its
        own mode (a HuggingFace model is built in eval mode)."""
        super().train(mode)
        if self.parallel is None:
            return self
        if not mode:
            self._hidden_modes = [(m, m.training) for m in self.parallel.modules()]
            self.parallel.train(False)
        elif (kept := self.__dict__.pop("_hidden_modes", None)) is not None:
            for m, training in kept:
                m.training = training
        else:
            self.parallel.train(True)
        return self

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The parallelized module's buffers (rotary caches, running statistics) under the dense
        names, as the checker compares them (checker/rank/buffers.py)."""
        if self.parallel is not None:
            yield from self.parallel.named_buffers(prefix, recurse, remove_duplicate)

    def _params(self) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        out = {}
        for name, p in self.named_parameters():
            if name in self.specs:
                placements, shape, stride = self.specs[name]
                p = DTensor.from_local(
                    p, self.mesh, placements, run_check=False, shape=shape, stride=stride
                )
            out[name] = p
        return out

    def forward(self, **inputs):
        # one mode per step: every micro-batch's forward and backward, to finalize_grads
        if self.comm is None:
            self.comm = _counting_mode()
            self.comm.__enter__()
        before = _counts(self.comm)
        out = self.call(self._params(), inputs)
        if hasattr(out, "to_local"):
            out = out.to_local()
        self._record("forward", before)
        if out.requires_grad:
            out.register_hook(self._on_backward_start)
        return out

    def call(self, params: dict[str, torch.Tensor], inputs: dict):
        """The parallelized module's forward with `params` (DTensors made from the local shards)."""
        return torch.func.functional_call(self.parallel, params, args=(), kwargs=inputs)

    def _on_backward_start(self, grad):
        start = _counts(self.comm)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._record("backward", start)
        )
        return grad

    def _record(self, phase: str, since: Counter) -> None:
        # the checker's tap records; a bare group does not
        note = getattr(self.group.tap, "note", None)
        if self.comm is None or note is None:
            return
        now = _counts(self.comm)
        for op, n in sorted((now - since).items()):
            for _ in range(n):
                note(op, "dtensor", phase)

    def _close(self) -> None:
        if self.comm is not None:
            self.comm.__exit__(None, None, None)
            self.comm = None

    def finalize_grads(self) -> None:
        """Called by the engine after the backward passes of a step: stop counting collectives."""
        self._close()


# DTensor's collectives, at the Python layer it issues them through (placements and redistribution
# call `funcol.<name>(...)`, looked up on the module at call time): {function: the ledger's op}.
_FUNCOL = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_tensor": "all_gather",
    "all_gather_inplace": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "permute_tensor": "all_to_all",
}
_ACTIVE: list[Counter] = []  # the open counters (innermost last); counted only while one is open
_DEPTH = [0]  # a funcol function calling another counts once


def _install_funcol_counting() -> None:
    """Wrap the functional collectives DTensor calls, once per process. A wrapped function costs one
    list lookup when no counter is open, so only the TP side's phases pay for it."""
    import torch.distributed._functional_collectives as funcol

    for fname, op in _FUNCOL.items():
        original = getattr(funcol, fname, None)
        if original is None or getattr(original, "_tpcheck_counted", False):
            continue

        def counted(*args, __original=original, __op=op, **kwargs):
            if _ACTIVE and _DEPTH[0] == 0:
                _ACTIVE[-1][__op] += 1
            _DEPTH[0] += 1
            try:
                return __original(*args, **kwargs)
            finally:
                _DEPTH[0] -= 1

        functools.update_wrapper(counted, original)
        counted._tpcheck_counted = True
        setattr(funcol, fname, counted)


class _CollectiveCount:
    """Counts, while open, the collectives DTensor issues (`counts`: {op: n}). Not torch's
    CommDebugMode, nor any dispatch mode: a Python dispatch mode sees every op of the TP forward and
    backward and made a HuggingFace check ~1.6x slower; and in torch 2.13 CommDebugMode's module
    tracker leaks the hooks of a module called twice in one forward (IndexError in
    `_fw_set_module_hook`)."""

    def __init__(self) -> None:
        _install_funcol_counting()
        self.counts: Counter = Counter()

    def __enter__(self):
        _ACTIVE.append(self.counts)
        return self

    def __exit__(self, *exc) -> None:
        if self.counts in _ACTIVE:
            _ACTIVE.remove(self.counts)


def _counting_mode() -> _CollectiveCount:
    return _CollectiveCount()


def _counts(comm) -> Counter:
    return Counter(comm.counts)


# ------------------------------------------------------------------------------ the Case


def dtensor_case(
    *,
    name: str,
    build_dense: Callable[[torch.dtype], nn.Module],
    tp_plan: dict,
    make_batch: Callable,
    placements: dict[str, Placement] | None = None,
    prepare: Callable[[nn.Module, TPGroup], nn.Module | None] | None = None,
    **fields,
) -> Case:
    """A Case whose TP side is `parallelize_module(build_dense(dtype), mesh, tp_plan)`. `prepare`:
    the framework's own step before `parallelize_module` (a library's `prepare_*_for_tp` that
    rewrites head counts for the ranks), called with the fresh copy and the group; it may return
    the module to parallelize (None: the copy, changed in place). `fields` are any other Case
    fields (init, loss, tp_loss, input_placements, output_placement, steps, ...)."""
    plan = derive_plan(build_dense(torch.float32), tp_plan, placements)

    def build_tp(group: TPGroup, dtype: torch.dtype) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = device_mesh(group)
        module = build_dense(dtype)
        if prepare is not None:
            prepared = prepare(module, group)
            module = module if prepared is None else prepared
        parallel = parallelize_module(module, mesh, dict(tp_plan))
        return LocalShards(parallel, mesh, group, plan)

    return Case(
        name=name,
        build_dense=build_dense,
        build_tp=build_tp,
        plan=plan,
        make_batch=make_batch,
        **fields,
    )


def _is_dtensor(p: torch.Tensor) -> bool:
    return hasattr(p, "to_local") and hasattr(p, "device_mesh")


def with_dtensor_modules(case: Case) -> Case:
    """A case file's `build_tp` may return a module with DTensor parameters (the common
    `parallelize_module(model, mesh, plan)` result): the engine then sees it through
    `LocalShards` over the DTensors' 1-D mesh, with the case's plan (checked against the DTensors'
    placements) or, without one, the plan inferred from the local shards' values. The user's
    `load_tp` receives the module as built (`LocalShards.as_held`: DTensor parameters over the
    shards' storage). A module without DTensor parameters is left as it is."""
    build, load = case.build_tp, case.load_tp

    def build_tp(group: TPGroup, dtype: torch.dtype) -> nn.Module:
        tp = build(group, dtype)
        held = [p for p in tp.parameters() if _is_dtensor(p)]
        if isinstance(tp, LocalShards) or not held:
            return tp
        if held[0].device_mesh.ndim != 1:
            raise UsageError(
                f"your build_tp returned DTensor parameters on a {held[0].device_mesh.ndim}-D "
                "mesh; tpcheck checks the TP dimension alone: parallelize over a 1-D mesh of the "
                "ranks (init_device_mesh(device, (world_size,)))"
            )
        shards = LocalShards(tp, held[0].device_mesh, group, case.plan)
        shards.built_by_user = True
        return shards

    def load_tp(tp: nn.Module, state: dict, group: TPGroup) -> None:
        return load(tp.as_held() if getattr(tp, "built_by_user", False) else tp, state, group)

    load_tp.__wrapped__ = load  # the user's file:line in messages
    build_tp.__wrapped__ = build
    return dataclasses.replace(case, build_tp=build_tp, load_tp=None if load is None else load_tp)
