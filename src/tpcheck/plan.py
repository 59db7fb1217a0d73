"""The sharding plan: the seam between the library and the checker.

A plan maps every dense parameter name to a `Placement`: how that tensor lives on the ranks. A
placement is one pure function, `shard(dense, rank, world) -> local`, made only of indexing (no
arithmetic). Everything else is derived from it by applying `shard` to a tensor of flat indices
(`arange`): which dense elements rank r holds (`index_map`), the check that the plan covers every
element (`validate`; plain shards and replicas cover by construction), and which elements several
ranks must hold identically (replicas: `copies`). So building TP weights from dense ones and the
dense reference each rank's tensors are compared with (its shard of the dense tensor) use one
source of truth, and a user placement needs only `shard`.

Conventions: weights as torch stores them, `[out, in]`; column-parallel shards dim 0 of the weight,
row-parallel dim 1; activations `[seq, batch, hidden]`, sequence parallelism shards dim 0.
"""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass, field

import torch

from tpcheck.errors import UsageError


class Placement:
    """How one dense tensor lives on the ranks. Subclasses implement `shard` with indexing only."""

    def shard(self, dense: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        raise NotImplementedError

    def check_divisible(self, shape: tuple[int, ...], world: int, what: str) -> None:
        """Raise UsageError if `shape` cannot be placed over `world` ranks."""

    @property
    def replicated(self) -> bool:
        """True when every rank holds the whole tensor."""
        return False

    def index_map(self, shape: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
        """Flat dense indices held by `rank`, in its local layout."""
        ids = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
        return self.shard(ids, rank, world)

    def may_share(self, world: int) -> bool:
        """Whether two of `world` ranks can hold the same dense element. True unless the placement
        knows better (then `copies` need not build index maps)."""
        return True

    @property
    def applied_on(self) -> int | None:
        """The one rank whose copy the computation uses (its gradient and update live there), when
        only one rank applies the tensor (AppliedOnRank: every rank holds it; OnRank: only that
        rank does); None for every ordinary placement."""
        return None

    def held_on(self, rank: int, world: int) -> bool:
        """Whether `rank` holds a parameter of this name at all. True unless the tensor lives on
        one rank only (OnRank): the other ranks' modules have no parameter of that name."""
        return True


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank holds the whole tensor (norm weights,
    row-parallel bias, replicated activations)."""

    def shard(self, dense, rank, world):
        return dense

    @property
    def replicated(self) -> bool:
        return True

    def __str__(self) -> str:
        return "replicate"


@dataclass(frozen=True)
class Shard(Placement):
    """Rank r holds the r-th contiguous block of `dim` (column-parallel: dim 0; row-parallel: dim 1;
    vocab-parallel embedding: dim 0; sequence parallel activations: dim 0)."""

    dim: int

    def check_divisible(self, shape, world, what):
        n = shape[self.dim]
        if n % world:
            raise UsageError(
                f"{what}: dim {self.dim} has size {n}, which does not divide by world size "
                f"{world}; choose a world size that divides {n}"
            )

    def shard(self, dense, rank, world):
        self.check_divisible(tuple(dense.shape), world, "shard")
        return dense.chunk(world, dim=self.dim)[rank]

    def may_share(self, world: int) -> bool:
        return False

    def __str__(self) -> str:
        return f"shard(dim={self.dim})"


@dataclass(frozen=True)
class AppliedOnRank(Placement):
    """Every rank holds the whole tensor, one rank applies it: a row-parallel bias added on rank
    `rank` only, before the all-reduce (TGI, nano-vllm), instead of on every rank after it. Weights
    are replicas (compared bitwise across ranks); the gradient and the optimizer's update live on
    `rank` only (bounded by the float64 reference on rank 0, whose bound is sent to `rank`), and the
    other ranks' gradient must be absent or zero."""

    rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise UsageError(
                f"AppliedOnRank({self.rank!r}): the rank that applies the tensor is a rank number "
                "(0, 1, ...)"
            )

    def check_divisible(self, shape: tuple[int, ...], world: int, what: str) -> None:
        if self.rank >= world:
            raise UsageError(
                f"{what}: AppliedOnRank({self.rank}) names a rank that world size {world} does not "
                f"have; name a rank below {world}"
            )

    def shard(self, dense, rank, world):
        return dense

    @property
    def replicated(self) -> bool:
        return True

    @property
    def applied_on(self) -> int:
        return self.rank

    def __str__(self) -> str:
        return f"applied on rank {self.rank}"


@dataclass(frozen=True)
class OnRank(Placement):
    """The whole tensor lives on rank `rank`, and the other ranks have no parameter of that name:
    a row-parallel bias created on TP rank 0 only (`self.bias = nn.Parameter(...) if rank == 0 else
    None`) and added to rank 0's partial sum before the all-reduce. Checked on `rank`, whole: the
    weights bitwise, the gradient and the optimizer's update against the dense ones (bounded by the
    float64 reference on rank 0, whose bound is sent to `rank`); on every other rank its absence
    (a parameter of that name there fails the weights stage). The other ranks' shard is empty."""

    rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise UsageError(
                f"OnRank({self.rank!r}): the rank that holds the tensor is a rank number "
                "(0, 1, ...)"
            )

    def check_divisible(self, shape: tuple[int, ...], world: int, what: str) -> None:
        if self.rank >= world:
            raise UsageError(
                f"{what}: OnRank({self.rank}) names a rank that world size {world} does not "
                f"have; name a rank below {world}"
            )

    def shard(self, dense, rank, world):
        return dense if rank == self.rank else dense.reshape(-1)[:0]

    def may_share(self, world: int) -> bool:
        return False

    @property
    def applied_on(self) -> int:
        return self.rank

    def held_on(self, rank: int, world: int) -> bool:
        return rank == self.rank

    def __str__(self) -> str:
        return f"on rank {self.rank} only"


@dataclass(frozen=True)
class Fused(Placement):
    """A fused weight: along `dim` the dense tensor is the concatenation of parts (e.g. [gate; up]
    or [q; k; v]); part i has `units[i]` units (rows, or heads) of `unit_size[i]` rows each. Rank r
    holds the concatenation of its block of every part: `[gate_r; up_r]`, `[q_r; k_r; v_r]`. A part
    with fewer units than ranks (GQA with kv_heads < world) is replicated: rank r holds unit r //
    (world // units). Concatenating the rank shards gives [g0; u0; g1; u1; ...], not the dense [g;
    u]: splitting the fused weight contiguously (the naive way) is a classic bug, in
    the fault catalogue.
    """

    dim: int
    units: tuple[int, ...]
    unit_size: tuple[int, ...] = field(default=())

    def sizes(self) -> tuple[int, ...]:
        unit_size = self.unit_size or (1,) * len(self.units)
        return tuple(n * u for n, u in zip(self.units, unit_size))

    def check_divisible(self, shape, world, what):
        if shape[self.dim] != sum(self.sizes()):
            raise UsageError(
                f"{what}: dim {self.dim} has size {shape[self.dim]} but the fused parts add up to "
                f"{sum(self.sizes())} ({self.sizes()})"
            )
        for n in self.units:
            if n <= 0:
                raise UsageError(
                    f"{what}: a fused part has {n} units; every part of a fused layout holds at "
                    "least one unit"
                )
            if n % world and world % n:
                raise UsageError(
                    f"{what}: a fused part has {n} units, which neither divides by nor divides "
                    f"world size {world}; choose a world size that divides {n} or a multiple of it"
                )

    def shard(self, dense, rank, world):
        self.check_divisible(tuple(dense.shape), world, "fused shard")
        unit_size = self.unit_size or (1,) * len(self.units)
        pieces = []
        for part, n, u in zip(dense.split(self.sizes(), dim=self.dim), self.units, unit_size):
            if n >= world:
                pieces.append(part.chunk(world, dim=self.dim)[rank])
            else:  # fewer units than ranks: replicate unit r // (world // n)
                unit = self.replica_unit(rank, world, n)
                pieces.append(part.narrow(self.dim, unit * u, u))
        return torch.cat(pieces, dim=self.dim)

    def may_share(self, world: int) -> bool:
        return any(n < world for n in self.units)

    def replica_unit(self, rank: int, world: int, units: int) -> int:
        """The unit a rank holds of a part with fewer
        units than ranks: consecutive ranks share one."""
        return rank // (world // units)

    def __str__(self) -> str:
        return f"fused(dim={self.dim}, units={list(self.units)})"


def copies(placement: Placement, shape: tuple[int, ...], world: int) -> torch.Tensor | None:
    """How many ranks hold each dense element (flat), or None when no element is held by two ranks
    (plain shards: nothing to compare across ranks). Replicate is the trivial case
    and not asked here."""
    if not placement.may_share(world):
        return None
    try:
        return _copies(placement, shape, world)
    except TypeError:  # a user's placement that cannot be hashed: computed each time
        return _copies.__wrapped__(placement, shape, world)


@functools.lru_cache(maxsize=256)
def _copies(placement: Placement, shape: tuple[int, ...], world: int) -> torch.Tensor | None:
    held = torch.zeros(math.prod(shape), dtype=torch.int64)
    for r in range(world):
        idx = placement.index_map(shape, r, world).reshape(-1)
        held.index_add_(0, idx, torch.ones_like(idx))
    return held if bool((held > 1).any()) else None


def validate(placement: Placement, shape: tuple[int, ...], world: int, what: str) -> None:
    """Raise UsageError unless the placement fits `shape`
    at `world` and covers every dense element."""
    placement.check_divisible(shape, world, what)
    # these shards cover a divisible shape by construction (not a subclass)
    if type(placement) in _COVERING:
        return
    covered = torch.zeros(math.prod(shape), dtype=torch.bool)
    for rank in range(world):
        covered[placement.index_map(shape, rank, world).reshape(-1)] = True
    if not bool(covered.all()):
        missing = int((~covered).sum())
        raise UsageError(
            f"{what}: placement {placement} leaves {missing} of {covered.numel()} "
            "elements on no rank"
        )


# Placements whose shards of a shape that passes `check_divisible` hold every element between them:
# the identity (Replicate, AppliedOnRank, OnRank's one rank) and `chunk` into equal blocks (Shard).
# `validate` builds index maps for every other placement (Fused, a user's), ~0.1 s per rank for a
# 1024 x 4096 weight.
_COVERING = (Replicate, AppliedOnRank, OnRank, Shard)


def as_placement(p, what: str) -> Placement:
    """`p` as a tpcheck placement: one already, or torch.distributed.tensor's `Shard(dim)` /
    `Replicate()` (the same layouts). Anything else is refused naming `what`."""
    if isinstance(p, Placement):
        return p
    kind = type(p)
    if kind.__module__.startswith("torch.distributed"):
        if kind.__name__ == "Shard" and isinstance(getattr(p, "dim", None), int):
            return Shard(p.dim)
        if kind.__name__ == "Replicate":
            return Replicate()
        if kind.__name__ == "Partial":
            held = "a parameter" if "params" in what else "a module output tpcheck compares"
            raise UsageError(
                f"{what} is torch's Partial(): {held} is held on the ranks, not summed across "
                "them, so it has no partial placement; use Shard(dim) or Replicate() (tpcheck.plan "
                "or torch.distributed.tensor)"
            )
    raise UsageError(
        f"{what} is {p!r} ({kind.__module__}.{kind.__qualname__}), not a placement; use "
        "Shard(dim), Replicate(), Fused(...) or OnRank(r) from tpcheck (torch.distributed.tensor's "
        "Shard and Replicate are accepted too)"
    )


@dataclass(frozen=True)
class Plan:
    """Per dense parameter, its placement; optionally placements of named activations (module
    outputs) for localizing the first divergent tensor -- the outputs not named are inferred by the
    checker where the layout decides it, so naming one only fixes its placement -- and of named
    buffers (`named_buffers()`: running statistics, caches; those not named are inferred from their
    shapes and values, replicated where the TP module holds the whole). Parameters absent
    from `params` are an error, not a silent default: a forgotten entry is how layouts go wrong."""

    params: dict[str, Placement]
    activations: dict[str, Placement] = field(default_factory=dict)
    # Renames from dense parameter (or buffer) names to TP names, when they differ.
    tp_names: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, Placement] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for what in ("params", "activations", "buffers"):
            table = getattr(self, what)
            if not isinstance(table, dict):
                raise UsageError(
                    f"Plan({what}=...) must be a dict of name -> placement, not "
                    f"{type(table).__name__}"
                )
            object.__setattr__(
                self,
                what,
                {name: as_placement(p, f"Plan {what}[{name!r}]") for name, p in table.items()},
            )

    def tp_name(self, dense_name: str) -> str:
        return self.tp_names.get(dense_name, dense_name)

    def check_against(self, dense: torch.nn.Module, world: int) -> None:
        """Raise UsageError unless the plan places exactly the dense module's parameters, each in a
        way that fits its shape at `world`. A key the dense module does not have is named first,
        with the closest real names: a typo in a key also leaves the real parameter without a
        placement, and "no placement for 'fc1.weight'" alone hides the line to fix."""
        names = [n for n, _ in dense.named_parameters()]
        missing = sorted(set(names) - set(self.params))
        extra = sorted(set(self.params) - set(names))
        if extra:
            raise UsageError(unknown_params_message(extra, missing, names))
        if missing:
            raise UsageError(
                f"plan has no placement for dense parameter(s) {missing}; add them to the plan "
                "(Replicate(), Shard(dim) or Fused(...))"
            )
        for name, p in dense.named_parameters():
            validate(
                self.params[name], tuple(p.shape), world, f"parameter {name!r} {list(p.shape)}"
            )
        buffers = dict(dense.named_buffers())
        if unknown := sorted(set(self.buffers) - set(buffers)):
            hints = [
                f"{' or '.join(map(repr, c))} for {k!r}"
                for k in unknown
                if (c := closest(k, list(buffers)))
            ]
            raise UsageError(
                f"plan names buffer(s) {unknown} that the dense module does not have"
                + (f" (did you mean {'; '.join(hints)}?)" if hints else "")
                + f"; dense buffers are {sorted(buffers)[:LISTED_PARAMS]} (dense.named_buffers())"
            )
        for name, placement in self.buffers.items():
            shape = tuple(buffers[name].shape)
            validate(placement, shape, world, f"buffer {name!r} {list(shape)}")


# the dense parameters an unknown-key message lists in full; a bigger model's are counted
LISTED_PARAMS = 20


def unknown_params_message(extra: list[str], missing: list[str], names: list[str]) -> str:
    """Plan keys the dense module does not have, each with the dense names closest to it ("did you
    mean"), the fix, and the dense parameters still without a placement (usually the same typo seen
    from the other side). The closest names are looked for among those without a placement first:
    'fc1.weigth' is 'fc1.weight', not the 'fc2.weight' the plan already places."""
    hints = []
    for key in extra:
        if close := closest(key, missing) or closest(key, names):
            hints.append(f"{' or '.join(map(repr, close))} for {key!r}")
    message = f"plan names parameter(s) {extra} that the dense module does not have"
    if hints:
        message += f" (did you mean {'; '.join(hints)}?)"
    message += (
        "; rename each to the dense parameter it places (the name in dense.named_parameters()), "
        "or remove it"
    )
    if missing:
        message += f"; the plan has no placement for dense parameter(s) {missing}"
    if len(names) <= LISTED_PARAMS:
        return f"{message}; dense parameters are {sorted(names)}"
    return f"{message}; the dense module has {len(names)} parameters"


def closest(key: str, names: list[str]) -> list[str]:
    """The names of `names` closest to `key` (difflib, at most 3), those nearly as close as the best
    only: 'fc2.weights' suggests 'fc2.weight', not also 'fc1.weight' and 'fc2.bias'."""
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    ratios = [difflib.SequenceMatcher(None, key, name).ratio() for name in close]
    return [name for name, r in zip(close, ratios) if r >= ratios[0] - 0.05]
