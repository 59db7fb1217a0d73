"""A check's identity: what was compared (`kind`), of which tensor (`target`), in which pass of a
step (`pass_`), and whether it is a control of the self-test. Made once, where the tensor is
captured or compared (checker/rank/), and carried on the `Check` to the parent's verdict, the
diagnosis and the repair; rendered to the string the report shows (`str(check_id)`, e.g.
`act:layers.0.attention:decode2`) only at the edge, and read back from a report (`CheckId.parse`,
the one place a rendered name is taken apart).

The rendered forms (the report's `name` of a check, docs/report-schema.md):

| kind | target | rendered |
|---|---|---|
| `output` | (none) | `output`, `output:decode2`, `output:eval`, `output:no_grad` (its pass) |
| `loss` | (none) | `loss` |
| `act`, `actgrad` | a module | `act:layers.0.mlp`, `act:layers.0.mlp:decode2` |
| `param`, `grad`, `update`, `weight` | a parameter (or a forward input) | `grad:fc1.weight` |
| `state` | a parameter and its state entry (against the replay) | `state:fc1.weight.exp_avg` |
| `moment` | a parameter's state entry (against the dense side's) | `moment:fc1.weight.exp_avg` |
| `clipped` | a parameter's gradient after the step's clipping | `clipped:fc1.bias` |
| `replay` | a parameter (a control only: the rule on a planted grad) | `control:replay:fc1.bias` |
| `buffer` | a buffer | `buffer:rope.cos` |
| `rng`, `routing` | where the draw or decision was made | `rng:layers.0.mlp: dropout #1` |
| `clip` | what was clipped | `clip:grad_norm` |

A control is its check's identity with `control:` before it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

Kind = Literal[
    "output",
    "loss",
    "act",
    "actgrad",
    "param",
    "grad",
    "update",
    "weight",
    "state",
    "moment",
    "clipped",
    "replay",
    "buffer",
    "rng",
    "routing",
    "clip",
]
KINDS: tuple[Kind, ...] = get_args(Kind)
# the kinds whose checks carry the pass of a decoding run (or the forward without autograd)
PASSED: tuple[Kind, ...] = ("output", "act", "actgrad")
# the kinds whose checks name an optimizer state entry: against the replay, against the dense side
ENTRIES: tuple[Kind, ...] = ("state", "moment")
CONTROL = "control:"


@dataclass(frozen=True, order=True)
class CheckId:
    """The identity of one check (module docstring)."""

    kind: Kind
    target: str = ""
    pass_: str = ""  # "" (a training forward, the prefill), "decode2", "eval", "no_grad"
    entry: str = ""  # an optimizer state's entry (`exp_avg`), for kinds "state" and "moment"
    control: bool = False

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"no check kind {self.kind!r}"
        assert not self.pass_ or self.kind in PASSED, f"{self.kind} checks have no pass"
        assert not self.entry or self.kind in ENTRIES, "only a state check has an entry"

    def __str__(self) -> str:
        text = self.kind
        if self.target:
            text += f":{self.target}"
        if self.entry:
            text += f".{self.entry}"
        if self.pass_:
            text += f":{self.pass_}"
        return CONTROL + text if self.control else text

    def as_control(self) -> CheckId:
        """The identity of this check's control (the self-test's planted copy)."""
        return replace(self, control=True)

    def in_pass(self, pass_: str) -> CheckId:
        return replace(self, pass_=pass_)

    @property
    def location(self) -> str:
        """Where the check looked, as the diagnosis names it: the target (with its state entry and
        pass), else the pass, else the kind (`output`, `loss`)."""
        if self.target:
            entry = f".{self.entry}" if self.entry else ""
            return self.target + entry + (f":{self.pass_}" if self.pass_ else "")
        return self.pass_ or self.kind

    @property
    def decoding(self) -> bool:
        """Whether the check belongs to a decode pass (`decode1`, `decode2`, ...)."""
        return self.pass_.startswith("decode")

    @classmethod
    def parse(cls, text: str) -> CheckId:
        """The identity a rendered name stands for (`str`'s inverse, for a report read back)."""
        control = text.startswith(CONTROL)
        if control:
            text = text[len(CONTROL) :]
        kind, _, rest = text.partition(":")
        target = pass_ = entry = ""
        if kind == "output":
            pass_ = rest
        elif kind in PASSED and ":" in rest:
            target, _, pass_ = rest.rpartition(":")
        elif kind in ENTRIES:
            target, _, entry = rest.rpartition(".")
        else:
            target = rest
        return cls(kind, target, pass_, entry, control)  # type: ignore[arg-type]


def decode_pass(k: int) -> str:
    """The pass of decode pass `k` (`decode2`); "" for the prefill, or a plain forward."""
    return f"decode{k}" if k else ""


OUTPUT = CheckId("output")
LOSS = CheckId("loss")
CLIP_NORM = CheckId("clip", "grad_norm")  # the total gradient norm of a clipping run
# the whole model's output of a forward without autograd, compared beside the training forward's:
# each step's first micro-batch (`Case.no_grad_forward`), and the last step's in eval mode
NO_GRAD_OUTPUT = CheckId("output", pass_="no_grad")
EVAL_OUTPUT = CheckId("output", pass_="eval")
WITHOUT_AUTOGRAD = (NO_GRAD_OUTPUT, EVAL_OUTPUT)
