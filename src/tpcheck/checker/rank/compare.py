"""Comparing one rank's TP tensors with the plan's shard of the dense reference.

Each rank checks its own local tensors (so every rank is checked, not only rank 0); replicated
tensors are also compared across ranks, bitwise, batched into one all-reduce per flush, outside the
model's collectives (CPU tensors, on gloo, whatever device the model computes on). Every comparison
becomes a `Check` that records its error, its bound and the reason for the bound; small tensors are
kept as evidence for the diagnosis (checker/rank/evidence.py). A Check is complete when `compare`
returns it: nothing outside this class writes to one.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.payload import Check
from tpcheck.checker.rank import tolerance, torch_collectives
from tpcheck.checker.rank.decisions import DECISION_BIAS, Judged
from tpcheck.checker.rank.evidence import Evidence
from tpcheck.checker.rank.ledger import CollectiveTap
from tpcheck.checker.rank.measure import absmax, maxdiff
from tpcheck.checker.vocabulary import Stage
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Placement, copies

# the kind of control planted on a tensor judged by magnitude (`Comparator._control`)
BY_MAGNITUDE = "calibrated by magnitude"


class Comparator:
    """The checks of one case on one rank, in execution
    order, and the evidence kept for diagnosis."""

    def __init__(
        self,
        group: TPGroup,
        tap: CollectiveTap,
        dtype: torch.dtype,
        dtype_name: str,
        masters: bool = False,
    ) -> None:
        self.group, self.tap, self.dtype, self.dtype_name = group, tap, dtype, dtype_name
        self.masters = masters  # the optimizers step float32 masters (named by a NaN's hint)
        self.checks: list[Check] = []
        # (check, values in float64, mask of the elements several ranks hold; None: all of them)
        self.pending_replicas: list[tuple[Check, torch.Tensor, torch.Tensor | None]] = []
        self.evidence = Evidence()
        self.seq = 0
        # what the float64 side is where it is not the float64 run itself (rounding.py: the
        # optimizer stage stepped from the rounding twin's gradients), named in bounds' reasons
        self.truth_from: str | None = None
        # (stage, step, bound kind) with a control
        self.controlled: set[tuple[str, int, str]] = set()
        # (stage, step, check) with a control: one per tensor (its evidence is keyed so)
        self.planted_on: set[tuple[str, int, CheckId]] = set()

    def compare(
        self,
        stage: Stage,
        step: int,
        check_id: CheckId,
        tp_local: torch.Tensor,
        dense: torch.Tensor,
        truth: torch.Tensor | None,
        placement: Placement,
        exact: bool = False,
        dtype: torch.dtype | None = None,
        bound: tolerance.Bound | None = None,
        *,
        reason: str | None = None,
        loaded_by: str | None = None,
        seq: int | None = None,
        raw: torch.Tensor | None = None,
    ) -> Check:
        """Compare this rank's tensor with the plan's shard of the reference. Local only: replicas
        are compared across ranks later, in `flush_replicas`, outside the model's collectives.
        `truth` (float64) is held on rank 0 only; elsewhere the bound comes from rank 0 (PENDING),
        or is given (`bound`: rank 0 computed it for a tensor only this rank compares,
        AppliedOnRank). `dtype`: the dtype the compared values were rounded to (default: the working
        dtype). What the caller knows of the check: `reason` (for the bound's own: the weights a
        user's loader loaded), `loaded_by` (that loader), `seq` (a tensor held until the activation
        placements were inferred: its place in execution order), `raw` (`tp_local` before an
        allowance excused part of the difference). A control's identity (`check_id.control`):
        this call is the self-test's, on a perturbed copy of a real tensor (`_control`), through
        this same code."""
        rank, world = self.group.rank, self.group.world_size
        ref = placement.shard(dense, rank, world)
        diff = maxdiff(tp_local, ref)
        if exact:
            bound = tolerance.EXACT
        elif bound is None:
            bound = self.calibrated(dense, truth, dtype) if truth is not None else tolerance.PENDING
        # NaN/Inf make the difference or the bound non-finite; only then look for their source
        if not math.isfinite(diff) or (bound.value is not None and not math.isfinite(bound.value)):
            self._check_reference_finite(stage, step, check_id, dense, truth)
        self.seq += 1
        check = self._record(stage, step, check_id, diff, bound, placement)
        self._note(check, ref, reason, loaded_by, seq, raw)
        rows = self._by_magnitude(check, tp_local, ref, dense, bound, placement, dtype)
        if check_id.control:  # its evidence, the few elements around the planted one: `_control`'s
            return check
        self._keep_evidence(check, tp_local, ref, dense)
        self._control(
            check,
            tp_local,
            ref,
            dense,
            bound,
            lambda planted: self.compare(
                stage, step, check_id.as_control(), planted, dense, truth, placement, exact, dtype,
                bound,
            ),
            rows,
        )  # fmt: skip
        self._hold_replicas(check, tp_local, dense, placement)
        return check

    def _note(self, check: Check, ref, reason, loaded_by, seq, raw) -> None:
        """What only the comparison knows, set before the check leaves `compare` (`_record`, which
        makes every check and control alike, takes what they share): the elements compared, the
        user's loader, the reason, the place in execution order, and the raw error where an
        allowance excused part of the difference."""
        check.numel, check.loaded_by = ref.numel(), loaded_by
        if reason is not None:
            check.reason = reason
        if seq is not None:
            check.seq = seq
        if raw is not None and (raw_error := maxdiff(raw, ref)) != check.error:
            check.raw_error = raw_error

    def _by_magnitude(
        self, check: Check, tp_local, ref, dense, bound, placement, dtype=None
    ) -> torch.Tensor | None:
        """A calibrated check of SMALL_NUMEL elements or more is judged per bin of magnitude
        (tolerance.py): this rank's errors per bin, and the bounds per bin where rank 0 made them
        here (elsewhere the parent takes them from rank 0's check). Returns the magnitudes the
        bins were made of, this rank's shard (None: the tensor is judged whole)."""
        if check.stage not in tolerance.BY_MAGNITUDE_STAGES or bound.kind != "calibrated":
            return None
        if (dtype or self.dtype) == torch.float64:
            return None  # rank 0's bound is "fp64", of one measure (ranks > 0 see it from `dtype`)
        if dense.numel() < tolerance.SMALL_NUMEL or not ref.numel():
            return None
        if tp_local.shape != ref.shape:
            return None
        # rank 0's bound of one bin: judged whole, its errors per bin not read; the magnitudes are
        # still wanted while a control of the stage is yet to be planted (its kind, by magnitude
        # or not, is decided alike on every rank: from `in_one_bin`)
        whole = bound.value is not None and bound.bins is None
        kinds = {(check.stage, check.step, k) for k in (BY_MAGNITUDE, bound.kind)}
        if whole and kinds <= self.controlled:
            return None
        top, magnitude = tolerance.top_exponent(dense), tolerance.row_magnitude(dense)
        if tolerance.in_one_bin(magnitude[..., 0] if magnitude.dim() else magnitude, top):
            return None  # rank 0's bound will be of one bin (every rank sees it from `dense`)
        rank, world = self.group.rank, self.group.world_size
        magnitude = placement.shard(magnitude, rank, world)
        if not whole:
            check.bin_errors = tolerance.bin_errors(tp_local, ref, magnitude, top)
            check.bins = bound.bins
        return magnitude

    def _hold_replicas(self, check: Check, tp_local, dense, placement: Placement) -> None:
        """What of `tp_local` other ranks hold too, kept for `flush_replicas` (compared bitwise)."""
        rank, world = self.group.rank, self.group.world_size
        if world > 1 and placement.replicated:
            self.pending_replicas.append(
                (check, tp_local.detach().double().reshape(-1).cpu(), None)
            )
        elif world > 1 and (held := copies(placement, tuple(dense.shape), world)) is not None:
            # some elements live on several ranks (GQA KV heads replicated over ranks): their
            # copies must agree bitwise too; compared in the dense layout, on the elements held
            # twice or more
            idx = placement.index_map(tuple(dense.shape), rank, world).reshape(-1)
            spread_in = torch.full((held.numel(),), -math.inf, dtype=torch.float64)
            spread_in[idx] = tp_local.detach().double().reshape(-1).cpu()
            self.pending_replicas.append((check, spread_in, held >= 2))

    def calibrated(
        self, dense: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tolerance.Bound:
        """The calibrated bound of a tensor of this rank's checks, in `dtype` (default: the working
        dtype), with the dense error the self-test measures apart (`tolerance.dense_error`)."""
        bound = tolerance.calibrated(dense, truth, dtype or self.dtype, self.group.world_size)
        if self.truth_from is not None:
            bound = dataclasses.replace(
                bound, reason=bound.reason.replace("vs float64", f"vs {self.truth_from}")
            )
        return dataclasses.replace(bound, measured=tolerance.dense_error(dense, truth))

    def compare_local(
        self,
        stage: Stage,
        step: int,
        check_id: CheckId,
        tp_local: torch.Tensor,
        ref_local: torch.Tensor,
        placement: Placement,
        reason: str,
        weights: torch.Tensor | None = None,
    ) -> Check:
        """Bitwise comparison of this rank's tensor with a reference computed on this rank from the
        TP side's own inputs (the optimizer replay): no cross-rank replica check, exact bound.
        `weights` (the parameter the tensor belongs to) is kept as evidence: a difference
        proportional to it names weight decay. A control's identity: the self-test's call
        (`compare`)."""
        diff = maxdiff(tp_local, ref_local)
        self.seq += 1
        bound = tolerance.Bound(0.0, "exact", reason)
        check = self._record(stage, step, check_id, diff, bound, placement)
        if check_id.control:
            return check
        self._keep_evidence(check, tp_local, ref_local, ref_local, weights)
        self._control(
            check,
            tp_local,
            ref_local,
            ref_local,
            bound,
            lambda planted: self.compare_local(
                stage, step, check_id.as_control(), planted, ref_local, placement, reason
            ),
        )  # fmt: skip
        return check

    def absent(self, check_id: CheckId, tp_name: str, present: bool, placement: Placement) -> Check:
        """The weights-stage check of a parameter `placement` holds on another rank only (OnRank):
        this rank must have no parameter `tp_name`. Its error is 1 when it has one (bound 0), and
        its evidence says so (the diagnosis names the rank that should hold it)."""
        owner = placement.applied_on
        check = self.compare_local(
            "weights",
            0,
            check_id,
            torch.tensor([1.0 if present else 0.0]),
            torch.tensor([0.0]),
            placement,
            f"absent: the plan holds {tp_name!r} on rank {owner} only (OnRank({owner})); "
            f"rank {self.group.rank} has {'a' if present else 'no'} parameter of that name",
        )
        if (kept := self.evidence.kept.get((check.stage, check.step, check.id))) is not None:
            kept["held_on"] = owner
        return check

    def record_rng(
        self,
        step: int,
        check_id: CheckId,
        seq: int,
        error: int,
        reason: str,
        placement: str,
        info: dict,
    ) -> Check:
        """An RNG placement check (checker/rank/rng.py): `error` counts the ranks whose draw breaks
        the rule against this rank's (bound 0); `info` (the rule, those ranks, a mismatch with the
        dense side's draw) is kept as evidence for the diagnosis."""
        check = Check(
            stage="forward",
            step=step,
            id=check_id,
            rank=self.group.rank,
            error=float(error),
            diff_vs_dense=float(error),
            bound=0.0,
            kind="rng",
            reason=reason,
            passed=error <= 0,
            placement=placement,
            seq=seq,
        )
        self.checks.append(check)
        self.evidence.keep_rng(step, check_id, error, placement, info)
        return check

    def record_routing(self, step: int, judged: Judged) -> Check:
        """A discrete decision of the TP side against the dense side's (checker/rank/decisions.py):
        `error` the gap between the competing values where the two differ (0: the same decision),
        bound the rounding margin; a flip within it was replayed, one beyond it fails. An input
        the TP side offsets per index beyond its bound fails as a `decision_bias` (error: the
        offset, bound: its bound). Once per step and kind on this rank, the self-test's controls
        the decision carries (a planted flip, a planted offset) are recorded the same way: each
        must fail, or be a blind spot its control named."""
        j = judged
        error, bound = (j.offset, j.offset_bound) if j.kind == DECISION_BIAS else (j.gap, j.margin)
        check = self._routing_check(step, CheckId("routing", j.label), j, j.kind, error, bound)
        check.reason, check.passed = j.reason(), j.passed
        for kind, planted, bound, blind in j.controls:
            if not self.take_control(("forward", step, kind)):
                continue
            target = j.label if kind == "routing" else f"{j.label}:offset"
            control = self._routing_check(
                step, CheckId("routing", target, control=True), j, kind, planted, bound
            )
            control.planted, control.blind = planted, blind
            zero = torch.zeros(1, dtype=torch.float64)
            self._keep_evidence(control, torch.tensor([planted], dtype=torch.float64), zero, zero)
        return check

    def _routing_check(
        self, step: int, check_id: CheckId, j: Judged, kind: str, error: float, bound: float
    ) -> Check:
        check = Check(
            stage="forward",
            step=step,
            id=check_id,
            rank=self.group.rank,
            error=error,
            diff_vs_dense=error,
            bound=bound,
            kind=kind,
            reason=f"a planted {'flip' if kind == 'routing' else 'offset'} of {error:.3g}",
            passed=error <= bound,
            placement="replicate",
            seq=j.seq,
            numel=j.of_rows,
        )
        self.checks.append(check)
        return check

    def record_layout(
        self, step: int, check_id: CheckId, seq: int, reason: str, stage: Stage = "forward"
    ) -> Check:
        """A module output, the model's output (or, at the buffers stage, a buffer:
        checker/rank/buffers.py) whose shape is no placement of the dense one
        (checker/rank/activations.py): a failed check at its place in execution order, `reason`
        saying the two shapes (error 1: this rank's tensor is not comparable, bound 0). It plants
        the stage's layout control if none is yet (a flag of 1 against 0 that must fail): it may be
        the stage's only check (a forward whose first module output already fails, the run then
        stopped at the model's output: passes.py)."""
        check = Check(
            stage=stage,
            step=step,
            id=check_id,
            rank=self.group.rank,
            error=1.0,
            diff_vs_dense=1.0,
            bound=0.0,
            kind="layout",
            reason=reason,
            passed=False,
            placement="no placement",
            seq=seq,
        )
        self.checks.append(check)
        flag = torch.zeros(1)
        self._control(
            check,
            flag,
            flag,
            flag,
            tolerance.Bound(0.0, "layout", reason),
            lambda planted: self.compare_local(
                stage, step, check_id.as_control(), planted, flag, "no placement", reason
            ),
        )  # fmt: skip
        return check

    def take_control(self, key: tuple[str, int, str]) -> bool:
        """Whether the control of `key` (stage, step, kind of check) is still to be planted on this
        rank: True once, to the first caller, who plants it."""
        if key in self.controlled:
            return False
        self.controlled.add(key)
        return True

    def next_seq(self) -> int:
        """A position in execution order for a check recorded
        later (an RNG check, known after the exchange)."""
        self.seq += 1
        return self.seq

    def _record(
        self,
        stage: Stage,
        step: int,
        check_id: CheckId,
        error: float,
        bound: tolerance.Bound,
        placement: Placement | str,
    ) -> Check:
        """One comparison's Check, appended in execution order. `passed` is provisional: the parent
        fills in pending bounds and judges every check (`result.judge`)."""
        check = Check(
            stage=stage,
            step=step,
            id=check_id,
            rank=self.group.rank,
            error=error,
            diff_vs_dense=error,
            bound=bound.value,
            kind=bound.kind,
            reason=bound.reason,
            passed=None if bound.value is None else error <= bound.value,
            placement=str(placement),
            seq=self.seq,
            ref_error=bound.ref_error,
            floor=bound.floor,
            scale=bound.scale,
        )
        self.checks.append(check)
        return check

    def _control(
        self,
        real: Check,
        tp_local: torch.Tensor,
        ref: torch.Tensor,
        dense: torch.Tensor,
        bound: tolerance.Bound,
        again,
        rows: torch.Tensor | None = None,
    ) -> None:
        """The self-test, once per (stage, step, kind of bound) on this rank: a copy of the real TP
        tensor with one element (where the reference is largest) moved away from the reference by
        `tolerance.control_shift` (the published detectability of the working dtype) goes through
        `again`, the very comparison `real` went through (`compare` or `compare_local`, with
        `real`'s bound). If it is not flagged, the checker cannot see errors of that size here,
        unless the dense model's own error, measured apart from the bound, says the tensor is
        ill-conditioned (`tolerance.blind_spot`, on rank 0; the parent copies it to the others).

        A tensor judged by magnitude (`rows`: the magnitudes its bins were made of, this rank's
        shard) has a control of its own kind, planted in the row of the smallest magnitude (a bin
        below the top one): its judgement then goes through the errors per bin, as the real
        tensor's does, and a misread bin is seen."""
        kind = real.kind if rows is None else BY_MAGNITUDE
        on = (real.stage, real.step, real.id)  # a name recurs once per micro-batch
        if ref.numel() == 0 or on in self.planted_on:
            return
        if not self.take_control((real.stage, real.step, kind)):
            return
        self.planted_on.add(on)
        planted = tp_local.detach().clone().reshape(-1)
        near = ref.detach().reshape(-1)
        if planted.is_floating_point() and not bool(torch.isfinite(planted).all()):
            # a TP tensor with NaN/Inf: its control is planted on the reference's values
            # there, so it shows the planted error
            planted = torch.where(torch.isfinite(planted), planted, near.to(planted.dtype))
        i = int(near.abs().argmax() if rows is None else rows.reshape(-1).argmin())
        scale = absmax(dense)
        # the working dtype's claim (masters included), or the tensor's own where it is stored
        # coarser (a float32 buffer in a float64 run): a shift below its resolution plants nothing
        claim = self.dtype
        if planted.is_floating_point() and _coarser(planted.dtype, claim):
            claim = planted.dtype
        shift = tolerance.control_shift(claim, scale)
        if not planted.is_floating_point():
            shift = max(1.0, round(shift))
        planted[i] = _away(planted[i], near[i], shift)
        check = again(planted.reshape(tp_local.shape))
        check.planted = shift
        if bound.measured is not None and dense.is_floating_point():
            check.blind = tolerance.blind_spot(
                bound.measured, scale, ref.numel(), dense.dtype, shift
            )
        lo = max(0, i - 4)  # the evidence of a control: the elements around the planted one
        self._keep_evidence(check, planted[lo : i + 4], near[lo : i + 4], near[lo : i + 4])

    def _check_reference_finite(
        self, stage: str, step: int, check_id: CheckId, dense, truth
    ) -> None:
        """Bad input is reported as such (exit 2), not as a TP bug."""
        if truth is not None and not bool(torch.isfinite(truth).all()):
            raise UsageError(
                f"the dense reference's {check_id} (step {step}, {stage}) contains NaN/Inf: "
                "the inputs or weights are bad, not the TP implementation"
            )
        if not bool(torch.isfinite(dense).all()):
            raise UsageError(
                f"the dense {self.dtype_name} reference's {check_id} (step {step}, {stage}) "
                f"contains NaN/Inf ({self._nonfinite_cause(stage, step)}). The reference is bad, "
                "not the TP implementation"
            )

    def _nonfinite_cause(self, stage: str, step: int) -> str:
        """The known causes of a non-finite dense reference that fit this run: float16 overflow
        (past 65504: an Inf, or the NaN an Inf makes), and AdamW's eps underflowing in pure float16
        parameters, named only where the parameters are float16 (no float32 masters) and an
        optimizer step has run."""
        causes = []
        if self.dtype == torch.float16:
            causes.append(
                "float16 overflows past 65504, to an Inf or the NaN an Inf makes (inf - inf, "
                "inf x 0): some value went past it; scale the inputs or weights down, or use "
                "--dtype bfloat16"
            )
            if not self.masters and (step > 1 or stage == "optimizer"):
                causes.append(
                    "pure float16 parameters with AdamW, whose eps underflows in float16, are a "
                    "known cause: drop --no-master-weights / master_weights=False, or use "
                    "--optimizer sgd"
                )
        return (
            "; ".join(causes) or "the inputs or the weights are bad, or the arithmetic overflowed"
        )

    def _keep_evidence(self, check: Check, tp_local, ref, dense, weights=None) -> None:
        """The tensors of `check`, kept for the diagnosis when small enough (evidence.py)."""
        self.evidence.keep(check, tp_local, ref, dense, weights)

    def flush_replicas(self) -> None:
        """Compare every pending replicated tensor (and every element several
        ranks hold) across ranks,
        bitwise: max - min over ranks, for all of them in one all-reduce (MAX of [x; -x]; an element
        a rank does not hold enters as -inf in x and in -x, so it drops out of both maxima)."""
        if not self.pending_replicas:
            return
        # the control: one element that the last rank holds 1 larger than the others must be flagged
        first = self.pending_replicas[0][0]
        planted = torch.tensor(
            [1.0 if self.group.rank == self.group.world_size - 1 else 0.0], dtype=torch.float64
        )
        self.pending_replicas.append(
            (dataclasses.replace(first, id=first.id.as_control()), planted, None)
        )
        flats = [t for _, t, _ in self.pending_replicas]
        sizes = [f.numel() for f in flats]
        both = torch.empty(2 * sum(sizes), dtype=torch.float64)
        hi, neg_lo = both.split(both.numel() // 2)
        torch.cat(flats, out=hi)
        torch.neg(hi, out=neg_lo)
        # views: the all-reduce fills them in place
        parts = list(zip(hi.split(sizes), neg_lo.split(sizes)))
        for (_, _, shared), (h, n) in zip(self.pending_replicas, parts):
            if shared is not None:  # an element this rank does not hold stays -inf in -x too
                n.masked_fill_(h == -math.inf, -math.inf)
        self.tap.performing(
            ("all_reduce", "checker:replicas", "optimizer"),
            torch_collectives.all_reduce,
            both,
            op=dist.ReduceOp.MAX,
            group=self.group.pg,
        )
        b = tolerance.REPLICA
        for (check, _, shared), (h, n) in zip(self.pending_replicas, parts):
            d = (h + n).abs() if shared is None else (h + n).abs()[shared]
            spread = float(d.max()) if d.numel() else 0.0
            spread = spread if not math.isnan(spread) else math.inf
            self.checks.append(
                Check(
                    stage="replicas",
                    step=check.step,
                    id=check.id,
                    rank=check.rank,
                    error=spread,
                    diff_vs_dense=spread,
                    bound=b.value,
                    kind="replica",
                    reason=b.reason,
                    passed=spread <= b.value,
                    placement=check.placement,
                    seq=check.seq,
                )
            )
        self.pending_replicas.clear()


def _coarser(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether floating `dtype` resolves less than `than`."""
    return torch.finfo(dtype).eps > torch.finfo(than).eps


def _away(value: torch.Tensor, ref: torch.Tensor, shift: float) -> torch.Tensor:
    """`value` moved by `shift` away from `ref` (so the planted difference is at least `shift`
    whatever error `value` already has), toward zero instead where that would overflow its dtype
    (float16 near 65504): a control stays finite."""
    v, r = value.double(), ref.double()
    sign = 1.0 if bool(v >= r) else -1.0
    moved = (v + sign * shift).to(value.dtype)
    if value.is_floating_point() and not bool(torch.isfinite(moved)):
        moved = (v - sign * shift).to(value.dtype)
    return moved
