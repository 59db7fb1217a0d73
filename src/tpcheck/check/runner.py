"""The per-rank engine: run one Case on this rank and compare every tensor through the plan.

Each rank checks its own local tensors against the plan's shard of the reference (so every rank is
checked, not only rank 0), and replicated tensors are compared across ranks, bitwise. Nothing here
knows a layer: shapes and layouts come from the plan.

Three models run on every rank: the dense model in the working dtype, a float64 copy of it (the
ground truth that calibrates tolerances) and the TP model. All start from the same weights.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from tpcheck.check import tolerance
from tpcheck.check.case import Case
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.layers import finalize_grads
from tpcheck.plan import Placement, Replicate


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives, or some never reached a checkpoint (a hang)."""


@dataclass
class Check:
    """One comparison on one rank. error: max |TP - truth| (or |TP - dense| for exact checks);
    diff_vs_dense: max |TP - dense| in the working dtype (the seed's metric)."""

    stage: str  # weights | forward | loss | backward | grads | optimizer
    step: int
    name: str
    rank: int
    error: float
    diff_vs_dense: float
    bound: float
    kind: str  # exact | calibrated | fp64 | replica
    reason: str
    passed: bool
    placement: str = "replicate"


class RankRun:
    """State of one case on one rank: the three models, their optimizers and the checks so far."""

    def __init__(self, case: Case, group: TPGroup) -> None:
        self.case, self.group = case, group
        self.dtype = case.torch_dtype
        self.checks: list[Check] = []
        self.gen = torch.Generator().manual_seed(case.seed)
        self.first_batch = case.make_batch(self.gen, torch.float32)  # drawn before the weights, as the seed
        master = case.build_dense(torch.float32)
        case.init(master, self.gen)
        self.dense = self._copy_of(master, self.dtype)
        self.truth = self.dense if self.dtype == torch.float64 else self._copy_of(self.dense, torch.float64)
        case.plan.check_against(self.dense, group.world_size)
        self.tp = case.build_tp(group, self.dtype)
        load_from_dense(self.tp, self.dense, case, group)
        if case.tamper is not None:
            case.tamper(self.tp, group)
        self.models = [self.dense, self.tp] + ([] if self.truth is self.dense else [self.truth])
        self.opts = [case.make_optimizer(m.parameters()) for m in self.models]

    def _copy_of(self, src: nn.Module, dtype: torch.dtype) -> nn.Module:
        model = self.case.build_dense(dtype)
        with torch.no_grad():
            for (name, p), (_, q) in zip(model.named_parameters(), src.named_parameters()):
                p.copy_(q.to(dtype))
        return model

    # ------------------------------------------------------------------ comparisons

    def compare(self, stage: str, step: int, name: str, tp_local: torch.Tensor, dense: torch.Tensor,
                truth: torch.Tensor, placement: Placement, exact: bool = False) -> None:
        rank, world = self.group.rank, self.group.world_size
        if not bool(torch.isfinite(truth).all()):
            raise UsageError(f"the dense reference's {name} (step {step}, {stage}) contains NaN/Inf: "
                             "the inputs or weights are bad, not the TP implementation")
        ref = placement.shard(dense, rank, world)
        diff = _maxdiff(tp_local, ref)
        if exact:
            bound, err = tolerance.EXACT, diff
        else:
            bound = tolerance.calibrated(dense, truth, self.dtype, world)
            err = _maxdiff(tp_local, placement.shard(truth, rank, world))
        self.checks.append(Check(stage, step, name, rank, err, diff, bound.value, bound.kind, bound.reason,
                                 err <= bound.value, str(placement)))
        if placement.replicated and world > 1:
            self._compare_replicas(stage, step, name, tp_local)

    def sync(self, where: str) -> None:
        """Before the checker's own collectives, every rank must have issued the same model collectives.
        Ledgers are exchanged through the rendezvous store, not a collective, so a rank out of step cannot
        make the checker's collectives pair with the model's (gloo aborts on such a size mismatch)."""
        g = self.group
        if g.world_size == 1 or g.store is None or g.ledger is None:
            return
        g.syncs += 1
        key = f"tpcheck/sync{g.syncs}"
        mine = [f"{e.phase} {e.op} at {e.site!r}" for e in g.ledger]
        g.store.set(f"{key}/{g.rank}", "\n".join(mine))
        keys = [f"{key}/{r}" for r in range(g.world_size)]
        try:
            g.store.wait(keys, timedelta(seconds=g.timeout_s))
        except Exception:  # noqa: BLE001 - a store wait past its timeout: some rank is stuck
            missing = [r for r, k in enumerate(keys) if not g.store.check([k])]
            raise CollectiveMismatch(
                f"hang detected: rank(s) {missing} did not reach the checkpoint after {where} within "
                f"{g.timeout_s:g} s; this rank had issued {len(mine)} collective(s), the last "
                f"{mine[-1] if mine else 'none'}") from None
        ledgers = [g.store.get(k).decode().split("\n") if g.store.get(k) else [] for k in keys]
        if any(ld != ledgers[0] for ld in ledgers):
            raise CollectiveMismatch(f"collective mismatch after {where}: " + _ledger_diff(ledgers))

    def _compare_replicas(self, stage: str, step: int, name: str, t: torch.Tensor) -> None:
        self.group.last_collective = ("all_reduce", f"checker:replicas of {name}", "optimizer"
                                      if stage == "optimizer" else "backward" if stage != "forward" else "forward")
        hi = t.detach().double().clone()
        lo = -hi
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group.pg)
        dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=self.group.pg)
        spread = float((hi + lo).abs().max()) if t.numel() else 0.0
        spread = spread if not math.isnan(spread) else math.inf
        b = tolerance.REPLICA
        self.checks.append(Check("replicas", step, name, self.group.rank, spread, spread, b.value, "replica",
                                 b.reason, spread <= b.value))

    # ------------------------------------------------------------------ the run

    def run(self) -> list[Check]:
        case, group = self.case, self.group
        tp_params = dict(self.tp.named_parameters())
        for name, p in self.dense.named_parameters():
            self.compare("weights", 0, f"param:{name}", tp_params[case.plan.tp_name(name)].detach(), p.detach(),
                         p.detach(), case.plan.params[name], exact=True)
        for step in range(1, case.steps + 1):
            for opt in self.opts:
                opt.zero_grad(set_to_none=True)
            for micro in range(case.micro_batches):
                batch = self.first_batch if step == 1 and micro == 0 else case.make_batch(self.gen, torch.float32)
                self._forward_backward(step, batch)
            if hasattr(self.tp, "finalize_grads"):
                self.tp.finalize_grads()
            else:
                finalize_grads(self.tp, group)
            self.sync(f"finalize_grads of step {step}")
            self._compare_params(step, "grads", lambda p: p.grad)
            for opt in self.opts:
                opt.step()
            self.sync(f"optimizer step {step}")
            self._compare_params(step, "optimizer", lambda p: p)
        return self.checks

    def _forward_backward(self, step: int, batch) -> None:
        case, group = self.case, self.group
        inputs, target = batch
        sides = {}
        for side, model, dtype in (("dense", self.dense, self.dtype), ("truth", self.truth, torch.float64)):
            if side == "truth" and self.truth is self.dense:
                sides["truth"] = sides["dense"]
                continue
            kw = {k: _leaf(v.to(dtype) if v.is_floating_point() else v, k in case.grad_inputs)
                  for k, v in inputs.items()}
            out = model(**kw)
            loss = case.loss(out, _cast(target, dtype)) / case.micro_batches
            loss.backward()
            sides[side] = (kw, out.detach(), loss.detach())
        kw_tp = {}
        for k, v in inputs.items():
            local = case.input_placements.get(k, Replicate()).shard(_cast(v, self.dtype), group.rank,
                                                                    group.world_size)
            kw_tp[k] = _leaf(local.clone(), k in case.grad_inputs)
        out_tp = self.tp(**kw_tp)
        target_local = case.target_placement.shard(_cast(target, self.dtype), group.rank, group.world_size)
        loss_tp = case.compute_tp_loss(out_tp, target_local, group) / case.micro_batches
        loss_tp.backward()
        self.sync(f"forward and backward of step {step}")
        (kw_d, out_d, loss_d), (kw_t, out_t, loss_t) = sides["dense"], sides["truth"]
        self.compare("forward", step, "output", out_tp.detach(), out_d, out_t, case.output_placement)
        self.compare("loss", step, "loss", loss_tp.detach(), loss_d, loss_t, Replicate())
        for k in case.grad_inputs:
            if kw_tp[k].grad is None:
                raise UsageError(f"input {k!r} got no gradient on the TP side: is it used in forward?")
            self.compare("backward", step, f"grad:{k}", kw_tp[k].grad, kw_d[k].grad, kw_t[k].grad,
                         case.input_placements.get(k, Replicate()))

    def _compare_params(self, step: int, stage: str, get) -> None:
        plan = self.case.plan
        tp_params = dict(self.tp.named_parameters())
        truth_params = dict(self.truth.named_parameters())
        for name, p in self.dense.named_parameters():
            tp_p = tp_params[plan.tp_name(name)]
            tp_val, dense_val, truth_val = get(tp_p), get(p), get(truth_params[name])
            if tp_val is None or dense_val is None:
                if (tp_val is None) != (dense_val is None):
                    who = "TP" if tp_val is None else "dense"
                    raise UsageError(f"parameter {name!r} got no gradient on the {who} side only")
                continue
            label = "grad" if stage == "grads" else "param"
            self.compare(stage, step, f"{label}:{name}", tp_val.detach(), dense_val.detach(), truth_val.detach(),
                         plan.params[name])


def load_from_dense(tp: nn.Module, dense: nn.Module, case: Case, group: TPGroup) -> None:
    """Fill every TP parameter with the plan's shard of its dense parameter, checking shapes."""
    plan = case.plan
    tp_params = dict(tp.named_parameters())
    expected = {plan.tp_name(n) for n, _ in dense.named_parameters()}
    unplanned = sorted(set(tp_params) - expected)
    if unplanned:
        raise UsageError(f"TP module has parameter(s) {unplanned} that map to no dense parameter; "
                         "name them like the dense ones or add plan.tp_names entries")
    with torch.no_grad():
        for name, p in dense.named_parameters():
            tp_name = plan.tp_name(name)
            if tp_name not in tp_params:
                raise UsageError(f"TP module has no parameter {tp_name!r} for dense parameter {name!r}; "
                                 f"TP parameters are {sorted(tp_params)}")
            local = plan.params[name].shard(p.detach(), group.rank, group.world_size)
            if tuple(local.shape) != tuple(tp_params[tp_name].shape):
                raise UsageError(f"parameter {tp_name!r} on rank {group.rank}: the plan ({plan.params[name]}) gives a "
                                 f"shard of shape {list(local.shape)} but the TP module holds "
                                 f"{list(tp_params[tp_name].shape)}")
            tp_params[tp_name].copy_(local)


def run_case_on_rank(case: Case, group: TPGroup) -> dict:
    """Run `case` on this rank; returns plain data (checks and ledger) for the launcher."""
    t0 = time.perf_counter()
    group.ledger = []
    checks = RankRun(case, group).run()
    return {"rank": group.rank, "checks": [asdict(c) for c in checks],
            "ledger": [asdict(e) for e in group.ledger], "seconds": time.perf_counter() - t0}


def _ledger_diff(ledgers: list[list[str]]) -> str:
    counts = ", ".join(f"rank {r}: {len(ld)}" for r, ld in enumerate(ledgers))
    for i in range(max(len(ld) for ld in ledgers)):
        at = [ld[i] if i < len(ld) else "nothing" for ld in ledgers]
        if len(set(at)) > 1:
            which = "; ".join(f"rank {r}: {a}" for r, a in enumerate(at))
            return f"collectives issued ({counts}) first differ at #{i + 1}: {which}"
    return f"collectives issued: {counts}"


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise UsageError(f"TP tensor of shape {list(a.shape)} cannot be compared with the plan's shard "
                         f"{list(b.shape)}: the plan or the TP module's layout is wrong")
    if a.numel() == 0:
        return 0.0
    d = (a.detach().double() - b.detach().double()).abs().max()
    return float(d) if not torch.isnan(d) else math.inf


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    t = t.detach().clone()
    return t.requires_grad_(requires_grad and t.is_floating_point())


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t
