"""The evidence of one case on one rank: the tensors behind its checks, kept for the parent's
diagnosis, and the part of them the rank sends.

Small tensors are kept as they are compared (every control's few elements and every RNG check's
record outside the budget); after the run one store exchange tells every rank which checks fail on
some rank, and only their tensors travel (with the loaded weights and the controls). The same
exchange at the end of every step but the last releases what that step kept for checks that passed
on every rank (`Evidence.release`): the budget then holds the tensors of the failures, so a first
divergence at a late step of a large model still has its tensors (with the budget spent by step 1,
its diagnosis would have no numbers to read). A key is `(stage, step, check id)`, a check's own
three fields (`payload.evidence_key`), on the rank and in the payload alike.
"""

from __future__ import annotations

import array
import base64
import hashlib
import json
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.payload import Check, EvidenceKey
from tpcheck.checker.sync import Rendezvous

EVIDENCE_MAX_NUMEL = 1 << 16  # tensors up to this size are sent to the parent for diagnosis
EVIDENCE_BUDGET = 1 << 21  # total elements per rank and case

Key = EvidenceKey


def key_of(check: Check) -> Key:
    return check.stage, check.step, check.id


class Evidence:
    """The tensors kept on this rank, by check, in the order they were compared."""

    def __init__(self) -> None:
        self.kept: dict[Key, dict] = {}
        self.left = EVIDENCE_BUDGET  # elements still to keep (a control's are outside the budget)
        self.cost: dict[Key, int] = {}  # what each entry took from the budget

    def __iter__(self) -> Iterator[Key]:
        return iter(self.kept)

    def keep(self, check: Check, tp_local, ref, dense, weights=None) -> None:
        """Small tensors (and every control's few elements,
        outside the budget) are kept for diagnosis."""
        if not check.control:
            if tp_local.numel() > EVIDENCE_MAX_NUMEL or self.left < 3 * dense.numel():
                return
            self.left -= 3 * dense.numel()
            key = key_of(check)  # a name that recurs (one per micro-batch) keeps its last tensors
            self.left += self.cost.pop(key, 0)
            self.cost[key] = 3 * dense.numel()
        # copies (later steps change these tensors in place), made numpy in `sent` if needed
        kept = self.kept[key_of(check)] = {
            "tp": tp_local.detach().clone(),
            "ref": ref.detach().clone(),
            "dense": dense.detach().clone(),
            "placement": check.placement,
            "eps": float(torch.finfo(tp_local.dtype).eps) if tp_local.is_floating_point() else 0.0,
        }
        if weights is not None:
            kept["weights"] = weights.detach().clone()

    def annotate(self, key: Key, what: str, info: dict) -> None:
        """Numbers the diagnosis of a kept check needs beside its tensors (a clip check's squared
        norms), under `what`; nothing when the check's tensors were not kept."""
        if key in self.kept:
            self.kept[key][what] = info

    def keep_rng(
        self, step: int, check_id: CheckId, error: int, placement: str, info: dict
    ) -> None:
        """An RNG check's record: the count of ranks breaking the rule, and `info` (the rule, those
        ranks, a mismatch with the dense side's draw), which the diagnosis names."""
        zero = np.zeros(1)
        self.kept[("forward", step, check_id)] = {
            "tp": np.array([float(error)]),
            "ref": zero,
            "dense": zero,
            "placement": placement,
            "eps": 0.0,
            "rng": info,
        }

    def release(self, step: int, needed: set[Key] | None) -> None:
        """Drop what step `step` kept for checks outside `needed` (`needed_evidence` of the step's
        checks: those failing on some rank, and the weights), giving their elements back to the
        budget; nothing when `needed` is None (the ranks could not tell)."""
        if needed is None:
            return
        for key in [k for k in self.cost if k[1] == step and k not in needed]:
            if key[0] != "weights":
                del self.kept[key]
                self.left += self.cost.pop(key)

    def sent(self, keys: set[Key] | None) -> dict[Key, dict]:
        """The evidence sent to the parent, as float64 arrays, under the payload's keys: the entries
        in `keys` (None: every one), every control's (the self-test reads them) and
        every RNG check's."""
        out = {}
        for key, e in self.kept.items():
            if keys is None or key in keys or key[2].control or "rng" in e:
                out[key] = {
                    k: v.double().cpu().numpy() if isinstance(v, torch.Tensor) else v
                    for k, v in e.items()
                }
        return out


def needed_evidence(
    checks: list[Check], kept: Iterable[Key], rendezvous: Rendezvous
) -> set[Key] | None:
    """The evidence keys the parent can need: those of every check that fails on some rank (the
    diagnosis reads the first one's tensors on every rank) and the weights stage's (a loaded bias
    can explain an offset), out of all this rank kept; None (send everything) when the ranks cannot
    tell. Sending only these saves pickling ~1,300 small arrays per tiny case. A rank other than 0
    cannot judge its calibrated checks, whose bound rank 0 computes: one store exchange carries rank
    0's bounds and the other ranks' errors for them, in check order, with a digest of that order
    (AppliedOnRank(r) makes the orders differ: then everything is sent)."""
    failing = {
        key_of(c)
        for c in checks
        if not c.control and c.bound is not None and not c.error <= c.bound
    }
    if rendezvous.rank == 0:  # the checks whose bound the other ranks take from here
        mine = [
            c
            for c in checks
            if not c.control
            and c.stage != "replicas"
            and c.bound is not None
            and c.kind == "calibrated"
        ]
        values = [c.bound for c in mine]
    else:
        mine = [c for c in checks if not c.control and c.stage != "replicas" and c.bound is None]
        values = [c.error for c in mine]
    said = _exchange(rendezvous, failing, mine, values)
    if said is None:
        return None
    bounds = array.array("d", base64.b64decode(said[0]["values"]))
    for other in said:
        # the keys as they cross the store: [stage, step, the rendered check name]
        failing.update((stage, step, CheckId.parse(name)) for stage, step, name in other["failing"])
    for other in said[1:]:
        errors = array.array("d", base64.b64decode(other["values"]))
        failing.update(key_of(c) for c, e, b in zip(mine, errors, bounds) if not e <= b)
    keys = {k for k in kept if k[0] == "weights"}
    for stage, step, name in failing:
        # the replicated tensor's own evidence, under the stage it was compared in
        if stage == "replicas":
            keys.update(k for k in kept if k[1:] == (step, name))
        else:
            keys.add((stage, step, name))
    return keys


def _exchange(
    rendezvous: Rendezvous, failing: set[Key], mine: list[Check], values: list[float]
) -> list[dict] | None:
    """Every rank's failing checks and `values` (rank 0's bounds, the others' errors) through the
    store, with a digest of the order of `mine`; None when the ranks' orders differ."""
    digest = hashlib.blake2b(
        "\n".join(repr(key_of(c)) for c in mine).encode(), digest_size=16
    ).hexdigest()
    said = [
        json.loads(t)
        for t in rendezvous.exchange(
            "evidence",
            json.dumps(
                {
                    "failing": [[st, sp, str(cid)] for st, sp, cid in sorted(failing)],
                    "digest": digest,
                    "values": base64.b64encode(array.array("d", values).tobytes()).decode(),
                }
            ),
            label="choosing the evidence to send",
        )
    ]
    return None if any(s["digest"] != digest for s in said) else said
