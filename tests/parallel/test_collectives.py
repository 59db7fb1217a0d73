"""The public autograd collectives of
`tpcheck.parallel.collectives`, checked against unsharded tensors.

In the style of Megatron-LM's tests/unit_tests/tensor_parallel/test_mappings.py: every wrapper's
forward value AND its backward (the adjoint its docstring states) is compared with what the full,
unsharded tensors say it must be.

Each rank builds the *full* tensors from one seeded generator (`_full_tensors`), takes its own shard
as the input, runs forward and backward, and returns plain tensors. The parent rebuilds the same
full tensors and computes the references there, so one fork per world size serves every check
(`_ranks_results` caches it).

Upstream gradients differ per rank on purpose: an adjoint that sums (or fails to sum) over ranks
where it should not is then visible.

Tolerances:
- pure data movement (identity, split, all-gather) must be bitwise: `rtol=0, atol=0`;
- a sum over ranks (all-reduce, reduce-scatter) is float32 arithmetic in an order the collective
  picks (gloo's ring / tree), so it may differ from any reference sum by rounding: see
  `assert_rank_sum_close` for the bound.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.testing import assert_close

from tpcheck.checker.pool.spawn import run_on_ranks
from tpcheck.parallel import collectives as C
from tpcheck.parallel.group import TPGroup

SEED = 1234
S, B, H = 4, 2, 8  # [s, b, h], sequence-first; s and h divide by every world size used (1, 2, 4)
WORLDS = [1, 2, pytest.param(4, marks=pytest.mark.slow)]
TIMEOUT_S = 60.0

# Every public autograd wrapper, plus the optimizer-phase all_reduce_grad_.
WRAPPERS = [
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]
ALL = [*WRAPPERS, "all_reduce_grad_"]

# (op, phase) of the collectives each one issues when world_size > 1, in order, per the docstrings.
EXPECTED_TAPS = {
    "copy_to_tp_region": [("all_reduce", "backward")],
    "reduce_from_tp_region": [("all_reduce", "forward")],
    "scatter_to_tp_region": [("all_gather", "backward")],
    "gather_from_tp_region": [("all_gather", "forward")],
    "scatter_to_sequence_parallel_region": [("all_gather", "backward")],
    "gather_from_sequence_parallel_region": [
        ("all_gather", "forward"),
        ("reduce_scatter", "backward"),
    ],
    "reduce_scatter_to_sequence_parallel_region": [
        ("reduce_scatter", "forward"),
        ("all_gather", "backward"),
    ],
    "all_reduce_grad_": [("all_reduce", "optimizer")],
}


def test_every_public_collective_is_covered():
    public = {
        n
        for n in dir(C)
        if not n.startswith("_")
        and callable(getattr(C, n))
        and getattr(getattr(C, n), "__module__", None) == C.__name__
    }
    assert public == set(ALL), (
        f"untested or renamed public collectives: {sorted(public ^ set(ALL))}"
    )


# ------------------------------------------------------------------------------------ full tensors


def _full_tensors(world: int) -> dict[str, torch.Tensor]:
    """The unsharded tensors every rank and the parent rebuild identically (same seed, same order).
    `*_parts` have a leading world dim: index r is rank r's own (distinct) tensor."""
    g = torch.Generator().manual_seed(SEED + world)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    return {
        "x": randn(S, B, H),  # a replicated activation
        "parts": randn(world, S, B, H),  # per-rank partial sums
        "grad_full": randn(world, S, B, H),  # per-rank upstream grads of a full-size output
        "grad_tp": randn(world, S, B, H // world),  # per-rank upstream grads of a last-dim shard
        "grad_sp": randn(world, S // world, B, H),  # per-rank upstream grads of a dim-0 shard
    }


def _shard_last(t: torch.Tensor, world: int, r: int) -> torch.Tensor:
    return t.chunk(world, dim=-1)[r]


def _shard_first(t: torch.Tensor, world: int, r: int) -> torch.Tensor:
    return t.chunk(world, dim=0)[r]


def _inputs(name: str, full: dict, world: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, upstream grad) of wrapper `name` on rank r."""
    if name == "copy_to_tp_region":
        return full["x"], full["grad_full"][r]
    if name == "reduce_from_tp_region":
        return full["parts"][r], full["grad_full"][r]
    if name == "scatter_to_tp_region":
        return full["x"], full["grad_tp"][r]
    if name == "gather_from_tp_region":
        return _shard_last(full["x"], world, r), full["grad_full"][r]
    if name == "scatter_to_sequence_parallel_region":
        return full["x"], full["grad_sp"][r]
    if name == "gather_from_sequence_parallel_region":
        return _shard_first(full["x"], world, r), full["grad_full"][r]
    if name == "reduce_scatter_to_sequence_parallel_region":
        return full["parts"][r], full["grad_sp"][r]
    raise KeyError(name)


# ------------------------------------------------------------------------------------ on the ranks


class _Recorder:
    """A tap that performs every collective and records (stage, op, site, phase); `stage` is what
    the test is doing when the collective is issued, so a collective mislabelled
    with a phase shows."""

    def __init__(self) -> None:
        self.stage = "idle"
        self.events: list[tuple[str, str, str, str]] = []

    def __call__(self, op, site, phase, x, perform):
        self.events.append((self.stage, op, site, phase))
        return perform(x)


def _run_all(group: TPGroup, record: _Recorder | None = None) -> dict:
    """Forward and backward of every wrapper on this rank; {name: {"out", "grad"}}."""
    world, r = group.world_size, group.rank
    full = _full_tensors(world)
    results = {}
    for name in WRAPPERS:
        x, upstream = _inputs(name, full, world, r)
        x = x.clone().requires_grad_(True)
        if record is not None:
            record.stage = "forward"
        out = getattr(C, name)(x, group, site=f"site:{name}")
        if record is not None:
            record.stage = "backward"
        out.backward(upstream)
        results[name] = {"out": out.detach().clone(), "grad": x.grad.clone()}
    # all_reduce_grad_: the optimizer-phase in-place sum of a replicated parameter's partial grad.
    p = torch.nn.Parameter(full["x"].clone())
    p.grad = full["parts"][r].clone()
    if record is not None:
        record.stage = "optimizer"
    C.all_reduce_grad_(p, group, site="site:all_reduce_grad_")
    results["all_reduce_grad_"] = {"out": p.detach().clone(), "grad": p.grad.clone()}
    # A parameter without a grad: nothing to sum, and (on every rank alike) no collective.
    q = torch.nn.Parameter(full["x"].clone())
    C.all_reduce_grad_(q, group, site="site:no_grad")
    results["all_reduce_grad_none"] = q.grad
    return results


def _rank_fn(group: TPGroup) -> dict:
    """Everything one rank does: the plain group (no tap), then the same calls through a recording
    tap, then non-contiguous inputs (the Megatron bug of reducing into a temporary copy)."""
    plain = _run_all(group)
    rec = _Recorder()
    tapped = _run_all(dataclasses.replace(group, tap=rec), rec)
    full = _full_tensors(group.world_size)
    # Non-contiguous inputs: [s, b, h] viewed as [b, s, h].
    nc_part = full["parts"][group.rank].transpose(0, 1)
    nc_shard = _shard_last(full["x"], group.world_size, group.rank).transpose(0, 1)
    assert not nc_part.is_contiguous() and not nc_shard.is_contiguous()
    noncontig = {
        "reduce_from_tp_region": C.reduce_from_tp_region(nc_part, group),
        "gather_from_tp_region": C.gather_from_tp_region(nc_shard, group),
    }
    return {"plain": plain, "tapped": tapped, "events": rec.events, "noncontig": noncontig}


@functools.cache
def _ranks_outcome(world: int) -> tuple[list[dict] | None, BaseException | None]:
    try:
        return run_on_ranks(_rank_fn, world, timeout_s=TIMEOUT_S), None
    except Exception as e:  # noqa: BLE001 - cached and re-raised by every test that needs it
        return None, e


def _ranks_results(world: int) -> list[dict]:
    """One fork of `world` ranks per world size, shared by every test below (a failure is cached
    too, so a broken collective costs one fork, not one per test)."""
    results, error = _ranks_outcome(world)
    if error is not None:
        raise error
    return results


# ------------------------------------------------------------------------------------ references


def assert_rank_sum_close(actual: torch.Tensor, parts: torch.Tensor, what: str = "") -> None:
    """`actual` is a float32 sum over ranks of `parts[r]`, added up by the collective in an order of
    its choosing. Compare it with the exact (float64) sum under the rounding-error bound of float32
    recursive summation of n terms: |fl(sum) - sum| <= gamma_{n-1} * sum|x_r| (gamma_k = k*u / (1 -
    k*u), u = 2^-24), plus u*|sum| for the reference's own final rounding. For n = 1 and 2 that
    bound is at most one rounding (a + b is commutative, so n = 2 is bitwise equal to parts[0] +
    parts[1]); a wrong reduction (missing rank, doubled rank) is off by O(|x|), far beyond it.
    assert_close takes a scalar atol, so use the largest element's bound; rtol = 0 since the bound
    is already absolute."""
    n = parts.shape[0]
    u = torch.finfo(torch.float32).eps / 2
    ref = parts.double().sum(0)
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    atol = float((gamma * parts.double().abs().sum(0) + u * ref.abs()).max())
    assert actual.dtype == parts.dtype, (actual.dtype, parts.dtype)
    assert_close(
        actual.double(), ref, rtol=0, atol=atol, msg=lambda m: f"{what}: sum over {n} ranks\n{m}"
    )


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Pure data movement (identity, split, gather,
    concatenate): nothing is computed, so bitwise."""
    assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: must be bitwise\n{m}")


def _check(name: str, world: int, r: int, out: torch.Tensor, grad: torch.Tensor) -> None:
    """Rank r's forward value and input grad of wrapper `name`, against the unsharded tensors."""
    full = _full_tensors(world)
    x, parts = full["x"], full["parts"]
    tag = f"{name} world={world} rank={r}"
    if name == "copy_to_tp_region":
        # forward: identity; backward: all-reduce of the per-rank upstream grads.
        assert_exact(out, x, f"{tag} forward")
        assert_rank_sum_close(grad, full["grad_full"], f"{tag} backward")
    elif name == "reduce_from_tp_region":
        # forward: all-reduce of the per-rank partials; backward: this rank's grad, unchanged.
        assert_rank_sum_close(out, parts, f"{tag} forward")
        assert_exact(grad, full["grad_full"][r], f"{tag} backward")
    elif name == "scatter_to_tp_region":
        # forward: block r of the last dim; backward: all-gather (concatenate) the last dim.
        assert_exact(out, _shard_last(x, world, r), f"{tag} forward")
        assert_exact(grad, torch.cat(list(full["grad_tp"]), dim=-1), f"{tag} backward")
    elif name == "gather_from_tp_region":
        # forward: the full last dim back; backward: block r of this rank's upstream grad.
        assert_exact(out, x, f"{tag} forward")
        assert_exact(grad, _shard_last(full["grad_full"][r], world, r), f"{tag} backward")
    elif name == "scatter_to_sequence_parallel_region":
        # forward: block r of dim 0; backward: all-gather (concatenate) dim 0.
        assert_exact(out, _shard_first(x, world, r), f"{tag} forward")
        assert_exact(grad, torch.cat(list(full["grad_sp"]), dim=0), f"{tag} backward")
    elif name == "gather_from_sequence_parallel_region":
        # forward: the full sequence back; backward:
        # reduce-scatter, i.e. block r of sum_r upstream_r.
        assert_exact(out, x, f"{tag} forward")
        assert_rank_sum_close(grad, full["grad_full"].chunk(world, dim=1)[r], f"{tag} backward")
    elif name == "reduce_scatter_to_sequence_parallel_region":
        # forward: block r of sum_r parts_r; backward: all-gather (concatenate) dim 0.
        assert_rank_sum_close(out, parts.chunk(world, dim=1)[r], f"{tag} forward")
        assert_exact(grad, torch.cat(list(full["grad_sp"]), dim=0), f"{tag} backward")
    elif name == "all_reduce_grad_":
        # the parameter is untouched; its grad becomes sum_r grad_r, in place.
        assert_exact(out, x, f"{tag} parameter")
        assert_rank_sum_close(grad, parts, f"{tag} grad")
    else:
        raise KeyError(name)


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ALL)
def test_forward_and_adjoint_match_unsharded_reference(name, world):
    for r, res in enumerate(_ranks_results(world)):
        _check(name, world, r, res["plain"][name]["out"], res["plain"][name]["grad"])


@pytest.mark.parametrize("world", WORLDS)
def test_a_performing_tap_changes_no_value(world):
    """Through a tap that performs each collective, every value is bitwise the untapped one."""
    for r, res in enumerate(_ranks_results(world)):
        for name in ALL:
            for key in ("out", "grad"):
                assert_exact(
                    res["tapped"][name][key], res["plain"][name][key], f"{name} {key} rank={r}"
                )


@pytest.mark.parametrize("world", WORLDS)
def test_tap_sees_every_collective_with_op_site_and_phase(world):
    """The tap sees each collective once, in order, labelled with the phase it actually runs in and
    the site the caller passed; world_size 1 issues none; a parameter without a grad issues none."""
    expected = []
    if world > 1:
        for name in ALL:
            expected += [(phase, op, f"site:{name}", phase) for op, phase in EXPECTED_TAPS[name]]
    for r, res in enumerate(_ranks_results(world)):
        assert res["events"] == expected, f"rank {r}: (stage, op, site, phase) seen by the tap"
        assert res["plain"]["all_reduce_grad_none"] is None
        assert res["tapped"]["all_reduce_grad_none"] is None


@pytest.mark.parametrize("world", WORLDS)
def test_non_contiguous_inputs(world):
    for r, res in enumerate(_ranks_results(world)):
        full = _full_tensors(world)
        assert_rank_sum_close(
            res["noncontig"]["reduce_from_tp_region"],
            full["parts"].transpose(1, 2),
            f"reduce_from_tp_region (non-contiguous) rank={r}",
        )
        assert_exact(
            res["noncontig"]["gather_from_tp_region"],
            full["x"].transpose(0, 1),
            f"gather_from_tp_region (non-contiguous) rank={r}",
        )


# ------------------------------------------------------------------------------------ in process
# No process group at all below: any real collective would fail, so these pin "no communication".


class _Forbidden:
    """A tap that fails the test if it is ever called."""

    def __call__(self, op, site, phase, x, perform):
        raise AssertionError(f"world_size 1 issued a collective: {op} at {site} in {phase}")


@pytest.mark.parametrize("name", WRAPPERS)
def test_world_size_1_is_the_identity_and_communicates_nothing(name):
    group = TPGroup(rank=0, world_size=1, pg=None, tap=_Forbidden())
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(S, B, H, generator=g).requires_grad_(True)
    upstream = torch.randn(S, B, H, generator=g)
    out = getattr(C, name)(x, group)
    out.backward(upstream)
    assert_exact(out.detach(), x.detach(), f"{name} forward")
    assert_exact(x.grad, upstream, f"{name} backward")


def test_world_size_1_all_reduce_grad_is_the_identity():
    group = TPGroup(rank=0, world_size=1, pg=None, tap=_Forbidden())
    p = torch.nn.Parameter(torch.randn(S, H, generator=torch.Generator().manual_seed(SEED)))
    p.grad = torch.randn(S, H, generator=torch.Generator().manual_seed(SEED + 1))
    before = p.grad.clone()
    C.all_reduce_grad_(p, group, site="s")
    assert_exact(p.grad, before, "all_reduce_grad_ grad")


def test_the_taps_return_value_is_what_the_layer_gets():
    """A tap may replace a collective (the fault injectors drop one by returning its input): the
    wrapper must use what the tap returns. A two-rank group with no process group and a tap
    that never performs."""
    group = TPGroup(
        rank=1, world_size=2, pg=None, tap=lambda op, site, phase, x, perform: x * 0 + 7
    )
    x = torch.ones(S, B, H)
    assert_exact(
        C.reduce_from_tp_region(x, group), torch.full((S, B, H), 7.0), "reduce_from_tp_region"
    )


@pytest.mark.parametrize(
    "name, shape",
    [
        ("scatter_to_tp_region", (S, B, 3)),
        ("scatter_to_sequence_parallel_region", (3, B, H)),
    ],
)
def test_a_split_that_does_not_divide_raises(name, shape):
    group = TPGroup(rank=0, world_size=2, pg=None, tap=_Forbidden())
    with pytest.raises(ValueError, match="does not divide"):
        getattr(C, name)(torch.zeros(shape), group)
