"""The per-rank engine: run one Case on this rank and compare every tensor through the plan.

Each rank checks its own local tensors against the plan's shard of the reference (so every rank is
checked, not only rank 0), and replicated tensors are compared across ranks, bitwise. Nothing here
knows a layer: shapes and layouts come from the plan.

Three models run on every rank: the dense model in the working dtype, a float64 copy of it (the
ground truth that calibrates tolerances, held on rank 0 only: it is the largest of the three) and the
TP model. All start from the same weights. Every rank measures its TP tensors against the dense ones;
rank 0 also measures the dense model's own error against float64, which sets each check's bound (the
parent fills in the bounds of the other ranks' checks from rank 0's, by `seq`).

Order of a step: dense and float64 forward/backward (capturing the activations named in
`plan.activations`), then the TP forward/backward, whose captured tensors are compared as they are
produced (local comparisons only, no collective inside the model's forward), then a ledger sync, then
the checker's own collectives (replica comparisons), then grads, optimizer step, weights.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from tpcheck.check import capture, tolerance
from tpcheck.check.case import Case
from tpcheck.check.ledger import CollectiveMismatch, sync_ledgers  # noqa: F401 (re-exported)
from tpcheck.check.loading import cast, leaf, load_from_dense, maxdiff
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.layers import finalize_grads
from tpcheck.plan import Placement, Replicate

EVIDENCE_MAX_NUMEL = 1 << 16  # tensors up to this size are sent to the parent for diagnosis
EVIDENCE_BUDGET = 1 << 21  # total elements per rank and case


class _NoGrad:
    """Stands for a float64 input on ranks that hold no float64 model."""

    grad = None


@dataclass
class Check:
    """One comparison on one rank. error: max |TP - dense| (the dense model in the working dtype);
    diff_vs_dense: the same number (the seed's metric); bound/passed: None until rank 0's bound for the
    same `seq` is filled in (calibrated checks on ranks > 0); seq: position in execution order (a
    replica check shares the seq of the tensor it checks)."""

    stage: str  # weights | forward | loss | backward | grads | optimizer | replicas
    step: int
    name: str
    rank: int
    error: float
    diff_vs_dense: float
    bound: float | None
    kind: str  # exact | calibrated | fp64 | replica
    reason: str
    passed: bool | None
    placement: str = "replicate"
    seq: int = 0


class RankRun:
    """State of one case on one rank: the three models, their optimizers and the checks so far."""

    def __init__(self, case: Case, group: TPGroup) -> None:
        self.case, self.group = case, group
        self.dtype = case.torch_dtype
        self.checks: list[Check] = []
        self.pending_replicas: list[tuple[Check, torch.Tensor]] = []
        self.evidence: dict[str, dict] = {}
        self.evidence_left = EVIDENCE_BUDGET
        self.seq = 0
        self.control: dict | None = None
        self.before: dict[str, torch.Tensor] | None = None  # dense params before the last adaptive step
        self.slack: dict[tuple[str, str], torch.Tensor] = {}  # see _adaptive_slack
        self.gen = torch.Generator().manual_seed(case.seed)
        self.first_batch = case.make_batch(self.gen, torch.float32)  # drawn before the weights, as the seed
        master = case.build_dense(torch.float32)
        case.init(master, self.gen)
        self.dense = self._copy_of(master, self.dtype)
        if self.dtype == torch.float64:
            self.truth = self.dense
        else:
            self.truth = self._copy_of(self.dense, torch.float64) if group.rank == 0 else None
        case.plan.check_against(self.dense, group.world_size)
        self.tp = case.build_tp(group, self.dtype)
        load_from_dense(self.tp, master, case, group)  # from the float32 master, cast on copy: = dense
        if case.tamper is not None:
            case.tamper(self.tp, group)
        self.models = [self.dense, self.tp] + ([] if self.truth in (None, self.dense) else [self.truth])
        self.opts = [case.make_optimizer(m.parameters()) for m in self.models]
        if case.tp_optimizer is not None:
            self.opts[1] = case.tp_optimizer(self.tp, group, case.make_optimizer)

    def _copy_of(self, src: nn.Module, dtype: torch.dtype) -> nn.Module:
        model = self.case.build_dense(dtype)
        with torch.no_grad():
            for (name, p), (_, q) in zip(model.named_parameters(), src.named_parameters()):
                p.copy_(q.to(dtype))
        return model

    # ------------------------------------------------------------------ comparisons

    def compare(self, stage: str, step: int, name: str, tp_local: torch.Tensor, dense: torch.Tensor,
                truth: torch.Tensor | None, placement: Placement, exact: bool = False) -> None:
        """Compare this rank's tensor with the plan's shard of the reference. Local only: replicas
        are compared across ranks later, in `flush_replicas`, outside the model's collectives."""
        rank, world = self.group.rank, self.group.world_size
        ref = placement.shard(dense, rank, world)
        diff = maxdiff(tp_local, ref)
        if exact:
            bound = tolerance.EXACT
        elif truth is not None:
            bound = tolerance.calibrated(dense, truth, self.dtype, world)
        else:
            bound = tolerance.PENDING
        # NaN/Inf make the difference or the bound non-finite; only then look for where they come from
        if not math.isfinite(diff) or (bound.value is not None and not math.isfinite(bound.value)):
            self._check_reference_finite(stage, step, name, dense, truth)
        self.seq += 1
        check = Check(stage, step, name, rank, diff, diff, bound.value, bound.kind, bound.reason,
                      None if bound.value is None else diff <= bound.value, str(placement), self.seq)
        self.checks.append(check)
        self._keep_evidence(check, tp_local, ref, dense)
        if placement.replicated and world > 1:
            self.pending_replicas.append((check, tp_local.detach().clone()))

    def _check_reference_finite(self, stage: str, step: int, name: str, dense, truth) -> None:
        """Bad input is reported as such (exit 2), not as a TP bug."""
        if truth is not None and not bool(torch.isfinite(truth).all()):
            raise UsageError(f"the dense reference's {name} (step {step}, {stage}) contains NaN/Inf: "
                             "the inputs or weights are bad, not the TP implementation")
        if not bool(torch.isfinite(dense).all()):
            raise UsageError(f"the dense {self.case.dtype} reference's {name} (step {step}, {stage}) contains "
                             "NaN/Inf (float16 with AdamW, whose eps underflows, is a known cause; use "
                             "float32/bfloat16 or --optimizer sgd). The reference is bad, not the TP implementation")

    def _keep_evidence(self, check: Check, tp_local, ref, dense) -> None:
        if check.step > 1 or tp_local.numel() > EVIDENCE_MAX_NUMEL or self.evidence_left < 3 * dense.numel():
            return
        self.evidence_left -= 3 * dense.numel()
        self.evidence[f"{check.stage}|{check.step}|{check.name}"] = {
            "tp": tp_local.detach().double().numpy().copy(), "ref": ref.detach().double().numpy().copy(),
            "dense": dense.detach().double().numpy().copy(), "placement": check.placement,
            "eps": float(torch.finfo(tp_local.dtype).eps) if tp_local.is_floating_point() else 0.0}

    def flush_replicas(self) -> None:
        """Compare every pending replicated tensor across ranks, bitwise: max - min over ranks, for all
        of them in one all-reduce (MAX of [x; -x])."""
        if not self.pending_replicas:
            return
        flats = [t.double().reshape(-1) for _, t in self.pending_replicas]
        both = torch.cat(flats + [-f for f in flats])
        self.group.last_collective = ("all_reduce", "checker:replicas", "optimizer")
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group.pg)
        hi, neg_lo = both.split(both.numel() // 2)
        b = tolerance.REPLICA
        for (check, t), h, n in zip(self.pending_replicas, hi.split([f.numel() for f in flats]),
                                    neg_lo.split([f.numel() for f in flats])):
            spread = float((h + n).abs().max()) if t.numel() else 0.0
            spread = spread if not math.isnan(spread) else math.inf
            self.checks.append(Check("replicas", check.step, check.name, check.rank, spread, spread, b.value,
                                     "replica", b.reason, spread <= b.value, check.placement, check.seq))
        self.pending_replicas.clear()

    def sync(self, where: str) -> None:
        sync_ledgers(self.group, where)

    # ------------------------------------------------------------------ the run

    def run(self) -> list[Check]:
        case = self.case
        tp_params = dict(self.tp.named_parameters())
        for name, p in self.dense.named_parameters():
            self.compare("weights", 0, f"param:{name}", tp_params[case.plan.tp_name(name)].detach(), p.detach(),
                         p.detach(), case.plan.params[name], exact=True)
        self.sync("loading the weights")
        self.flush_replicas()
        for step in range(1, case.steps + 1):
            for opt in self.opts:
                opt.zero_grad(set_to_none=True)
            for micro in range(case.micro_batches):
                batch = self.first_batch if step == 1 and micro == 0 else case.make_batch(self.gen, torch.float32)
                self._forward_backward(step, batch)
            if hasattr(self.tp, "finalize_grads"):
                self.tp.finalize_grads()
            else:
                finalize_grads(self.tp, self.group)
            self.sync(f"finalize_grads of step {step}")
            self._compare_params(step, "grads", lambda p: p.grad)
            self.flush_replicas()
            adaptive = self.case.optimizer != "sgd"
            before = {n: p.detach().clone() for n, p in self.dense.named_parameters()} if adaptive else None
            for opt in self.opts:
                opt.step()
            self.before = before
            self.sync(f"optimizer step {step}")
            self._compare_params(step, "optimizer", lambda p: p)
            self.flush_replicas()
        return self.checks

    def _reference_pass(self, model: nn.Module, dtype: torch.dtype, inputs, target, recorder):
        case = self.case
        handles = capture.attach(model, set(case.plan.activations), recorder) if case.capture else []
        kw = {k: leaf(cast(v, dtype), k in case.grad_inputs) for k, v in inputs.items()}
        out = model(**kw)
        loss = case.loss(out, cast(target, dtype)) / case.micro_batches
        loss.backward()
        capture.detach_all(handles)
        return kw, out.detach(), loss.detach()

    def _forward_backward(self, step: int, batch) -> None:
        case, group = self.case, self.group
        inputs, target = batch
        rec_d, rec_t = capture.Recorder(), capture.Recorder()
        kw_d, out_d, loss_d = self._reference_pass(self.dense, self.dtype, inputs, target, rec_d)
        if self.truth is self.dense:
            (kw_t, out_t, loss_t), rec_t = (kw_d, out_d, loss_d), rec_d
        elif self.truth is None:
            kw_t, out_t, loss_t = {k: _NoGrad for k in kw_d}, None, None
        else:
            kw_t, out_t, loss_t = self._reference_pass(self.truth, torch.float64, inputs, target, rec_t)

        def on_tp_tensor(stage: str, name: str, t: torch.Tensor) -> None:
            d, tr = rec_d.take(stage, name), rec_t.take(stage, name) if rec_t is not rec_d else None
            if d is not None:
                label = "act" if stage == "forward" else "actgrad"
                self.compare(stage, step, f"{label}:{name}", t, d, tr if rec_t is not rec_d else d,
                             case.plan.activations[name])

        handles = capture.attach(self.tp, set(case.plan.activations), on_tp_tensor) if case.capture else []
        kw_tp = {}
        for k, v in inputs.items():
            local = case.input_placements.get(k, Replicate()).shard(cast(v, self.dtype), group.rank,
                                                                    group.world_size)
            kw_tp[k] = leaf(local, k in case.grad_inputs)
        out_tp = self.tp(**kw_tp)
        self.compare("forward", step, "output", out_tp.detach(), out_d, out_t, case.output_placement)
        if step == 1 and self.truth is not None:
            self.control = tolerance.self_test(self.checks[-1], out_tp.detach(), out_d, case.output_placement, group)
        target_local = case.target_placement.shard(cast(target, self.dtype), group.rank, group.world_size)
        loss_tp = case.compute_tp_loss(out_tp, target_local, group) / case.micro_batches
        self.compare("loss", step, "loss", loss_tp.detach(), loss_d, loss_t, Replicate())
        loss_tp.backward()
        capture.detach_all(handles)
        self.sync(f"forward and backward of step {step}")
        for k in case.grad_inputs:
            if kw_tp[k].grad is None:
                raise UsageError(f"input {k!r} got no gradient on the TP side: is it used in forward?")
            self.compare("backward", step, f"grad:{k}", kw_tp[k].grad, kw_d[k].grad, kw_t[k].grad,
                         case.input_placements.get(k, Replicate()))
        self.flush_replicas()

    def _compare_params(self, step: int, stage: str, get) -> None:
        plan = self.case.plan
        tp_params = dict(self.tp.named_parameters())
        truth_params = dict(self.truth.named_parameters()) if self.truth is not None else {}
        for name, p in self.dense.named_parameters():
            tp_p = tp_params[plan.tp_name(name)]
            tp_val, dense_val = get(tp_p), get(p)
            truth_val = get(truth_params[name]) if truth_params else None
            if tp_val is None or dense_val is None:
                if (tp_val is None) != (dense_val is None):
                    who = "TP" if tp_val is None else "dense"
                    raise UsageError(f"parameter {name!r} got no gradient on the {who} side only")
                continue
            tp_val, truth_val = tp_val.detach(), truth_val.detach() if truth_val is not None else None
            if stage == "optimizer" and self.before is not None:
                tp_val, truth_val = self._adaptive_slack(name, tp_p, p, truth_params.get(name), tp_val, truth_val)
            label = "grad" if stage == "grads" else "param"
            self.compare(stage, step, f"{label}:{name}", tp_val, dense_val.detach(), truth_val, plan.params[name])

    def _adaptive_slack(self, name, tp_p, p, truth_p, tp_val, truth_val):
        """An adaptive optimizer amplifies small grad differences: AdamW steps by lr * m / (sqrt(v) +
        eps), about lr * sign(grad) at first, so where a moment is near 0 (or near eps) a rounding-level
        difference in the grads can move an element by up to 2 x lr, and it stays moved. The grads were
        already checked against their bounds; what the optimizer stage must show is that the TP side
        applied the same update rule to them. So each element may differ by (twice) the update
        difference its own moments explain, lr * |u_tp - u_dense| with u computed from each side's
        moments and the DENSE side's hyperparameters (a different lr, betas, eps or weight decay on the
        TP side stays unexplained), accumulated over steps. Likewise the float64 side against the dense
        one, so that bounds are not inflated by the same effect. Only after adaptive optimizer steps."""
        placement, rank, world = self.case.plan.params[name], self.group.rank, self.group.world_size
        hyper = next(g for g in self.opts[0].param_groups if any(q is p for q in g["params"]))
        u_dense = _adam_direction(self.opts[0].state.get(p, {}), hyper)
        if u_dense is None:
            return tp_val, truth_val

        def relax(key, x, ref, u_x, u_ref):
            slack = self.slack.setdefault(key, torch.zeros_like(x, dtype=torch.float64))
            slack += 2.0 * hyper["lr"] * (u_x.double() - u_ref.double()).abs()
            return torch.where((x - ref).abs().double() <= slack, ref.to(x.dtype), x)

        u_tp = _adam_direction(self.opts[1].state.get(tp_p, {}), hyper)
        if u_tp is not None:
            tp_val = relax(("tp", name), tp_val, placement.shard(p.detach(), rank, world), u_tp,
                           placement.shard(u_dense, rank, world))
        if truth_val is not None and truth_p is not None and truth_p is not p:
            u_truth = _adam_direction(self.opts[2].state.get(truth_p, {}), hyper)
            if u_truth is not None:
                truth_val = relax(("truth", name), truth_val, p.detach(), u_truth, u_dense)
        return tp_val, truth_val


def _adam_direction(state: dict, hyper: dict) -> torch.Tensor | None:
    """Adam's step direction m_hat / (sqrt(v_hat) + eps) from one side's moments, or None."""
    if "exp_avg" not in state or "exp_avg_sq" not in state:
        return None
    (b1, b2), eps, t = hyper["betas"], hyper["eps"], float(state["step"])
    m_hat = state["exp_avg"].double() / (1 - b1**t)
    v_hat = state["exp_avg_sq"].double() / (1 - b2**t)
    return m_hat / (v_hat.sqrt() + eps)


def run_case_on_rank(case: Case, group: TPGroup) -> dict:
    """Run `case` on this rank; returns plain data (checks, ledger, evidence) for the launcher."""
    t0 = time.perf_counter()
    group.ledger = []
    run = RankRun(case, group)
    checks = run.run()
    return {"rank": group.rank, "checks": [asdict(c) for c in checks], "evidence": run.evidence,
            "expected_collectives": case.expected_collectives, "control": run.control,
            "ledger": [asdict(e) for e in group.ledger], "seconds": time.perf_counter() - t0}
