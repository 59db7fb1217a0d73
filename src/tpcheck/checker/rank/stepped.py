"""What a user's optimizer steps, by module parameter (training.py's `UserOptimizer` finds it):
the parameter itself, a float32 master copy of it, or a segment of a flat buffer, mapped once, right
after the optimizer is built, while every stepped tensor still equals its parameter.

Copies are matched by shape and values, and values can tie: a model's own initialisation puts every
norm at ones and every bias at zeros, so several parameters match several masters. Ties are bound in
order first and settled by their gradients at the first step (`settle_ties`, from the optimizer's
step pre-hook, when each master holds the gradient the wrapper copied into it): bound in order only,
a wrapper that lists its parameters in another order than the module's (parameter groups by weight
decay) would have its norms' state compared with another norm's.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Stepped:
    """Where one module parameter lives in an inner optimizer: the tensor it steps (`tensor`, the
    parameter itself, a master copy, or a flat buffer) and the segment of it (`segment`: (offset,
    numel) in the flat buffer; None: the whole tensor)."""

    def __init__(self, opt, tensor, shape, segment=None) -> None:
        self.opt, self.tensor, self.shape, self.segment = opt, tensor, shape, segment
        # the parameters whose copies tied by value with this one's, until `settle_ties`
        self.ties: tuple[str, ...] | None = None

    def holds(self, p: torch.Tensor) -> bool:
        """Whether the tensor stepped is module parameter `p` itself: `p`, or a DTensor over
        `p`'s storage (the module as the framework holds it: adapters/dtensor.py `as_held`)."""
        local = local_of(self.tensor)
        return self.tensor is p or (local is not self.tensor and local.data_ptr() == p.data_ptr())

    def view(self, t: torch.Tensor) -> torch.Tensor:
        t = local_of(t)
        if self.segment is None:
            return t
        offset, n = self.segment
        return t.reshape(-1)[offset : offset + n].view(self.shape)

    @property
    def value(self) -> torch.Tensor:
        return self.view(self.tensor.detach())

    @property
    def grad(self) -> torch.Tensor | None:
        g = self.tensor.grad
        return None if g is None else self.view(g.detach())

    def state(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in self.opt.state.get(self.tensor, {}).items():
            if isinstance(v, torch.Tensor):
                v = local_of(v)
                full = v.dim() and v.numel() == local_of(self.tensor).numel()
                out[k] = self.view(v) if full else v
        return out


def local_of(t):
    """A DTensor's local tensor (the same storage), any other tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def _segment_of(flat: torch.Tensor, p: torch.Tensor, start: int) -> int | None:
    """The offset of `p`'s values (as float) in the 1-D `flat`, searched from `start` first."""
    want = p.detach().reshape(-1).to(flat.dtype)
    n = want.numel()
    if n == 0 or n > flat.numel():
        return None
    hits = torch.nonzero(flat == want[0]).reshape(-1).tolist()
    for offset in sorted(hits, key=lambda o: (o < start, o)):
        if offset + n <= flat.numel() and torch.equal(flat[offset : offset + n], want):
            return offset
    return None


def map_stepped(module: nn.Module, optimizers: list) -> dict[str, Stepped]:
    """Each module parameter's `Stepped`, where one of `optimizers` steps it: by identity, else by
    shape and values (a master copy), else as a segment of a flat buffer (in order)."""
    own = dict(module.named_parameters())
    found: dict[str, Stepped] = {}
    tensors = [
        (opt, t) for opt in optimizers for group in opt.param_groups for t in group["params"]
    ]
    by_id = {id(t): (opt, t) for opt, t in tensors}
    for name, p in own.items():
        if id(p) in by_id:
            opt, t = by_id[id(p)]
            found[name] = Stepped(opt, t, p.shape)
        else:  # a DTensor over the parameter's storage (the module as the framework holds it)
            held = [(opt, t) for opt, t in tensors if Stepped(opt, t, p.shape).holds(p)]
            if held and local_of(held[0][1]).shape == p.shape:
                found[name] = Stepped(*held[0], p.shape)
    left = [(opt, t) for opt, t in tensors if not any(s.tensor is t for s in found.values())]
    by_value: dict[tuple, list[str]] = {}  # the values a copy was matched by -> the parameters
    for name, p in own.items():
        if name in found:
            continue
        for opt, t in left:
            if t.shape == p.shape and torch.equal(t.detach(), p.detach().to(t.dtype)):
                if not any(s.tensor is t for s in found.values()):
                    found[name] = Stepped(opt, t, p.shape)
                    by_value.setdefault(_fingerprint(p), []).append(name)
                    break
    cursor: dict[int, int] = {}
    for name, p in own.items():
        if name in found:
            continue
        for opt, t in left:
            if t.dim() == 1 and t.numel() > p.numel():
                offset = _segment_of(t.detach(), p, cursor.get(id(t), 0))
                if offset is not None:
                    found[name] = Stepped(opt, t, p.shape, (offset, p.numel()))
                    cursor[id(t)] = offset + p.numel()
                    break
    for names in by_value.values():
        for tie in _equal_runs(names, own):
            for name in tie:
                found[name].ties = tie
    return found


def _fingerprint(p: torch.Tensor) -> tuple:
    """Shape and two cheap sums: parameters of equal values share one (others rarely do)."""
    v = p.detach().double()
    return (tuple(p.shape), float(v.sum()), float(v.abs().sum()))


def _equal_runs(names: list[str], own: dict[str, nn.Parameter]) -> list[tuple[str, ...]]:
    """`names` (one fingerprint's) split into the groups of equal values, those of two or more."""
    groups: list[list[str]] = []
    for name in names:
        p = own[name].detach()
        same = next((g for g in groups if torch.equal(own[g[0]].detach(), p)), None)
        if same is None:
            groups.append([name])
        else:
            same.append(name)
    return [tuple(g) for g in groups if len(g) > 1]


def settle_ties(found: dict[str, Stepped], grads: dict[str, torch.Tensor | None]) -> None:
    """Each group of parameters whose copies tied by value (`Stepped.ties`) bound to the copies
    by gradient: the copy whose gradient (as the wrapper handed it to its optimizer) is nearest the
    parameter's own (`grads`, read where its framework keeps them), greedily in the module's order.
    Where the gradients do not tell the copies apart, the binding in order stays."""
    done: set[tuple[str, ...]] = set()
    for stepped in list(found.values()):
        tie = stepped.ties
        if tie is None or tie in done:
            continue
        done.add(tie)
        pool, settled = [found[n] for n in tie], {}
        for name in tie:
            g = grads.get(name)
            if g is None:
                continue
            dist = [_grad_distance(c, g) for c in pool]
            best = min(range(len(pool)), key=dist.__getitem__)
            if dist.count(dist[best]) == 1:
                settled[name] = pool.pop(best)
        rest = [n for n in tie if n not in settled]
        settled.update(zip(rest, pool))  # untold apart: in order, as bound
        for name, copy in settled.items():
            copy.ties, found[name] = None, copy


def _grad_distance(copy: Stepped, g: torch.Tensor) -> float:
    mine = copy.grad
    if mine is None:
        return math.inf
    return float((mine.double() - g.detach().double()).abs().max())


def check_found(found: dict[str, Stepped], own: dict[str, nn.Parameter]) -> None:
    """What the finder mapped must be what it claims: each stepped tensor (or segment) holds its
    parameter's values as built. Anything else is a bug in the finder, raised (verdict "error"),
    never a state compared against the wrong parameter's."""
    for name, s in found.items():
        p = own[name]
        if s.value.shape != p.shape or not torch.equal(s.value, p.detach().to(s.value.dtype)):
            raise RuntimeError(
                f"tpcheck's optimizer state finder mapped parameter {name!r} to a tensor that does "
                "not hold its values (a bug in tpcheck: please report it with this case)"
            )
