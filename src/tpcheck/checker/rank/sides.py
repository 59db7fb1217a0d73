"""The sides of one case on one rank, built once: what every stage receives.

`Sides` is a frozen record of the three models (the dense one in the working dtype, the float64
truth -- on rank 0 only, the dense model itself in a float64 run -- and the TP one), the comparator
every check goes through, the discovery of the plan, the random draws, the collective tap, the
group and the rendezvous, where the TP side's gradients are read (grad_source.py), and the run
settings. A stage module (params.py, passes.py,
optimizer_stage.py, buffers.py, warmup.py, forward_only.py, manifest.py, grad_evidence.py) is a
function of a `Sides` (and, for the optimizer stages, of the `Optimizers` built over it): none
imports the engine, so each can be run on a fake `Sides` in a test. The engine (engine.py) is the
step loop over them.

`build_sides` is the case's set-up, in the order the seed fixed: the first batch is drawn before
the weights; the dense model is built in float32 on the CPU (where the seeded init draws), copied
into the working dtype and float64; the TP model is built and loaded from the float32 master (the
user's `load_tp` once, else the plan). A failure is told to the other ranks before they issue a
collective (`Rendezvous.setup_failed`).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from tpcheck.checker.case import Case
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.discover import Discovery
from tpcheck.checker.rank.grad_source import GradSource
from tpcheck.checker.rank.ledger import CollectiveTap, sync_ledgers
from tpcheck.checker.rank.loading import cast, check_names, leaf, load_from_dense, map_tensors
from tpcheck.checker.rank.rng import RandomDraws
from tpcheck.checker.rank.rounding import Twin
from tpcheck.checker.rank.shard_ops import ShardOps
from tpcheck.checker.rank.tolerance import Bound
from tpcheck.checker.settings import RunSettings
from tpcheck.checker.sync import Rendezvous
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Plan, Replicate


@dataclass(frozen=True, eq=False)
class Sides:
    """One case on one rank: the models, the comparator, the discovered plan, the settings."""

    case: Case
    group: TPGroup
    tap: CollectiveTap
    rendezvous: Rendezvous
    cmp: Comparator
    draws: RandomDraws
    discovery: Discovery
    dense: nn.Module
    truth: nn.Module | None  # rank 0's float64 copy; `dense` itself in a float64 run
    tp: nn.Module
    gen: torch.Generator  # the batches' generator, on the CPU
    first_batch: tuple  # (inputs, target), drawn before the weights, as the seed
    shard_ops: ShardOps  # the reductions and splits of step 1 (shard_ops.py)
    # where the TP side's gradients are read: `.grad`, or the framework's (grad_source.py)
    grad_of: GradSource = field(default_factory=GradSource)
    wait_threads: int = 1  # threads for rank 0's float64 passes while the others wait
    # (step, module): the dense side's outputs captured (the manifest's count: manifest.py)
    produced: collections.Counter = field(default_factory=collections.Counter)
    # the dense model's rounding twin, on rank 0 (rounding.py)
    twin: Twin = field(default_factory=Twin)

    @property
    def settings(self) -> RunSettings:
        return self.case.run

    @property
    def dtype(self) -> torch.dtype:
        return self.case.run.torch_dtype

    @property
    def device(self) -> torch.device:
        return self.group.device

    @property
    def plan(self) -> Plan:
        """The plan as known so far: written, or inferred as the run reveals it (discover.py)."""
        return self.discovery.plan

    @property
    def twin_wanted(self) -> bool:
        """Whether this rank may run the dense model's rounding twin: it holds a float64 truth of
        its own, in a run of another dtype."""
        return self.has_truth and self.dtype != torch.float64

    @property
    def has_truth(self) -> bool:
        """Whether a float64 truth apart from the dense model runs on this rank."""
        return self.truth is not None and self.truth is not self.dense

    def models(self) -> list[nn.Module]:
        """Every model this rank holds: dense, TP, and the truth where it is one of its own."""
        return [self.dense, self.tp] + ([self.truth] if self.has_truth else [])

    def sync(self, where: str) -> None:
        sync_ledgers(self.tap, self.rendezvous, where)

    def batch(self) -> tuple:
        """The next batch: drawn by `make_batch` from the case's generator (on the CPU, so every
        device draws the same values), then on this rank's device."""
        return _batch(self.case, self.gen, self.device)

    def tp_inputs(self, inputs: dict, wanted: tuple = ()) -> dict:
        """The TP side's forward inputs: each placed as `input_placements` says (Replicate by
        default); those in `wanted` are leaves that collect their gradient."""
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

    def truth_bound(self, dense: torch.Tensor, truth: torch.Tensor) -> Bound | None:
        """The bound of a captured tensor, calibrated when the truth produces it against the dense
        side's copy (what `Comparator.compare` would calibrate later), so that no float64 copy is
        held; None (keep the copy) where the truth is not finite, for the comparison to name
        the bad reference."""
        bound = self.cmp.calibrated(dense, truth)
        return bound if math.isfinite(bound.value) else None


def _batch(case: Case, gen: torch.Generator, device) -> tuple:
    inputs, target = case.make_batch(gen, case.run.torch_dtype)
    move = lambda t: t.to(device)  # noqa: E731
    return map_tensors(move, inputs), map_tensors(move, target)


def build_sides(case: Case, group: TPGroup, rendezvous: Rendezvous, wait_threads: int = 1) -> Sides:
    """The case's set-up on this rank (module docstring); the other ranks are told of a failure
    before they issue a collective."""
    assert isinstance(group.tap, CollectiveTap), "the TP side runs through the checker's tap"
    try:
        built = _build(case, group, rendezvous)
    except Exception as e:  # noqa: BLE001 - tell the other ranks before they issue a collective
        rendezvous.setup_failed(
            f"{type(e).__name__}: {e}" if not isinstance(e, UsageError) else str(e)
        )
        raise
    rendezvous.setup_done()
    discovery = Discovery(case, group, rendezvous, built["dense"], built["tp"])
    return Sides(
        case=case,
        group=group,
        tap=group.tap,
        rendezvous=rendezvous,
        discovery=discovery,
        shard_ops=ShardOps(case.run.capture),
        grad_of=GradSource(case.grad_of),
        wait_threads=wait_threads,
        **built,
    )


def _build(case: Case, group: TPGroup, rendezvous: Rendezvous) -> dict:
    run, device = case.run, group.device
    dtype = run.torch_dtype
    cmp = Comparator(group, group.tap, dtype, run.dtype, run.uses_masters)
    gen = torch.Generator().manual_seed(run.seed)
    # the dense side's dropout masks and the checks of the TP side's draws (rng.py)
    draws = RandomDraws(run.seed, case.dropout, cmp, rendezvous, device)
    first_batch = _batch(case, gen, device)  # drawn before the weights, as the seed
    master = case.build_dense(torch.float32)  # on the CPU, where the seeded init draws
    case.init(master, gen)
    dense = _copy_of(case, master, dtype, device)
    if dtype == torch.float64:
        truth = dense
    else:
        truth = _copy_of(case, dense, torch.float64, device) if group.rank == 0 else None
    if case.plan is not None:
        case.plan.check_against(dense, group.world_size)
    if case.inject.intercept is not None:
        group.tap.interceptor = case.inject.intercept(group)
    if case.setup is not None:
        case.setup(group)
    tp = case.build_tp(group, dtype)
    _load_tp(case, tp, master, group, dtype)  # from the float32 master
    tp.to(device)
    if case.inject.tamper is not None:
        case.inject.tamper(tp, group)
    return dict(
        cmp=cmp, draws=draws, dense=dense, truth=truth, tp=tp, gen=gen, first_batch=first_batch
    )


def _load_tp(case: Case, tp: nn.Module, dense: nn.Module, group: TPGroup, dtype) -> None:
    """The TP module's weights from the dense ones, once, before the optimizers are built: the
    user's own `load_tp` when the case has one (checked at the weights stage, never overwritten;
    its names held to a written plan), else through the fault's own loading plan or the case's."""
    plan = case.plan
    if case.load_tp is None:
        load_from_dense(tp, dense, case.inject.load_plan or plan, group)
        return
    if plan is not None:
        check_names(tp, dense, plan, group)
    # full tensors in float32 (float64 in a float64 run: the truth's own precision)
    full = torch.float64 if dtype == torch.float64 else torch.float32
    state = {name: p.detach().to(full).clone() for name, p in dense.named_parameters()}
    with torch.no_grad():
        case.load_tp(tp, state, group)


def _copy_of(case: Case, src: nn.Module, dtype: torch.dtype, device) -> nn.Module:
    """A dense model in `dtype` with `src`'s weights, on this rank's device."""
    model = case.build_dense(dtype)
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.named_parameters(), src.named_parameters()):
            p.copy_(q.to(dtype))
    return model.to(device)
