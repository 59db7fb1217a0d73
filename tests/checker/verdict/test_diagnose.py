"""`tpcheck.checker.verdict.diagnose.diagnose` on synthetic evidence, without processes: for each
signature of the module docstring, per-rank tensors built to have exactly that numerical shape must
be named by it, and near misses (a correct-ish tensor, a world-size factor, evidence from only some
ranks) must not be misnamed."""

import numpy as np
import pytest

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.verdict import diagnose as diagnosing
from tpcheck.checker.verdict.diagnose import CAUSES
from tpcheck.checker.verdict.divergence import Diagnosis, FirstDivergence

FP32_EPS = float(np.finfo(np.float32).eps)
BF16_EPS = 2.0**-7
KEY = ("forward", 1, "act:down")
SHAPE = (8, 16)


def typed(evidence: list[dict]) -> list[dict]:
    """Evidence keyed as a report names checks, keyed as the verdict holds it (the identity)."""
    return [{(st, sp, CheckId.parse(n)): v for (st, sp, n), v in e.items()} for e in evidence]


def diagnose(first: dict, evidence: list[dict], *args, **kw) -> dict:
    """The diagnosis of a first divergence given as the report's object (read back as the verdict
    holds it), over evidence keyed by the report's names."""
    return diagnosing.diagnose(
        FirstDivergence.from_json(first), typed(evidence), *args, **kw
    ).to_json()


def structural(first: dict, diagnosis: dict, f64_first: dict, f64_diagnosis: dict) -> dict:
    """`structural` on the report's objects (read back as the verdict holds them): the same object
    back where the diagnosis stands, else the new one."""
    here, there = FirstDivergence.from_json(first), FirstDivergence.from_json(f64_first)
    theirs = Diagnosis.from_json({**EMPTY, **f64_diagnosis})
    mine = Diagnosis.from_json(diagnosis)
    said = diagnosing.structural(here, mine, there, theirs)
    return diagnosis if said is mine else said.to_json()


# the fields a test's float64 diagnosis leaves out (it gives the signature and the cause)
EMPTY = {"location": "", "tensor": "", "stage": "", "step": 0, "ranks": [], "evidence": {}}
EMPTY["sentence"] = ""


def first(stage="forward", step=1, name="act:down", ranks=(0, 1)) -> dict:
    return {"stage": stage, "step": step, "name": name, "ranks": list(ranks)}


def evidence(tps, refs, placement, dense=None, key=KEY, eps=FP32_EPS, weights=None) -> list[dict]:
    """One evidence dict per rank; `weights` = {param name:
    dense value} added as ("weights", 0, "param:NAME")."""
    dense = refs[0] if dense is None else dense
    out = []
    for tp, ref in zip(tps, refs):
        e = {
            key: {
                "tp": np.asarray(tp, dtype=np.float64),
                "ref": np.asarray(ref, dtype=np.float64),
                "dense": dense,
                "placement": placement,
                "eps": eps,
            }
        }
        for name, value in (weights or {}).items():
            e[("weights", 0, f"param:{name}")] = {
                "tp": value,
                "ref": value,
                "dense": value,
                "placement": "replicate",
                "eps": eps,
            }
        out.append(e)
    return out


def rng(seed):
    return np.random.default_rng(seed)


def sharded_refs(world, seed=0, shape=SHAPE):
    """The plan's shards of a dense tensor split along dim 0: one distinct reference per rank."""
    dense = rng(seed).standard_normal((shape[0] * world, *shape[1:]))
    return dense, list(np.split(dense, world, axis=0))


def run(tps, refs, placement, world, micro_batches=1, **kw):
    f = kw.pop("first", None) or first(ranks=range(world))
    return diagnose(f, evidence(tps, refs, placement, **kw), world, micro_batches)


# --- one test per signature -----------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_partial_sum(world):
    ref = rng(1).standard_normal(SHAPE)
    partials = [rng(10 + r).standard_normal(SHAPE) for r in range(world - 1)]
    partials.append(ref - np.sum(partials, axis=0))  # the partials add up to the reference
    d = run(partials, [ref] * world, "replicate", world)
    assert d["signature"] == "partial_sum"
    assert d["evidence"]["sum_over_ranks_error"] < 1e-12
    assert d["cause"] == CAUSES["partial_sum"]


def test_partial_sum_with_a_bias_added_on_every_rank_names_the_bias():
    # Row-parallel output whose replicated bias was added on each rank before the (missing)
    # reduction: the partials sum to ref + (world - 1) x bias.
    world = 2
    ref = rng(2).standard_normal(SHAPE)
    bias = rng(3).standard_normal(SHAPE[-1])
    p0 = rng(4).standard_normal(SHAPE)
    partials = [p0, ref + (world - 1) * bias - p0]
    d = run(partials, [ref] * world, "replicate", world, weights={"down.bias": bias})
    assert d["signature"] == "partial_sum"
    assert "down.bias" in d["evidence"]["plus"]


def test_partial_sums_rounded_in_16_bit_at_their_own_scale():
    # Partials much larger than their sum (cancellation), each rounded to float16 at its own scale:
    # the sum misses the reference by more than rounding at the *reference's* scale,
    # not at the partials'.
    world, eps = 2, 2.0**-10
    ref = rng(30).standard_normal(SHAPE)
    p0 = 64 * rng(31).standard_normal(SHAPE)
    partials = [np.float16(p0).astype(np.float64), np.float16(ref - p0).astype(np.float64)]
    # the case this is about
    assert np.abs(sum(partials) - ref).max() > 16 * eps * np.abs(ref).max()
    d = run(partials, [ref] * world, "replicate", world, eps=eps)
    assert d["signature"] == "partial_sum"


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_scaled_by_micro_batches(micro_batches):
    ref = rng(32).standard_normal(SHAPE)
    world = 4  # not a multiple that scaled_by_world could also explain
    d = run(
        [micro_batches * ref] * world,
        [ref] * world,
        "replicate",
        world,
        micro_batches=micro_batches,
    )
    assert d["signature"] == "scaled_by_micro_batches"
    assert d["evidence"]["factor"] == pytest.approx(micro_batches)
    # without accumulation, the same numbers are a plain scale
    assert (
        run([micro_batches * ref] * world, [ref] * world, "replicate", world)["signature"]
        == "scaled"
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("placement", ["replicate", "shard(dim=0)"])
def test_scaled_by_world(world, placement):
    refs = (
        sharded_refs(world, seed=5)[1]
        if placement != "replicate"
        else [rng(5).standard_normal(SHAPE)] * world
    )
    d = run([world * r for r in refs], refs, placement, world)
    assert d["signature"] == "scaled_by_world"
    assert d["evidence"]["factor"] == pytest.approx(world)


@pytest.mark.parametrize("world", [2, 4])
def test_scaled_by_one_over_world(world):
    ref = rng(6).standard_normal(SHAPE)
    d = run([ref / world] * world, [ref] * world, "replicate", world)
    assert d["signature"] == "scaled_by_1/world"
    assert d["evidence"]["factor"] == pytest.approx(1 / world)


def test_scaled_by_another_constant():
    world = 2
    _, refs = sharded_refs(world, seed=7)
    d = run([1.7 * r for r in refs], refs, "shard(dim=0)", world)
    assert d["signature"] == "scaled"
    assert d["evidence"]["factor"] == pytest.approx(1.7)


@pytest.mark.parametrize("world", [2, 4])
def test_offset_names_the_bias(world):
    # A bias added before the reduction is counted `world` times: (world - 1) x bias too much,
    # broadcast over every token (row).
    ref = rng(8).standard_normal(SHAPE)
    bias = rng(9).standard_normal(SHAPE[-1])
    tp = ref + (world - 1) * bias
    d = run([tp] * world, [ref] * world, "replicate", world, weights={"down.bias": bias})
    assert d["signature"] == "offset"
    assert d["evidence"]["offset_is"] == "(world - 1) x down.bias"
    assert d["evidence"]["offset_norm"] == pytest.approx(np.linalg.norm((world - 1) * bias))


def test_offset_without_a_matching_parameter_is_still_offset():
    world = 2
    ref = rng(8).standard_normal(SHAPE)
    vec = rng(9).standard_normal(SHAPE[-1])
    other = rng(10).standard_normal(SHAPE[-1])  # a bias that does not explain the offset
    d = run([ref + vec] * world, [ref] * world, "replicate", world, weights={"up.bias": other})
    assert d["signature"] == "offset"
    assert "offset_is" not in d["evidence"]


@pytest.mark.parametrize("world", [2, 4])
def test_rank0_shard(world):
    _, refs = sharded_refs(world, seed=11)
    d = run(
        [refs[0].copy() for _ in range(world)],
        refs,
        "shard(dim=0)",
        world,
        first=first(ranks=range(1, world)),
    )
    assert d["signature"] == "rank0_shard"


def test_permuted_within_a_rank():
    world = 2
    _, refs = sharded_refs(world, seed=12)
    tps = [r.T.reshape(r.shape) for r in refs]  # same values, transposed layout
    d = run(tps, refs, "shard(dim=0)", world)
    assert d["signature"] == "permuted"


def test_permuted_across_ranks():
    # Shards swapped between ranks (a wrong shard index):
    # no rank holds its own values, all values exist.
    world = 2
    _, refs = sharded_refs(world, seed=13)
    d = run([refs[1], refs[0]], refs, "shard(dim=0)", world)
    assert d["signature"] == "permuted"


def test_replicas_differ_at_the_replicas_stage():
    world = 2
    ref = rng(14).standard_normal(SHAPE)
    off = ref + 0.3 * rng(15).standard_normal(SHAPE)
    # keyed by the stage that produced the tensor
    ev = evidence([ref, off], [ref, ref], "replicate")
    d = diagnose(first(stage="replicas", ranks=[1]), ev, world)
    assert d["signature"] == "replicas_differ"
    assert d["evidence"]["ranks_off"] == [1]
    assert d["stage"] == "replicas"


@pytest.mark.parametrize("world", [2, 4])
def test_replicas_differ_on_a_replicated_tensor(world):
    ref = rng(16).standard_normal(SHAPE)
    tps = [ref.copy() for _ in range(world)]
    tps[-1] = ref + 0.3 * rng(17).standard_normal(SHAPE)
    d = run(tps, [ref] * world, "replicate", world)
    assert d["signature"] == "replicas_differ"
    assert d["evidence"]["ranks_off"] == [world - 1]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf(bad):
    world = 2
    _, refs = sharded_refs(world, seed=18)
    tps = [r.copy() for r in refs]
    tps[1][3, 4] = bad
    d = run(tps, refs, "shard(dim=0)", world)
    assert d["signature"] == "nan_inf"
    assert d["evidence"]["ranks"] == [1]


@pytest.mark.parametrize("world", [2, 4])
def test_near_bound(world):
    _, refs = sharded_refs(world, seed=19)
    tps = [
        r + 1e-6 * np.abs(r).max() * rng(20 + i).uniform(-1, 1, r.shape) for i, r in enumerate(refs)
    ]
    d = run(tps, refs, "shard(dim=0)", world)
    assert d["signature"] == "near_bound"


def test_mismatch():
    world = 2
    _, refs = sharded_refs(world, seed=21)
    tps = [rng(22 + i).standard_normal(r.shape) for i, r in enumerate(refs)]
    d = run(tps, refs, "shard(dim=0)", world)
    assert d["signature"] == "mismatch"
    assert d["evidence"]["relative_error"] > 0.1


@pytest.mark.parametrize(("rel", "eps"), [(1e-4, FP32_EPS), (5e-4, BF16_EPS)], ids=["fp32", "bf16"])
def test_rounding_level_noise_within_1e_3_is_near_bound(rel, eps):
    # Docstring: near_bound = "every rank within 1e-3 relative of the reference". Every element is
    # within `rel` (<= 5e-4) relative; the noise moves the fitted factor off 1 (c ~ 1.00002), but a
    # scale does not explain the difference, so this is not "scaled".
    world = 2
    _, refs = sharded_refs(world, seed=34)
    tps = [
        r + rel * np.abs(r).max() * rng(35 + i).uniform(-1, 1, r.shape) for i, r in enumerate(refs)
    ]
    assert run(tps, refs, "shard(dim=0)", world, eps=eps)["signature"] == "near_bound"


# --- the returned record --------------------------------------------------------------------------


def test_record_fields():
    ref = rng(23).standard_normal(SHAPE)
    f = {"stage": "backward", "step": 3, "name": "grad:mlp.down", "ranks": [0, 1]}
    ev = evidence([2 * ref] * 2, [ref] * 2, "replicate", key=("backward", 3, "grad:mlp.down"))
    d = diagnose(f, ev, 2)
    assert d["signature"] == "scaled_by_world"
    assert (d["tensor"], d["location"], d["stage"], d["step"], d["ranks"]) == (
        "grad:mlp.down",
        "mlp.down",
        "backward",
        3,
        [0, 1],
    )
    assert d["cause"] == CAUSES["scaled_by_world"]
    assert d["sentence"].startswith("grad:mlp.down (backward, step 3) diverges first: ")
    assert d["sentence"].endswith(CAUSES["scaled_by_world"])
    assert set(CAUSES) == {
        "packed_shard",
        "partial_sum",
        "scaled_by_world",
        "scaled_by_1/world",
        "scaled",
        "offset",
        "rank0_shard",
        "permuted",
        "replicas_differ",
        "nan_inf",
        "near_bound",
        "mismatch",
        "not_applied",
        "decay",
        "scaled_by_micro_batches",
        "routing",
        "decision_bias",
        "clip_partial",
        "rng_not_forked",
        "rng_diverged",
        "dropout_mismatch",
        "clip_local_norm",
        "clip_replicated_counted",
        "held_off_rank",
        "no_placement",
        "grad_accumulation_reduced",
        "no_plan_rule",
        "op_on_shard",
    }


@pytest.mark.parametrize(
    "rule,problem,signature",
    [
        ("differ", None, "rng_not_forked"),
        ("same", None, "rng_diverged"),
        ("same", "the TP side drops with p=0.2", "dropout_mismatch"),
        (None, "a mask where the dense side drew none", "dropout_mismatch"),
    ],
)
def test_an_rng_check_is_named_by_the_rule_it_broke(rule, problem, signature):
    f = {
        "stage": "forward",
        "step": 1,
        "name": "rng:layers.0.attention.attn_dropout",
        "ranks": [0, 1],
        "kind": "rng",
    }
    info = {"rule": rule, "ranks": [1], "problem": problem}
    ev = [
        {
            ("forward", 1, "rng:layers.0.attention.attn_dropout"): {
                "tp": np.array([1.0]),
                "ref": np.zeros(1),
                "dense": np.zeros(1),
                "rng": info,
            }
        }
    ] * 2
    d = diagnose(f, ev, 2)
    assert d["signature"] == signature and d["cause"] == CAUSES[signature]
    assert d["location"] == "layers.0.attention.attn_dropout"
    assert d["evidence"]["with_ranks"] == [1] and d["evidence"].get("problem") == problem


# --- checker mutants: near misses that must not be misnamed ---------------------------------------


def test_correct_ish_replicated_tensor_is_not_a_partial_sum():
    # Both ranks within rounding of the reference, not bitwise equal: their sum is 2 x ref, and each
    # is already right, so no all-reduce is missing.
    world = 2
    ref = rng(24).standard_normal(SHAPE)
    tps = [ref + 1e-7 * rng(25 + i).standard_normal(SHAPE) for i in range(world)]
    d = run(tps, [ref] * world, "replicate", world)
    assert d["signature"] != "partial_sum"
    assert d["signature"] == "replicas_differ"  # replicas must be bitwise equal


def test_identical_halves_are_not_a_partial_sum():
    # Every rank holds ref / 2, identically: that is a scale, not per-rank partials.
    ref = rng(26).standard_normal(SHAPE)
    d = run([ref / 2] * 2, [ref] * 2, "replicate", 2)
    assert d["signature"] == "scaled_by_1/world"


def test_world_factor_at_world_4_is_recognised_not_generic_scale():
    world = 4
    _, refs = sharded_refs(world, seed=27)
    d = run([4 * r for r in refs], refs, "shard(dim=0)", world)
    assert d["signature"] == "scaled_by_world"
    # ... while a factor of 2 at world 4 is neither world nor 1/world.
    d2 = run([2 * r for r in refs], refs, "shard(dim=0)", world)
    assert d2["signature"] == "scaled"
    assert d2["evidence"]["factor"] == pytest.approx(2)


def test_correct_shards_are_not_rank0_shard():
    world = 2
    _, refs = sharded_refs(world, seed=28)
    tps = [r * (1 + 1e-7) for r in refs]
    assert run(tps, refs, "shard(dim=0)", world)["signature"] == "near_bound"


def test_bf16_eps_widens_the_tolerance_for_partial_sums():
    # A partial sum whose total is off by 5% is still a
    # partial sum in bf16 (16 ulps = 12.5%), not in fp32.
    world = 2
    ref = rng(29).standard_normal(SHAPE)
    p0 = rng(30).standard_normal(SHAPE)
    noise = 0.05 * np.abs(ref).max() * rng(31).uniform(-1, 1, SHAPE)
    partials = [p0, ref - p0 + noise]
    assert (
        run(partials, [ref] * world, "replicate", world, eps=BF16_EPS)["signature"] == "partial_sum"
    )
    assert (
        run(partials, [ref] * world, "replicate", world, eps=FP32_EPS)["signature"] != "partial_sum"
    )


@pytest.mark.parametrize("present", [[0], [1]])
def test_evidence_from_only_some_ranks_still_gives_a_signature(present):
    world = 2
    _, refs = sharded_refs(world, seed=32)
    full = evidence([2 * r for r in refs], refs, "shard(dim=0)")
    partial = [e if r in present else {} for r, e in enumerate(full)]
    d = diagnose(first(ranks=present), partial, world)
    # The failing rank's own tensor still shows the factor.
    assert d["signature"] == "scaled_by_world"


def test_evidence_missing_the_failing_rank_falls_back_to_mismatch():
    world = 4
    _, refs = sharded_refs(world, seed=33)
    full = evidence([2 * r for r in refs], refs, "shard(dim=0)")
    d = diagnose(first(ranks=[3]), full[:2], world)  # ranks 2 and 3 never reported
    assert d["signature"] == "mismatch"
    assert d["evidence"] == {}


def test_no_evidence_at_all():
    d = diagnose(first(ranks=[]), [], 2)
    assert d["signature"] == "mismatch"
    assert d["sentence"].startswith("act:down (forward, step 1)")


def test_not_applied_names_the_ranks_where_nothing_happened():
    """An update (or grad) that never happened on some ranks: zero there, the reference is not.
    Checked before the replicated-tensor signatures, where a zero on one rank would read
    as a partial sum."""
    world = 2
    ref = rng(40).standard_normal(SHAPE)
    d = run([ref, np.zeros_like(ref)], [ref, ref], "replicate", world)
    assert d["signature"] == "not_applied" and d["evidence"]["ranks"] == [1]
    _, refs = sharded_refs(world, seed=41)
    d = run([refs[0], np.zeros_like(refs[1])], refs, "shard(dim=0)", world)
    assert d["signature"] == "not_applied"
    # a zero reference is not "not applied"
    d = run([np.zeros(SHAPE)] * 2, [np.zeros(SHAPE)] * 2, "replicate", world)
    assert d["signature"] != "not_applied"


def test_decay_is_a_difference_proportional_to_the_weights():
    """Optimizer-stage evidence carries the parameter's weights: an update that differs by k * w
    (weight decay applied twice, or as L2) is named so; an update that differs otherwise is not."""
    world = 2
    w = [rng(50 + r).standard_normal(SHAPE) for r in range(world)]
    upd = [rng(60 + r).standard_normal(SHAPE) * 1e-3 for r in range(world)]
    tps = [u - 1e-5 * wr for u, wr in zip(upd, w)]
    ev = evidence(tps, upd, "shard(dim=0)", key=("optimizer", 1, "update:fc.weight"))
    for r in range(world):
        ev[r][("optimizer", 1, "update:fc.weight")]["weights"] = w[r]
    d = diagnose(
        {"stage": "optimizer", "step": 1, "name": "update:fc.weight", "ranks": [0, 1]}, ev, world
    )
    assert d["signature"] == "decay" and abs(d["evidence"]["difference_over_weights"] + 1e-5) < 1e-7
    for r in range(world):  # the same difference without weights as evidence: no such claim
        del ev[r][("optimizer", 1, "update:fc.weight")]["weights"]
    d = diagnose(
        {"stage": "optimizer", "step": 1, "name": "update:fc.weight", "ranks": [0, 1]}, ev, world
    )
    assert d["signature"] != "decay"


def test_small_but_far_over_the_bound_is_not_near_bound():
    """A 5e-6 relative error (an RMSNorm eps of 1e-5 instead of 1e-6) is within 1e-3 relative, but
    7x a tight float32 bound: that is a real difference, not rounding."""
    world = 2
    _, refs = sharded_refs(world, seed=70)
    tps = [r * (1 + 5e-6 * rng(71 + i).uniform(0.5, 1, r.shape)) for i, r in enumerate(refs)]
    ev = evidence(tps, refs, "shard(dim=0)")
    scale = max(float(np.abs(r).max()) for r in refs)
    near = {
        "stage": "forward",
        "step": 1,
        "name": "act:down",
        "ranks": [0, 1],
        "error": 5e-6 * scale,
        "bound": 4e-6 * scale,
    }
    assert diagnose(near, ev, world)["signature"] == "near_bound"
    far = dict(near, bound=5e-6 * scale / 7)
    d = diagnose(far, ev, world)
    assert d["signature"] == "mismatch" and d["evidence"]["error_over_bound"] > 6


def _clip_evidence(tp_norms, correct=10.0, local=(6.0, 5.0), replicated_world=13.0):
    """A clip:grad_norm check's evidence on each rank: the TP norm and the squared norms a TP
    clipping could have summed (checker/rank/training.py)."""
    key = ("optimizer", 1, "clip:grad_norm")
    return [
        {
            key: {
                "tp": np.array([t]),
                "ref": np.array([correct**0.5]),
                "dense": np.array([correct**0.5]),
                "placement": "replicate",
                "eps": 1.2e-7,
                "clip": {
                    "correct": correct,
                    "local": local[r],
                    "replicated_world": replicated_world,
                    "world": 2,
                },
            }
        }
        for r, t in enumerate(tp_norms)
    ]


@pytest.mark.parametrize(
    "tp_norms,signature",
    [
        ((6.0**0.5, 5.0**0.5), "clip_local_norm"),
        ((13.0**0.5, 13.0**0.5), "clip_replicated_counted"),
        ((3.0, 3.0), "scaled"),  # neither: the classifier's own reading of two scalars
    ],
)
def test_a_clip_check_is_named_by_the_norms_it_matches(tp_norms, signature):
    first = {"stage": "optimizer", "step": 1, "name": "clip:grad_norm", "ranks": [0, 1]}
    d = diagnose(first, _clip_evidence(tp_norms), 2)
    if signature.startswith("clip_"):
        assert d["signature"] == signature
    else:
        assert not d["signature"].startswith("clip_")


def test_a_bitwise_check_just_off_is_a_mismatch_not_near_the_bound():
    ref = rng(5).standard_normal(SHAPE)
    key = ("optimizer", 1, "update:w")
    ev = evidence([ref * (1 + 1e-6)] * 2, [ref] * 2, "replicate", key=key)
    first = {"stage": "optimizer", "step": 1, "name": "update:w", "ranks": [0, 1]}
    assert diagnose({**first, "error": 1e-6, "bound": 0.0}, ev, 2)["signature"] == "mismatch"
    assert diagnose({**first, "error": 1e-6, "bound": 1e-6}, ev, 2)["signature"] == "near_bound"


def test_a_layout_check_is_diagnosed_from_its_reason_with_no_evidence():
    """A module output that is no placement of the dense one (kind "layout"): the diagnosis names
    the module, the shapes its check's reason gives and the mechanism; no tensor is needed."""
    f = {
        "stage": "forward",
        "step": 1,
        "name": "act:mlp.up",
        "ranks": [0, 1],
        "kind": "layout",
        "reason": "its output [8, 32] is no placement of the dense [4, 2, 32]",
    }
    d = diagnose(f, [{}, {}], 2)
    assert (d["signature"], d["location"]) == ("no_placement", "mlp.up")
    assert d["cause"].startswith("its output [8, 32] is no placement of the dense [4, 2, 32]: ")
    assert d["cause"].endswith(CAUSES["no_placement"])


def _near(key, seed=6):
    """Evidence of a replicated tensor off by a rounding-level 1e-6 relative, element by element."""
    ref = rng(seed).standard_normal(SHAPE)
    tp = ref * (1 + 1e-6 * rng(seed + 1).uniform(-1, 1, SHAPE))
    return evidence([tp] * 2, [ref] * 2, "replicate", key=key)


def test_an_exact_check_is_never_near_the_bound_whatever_bound_it_carries():
    ev = _near(("optimizer", 1, "update:w"))
    f = {"stage": "optimizer", "step": 1, "name": "update:w", "ranks": [0, 1], "error": 1e-6}
    assert diagnose({**f, "bound": 1e-6, "kind": "exact"}, ev, 2)["signature"] == "mismatch"
    assert diagnose({**f, "bound": 1e-6, "kind": "calibrated"}, ev, 2)["signature"] == "near_bound"


def test_near_bound_is_re_said_once_the_float64_run_fails():
    """`structural`: at the same check, the float64 run's signature; elsewhere `mismatch` naming
    where the float64 run failed; any other diagnosis unchanged."""

    here = {"stage": "forward", "step": 1, "name": "act:q_norm", "ranks": [0, 1]}
    ev = _near(("forward", 1, "act:q_norm"))
    near = diagnose({**here, "error": 1e-6, "bound": 1e-6}, ev, 2)
    assert near["signature"] == "near_bound"
    f64 = {"signature": "partial_sum", "cause": CAUSES["partial_sum"]}
    same = structural(here, near, here, f64)
    assert same["signature"] == "partial_sum" and "fails at this check" in same["cause"]
    assert same["tensor"] == "act:q_norm" and same["evidence"]["float64_run"] == "partial_sum"
    later = {**here, "name": "act:o_proj"}
    other = structural(here, near, later, f64)
    assert other["signature"] == "mismatch" and "first at act:o_proj" in other["cause"]
    assert "not a tolerance question" in other["cause"]
    # another signature: kept where the float64 run failed elsewhere or reads it the same
    permuted = {**near, "signature": "permuted"}
    assert structural(here, permuted, later, f64) is permuted
    assert structural(here, permuted, here, {**f64, "signature": "permuted"}) is permuted
    # at the same check, the float64 run's reading, free of 16-bit rounding, wins
    offset = structural(here, permuted, here, {"signature": "offset", "cause": CAUSES["offset"]})
    assert offset["signature"] == "offset" and "numbers read as permuted" in offset["cause"]
