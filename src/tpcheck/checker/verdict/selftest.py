"""The self-test's reading of a merged case (checker/verdict/result.py merges, this judges the
checker): the one list of failures the verdict and the self-test both read (`failing`,
`read_failures`), the controls held to having been flagged and to showing their planted error, and
the manifest of every check a rank owed (`missing_checks`)."""

from __future__ import annotations

from dataclasses import dataclass

from tpcheck.checker.payload import Check, RankPayload, evidence_key
from tpcheck.checker.verdict.divergence import SelfTest
from tpcheck.checker.vocabulary import Verdict


def failing(checks: list[Check]) -> list[Check]:
    """Every judged check that failed, controls included, in execution order (a replica check
    after the tensor it checks): the one list the verdict and the self-test read (`read_failures`),
    so a verdict that misses a failure misses a control's too."""
    return sorted(
        (c for c in checks if not c.passed), key=lambda c: (c.seq, c.stage == "replicas", c.rank)
    )


@dataclass
class Reading:
    """The failures as the verdict reads them: `flagged`, the one list (`failing`), split into the
    real checks that failed (`failed`, the verdict's) and the controls (`caught`, the self-test's).
    The self-test holds the split to the list: every failure in it once, a control among `caught`,
    any other among `failed`."""

    flagged: list[Check]
    failed: list[Check]
    caught: list[Check]

    @property
    def verdict(self) -> Verdict:  # from `failed` alone
        return "not equivalent" if self.failed else "equivalent"


def read_failures(flagged: list[Check]) -> Reading:
    """The one reading of the failures (`failing`'s list) the verdict is computed from."""
    return Reading(
        flagged=flagged,
        failed=[c for c in flagged if not c.control],
        caught=[c for c in flagged if c.control],
    )


def unread(reading: Reading) -> list[str]:
    """What of the failures the reading does not account for: failures of `flagged` that neither
    the verdict (`failed`) nor the self-test (`caught`) read, checks read that are not in
    `flagged`, failures read on the wrong side or twice. A filter between the one list and the
    verdict, or the self-test, shows here."""
    listed = {id(c) for c in reading.flagged}
    sides = [(c, False) for c in reading.failed] + [(c, True) for c in reading.caught]
    read = {id(c) for c, _ in sides}
    out, missed = [], [c for c in reading.flagged if id(c) not in read]
    for what, found in (
        (f"of the {len(listed)} failures were not read", missed),
        ("check(s) read are not among the failures", [c for c, _ in sides if id(c) not in listed]),
        ("failure(s) were read on the wrong side", [c for c, side in sides if c.control != side]),
    ):
        if found:
            out.append(f"{len(found)} {what} (first: {_where(found[0])})")
    if len(read) != len(sides):
        out.append(f"{len(sides) - len(read)} failure(s) were read twice")
    return out


def _where(c: Check) -> str:
    return f"{c.name} ({c.stage}, step {c.step}, rank {c.rank})"


def self_test(
    checks: list[Check],
    controls: list[Check],
    evidence: list[dict],
    reading: Reading | None = None,
    manifests: list[tuple[int, list | None]] | None = None,
    read: dict[int, float] | None = None,
) -> SelfTest:
    """The controls must all be among the failures the verdict read (`reading.caught`; default:
    the reading of `failing(controls)`), the reading must account for every failure once
    (`unread`), every rank must have a control at every stage and step where it has checks, each
    non-replica control's evidence must show its planted error, and every rank must have made every
    check of its manifest (`missing_checks`). Any of these missing is a failure: the verdict is then
    "error".

    A calibrated control that was not flagged is skipped (counted, named) only where rank 0
    measured, apart from the bound under test, that the dense model's own error puts the published
    bound above half the planted error (`Check.blind`, tolerance.blind_spot, with its own
    constants): an ill-conditioned tensor (an RMSNorm of a near-zero input in 16 bits). Any other
    unflagged control fails.

    Flagged or excused, a control must have been judged by an error that shows its planted one
    (`read`: each control's `judged_error`, taken before `judge` keeps one bin of it; default: its
    error as judged): a comparison that misreads errors (a bin's, or the whole tensor's) is seen
    even where a blind spot excuses the control."""
    reading = read_failures(failing(controls)) if reading is None else reading
    caught = {id(c) for c in reading.caught}
    failures, skipped = unread(reading), []
    for c in controls:
        where = _where(c)
        seen = read[id(c)] if read is not None and id(c) in read else c.error
        if c.planted is not None and not seen >= c.planted / 2:
            failures.append(
                f"{where} was judged by an error of {seen:.3g}, not its planted {c.planted:.3g}"
            )
            continue
        if id(c) not in caught:
            if c.blind is not None:
                skipped.append(f"{where}: {c.blind}")
            else:
                failures.append(
                    f"a planted error of {c.error:.3g} in {where} was not flagged "
                    f"(bound {c.bound:.3g})"
                )
        elif c.stage != "replicas" and (shown := _shown(c, evidence)) is not None:
            failures.append(f"the evidence of {where} does not show its planted error ({shown})")
    have = {(c.rank, c.stage, c.step) for c in controls}
    failures += [
        f"no control on rank {r} for the {s} checks of step {t}"
        for r, s, t in sorted({(c.rank, c.stage, c.step) for c in checks} - have)
    ]
    if manifests is not None:
        failures += missing_checks(checks, manifests)
    return SelfTest(
        controls=len(controls),
        flagged=sum(id(c) in caught for c in controls),
        failures=failures,
        skipped=skipped,
        manifest=sum(len(m or ()) for _, m in manifests or ()),
    )


def missing_warmup(payloads: list[RankPayload], warmup: int) -> list[str]:
    """The manifest of the warm-up (`RunSettings.warmup`): every rank ran its TP module's `warmup`
    forwards before the first step (counted by a hook on the module: checker/rank/warmup.py)."""
    return [
        f"rank {p.rank} ran {p.warmed_up} of the {warmup} warm-up forward(s) of the TP module"
        for p in payloads
        if p.warmed_up != warmup
    ]


def _shown(control: Check, evidence: list[dict]) -> str | None:
    """What is wrong with a control's evidence (None: it shows the planted element, its difference
    at least half the planted error, at most the control's whole error)."""
    kept = evidence[control.rank].get(evidence_key(control.stage, control.step, control.id))
    if kept is None:
        return f"missing instead of {control.error:.3g}"
    shown = float(abs(kept["tp"] - kept["ref"]).max(initial=0.0))
    planted = control.planted if control.planted is not None else control.error
    # diff_vs_dense: the whole tensor's max |TP - dense| (`error` may be a magnitude bin's)
    if planted / 2 <= shown <= max(control.error, control.diff_vs_dense) * (1 + 1e-3):
        return None
    return f"{shown:.3g} instead of {planted:.3g}"


def missing_checks(checks: list[Check], manifests: list[tuple[int, list | None]]) -> list[str]:
    """The manifest held against what was compared: each rank's entries [stage, step, name, count]
    (checker/rank/manifest.py: from the plan and the run settings, every parameter, gradient and
    module output of the plan, every step, micro-batch and rank) against its real checks. Each
    check missing, or made fewer times than the micro-batches, is a failure of the checker, and so
    is a rank that sent no manifest."""
    have: dict[tuple, int] = {}
    for c in checks:
        key = (c.rank, c.stage, c.step, c.id)
        have[key] = have.get(key, 0) + 1
    out = []
    for rank, entries in manifests:
        if entries is None:
            out.append(f"no manifest from rank {rank}: what it compared cannot be held to the plan")
            continue
        for stage, step, name, count in entries:
            made = have.get((rank, stage, step, name), 0)
            if made == 0:
                out.append(f"no check of {name} ({stage}, step {step}) on rank {rank}")
            elif made < count:
                out.append(
                    f"{made} check(s) of {name} ({stage}, step {step}) on rank {rank} where "
                    f"{count} were due (one per micro-batch)"
                )
    return out
