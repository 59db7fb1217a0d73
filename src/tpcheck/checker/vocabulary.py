"""The checker's words, defined once: `Verdict` (a case's), `Stage` (where in a step a check is
made), `Status` (how a rank's run of a case ended). Every module that spells one imports it; the
report schema's enums are held to them (tests/checker/verdict/test_result.py)."""

from __future__ import annotations

from typing import Literal, get_args

from tpcheck.parallel.group import PHASES

# equivalent: every check on every rank passed; not equivalent: some check failed; hang: a
# collective wait timed out (some ranks issued a collective the others did not); error: a rank
# raised or died, or the checker failed its own control; invalid: the input was
# wrong (a usage error)
Verdict = Literal["equivalent", "not equivalent", "hang", "error", "invalid"]
VERDICTS: tuple[Verdict, ...] = get_args(Verdict)
# what a case may expect
VERDICTS_EXPECTED: tuple[Verdict, ...] = ("equivalent", "not equivalent", "hang")
# the order of a step: the loaded weights (step 0), each micro-batch's forward, loss and backward,
# the step's gradients, the optimizer's state, update and weights, the module's buffers (step 0 too:
# as built); replicas: the same tensor across ranks
Stage = Literal[
    "weights", "forward", "loss", "backward", "grads", "optimizer", "buffers", "replicas"
]
STAGES: tuple[Stage, ...] = get_args(Stage)
# ok | usage (bad input) | error (raised) | crash (died) | hang (a wait timed out) | aborted
# (stopped after another rank's failure)
Status = Literal["ok", "usage", "error", "crash", "hang", "aborted"]
# the phase the collectives of the warm-up forwards are recorded in (RunSettings.warmup,
# checker/rank/warmup.py): outside the per-step counts, held only to being the same on every rank
WARMUP = "warmup"
# the phases of the collective ledger, in the order a run issues them
LEDGER_PHASES = (WARMUP, *PHASES)
