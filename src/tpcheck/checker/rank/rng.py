"""Random draws under the checker, on this rank: the masks of every forward (drawn by the dense
side, replayed by the truth and, part by part, by the TP side: masks.py) and the RNG placement check
of the TP side's own draws.

The dense side must draw nothing but what masks.py replays (any other draw is refused:
NONDETERMINISTIC). The TP side draws from the default generators as a training script leaves them
(`training_rng`). After each forward the ranks exchange their draws through the store (never a
collective) and each of this rank's draws is held to its region's rule against the others' (a
sharded region forked per rank, a replicated one the same everywhere: `masks.violations`); once per
step a control with one rank's draw planted to break the rule must fail.
"""

from __future__ import annotations

import contextlib
import json

import torch
from torch import nn

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.devices import rng_states, seed_rng
from tpcheck.checker.rank import case_threads, decisions
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.masks import DIFFER, REASONS, MaskBook, TPDraw, violations
from tpcheck.checker.sync import Rendezvous
from tpcheck.errors import UsageError
from tpcheck.plan import Placement

NONDETERMINISTIC = (
    "the dense model drew random numbers in its forward or backward other than through the calls "
    "tpcheck replays (F.dropout and nn.Dropout, F.scaled_dot_product_attention's dropout_p, "
    "torch.bernoulli and Tensor.bernoulli_): a mask drawn with torch.rand/rand_like, say. Its "
    "masks and the TP model's would differ and no tensor could be compared element by element; "
    "draw the mask with torch.bernoulli or F.dropout, or disable the randomness for the "
    "check, see docs/case-files.md#dropout"
)


@contextlib.contextmanager
def training_rng(device: torch.device, seed: int, step: int, micro: int):
    """The default generators (the CPU's, and the GPU's on "cuda") as a training script leaves them
    for the TP side: seeded the same on every rank (what a replicated region draws from), whatever
    the checker drew before; restored after. `micro` -1: the forward without autograd."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        seed_rng(device, (seed + 7919 * step + 104729 * (micro + 2)) % 2**63)
        yield


class RandomDraws:
    """The masks of this rank's forwards (one `MaskBook`
    each) and the checks of the TP side's draws."""

    def __init__(
        self,
        seed: int,
        dropout: dict[str, Placement] | None,
        cmp: Comparator,
        rendezvous: Rendezvous,
        device: torch.device,
    ) -> None:
        # the dense side's masks: its own generator, the same on every rank
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.dropout, self.cmp, self.rendezvous, self.device = dropout, cmp, rendezvous, device
        # whether the model draws random masks: known after the first dense forward, which always
        # runs under the mask book; without draws the later forwards skip its interception (~10% of
        # a tiny check), and a draw after all is still refused by the dense side's RNG
        # check (NONDETERMINISTIC)
        self.draws_random: bool | None = None
        # likewise whether it takes discrete decisions (top-k, argmax, sort: decisions.py)
        self.decides: bool | None = None
        # the notes of the report: label -> (forwards, rows flipped, largest gap, its margin)
        self.flips: dict[str, list] = {}
        self.unreplayed: dict[str, None] = {}

    def book(self) -> MaskBook:
        """The masks and the discrete decisions of one forward."""
        book = MaskBook(self.gen, self.dropout)
        book.decisions = decisions.DecisionBook()
        return book

    @contextlib.contextmanager
    def masks(self, role, model: nn.Module):
        """The dense side's draws and decisions (`book.draw`) or the truth's replay of them
        (`book.replay`), each unless the model has none."""
        with contextlib.ExitStack() as stack:
            if self.draws_random is not False:
                stack.enter_context(role(model))
            if self.decides is not False:
                stack.enter_context(role.__self__.decisions.mode(role.__name__, model))
            yield

    @contextlib.contextmanager
    def tp_masks(self, book: MaskBook, tp: nn.Module):
        """The TP side's part of each mask, its own draw recorded, and its decisions judged
        against the dense side's (after rank 0 shared their margins), each unless the model has
        none."""
        group = self.cmp.group
        with contextlib.ExitStack() as stack:
            if self.draws_random is not False:
                stack.enter_context(book.tp(tp, group.rank, group.world_size, self.cmp.next_seq))
            if book.decisions.dense:
                book.decisions.share(self.rendezvous, self.cmp.dtype, group.world_size, group.rank)
                stack.enter_context(book.decisions.mode("tp", tp, self.cmp.next_seq))
            yield

    @contextlib.contextmanager
    def watching(self, book: MaskBook):
        """Around a dense pass: random draws other than the replayed ones are refused; the first
        pass tells whether the model draws at all."""
        before = rng_states(self.device)
        yield
        if not all(map(torch.equal, before, rng_states(self.device))):
            if threads := case_threads.running():
                raise UsageError(
                    "the global RNG moved during the dense pass while thread(s) your code started "
                    f"ran beside it: {case_threads.describe(threads)}. A thread that draws from "
                    "torch's default generator (a loader's shuffle, an augmentation) makes every "
                    "draw of the step depend on its timing: give it a torch.Generator of its own "
                    "(torch.rand(..., generator=g)), or start it after the check"
                )
            raise UsageError(NONDETERMINISTIC)
        if self.draws_random is None:
            self.draws_random = bool(book.draws)
        if self.decides is None:
            self.decides = bool(book.decisions.dense)

    def check(self, step: int, book: MaskBook, where: str) -> None:
        """The RNG placement checks of one forward's random draws: every rank's draws are exchanged
        through the rendezvous store (not a collective) and each of this rank's is held to its
        region's rule against the others'; a draw that did not match the dense side's fails as it
        is. Only where the dense side drew (the same on every rank, so every rank
        exchanges or none does); then the TP side's discrete decisions (`decided`)."""
        self.decided(step, book.decisions)
        if not book.draws:
            for d in book.tp_draws:
                self._record(step, d, 1, d.problem or "", d.rule, [], d.problem)
            return
        said = self.rendezvous.exchange(
            "rng", json.dumps([d.as_json() for d in book.tp_draws]), label=where
        )
        everyone = [json.loads(text) for text in said]
        me = self.cmp.group.rank
        for k, d in enumerate(book.tp_draws):
            short = [r for r, theirs in enumerate(everyone) if len(theirs) <= k]
            problem = d.problem or (
                f"rank(s) {short} drew fewer random masks in this forward than rank {me}"
                if short
                else None
            )
            if problem or d.rule is None:
                self._record(
                    step,
                    d,
                    1 if problem else 0,
                    problem or "one rank: no RNG placement to check",
                    d.rule,
                    short,
                    problem,
                )
                continue
            states, masks = [t[k][2] for t in everyone], [t[k][3] for t in everyone]
            bad = violations(d.rule, states, masks, me)
            self._record(step, d, len(bad), REASONS[d.rule], d.rule, bad, None)
            self._control(step, d, states, masks)
        # masks the dense side applied and the TP side never drew
        if len(book.tp_draws) < len(book.draws):
            missed = book.draws[len(book.tp_draws)]
            problem = (
                f"the dense side drew {len(book.draws)} random mask(s) in this forward, the TP "
                f"side {len(book.tp_draws)} on rank {me}: none where the dense side "
                f"drew at {missed.label}"
            )
            self.cmp.record_rng(
                step,
                CheckId("rng", missed.label),
                self.cmp.next_seq(),
                1,
                problem,
                "?",
                {"rule": None, "ranks": [], "problem": problem},
            )

    def decided(self, step: int, book: decisions.DecisionBook) -> None:
        """A `routing:<decision>` check of each TP decision judged against the dense side's (error:
        the gap of its flips, bound: the rounding margin); the flips within the margin (the dense
        decision substituted) and the decisions not replayed are kept for the report's notes."""
        for j in book.judged:
            self.cmp.record_routing(step, j)
            if j.substituted:
                seen = self.flips.setdefault(j.label, [0, 0, 0.0, j.margin])
                seen[0], seen[1] = seen[0] + 1, seen[1] + j.rows
                if j.gap >= seen[2]:
                    seen[2], seen[3] = j.gap, j.margin
        self.unreplayed.update(dict.fromkeys(book.unreplayed))

    def notes(self) -> list[str]:
        """The report's notes on the decisions: each flipped at a near-tie (and replayed), each not
        replayed (its TP input shaped otherwise than the dense one)."""
        out = [
            f"{decisions.FLIPPED} (margin {gap:.3g}, within the rounding margin {margin:.3g}): "
            f"{label}, {rows} row(s) in {n} forward(s); the dense decision was replayed"
            for label, (n, rows, gap, margin) in self.flips.items()
        ]
        return out + [
            f"the decision {label} was not replayed: its TP input is not shaped as the dense "
            "one (a decision on shards), or not at the same place in call order; its effect is "
            "checked through the values after it"
            for label in self.unreplayed
        ]

    def _record(
        self,
        step: int,
        d: TPDraw,
        error: int,
        reason: str,
        rule: str | None,
        ranks: list[int],
        problem: str | None,
    ) -> None:
        self.cmp.record_rng(
            step,
            CheckId("rng", d.label),
            d.seq,
            error,
            reason,
            d.placement,
            {"rule": rule, "ranks": ranks, "problem": problem},
        )

    def _control(self, step: int, d: TPDraw, states: list, masks: list) -> None:
        """The self-test of the RNG rule, once per step: the exchanged draws with one rank's planted
        to break the rule (a copy of this rank's draw on a sharded region, another state on a
        replicated one) go through `violations` and are recorded like the real
        check; it must fail."""
        if not self.cmp.take_control(("forward", step, "rng")):
            return
        me, other = self.cmp.group.rank, (self.cmp.group.rank + 1) % len(states)
        states, masks = list(states), list(masks)
        if d.rule == DIFFER:
            states[other], masks[other] = states[me], masks[me]
        else:
            states[other] = states[other] + "~"
        bad = violations(d.rule, states, masks, me)
        self.cmp.record_rng(
            step,
            CheckId("rng", d.label, control=True),
            d.seq,
            len(bad),
            REASONS[d.rule],
            d.placement,
            {"rule": d.rule, "ranks": bad, "problem": None},
        )
