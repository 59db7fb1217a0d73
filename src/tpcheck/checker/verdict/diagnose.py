"""Diagnosis: what the numbers of the first divergent tensor say about the bug.

Signatures are computed from the tensors every rank sent back (`evidence`: the TP local tensor, the
plan's shard of the dense reference, and the dense tensor), for the first divergent check in
execution order. Each signature is a test on numbers, not on the fault's name:

  partial_sum       replicated tensor; each rank differs, the sum over ranks equals the reference
  scaled_by_world   TP = world x reference            (reduced twice; summed instead of averaged)
  scaled_by_1/world TP = reference / world            (loss divided by tp as if data parallel)
  scaled_by_micro_batches  TP = micro-batches x reference (losses summed over the micro-batches of a
                    step instead of averaged)
  scaled            TP = c x reference for another c
  offset            TP - reference is one per-feature vector broadcast over tokens (a bias counted
                    (tp-1) extra times when added before the reduction)
  rank0_shard       every rank holds what rank 0 should hold (shards loaded without the rank offset)
  permuted          same values, wrong places (fused weight split contiguously, wrong shard/gather
                    dim, wrong head index)
  replicas_differ   a replicated tensor differs across ranks
  decay             TP - reference is proportional to the weights (optimizer stage): weight decay or
                    an L2 term applied differently
  not_applied       TP is zero on some ranks where the reference is not (an update, a gradient or a
                    load that never happened there)
  nan_inf           NaN/Inf appears on the TP side while the reference is finite
  near_bound        every rank within 1e-3 relative of the reference and the error within 2x the
                    bound: rounding, not a collective bug. Never said of an exact check (bound 0:
                    no rounding separates the sides), nor once the case's float64 run failed too
                    (`structural`: the bug acts at float64's resolution)
  held_off_rank     a parameter the plan holds on one rank only (OnRank) exists on another rank
  rng_not_forked    (an RNG check) ranks holding different shards of a mask drew the same mask from
                    the same generator state: the sharded region's draws were not forked per rank
  rng_diverged      (an RNG check) replicas drew different masks, or from different states: a
                    replicated region drew from a rank-seeded generator
  dropout_mismatch  (an RNG check) the TP side's random draw does not match the dense side's
                    (another count, kind, probability or shape)
  clip_local_norm   (a clip:grad_norm check) the TP total gradient norm squared equals the sum over
                    this rank's shards and the replicated parameters: the squared norms were not
                    summed over the ranks
  clip_partial      (a clipped:<parameter> check) the TP clipping scaled some gradients by the
                    clip coefficient and left others unscaled (verdict/clipping.py)
  clip_replicated_counted  (a clip:grad_norm check) the TP norm squared equals the sharded
                    parameters' plus world x the replicated ones': replicated parameters summed over
                    the ranks like shards
  no_placement      (a layout check) a module output whose shape is no placement of the dense
                    module's output (flattened, transposed, reshaped, larger along a dim): the
                    check's reason says the two shapes
  routing           (a routing check) a discrete decision of the TP side (top-k, argmax, sort)
                    picked other indices than the dense side's where the competing values are
                    further apart than rounding explains (a flip at a near-tie is replayed,
                    never a failure: checker/rank/decisions.py)
  decision_bias     (a routing check) the TP side's decision input offset on one index beyond what
                    rounding averages to: a systematic selection bias (mechanisms.py)
  grad_accumulation_reduced  (a gradient check, several micro-batches) TP = W^(n-1)·G_1 + ... +
                    G_n within the bound, the plain sum not: the accumulated .grad all-reduced
                    after every backward (mechanisms.py)
  no_plan_rule      a partial_sum gradient of a parameter no rule of the TP code's own plan
                    (Case.plan_rules) covers (mechanisms.py)
  packed_shard      a mismatch (or replicas that differ) at a module output whose code splits
                    the output of a module whose weight is sharded as one block (mechanisms.py)
  op_on_shard       a mismatch at a module output whose code (its own, a module's in it, or its
                    parent's between its children) runs a reduction or a split on a shard of the
                    dimension it reads: the TP side's dimension smaller at the same source line
                    (mechanisms.py, over checker/rank/shard_ops.py)
  mismatch          none of the above
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpcheck.checker.payload import evidence_key
from tpcheck.checker.verdict import clipping, mechanisms
from tpcheck.checker.verdict.divergence import Diagnosis, FirstDivergence

# How close "equal up to rounding" must be for a signature, relative to the tensor scale: 1e-3, or
# 16 ulps of the working dtype when coarser (bf16). Chosen per diagnosis from the evidence's dtype.
REL_MIN = 1e-3
# "near the bound": within this factor of it; a small relative error far over a tight bound is real
NEAR = 2.0

CAUSES = {
    "partial_sum": (
        "partial sum: the per-rank values add up to the reference, so an all-reduce is missing "
        "(or its result was dropped) before this tensor"
    ),
    "scaled_by_world": (
        "scaled by the world size: reduced twice, or summed where it should be averaged"
    ),
    "scaled_by_1/world": (
        "scaled by 1/world size: divided by tp as if data parallel, or averaged where it "
        "should be summed"
    ),
    "scaled_by_micro_batches": (
        "scaled by the number of micro-batches: the micro-batch losses (or grads) "
        "were summed where they should be averaged"
    ),
    "scaled": "scaled by a constant factor",
    "offset": (
        "offset by a per-feature vector: a bias added before the reduction is counted tp times"
    ),
    "rank0_shard": "every rank holds rank 0's shard: weights loaded without the rank offset",
    "permuted": (
        "same values in the wrong places: a layout bug (a fused weight split contiguously, a wrong "
        "shard or gather dim, a wrong head index)"
    ),
    "replicas_differ": (
        "replicas differ across ranks: a replicated tensor was computed or updated differently "
        "on some rank"
    ),
    "nan_inf": "NaN/Inf appears first here on the TP side while the reference is finite",
    "decay": (
        "the difference is proportional to the weights: weight decay (or an L2 penalty) applied "
        "differently from the dense rule (twice, as L2 instead of decoupled, "
        "with another coefficient)"
    ),
    "not_applied": (
        "zero on these ranks where the reference is not: the operation (an optimizer update, a "
        "gradient, a load) was not applied there"
    ),
    "held_off_rank": (
        "a parameter the plan holds on one rank only (OnRank(r)) exists on these ranks too: the TP "
        "module creates it on every rank (a row-parallel bias meant for rank r only, None "
        "elsewhere), or the plan names the wrong rank"
    ),
    "near_bound": (
        "a rounding-level difference just over the bound (every rank within 1e-3 relative): "
        "a tolerance question more likely than a TP bug"
    ),
    "rng_not_forked": (
        "ranks that hold different shards drew the same dropout mask from the same generator "
        "state: the sharded region's random draws are not forked per rank (Megatron's "
        "get_cuda_rng_tracker().fork(); tpcheck.parallel.RNGTracker), so the shards' masks are "
        "copies of one another"
    ),
    "rng_diverged": (
        "replicas drew different dropout masks (or from different generator states): a replicated "
        "region drew from a generator seeded by rank, so the replicas drift apart"
    ),
    "dropout_mismatch": (
        "the TP side's random draw does not match the dense side's (another number of draws, kind, "
        "probability or shape)"
    ),
    "clip_local_norm": (
        "the TP gradient norm is the norm of this rank's shards only: the squared norms were not "
        "summed over the ranks before clipping (an all-reduce missing in the clipping)"
    ),
    "clip_replicated_counted": (
        "replicated parameters are counted once per rank in the TP gradient norm: their squared "
        "norms were summed over the ranks like the shards' (count them once)"
    ),
    "no_placement": (
        "this module's output on the TP side is laid out as no part of the dense module's output "
        "(flattened, transposed or reshaped; larger along a dim: gathered or concatenated where "
        "the dense module has nothing to gather), so nothing after it computes on what the dense "
        "model computes on"
    ),
    "routing": (
        "a routing decision differs beyond rounding: the TP side's top-k/argmax/sort picked other "
        "indices than the dense side's where the competing values are further apart than the "
        "rounding margin (the router's input computed from a rank's shard or partial sum of the "
        "hidden state)"
    ),
    **mechanisms.CAUSES,
    **clipping.CAUSES,
    "mismatch": "a numerical mismatch with no recognised collective signature",
}
# a buffer (checker/rank/buffers.py) laid out as no placement of the dense one
BUFFER_NO_PLACEMENT = (
    "the TP module keeps this buffer in a layout that is no part of the dense module's buffer "
    "(another length, a reshape), so it cannot be what the dense module computes with; if it is "
    "one, write its placement in Plan(buffers=...)"
)

RNG_SIGNATURES = {"differ": "rng_not_forked", "same": "rng_diverged"}


def diagnose(
    first: FirstDivergence,
    evidence: list[dict],
    world: int,
    micro_batches: int = 1,
    shard_ops: list[dict] | None = None,
) -> Diagnosis:
    """The diagnosis of the first divergent check; `evidence` holds each rank's evidence dict,
    `shard_ops` the operations the TP side ran on a shard of the dimension they read
    (checker/rank/shard_ops.py), to name a mismatch's mechanism."""
    key = evidence_key(first.stage, first.step, first.id)
    # the replicated tensor's own evidence, under the stage it was compared in
    if first.stage == "replicas":
        key = next((k for k in _keys(evidence) if k[1:] == key[1:]), key)
    ev = {r: e[key] for r, e in enumerate(evidence) if key in e}
    if first.kind == "rng":
        return _rng_diagnosis(first, ev)
    if any("held_on" in ev[r] for r in first.ranks if r in ev):
        return _held_off_rank(first, ev)
    if first.id.kind in ("clip", "clipped") and (found := _clip_diagnosis(first, ev)):
        return found
    if first.kind == "layout":
        return _layout_diagnosis(first)
    if first.kind in ("routing", mechanisms.DECISION_BIAS):
        location, said = first.id.location, CAUSES[first.kind]
        sentence = f"the decision {location} (step {first.step}) diverges first: {said}"
        return _diagnosis(first, first.kind, {"flips": first.reason}, sentence=sentence)
    signature, details = ("replicas_differ", {}) if first.stage == "replicas" else ("mismatch", {})
    c = Classifier(
        rel=max(REL_MIN, 16 * max((e.get("eps", 0.0) for e in ev.values()), default=0.0)),
        micro_batches=micro_batches,
    )
    off = first.ranks[0] if first.ranks else 0
    if found := mechanisms.reduced_accumulated(first, ev, world):
        return _diagnosis(first, found[0], found[1], cause=found[2])
    if len(ev) == world:
        signature, details = c.classify(ev, world, evidence, off)
        if signature == "partial_sum" and (found := mechanisms.unruled(first, ev)):
            return _diagnosis(first, found[0], {**details, **found[1]}, cause=found[2])
        if first.stage == "replicas" and signature in ("near_bound", "mismatch"):
            # copies of one element on several ranks differ, by however little
            signature = "replicas_differ"
        error, bound = first.error, first.bound
        exact = bound == 0 or first.kind in ("exact", "replica")
        if signature == "near_bound" and error is not None and exact:
            # a bitwise check: no rounding separates the two sides
            signature, details = "mismatch", {"error": error, "bound": "bitwise"}
        elif signature == "near_bound" and error is not None and bound and error > NEAR * bound:
            # small, but not rounding
            signature, details = "mismatch", {"error_over_bound": error / bound}
    elif off in ev and signature == "mismatch":
        signature, details = c.classify_local(ev[off], world)
    if signature in ("mismatch", "replicas_differ") and (
        found := mechanisms.packed_shard(first, shard_ops or [])
    ):
        return _diagnosis(first, found[0], {**details, **found[1]}, cause=found[2])
    if signature == "mismatch" and (found := mechanisms.op_on_shard(first, shard_ops or [])):
        return _diagnosis(first, found[0], {**details, **found[1]}, cause=found[2])
    return _diagnosis(first, signature, details, cause=_state_cause(first, signature, details))


def _state_cause(first: FirstDivergence, signature: str, details: dict) -> str | None:
    """An optimizer state entry held to the dense optimizer's (`moment:`) and scaled by a constant
    factor: the TP optimizer stepped on gradients scaled after they were checked (None: the
    signature's own cause)."""
    if first.id.kind != "moment" or signature != "scaled":
        return None
    return (
        f"the TP optimizer's {first.id.entry} is the dense optimizer's times "
        f"{details.get('factor', float('nan')):.3g}, while the gradients checked before the step "
        "agree: they were scaled between the check and the step (a gradient clipping or a loss "
        "scale on the TP side only, such as an engine's default gradient clipping; clip both "
        "sides with RunSettings(clip_grad_norm=...) and the TP clipping as tp_clip_grad_norm)"
    )


def structural(
    first: FirstDivergence,
    diagnosis: Diagnosis | None,
    f64_first: FirstDivergence,
    f64_diagnosis: Diagnosis,
) -> Diagnosis:
    """The working run's `diagnosis` of its first divergence `first` once the float64 run of the
    case failed too (first at `f64_first`, diagnosed `f64_diagnosis`). At the same check, the
    float64 run's signature where the two differ: its numbers are free of 16-bit rounding, which
    can make a bias counted twice read as `permuted`, a stale shard as `mismatch`. Elsewhere a
    `near_bound` one is re-said `mismatch`, naming where the float64 run failed: a bug that acts at
    float64's resolution is structural, never a tolerance question. Any other diagnosis is returned
    as it is."""
    if diagnosis is None:
        return diagnosis
    same = first.same_check(f64_first)
    theirs = f64_diagnosis.signature
    readable = same and theirs != "near_bound"
    if diagnosis.signature == "near_bound":
        where = f"{f64_first.name} ({f64_first.stage}, step {f64_first.step})"
        signature, cause = (
            (theirs, f64_diagnosis.cause) if readable else ("mismatch", CAUSES["mismatch"])
        )
        said = "the float64 run fails " + ("at this check" if same else f"too, first at {where}")
        said += ": structural, not a tolerance question"
    elif readable and theirs != diagnosis.signature:
        signature, cause = theirs, f64_diagnosis.cause
        said = (
            "read in the float64 run, which fails at this check too; the working dtype's "
            f"numbers read as {diagnosis.signature}"
        )
    else:
        return diagnosis
    details = {**diagnosis.evidence, "float64_run": theirs}
    return _diagnosis(first, signature, details, cause=f"{cause} ({said})")


def _clip_diagnosis(first: FirstDivergence, ev: dict[int, dict]) -> Diagnosis | None:
    """A clip check's diagnosis (its total norm), or a clipped gradient's (verdict/clipping.py)."""
    if first.id.kind == "clip":
        sig = _clip_signature(ev)
        return sig and _diagnosis(first, *sig)
    if not (sig := clipping.clipped_signature(ev)):
        return None
    left = ", ".join(sig[1]["left_unscaled"])
    return _diagnosis(first, sig[0], sig[1], cause=f"{CAUSES[sig[0]]} (left unscaled: {left})")


def _clip_signature(ev: dict[int, dict]) -> tuple[str, dict] | None:
    """A clip check's TP norm against the squared norms a TP clipping could have summed (kept by
    checker/rank/training.py): the one it matches on every rank where it differs, else None."""
    for name, part in (
        ("clip_local_norm", "local"),
        ("clip_replicated_counted", "replicated_world"),
    ):
        matched = {}
        for r, e in ev.items():
            info = e.get("clip")
            if info is None:
                return None
            tp_sq = float(np.asarray(e["tp"]).reshape(-1)[0]) ** 2
            if abs(tp_sq - info["correct"]) <= REL_MIN * info["correct"]:
                continue  # this rank's norm is right
            if abs(tp_sq - info[part]) > 1e-2 * max(info[part], 1e-30):
                break
            matched[r] = tp_sq
        else:
            if matched and info["correct"] != info[part]:
                return name, {"tp_norm_squared": matched, "expected": info["correct"]}
    return None


def _diagnosis(
    first: FirstDivergence,
    signature: str,
    details: dict,
    cause: str | None = None,
    sentence: str | None = None,
) -> Diagnosis:
    """The diagnosis record of the first divergent check: its signature, the cause in words
    (`CAUSES[signature]` unless said), the evidence's `details` and one sentence (by default
    "<tensor> (<stage>, step <n>) diverges first: <cause>")."""
    cause = CAUSES[signature] if cause is None else cause
    return Diagnosis(
        signature=signature,
        cause=cause,
        location=first.id.location,
        tensor=first.name,
        stage=first.stage,
        step=first.step,
        ranks=first.ranks,
        evidence=details,
        sentence=sentence
        or f"{first.name} ({first.stage}, step {first.step}) diverges first: {cause}",
    )


def _rng_diagnosis(first: FirstDivergence, ev: dict[int, dict]) -> Diagnosis:
    """An RNG placement check diverges first: the rule it broke names the signature."""
    info = next((e["rng"] for r, e in sorted(ev.items()) if r in first.ranks and "rng" in e), {})
    signature = (
        "dropout_mismatch"
        if info.get("problem") or info.get("rule") not in RNG_SIGNATURES
        else RNG_SIGNATURES[info["rule"]]
    )
    details = {"rule": info.get("rule"), "with_ranks": info.get("ranks", [])}
    if info.get("problem"):
        details["problem"] = info["problem"]
    location = first.id.location
    sentence = (
        f"the random masks at {location} (step {first.step}) diverge first: {CAUSES[signature]}"
    )
    return _diagnosis(first, signature, details, sentence=sentence)


def _held_off_rank(first: FirstDivergence, ev: dict[int, dict]) -> Diagnosis:
    """A parameter the plan holds on one rank only is present on another rank (the weights stage's
    absence check fails there)."""
    owner = next(ev[r]["held_on"] for r in first.ranks if "held_on" in ev.get(r, {}))
    location = first.id.location
    sentence = (
        f"{location} exists on rank(s) {first.ranks} although the plan holds it on rank "
        f"{owner} only: {CAUSES['held_off_rank']}"
    )
    details = {"held_on": owner, "present_on": first.ranks}
    return _diagnosis(first, "held_off_rank", details, sentence=sentence)


def _layout_diagnosis(first: FirstDivergence) -> Diagnosis:
    """A module output that is no placement of the dense one diverges first: its shapes (the check's
    reason) and the mechanism, in words."""
    why = BUFFER_NO_PLACEMENT if first.stage == "buffers" else CAUSES["no_placement"]
    cause = f"{first.reason}: {why}"
    return _diagnosis(first, "no_placement", {"shapes": first.reason}, cause=cause)


def _keys(evidence: list[dict]):
    for e in evidence:
        yield from e


def _scale(a: np.ndarray) -> float:
    return float(np.abs(a).max()) if a.size else 0.0


def _close_exact(a: np.ndarray, b: np.ndarray) -> bool:
    return float(np.abs(a - b).max(initial=0.0)) <= 1e-12 * max(_scale(b), 1e-30)


@dataclass(frozen=True)
class Classifier:
    """The signature tests, with `rel`: how close "equal
    up to rounding" is, relative to a tensor's scale."""

    rel: float = REL_MIN
    micro_batches: int = 1

    def _close(self, a: np.ndarray, b: np.ndarray) -> bool:
        return a.shape == b.shape and float(np.abs(a - b).max(initial=0.0)) <= self.rel * max(
            _scale(b), 1e-30
        )

    def _scale_factor(self, tp: np.ndarray, ref: np.ndarray) -> float | None:
        """c with tp == c * ref, or tp == c * ref + v for one per-feature vector v (a replicated
        bias that was not scaled, e.g. a row-parallel output reduced twice, then
        biased); else None."""
        denom = float((ref * ref).sum())
        if denom > 0:
            c = float((tp * ref).sum()) / denom
            if self._close(tp, c * ref):
                return c
        if ref.ndim >= 2 and ref.size > ref.shape[-1]:
            rows_t, rows_r = tp.reshape(-1, tp.shape[-1]), ref.reshape(-1, ref.shape[-1])
            ct, cr = rows_t - rows_t.mean(0), rows_r - rows_r.mean(0)
            denom = float((cr * cr).sum())
            if denom > 0:
                c = float((ct * cr).sum()) / denom
                if self._per_feature(tp - c * ref) or self._close(tp, c * ref):
                    return c
        return None

    def _per_feature(self, d: np.ndarray, noise: float = 0.0) -> bool:
        """d is one nonzero vector over the last dim, broadcast over all other dims (up to `noise`,
        the absolute rounding of the tensors d was computed from, or `rel` of d's own scale)."""
        if d.ndim < 2 or _scale(d) <= noise:
            return False
        rows = d.reshape(-1, d.shape[-1])
        return rows.shape[0] > 1 and float(np.abs(rows - rows[0]).max()) <= max(
            noise, self.rel * _scale(d)
        )

    def classify(
        self, ev: dict[int, dict], world: int, evidence: list[dict], off: int = 0
    ) -> tuple[str, dict]:
        """Signatures that need every rank's tensor; `off` is a rank where the check failed."""
        tps = [ev[r]["tp"] for r in range(world)]
        refs = [ev[r]["ref"] for r in range(world)]
        if any(not np.isfinite(t).all() for t in tps):
            return "nan_inf", {"ranks": [r for r in range(world) if not np.isfinite(tps[r]).all()]}
        zero = [r for r in range(world) if tps[r].size and not tps[r].any() and refs[r].any()]
        if zero:
            return "not_applied", {"ranks": zero}
        replicated = ev[0]["placement"] == "replicate"
        identical = all(np.array_equal(t, tps[0]) for t in tps[1:])
        if replicated and world > 1 and not identical:
            total = np.sum(tps, axis=0)
            if not all(self._close(t, refs[0]) for t in tps):
                # each partial was rounded at its own scale, which
                # cancellation can make larger than the sum's
                noise = self.rel * max(_scale(t) for t in [*tps, refs[0]])
                if float(np.abs(total - refs[0]).max(initial=0.0)) <= noise:
                    return "partial_sum", {
                        "sum_over_ranks_error": float(np.abs(total - refs[0]).max())
                    }
                bias = self._bias_explaining(total - refs[0], world, evidence, noise)
                # a replicated bias added on every rank
                if bias or self._per_feature(total - refs[0], noise):
                    return "partial_sum", {
                        "plus": f"(world - 1) x {bias or 'a per-feature vector'} "
                        "(a bias added on each rank)"
                    }
            errs = [float(np.abs(t - refs[0]).max(initial=0.0)) for t in tps]
            if min(errs) * 10 < max(errs):  # some ranks (nearly) right, others not
                return "replicas_differ", {
                    "ranks_off": [r for r in range(world) if errs[r] > 10 * min(errs)]
                }
            sig, details = self.classify_local(ev[off], world)
            return ("replicas_differ", details) if sig == "mismatch" else (sig, details)
        if (
            world > 1
            and not replicated
            and all(self._close(tps[r], refs[0]) for r in range(world))
            and not self._close(refs[1], refs[0])
        ):
            return "rank0_shard", {}
        sig, details = self.classify_local(ev[off], world)
        if sig == "offset":
            details.update(self._offset_source(ev, world, evidence))
        if sig == "mismatch" and all(self._close(t, r) for t, r in zip(tps, refs)):
            return "near_bound", {}
        if sig == "mismatch":
            flat_tp = np.sort(np.concatenate([t.ravel() for t in tps]))
            flat_ref = np.sort(np.concatenate([r.ravel() for r in refs]))
            if self._close(flat_tp, flat_ref):
                return "permuted", {}
        return sig, details

    def classify_local(self, e: dict, world: int) -> tuple[str, dict]:
        """Signatures visible on one rank's tensor alone (scale, offset, layout)."""
        tp, ref = e["tp"], e["ref"]
        if not np.isfinite(tp).all():
            return "nan_inf", {}
        if tp.size and not tp.any() and ref.any():
            return "not_applied", {}
        c = self._scale_factor(tp, ref)
        if c is not None:
            for name, target, applies in (
                ("scaled_by_world", world, world > 1),
                ("scaled_by_1/world", 1.0 / world, world > 1),
                ("scaled_by_micro_batches", self.micro_batches, self.micro_batches > 1),
            ):
                if applies and abs(c - target) <= 1e-2 * target:
                    return name, {"factor": c}
        if "weights" in e and (k := self._proportional(tp - ref, e["weights"])) is not None:
            return "decay", {"difference_over_weights": k}
        if c is not None:
            # any two scalars "scale"; and noise moves the fitted c off 1 too: a scale explains the
            # difference only when removing it leaves (almost) nothing
            if (
                abs(c - 1.0) > 1e-6
                and not _close_exact(tp, ref)
                and tp.size > 1
                and self._explains(tp, ref, c)
            ):
                return "scaled", {"factor": c}
        d = tp - ref
        if self._per_feature(d):
            return "offset", {"offset_norm": float(np.linalg.norm(d.reshape(-1, d.shape[-1])[0]))}
        if (
            tp.shape == ref.shape
            and not self._close(tp, ref)
            and self._close(np.sort(tp.ravel()), np.sort(ref.ravel()))
        ):
            return "permuted", {}
        return "mismatch", {"relative_error": float(np.abs(d).max()) / max(_scale(ref), 1e-30)}

    def _proportional(self, d: np.ndarray, w: np.ndarray) -> float | None:
        """k with d == k * w up to 10% of d (rounding in
        the optimizer's arithmetic is coarser than d)."""
        denom = float((w * w).sum())
        if d.shape != w.shape or denom == 0 or _scale(d) == 0:
            return None
        k = float((d * w).sum()) / denom
        return k if float(np.abs(d - k * w).max()) <= 0.1 * _scale(d) else None

    def _explains(self, tp: np.ndarray, ref: np.ndarray, c: float) -> bool:
        """Scaling by c removes at least 90% of the difference (up to one per-feature vector)."""
        rest = tp - c * ref
        return self._per_feature(rest) or float(np.abs(rest).max()) <= 0.1 * float(
            np.abs(tp - ref).max()
        )

    def _offset_source(self, ev: dict[int, dict], world: int, evidence: list[dict]) -> dict:
        """Name the replicated parameter p with offset ==
        (world - 1) * p, if the loaded weights say so."""
        bias = self._bias_explaining(ev[0]["tp"] - ev[0]["ref"], world, evidence)
        return {"offset_is": f"(world - 1) x {bias}"} if bias else {}

    def _bias_explaining(
        self, d: np.ndarray, world: int, evidence: list[dict], noise: float = 0.0
    ) -> str | None:
        """The name of a 1-D parameter p (as loaded) with every row of d equal to (world - 1) * p,
        up to `noise` (the absolute rounding of the tensors d was computed from) or
        `rel` of p's scale."""
        if world < 2 or d.ndim < 1 or _scale(d) <= noise:
            return None
        rows = d.reshape(-1, d.shape[-1])
        for key, e in evidence[0].items():
            stage, _, name = key
            if stage == "weights" and e["dense"].shape == rows.shape[1:]:
                bias = (world - 1) * e["dense"]
                tol = max(noise, self.rel * _scale(bias))
                if all(float(np.abs(row - bias).max(initial=0.0)) <= tol for row in rows):
                    return name.location
        return None
