"""What crosses the pipe from a rank to the parent: the `Check` records of one case on one rank, the
rank's `RankPayload` (its checks, its ledger of collectives, the evidence kept for the diagnosis)
and the ledger's entries and how two ranks' ledgers differ. Plain data: no tensor maths, no process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.settings import RunSettings
from tpcheck.checker.vocabulary import Stage, Status


@dataclass(kw_only=True)
class Check:
    """One comparison on one rank. error: max |TP - dense| (the dense model in the working dtype);
    diff_vs_dense: the same number (the seed's metric); bound/passed: None until rank 0's bound for
    the same `seq` is filled in (calibrated checks on ranks > 0); seq: position in execution order
    (a replica check shares the seq of the tensor it checks)."""

    stage: Stage
    step: int
    id: CheckId  # what was compared (checker/checkid.py); rendered as the report's `name`
    rank: int
    error: float
    diff_vs_dense: float
    bound: float | None
    kind: str  # exact | calibrated | fp64 | replica | rng | layout | routing
    reason: str
    passed: bool | None
    placement: str = "replicate"
    seq: int = 0
    # set where an allowance excused part of the difference: the raw max |TP - dense| (`error` is
    # then what the allowance left unexplained, the figure held against the bound)
    raw_error: float | None = None
    # calibrated bounds: bound = factor(world) * ref_error + floor (tolerance.py)
    ref_error: float | None = None
    floor: float | None = None
    numel: int = 0  # elements compared on this rank
    # a control's planted error (its evidence must show it), and why it may go unflagged (an
    # ill-conditioned tensor: `tolerance.blind_spot`; None: it must be flagged)
    planted: float | None = None
    blind: str | None = None
    # what loaded the tensor, where it was not tpcheck through the plan: a weights check of a case
    # with its own `load_tp` ("your load_tp (case.py:34)"), named by the summary of a failing one
    loaded_by: str | None = None
    # calibrated checks of SMALL_NUMEL elements or more, judged by magnitude (tolerance.py): this
    # rank's max |TP - dense| per bin and rank 0's bound per bin (bound, ref_error, floor,
    # magnitude), until the parent judges the check (then only the judged bin's figures are kept:
    # `magnitude` is the largest row magnitude it covers, where it is not the whole tensor's)
    bin_errors: tuple | None = None
    bins: tuple | None = None
    magnitude: float | None = None
    scale: float | None = None  # calibrated: max |float64 truth| over the whole tensor

    @property
    def name(self) -> str:
        """The check's name as the report shows it (`str(self.id)`)."""
        return str(self.id)

    @property
    def control(self) -> bool:
        """A control (self-test): a copy of the reference with one element moved by a known amount,
        compared through the same path; it must be flagged (checker/verdict/result.py turns an
        unflagged control into "error")."""
        return self.id.control


# (stage, step, check identity): where a check's evidence is kept, on a rank and in its payload
EvidenceKey = tuple[str, int, CheckId]


def evidence_key(stage: str, step: int, check_id: CheckId) -> EvidenceKey:
    """The key of a check's evidence, in a rank's `Evidence` and in the payload the parent reads."""
    return stage, step, check_id


PROBLEM_KEYS = (
    "status",
    "rank",
    "message",
    "traceback",
    "last_collective",
    "waiting_in",
    "checkpoint",
    "where",
)


@dataclass
class RankPayload:
    """What one rank reports for one case. status: ok | usage (bad input) | error (raised) | crash
    (died) | hang (a wait timed out) | aborted (stopped after another rank's failure)."""

    status: Status
    rank: int
    message: str = ""
    checks: list[Check] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)
    ledger: list[LedgerEntry] = field(default_factory=list)
    expected_collectives: tuple | None = None
    seconds: float = 0.0
    traceback: str | None = None
    last_collective: tuple | None = None
    waiting_in: str | None = None  # collective | checkpoint | subprocess | compute | unresponsive
    checkpoint: str | None = None
    where: dict | None = None  # the launcher's evidence of where the rank was (heartbeat.py)
    inferred_plan: str | None = None  # a case without a written plan: the plan inferred, as code
    # the module outputs: which placements were written, which inferred, which outputs were not
    # checked and which are no placement of the dense output (checker/rank/discover.py `record`)
    activations: dict | None = None
    has_ledger: bool = True  # False for payloads made up by the launcher (killed or dead ranks)
    run: RunSettings | None = None  # the settings the rank ran (None: it never built the case)
    notes: list[str] = field(default_factory=list)  # what the rank could not check, and why
    # a case checked forward only: why, its decode passes per step and the notes for the report
    # (checker/rank/forward_only.py); None: it trained
    forward_only: dict | None = None
    # the TP module's forwards the warm-up ran (RunSettings.warmup; checker/rank/warmup.py)
    warmed_up: int = 0
    # what this rank must have compared, from the plan and the run settings (checker/rank/
    # manifest.py): [stage, step, name, count]; the parent fails the self-test on any it lacks
    manifest: list | None = None
    # the operations that read a whole dimension and found it smaller on the TP side, in step 1's
    # first forward (checker/rank/shard_ops.py): the diagnosis of a mismatch names them
    shard_ops: list = field(default_factory=list)
    # rank 0's lines of the code under test that called a torch operation in that forward, per
    # side: {"dense" | "tp": [[file, line, operation, module], ...]} (checker/rank/shard_ops.py)
    code_paths: dict | None = None
    # threads the case started that still ran at its end (checker/rank/case_threads.py): the pool
    # is then replaced before the next case
    threads_left: int = 0

    def problem_json(self) -> dict:
        return {
            k: getattr(self, k)
            for k in PROBLEM_KEYS
            if getattr(self, k) not in (None, "") or k in ("status", "rank", "message")
        }

    def ledger_lines(self) -> list[str] | None:
        return [e.line() for e in self.ledger] if self.has_ledger else None


@dataclass
class LedgerEntry:
    rank: int
    phase: str
    op: str
    site: str
    nbytes: int

    def line(self) -> str:
        return f"{self.phase} {self.op} at {self.site!r}"


def ledger_diff(ledgers: dict[int, list[str]]) -> str:
    """Where the ranks' lists of issued collectives ("phase op at 'site'" each) first part."""
    counts = ", ".join(f"rank {r}: {len(ld)}" for r, ld in sorted(ledgers.items()))
    longest = max((len(ld) for ld in ledgers.values()), default=0)
    for i in range(longest):
        at = {r: ld[i] if i < len(ld) else "nothing" for r, ld in sorted(ledgers.items())}
        if len(set(at.values())) > 1:
            which = "; ".join(f"rank {r}: {a}" for r, a in at.items())
            return f"collectives issued ({counts}) first differ at #{i + 1}: {which}"
    return f"collectives issued ({counts}) agree"
