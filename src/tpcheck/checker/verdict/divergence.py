"""The first divergence of a case: the first failed check in execution order, with the ranks it
failed on, as a typed record (`FirstDivergence`) from the verdict to the diagnosis; the report's
`first_divergence` object is its `to_json()` (docs/report-schema.md), read back by `from_json`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tpcheck.checker.checkid import NO_GRAD_OUTPUT, WITHOUT_AUTOGRAD, CheckId
from tpcheck.checker.payload import Check


@dataclass(frozen=True)
class FirstDivergence:
    """Where a case first diverges: the check (`id`, `stage`, `step`), the ranks it failed on, and
    its figures (error, bound, the kind of bound, its reason; `raw_error` where an allowance excused
    part of the difference)."""

    id: CheckId
    stage: str
    step: int
    ranks: list[int] = field(default_factory=list)
    error: float | None = None
    bound: float | None = None
    kind: str | None = None
    reason: str | None = None
    raw_error: float | None = None

    @property
    def name(self) -> str:
        return str(self.id)

    def same_check(self, other: FirstDivergence) -> bool:
        return (self.stage, self.step, self.id) == (other.stage, other.step, other.id)

    def to_json(self) -> dict:
        out = {
            "stage": self.stage,
            "step": self.step,
            "name": self.name,
            "ranks": self.ranks,
            "error": self.error,
            "bound": self.bound,
            "kind": self.kind,
            "reason": self.reason,
        }
        if self.raw_error is not None:
            out["raw_error"] = self.raw_error
        return out

    @classmethod
    def from_json(cls, d: dict) -> FirstDivergence:
        return cls(
            id=CheckId.parse(d["name"]),
            stage=d["stage"],
            step=d["step"],
            ranks=list(d.get("ranks", [])),
            error=d.get("error"),
            bound=d.get("bound"),
            kind=d.get("kind"),
            reason=d.get("reason"),
            raw_error=d.get("raw_error"),
        )


def first_divergence(failed: list[Check], checks: Sequence[Check] = ()) -> FirstDivergence:
    """The first divergence: the first failed check in execution order (`failing`), but for one
    made in a forward without autograd where the same step's training forward fails too: that
    forward's first failure names the module, while the pass without autograd compares the model's
    output only (and the decisions made on the way, a router's top-k). The pass without autograd
    is each step's first (`Case.no_grad_forward`: the checks of the step up to its output's,
    `checks` on the same rank) and the eval-mode one after the last step's micro-batches. A failure
    of that pass alone stays first: a path taken only without autograd."""
    ends = {
        (c.rank, c.step): c.seq for c in checks if c.id == NO_GRAD_OUTPUT and c.stage == "forward"
    }

    def without_autograd(c: Check) -> bool:
        end = ends.get((c.rank, c.step))
        return c.id in WITHOUT_AUTOGRAD or (
            c.stage == "forward" and end is not None and c.seq <= end
        )

    first = failed[0]
    if without_autograd(first):
        first = next(
            (
                c
                for c in failed
                if c.stage == "forward" and c.step == first.step and not without_autograd(c)
            ),
            first,
        )
    ranks = sorted(
        {
            c.rank
            for c in failed
            if c.id == first.id and c.step == first.step and c.stage == first.stage
        }
    )
    return FirstDivergence(
        id=first.id,
        stage=first.stage,
        step=first.step,
        ranks=ranks,
        error=first.error,
        bound=first.bound,
        kind=first.kind,
        reason=first.reason,
        raw_error=first.raw_error,
    )


@dataclass(frozen=True)
class Diagnosis:
    """What the first divergence's numbers say (checker/verdict/diagnose.py): the `signature`
    (partial_sum, scaled, ..., mismatch), the `cause` in words, where (`location`, the check's
    `tensor` name, stage, step, ranks), the `evidence` the signature was read from, and one
    `sentence` for people. The report's `diagnosis` object is its `to_json()`."""

    signature: str
    cause: str
    location: str
    tensor: str
    stage: str
    step: int
    ranks: list[int]
    evidence: dict
    sentence: str

    def to_json(self) -> dict:
        return {
            "signature": self.signature,
            "cause": self.cause,
            "location": self.location,
            "tensor": self.tensor,
            "stage": self.stage,
            "step": self.step,
            "ranks": self.ranks,
            "evidence": self.evidence,
            "sentence": self.sentence,
        }

    @classmethod
    def from_json(cls, d: dict) -> Diagnosis:
        return cls(**{k: d[k] for k in DIAGNOSIS_KEYS})


DIAGNOSIS_KEYS = tuple(Diagnosis.__dataclass_fields__)


@dataclass
class SelfTest:
    """The checker's test of itself on one case (checker/verdict/result.py `self_test`): how many
    controls were planted and flagged, the `failures` (any one makes the verdict "error"), the
    controls `skipped` as ill-conditioned (each with why), and how many entries the ranks'
    manifests held. The report's `self_test` object is its `to_json()`."""

    controls: int = 0
    flagged: int = 0
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    manifest: int = 0

    def to_json(self) -> dict:
        return {
            "controls": self.controls,
            "flagged": self.flagged,
            "failures": self.failures,
            "skipped": self.skipped,
            "manifest": self.manifest,
        }

    @classmethod
    def from_json(cls, d: dict) -> SelfTest:
        return cls(**{k: d[k] for k in ("controls", "flagged", "failures", "skipped", "manifest")})
