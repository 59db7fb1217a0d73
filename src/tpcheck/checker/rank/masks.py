"""Dropout under the checker: each mask drawn once, in the dense layout, and given to every side.

Per forward (a `MaskBook`): the dense model draws each mask from the checker's own generator (seeded
the same on every rank, so every rank's dense model draws the same masks, and the default generator
is not touched); the float64 truth replays them; the TP side's k-th random draw gets the part of the
dense side's k-th mask that its tensor holds (its placement: `Case.dropout`, else a DTensor's own
placements, else inferred from the shapes). So the comparison is as exact as without dropout.

The TP side's own draw still happens, on a probe (`ones_like` its input: its generator advances as
in training) and is recorded: a hash of the generator state it drew from and of the mask it drew.
The RNG placement check compares these across ranks (`violations`): ranks holding different shards
of one mask must not have drawn the same mask from the same state (else `rng_not_forked`: the region
was not forked per rank), replicas must have drawn the same mask from the same state
(else `rng_diverged`).

Intercepted through a TorchFunctionMode (so also a `from torch.nn.functional import dropout`
binding): `F.dropout` (and so `nn.Dropout`), `F.scaled_dot_product_attention` with `dropout_p > 0`
(computed in plain math on every side, the mask applied to the attention weights), and
`torch.bernoulli`, `Tensor.bernoulli`, `Tensor.bernoulli_` (a custom dropout that draws its mask
with bernoulli). Any other random draw in the dense forward (a `torch.rand_like` mask) is refused
(rng.py: NONDETERMINISTIC).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from tpcheck.checker.rank.capture import named_modules
from tpcheck.errors import UsageError
from tpcheck.parallel.random import default_rng_state
from tpcheck.plan import Placement, Replicate, Shard

DIFFER, SAME = "differ", "same"  # the RNG rule of a site: sharded region / replicated region


@dataclass
class Draw:
    """One random draw of a forward: where (`label`: the module running it), what (`kind`, `p`), and
    on the dense side its mask (bool, dense layout)."""

    label: str
    kind: str  # dropout | sdpa | bernoulli
    p: float | None
    mask: torch.Tensor | None = None


@dataclass
class TPDraw:
    """The TP side's k-th draw on this rank: its RNG rule (None: nothing to compare, world 1), its
    placement, the hashes of the generator state and of the mask it drew, and `problem` when it does
    not match the dense side's k-th draw (then it was not replaced and the values show it too)."""

    label: str
    rule: str | None
    placement: str
    state: str
    mask: str
    seq: int
    problem: str | None = None

    def as_json(self) -> list:
        return [self.label, self.rule, self.state, self.mask, self.problem]


def _hash(t: torch.Tensor) -> str:
    """A short hash of `t`'s bytes, whatever its dtype (bfloat16 and the float8 types have no numpy
    dtype: their bytes are read as uint8)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=8).hexdigest()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------- the intercepted calls, normalized


@dataclass
class Call:
    kind: str
    x: torch.Tensor  # the tensor the mask has the shape of (for sdpa: the query)
    shape: tuple[int, ...]  # the mask's shape in this side's layout
    p: float | None  # drop probability (dropout, sdpa); None: bernoulli (probabilities in `probs`)
    args: tuple
    kwargs: dict
    probs: object = None
    inplace: bool = False
    generator: torch.Generator | None = None


def _dropout_call(args, kwargs):
    def bind(input, p=0.5, training=True, inplace=False):
        return input, p, training, inplace

    x, p, training, inplace = bind(*args, **kwargs)
    if not training or p == 0 or not isinstance(x, torch.Tensor) or x.numel() == 0:
        return None
    return Call("dropout", x, tuple(x.shape), float(p), args, kwargs, inplace=inplace)


def _sdpa_call(args, kwargs):
    def bind(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        return query, key, dropout_p

    q, k, p = bind(*args, **kwargs)
    if p == 0:
        return None
    return Call("sdpa", q, (*q.shape[:-1], k.shape[-2]), float(p), args, kwargs)


def _bernoulli_call(args, kwargs, method_default):
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", method_default)
    if "out" in kwargs:
        raise UsageError(
            "torch.bernoulli(..., out=...) inside the forward cannot be replayed by tpcheck; "
            "assign the result instead"
        )
    return Call(
        "bernoulli",
        x,
        tuple(x.shape),
        None,
        args,
        kwargs,
        probs=x if p is None else p,
        generator=kwargs.get("generator"),
    )


_CALLS = {
    F.dropout: _dropout_call,
    F.scaled_dot_product_attention: _sdpa_call,
    torch.bernoulli: lambda a, k: _bernoulli_call(a, k, None),
    torch.Tensor.bernoulli: lambda a, k: _bernoulli_call(a, k, None),
    torch.Tensor.bernoulli_: lambda a, k: _bernoulli_call(a, k, 0.5),
}
_INPLACE = {torch.Tensor.bernoulli_}


def _apply(call: Call, mask: torch.Tensor, p: float | None):
    """The call's result with `mask` (bool, this side's layout) as its random draw."""
    x = call.x
    if call.kind == "bernoulli":
        values = mask.to(x.dtype)
        if call.inplace:
            return x.copy_(values)
        return values
    if call.kind == "dropout":
        keep = _keep(mask, p, x.dtype)
        return x.mul_(keep) if call.inplace else x * keep
    return _sdpa_math(mask, p, *call.args, **call.kwargs)


def _sdpa_math(
    mask,
    p,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """scaled_dot_product_attention in plain math, with `mask` as the dropout of the attention
    weights (torch's documented reference implementation)."""
    L, S = query.shape[-2], key.shape[-2]
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
    weights = query @ key.transpose(-2, -1) * scale
    if is_causal:
        weights = weights.masked_fill(
            torch.ones(L, S, dtype=torch.bool, device=weights.device).tril().logical_not(),
            float("-inf"),
        )
    if attn_mask is not None:
        weights = (
            weights.masked_fill(attn_mask.logical_not(), float("-inf"))
            if attn_mask.dtype == torch.bool
            else weights + attn_mask
        )
    weights = weights.softmax(dim=-1)
    return (weights * _keep(mask, p, weights.dtype)) @ value


def _keep(mask: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """What dropout multiplies by: 1/(1-p) where `mask` keeps, 0 where it drops (torch's form)."""
    return mask.to(dtype) / (1 - p) if p < 1 else torch.zeros_like(mask, dtype=dtype)


# ------------------------------------------------------------------ where a draw happens


class _Where:
    """The innermost module of one model running now (global module hooks while a forward runs), and
    the label of a draw made there: the module's name for a dropout module, else `name: kind #n`."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name or "(model)" for name, m in named_modules(model)}
        self.stack: list[tuple[str, nn.Module]] = []
        self.counts: Counter = Counter()
        self.handles = []

    def __enter__(self):
        self.handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._leave, always_call=True),
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _enter(self, module, args):
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append((name, module))

    def _leave(self, module, args, output):
        if self.stack and self.stack[-1][1] is module:
            self.stack.pop()

    def label(self, kind: str) -> str:
        name, module = self.stack[-1] if self.stack else ("(model)", None)
        if isinstance(module, nn.modules.dropout._DropoutNd):
            return name
        self.counts[(name, kind)] += 1
        return f"{name}: {kind} #{self.counts[(name, kind)]}"


# ------------------------------------------------------------------ one forward's masks


def infer_placement(local: tuple[int, ...], dense: tuple[int, ...], world: int) -> Placement | None:
    """The placement of a mask from its shapes: the same shape -> Replicate; one dim `world` times
    smaller -> Shard(that dim); anything else -> None (ambiguous or not a plain shard)."""
    if local == dense:
        return Replicate()
    if len(local) != len(dense):
        return None
    dims = [d for d, (a, b) in enumerate(zip(local, dense)) if a != b]
    if len(dims) == 1 and local[dims[0]] * world == dense[dims[0]]:
        return Shard(dims[0])
    return None


class MaskBook:
    """The random draws of one forward: drawn by the dense side (`draw`), replayed by the float64
    truth (`replay`), handed out to the TP side (`tp`), whose own draws are
    recorded in `tp_draws`."""

    def __init__(
        self, gen: torch.Generator, placements: dict[str, Placement] | None = None
    ) -> None:
        self.gen, self.placements = gen, dict(placements or {})
        self.draws: list[Draw] = []
        self.tp_draws: list[TPDraw] = []
        self.decisions = None  # the forward's discrete decisions (decisions.py), set by rng.py

    def draw(self, model: nn.Module) -> _MaskMode:
        return _MaskMode(self, "draw", model)

    def replay(self, model: nn.Module) -> _MaskMode:
        return _MaskMode(self, "replay", model)

    def tp(self, model: nn.Module, rank: int, world: int, next_seq) -> _MaskMode:
        return _MaskMode(self, "tp", model, rank, world, next_seq)

    # the three roles
    def _dense(self, call: Call, label: str):
        u = torch.rand(call.shape, generator=self.gen, dtype=torch.float64)
        if call.kind == "bernoulli":
            probs = call.probs
            probs = (
                probs.detach().double().cpu() if isinstance(probs, torch.Tensor) else float(probs)
            )
            mask = u < probs
        else:
            mask = u >= call.p
        mask = mask.to(call.x.device)
        self.draws.append(Draw(label, call.kind, call.p, mask))
        return _apply(call, mask, call.p)

    def _replay(self, call: Call, label: str, k: int):
        draw = self.draws[k] if k < len(self.draws) else None
        if draw is None or draw.kind != call.kind or tuple(draw.mask.shape) != call.shape:
            raise UsageError(
                "the float64 copy of the dense model drew other random masks than the dense model "
                f"at {label} (a model whose forward depends on its dtype): tpcheck "
                "cannot replay them"
            )
        return _apply(call, draw.mask, call.p)

    def _tp(self, mode: _MaskMode, func, call: Call, label: str, k: int):
        draw = self.draws[k] if k < len(self.draws) else None
        state, mask_hash = self._probe(func, call)
        placement, local = None, None
        problem = None
        if draw is None:
            problem = (
                f"the TP side drew a mask (#{k + 1}, {call.kind}) where the dense side drew none"
            )
        elif draw.kind != call.kind:
            problem = (
                f"the TP side drew a {call.kind} mask where the dense side drew a "
                f"{draw.kind} one ({draw.label})"
            )
        else:
            placement, local = self._local_mask(call, draw, label, mode.rank, mode.world)
            if local is None:
                problem = (
                    f"the TP side's mask has shape {list(call.shape)}, no {placement} part of the "
                    f"dense mask {list(draw.mask.shape)} ({draw.label})"
                )
            elif draw.p != call.p:
                problem = (
                    f"the TP side drops with p={call.p}, the dense side with "
                    f"p={draw.p} ({draw.label})"
                )
        rule = None
        if placement is not None and mode.world > 1:
            rule = SAME if placement.replicated else DIFFER
        self.tp_draws.append(
            TPDraw(
                label,
                rule,
                str(placement) if placement is not None else "?",
                state,
                mask_hash,
                mode.next_seq(),
                problem,
            )
        )
        if local is None:
            # not replayable: the TP side as it is (the values show it)
            return func(*call.args, **call.kwargs)
        return _apply(call, local, call.p)

    def _local_mask(self, call: Call, draw: Draw, label: str, rank: int, world: int):
        """(placement, this rank's part of the dense mask) for the TP side's call; the part is None
        when the placement's shard does not have the call's shape."""
        x = call.x
        if hasattr(x, "device_mesh"):  # a DTensor: its own placements say which part it holds
            from torch.distributed.tensor import Partial, distribute_tensor
            from torch.distributed.tensor import Replicate as DReplicate

            places = [DReplicate() if isinstance(p, Partial) else p for p in x.placements]
            if tuple(x.shape) != tuple(draw.mask.shape):
                return Replicate(), None
            local = distribute_tensor(draw.mask, x.device_mesh, places, src_data_rank=None)
            sharded = any(not isinstance(p, DReplicate) for p in places)
            return (_DTensorPlaced(str(tuple(x.placements)), sharded), local)
        placement = self.placements.get(label) or infer_placement(
            call.shape, tuple(draw.mask.shape), world
        )
        if placement is None:
            raise UsageError(
                f"dropout at {label}: the TP side's mask has shape {list(call.shape)} and the "
                f"dense side's {list(draw.mask.shape)}; tpcheck cannot tell which part of it this "
                f"rank holds. Name its placement: Case(dropout={{{label!r}: Shard(dim)}})"
            )
        local = placement.shard(draw.mask, rank, world)
        return placement, (local if tuple(local.shape) == call.shape else None)

    def _probe(self, func, call: Call) -> tuple[str, str]:
        """The TP side's own draw, made on a probe so that its generator advances as in training:
        the hashes of the generator state it drew from and of the mask it drew ("" where the
        mask cannot be read)."""
        gen = call.generator
        device = _local(call.x).device
        state = _hash(gen.get_state() if gen is not None else default_rng_state(device))
        with torch.no_grad():
            if call.kind == "dropout":
                out = func(torch.ones_like(call.x), call.p, True, False)
                return state, _hash(_local(out) != 0)
            if call.kind == "bernoulli":
                args = (call.x.detach().clone(), *call.args[1:])
                return state, _hash(_local(func(*args, **call.kwargs)))
            args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in call.args)
            kwargs = {
                k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in call.kwargs.items()
            }
            func(*args, **kwargs)
            return state, ""


@dataclass(frozen=True)
class _DTensorPlaced(Placement):
    """The placement of a DTensor's mask (its own placements), for the report."""

    text: str
    sharded: bool

    @property
    def replicated(self) -> bool:
        return not self.sharded

    def __str__(self) -> str:
        return f"DTensor {self.text}"


class _MaskMode(TorchFunctionMode):
    def __init__(
        self,
        book: MaskBook,
        role: str,
        model: nn.Module,
        rank: int = 0,
        world: int = 1,
        next_seq=None,
    ) -> None:
        super().__init__()
        self.book, self.role, self.rank, self.world, self.next_seq = (
            book,
            role,
            rank,
            world,
            next_seq,
        )
        self.where = _Where(model)
        self.k = 0

    def __enter__(self):
        self.where.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self.where.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        parse = _CALLS.get(func)
        call = parse(args, kwargs) if parse is not None else None
        if call is None:
            return func(*args, **kwargs)
        call.inplace = call.inplace or func in _INPLACE
        label, k = self.where.label(call.kind), self.k
        self.k += 1
        if self.role == "draw":
            return self.book._dense(call, label)
        if self.role == "replay":
            return self.book._replay(call, label, k)
        return self.book._tp(self, func, call, label, k)


# ------------------------------------------------------------------ the RNG placement check


def violations(rule: str, states: list[str], masks: list[str], me: int) -> list[int]:
    """The ranks whose draw breaks the rule against this rank's: DIFFER (a sharded region): the same
    state and the same mask; SAME (a replicated region): another state or another mask."""
    if rule == DIFFER:
        return [
            r
            for r in range(len(states))
            if r != me and states[r] == states[me] and masks[r] == masks[me]
        ]
    return [r for r in range(len(states)) if states[r] != states[me] or masks[r] != masks[me]]


REASONS = {
    DIFFER: (
        "sharded region: each rank's mask must come from its own generator state (forked per rank)"
    ),
    SAME: "replicated region: every rank must draw the same mask from the same generator state",
}
