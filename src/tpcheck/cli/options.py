"""The flags several commands share, each defined once: the run settings, the outputs, the device.

Run settings: one flag per field of `RunSettings` (`RUN_SETTINGS`; `capture` has none: the
command always captures module outputs, which is how a report names the first divergent module).
Every such flag defaults to None, "not given"; what a command uses instead is its own and explicit:
a mapping of `defaults` ({}: RunSettings' own values; CASE_OWN: a case file's own), shown in the
flag's help as "(default: ...)" and applied in one place (`given_settings`, `run_settings`,
`dtypes`).

The limits the CLI refuses before any rank starts are the checker's own: the timeout bounds are the
Launcher's (checker/pool/launch.py), the learning-rate limit RunSettings' (checker/case.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType

from tpcheck.checker.pool.launch import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, MIN_TIMEOUT_S
from tpcheck.checker.settings import DEFAULT_LR, FLOAT64_RUN, MAX_LR, OPTIMIZERS, RunSettings
from tpcheck.errors import UsageError
from tpcheck.report.output import check_output_path

DTYPE_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
}
CASE_OWN = None  # a command's `defaults` for case files: every setting not given is the case's own
NO_DEFAULTS: Mapping[str, object] = MappingProxyType({})  # RunSettings' own values


def dtype_name(text: str) -> str:
    """A --dtype value, aliases (bf16, fp32, half, ...) spelled out."""
    return DTYPE_ALIASES.get(text.lower(), text)


@dataclasses.dataclass(frozen=True)
class SettingFlag:
    """The flag of one RunSettings field: its option string, its help (the command's default is
    appended) and the rest of its argparse arguments."""

    field: str
    flag: str
    help: str
    kwargs: Mapping[str, object]


RUN_SETTINGS = (
    SettingFlag(
        "dtype",
        "--dtype",
        "working dtypes, one case each: float32, bfloat16 (bf16), float16 (fp16), float64 (fp64)",
        {"nargs": "+", "type": dtype_name},
    ),
    SettingFlag("steps", "--steps", "optimizer steps", {"type": int}),
    SettingFlag("optimizer", "--optimizer", "the optimizer", {"choices": OPTIMIZERS}),
    SettingFlag("lr", "--lr", f"learning rate, up to {MAX_LR:g}", {"type": float}),
    SettingFlag(
        "micro_batches",
        "--micro-batches",
        "gradient accumulation: micro-batches per step",
        {"type": int},
    ),
    SettingFlag(
        "master_weights",
        "--no-master-weights",
        "with bfloat16/float16: pure 16-bit "
        "parameters and optimizer state instead of float32 master weights, grads and "
        "optimizer state (as Megatron-Core and torchtitan train)",
        {"action": "store_false"},
    ),
    SettingFlag("seed", "--seed", "seed of the weights and batches", {"type": int}),
    SettingFlag(
        "train",
        "--forward-only",
        "check the forward only: the loaded weights, then every module output, the output and "
        "the loss of each step's batch; no backward, no optimizer (chosen by itself when no TP "
        "parameter requires grad)",
        {"action": "store_false"},
    ),
    SettingFlag(
        "clip_grad_norm",
        "--clip-grad-norm",
        "clip the gradients to this total norm before each step (torch.nn.utils.clip_grad_norm_ "
        "on the dense side, the case's or a TP-aware clipping on the TP side; the norms compared)",
        {"type": float},
    ),
    SettingFlag(
        "warmup",
        "--warmup",
        "forward passes of every side before the first checked step, not compared: for TP code "
        "that changes path after N calls (a fused kernel, graph capture); without them a check "
        "sees steps x micro-batches forwards and one eval-mode forward",
        {"type": int, "metavar": "N"},
    ),
    SettingFlag(
        "float64_run",
        "--float64-run",
        "also run the TP model in float64 against the float64 truth and merge the verdicts (a "
        "structural bug shows at float64's resolution): auto = with bfloat16/float16, on, off",
        {"choices": FLOAT64_RUN},
    ),
)  # in the order `run` and `verify` listed them (and `run --mode` names the flags it ignores)
NOT_FLAGS = {"capture"}  # RunSettings fields the command line does not set (see the docstring)


# ------------------------------------------------------------------------------ run settings


def add_run_settings(
    parser: argparse.ArgumentParser,
    defaults: Mapping[str, object] | None,
    notes: Mapping[str, str] = NO_DEFAULTS,
) -> None:
    """Add one flag per RunSettings field, each defaulting to None (not given). `defaults`: the
    command's values for those not given ({}: RunSettings' own; CASE_OWN: the case file's own);
    `notes`: a word on a field's default, after it in the help (run's "1 for --mode")."""
    for setting in RUN_SETTINGS:
        shown = shown_default(setting.field, defaults)
        if setting.field in notes:
            shown += f"; {notes[setting.field]}"
        parser.add_argument(
            setting.flag,
            dest=setting.field,
            default=None,
            help=f"{setting.help} (default: {shown})",
            **setting.kwargs,
        )


def shown_default(field: str, defaults: Mapping[str, object] | None) -> str:
    """The default of a run-settings flag as its help says it."""
    if defaults is CASE_OWN:
        return "the case's own"
    value = defaults.get(field, _own_default(field))
    if field == "lr" and value is None:
        return ", ".join(f"{lr:g} for {optimizer}" for optimizer, lr in DEFAULT_LR.items())
    if field == "master_weights":
        return "float32 master weights" if value else "pure 16-bit"
    if field == "train":
        return "train, unless no TP parameter requires grad" if value else "forward only"
    if field == "clip_grad_norm" and value is None:
        return "no clipping"
    if field == "float64_run" and value == "auto":
        return "auto: on with bfloat16/float16, off with float32/float64"
    return str(value)


def _own_default(field: str) -> object:
    (own,) = [f.default for f in dataclasses.fields(RunSettings) if f.name == field]
    return own


def given_settings(args: argparse.Namespace, defaults: Mapping[str, object] = NO_DEFAULTS) -> dict:
    """RunSettings keywords, the dtype aside (one case per dtype: `dtypes`): the flags given, else
    the command's `defaults`; a setting in neither is left out (RunSettings' own, or a case file's
    own)."""
    given = {s.field: getattr(args, s.field) for s in RUN_SETTINGS if s.field != "dtype"}
    return {**defaults, **{field: value for field, value in given.items() if value is not None}}


def run_settings(
    args: argparse.Namespace, dtype: str, defaults: Mapping[str, object] = NO_DEFAULTS
) -> RunSettings:
    """The RunSettings of one case in `dtype`, from the flags given and the command's `defaults`."""
    return RunSettings(dtype=dtype, **given_settings(args, defaults))


def dtypes(args: argparse.Namespace, defaults: Mapping[str, object] | None) -> list:
    """The dtypes to check, a case each: --dtype given, else the command's default ([None] for
    CASE_OWN: the case's own)."""
    if args.dtype:
        return args.dtype
    return [None] if defaults is CASE_OWN else [defaults.get("dtype", _own_default("dtype"))]


# ------------------------------------------------------------------------------ outputs, device


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds any collective may wait, {MIN_TIMEOUT_S:g}.."
        f"{MAX_TIMEOUT_S:g} (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--json", dest="json_path", metavar="PATH", help="write the full JSON report here"
    )
    parser.add_argument(
        "--html", dest="html_path", metavar="PATH", help="write the HTML report here"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the ranks compute: cpu (gloo, the default) or cuda (one GPU per rank, NCCL)",
    )


def check_flags(args: argparse.Namespace) -> None:
    """What the commands that run cases check alike before any rank starts: --timeout, --lr, the
    output paths."""
    if args.timeout is not None and not MIN_TIMEOUT_S <= args.timeout <= MAX_TIMEOUT_S:
        raise UsageError(
            f"--timeout {args.timeout:g} must be between {MIN_TIMEOUT_S:g} and "
            f"{MAX_TIMEOUT_S:g} seconds: it is how long any collective may wait, and "
            f"below {MIN_TIMEOUT_S:g} s a correct implementation is reported as a "
            "false hang"
        )
    if args.lr is not None and math.isfinite(args.lr) and args.lr > MAX_LR:
        raise UsageError(
            f"--lr {args.lr:g} is above {MAX_LR:g}: steps that large make the "
            "weights, and the dense reference itself, overflow to Inf/NaN within a "
            "few steps (the seed MLP's does at lr 30 with SGD), leaving nothing to "
            "compare; typical learning rates are 1e-5..1e-1"
        )
    check_output_path("--json", args.json_path)
    check_output_path("--html", args.html_path)
