"""The flags several commands share are defined once (tpcheck.cli.options): the run settings (one
flag per RunSettings field) and the outputs are the same flags in `run`, `verify` and `hf`, each
command's default is its own and said in its help, and the timeout the CLI accepts is exactly the
one the Launcher accepts."""

import argparse
import dataclasses
import importlib
import re

import pytest

from tpcheck.checker.settings import RunSettings
from tpcheck.cli import main, options
from tpcheck.cli.parser import build_parser
from tpcheck.errors import UsageError

from paths import REPO

SETTINGS_COMMANDS = ("run", "verify", "hf")
CASE_FILE = str(REPO / "examples" / "own_module.py") + ":correct"
DEFAULT = re.compile(r"^(.*) \(default: (.*)\)$", re.DOTALL)


def command_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser(name)
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def options_of(name: str) -> dict[str, argparse.Action]:
    """{longest option string: action} of command `name`."""
    return {
        max(a.option_strings, key=len): a
        for a in command_parser(name)._actions
        if a.option_strings and a.dest != "help"
    }


def parsed(*argv: str) -> argparse.Namespace:
    return build_parser(argv[0]).parse_args(list(argv))


def _definition(action: argparse.Action) -> tuple:
    """What makes two argparse options the same flag, the help aside."""
    return (
        type(action),
        tuple(action.option_strings),
        action.dest,
        action.nargs,
        action.const,
        action.default,
        action.type,
        tuple(action.choices or ()),
        action.metavar,
    )


# ------------------------------------------------------------------------------ run settings


def test_every_run_settings_field_has_one_flag_but_capture():
    fields = {f.name for f in dataclasses.fields(RunSettings)}
    assert {s.field for s in options.RUN_SETTINGS} == fields - options.NOT_FLAGS
    assert options.NOT_FLAGS <= fields  # a field that went away is not silently "not a flag"


@pytest.mark.parametrize("command", SETTINGS_COMMANDS)
def test_each_command_exposes_exactly_the_run_settings_flags(command):
    flags = {s.flag: s for s in options.RUN_SETTINGS}
    given = {flag: action for flag, action in options_of(command).items() if flag in flags}
    assert set(given) == set(flags)
    assert {action.dest for action in given.values()} == {s.field for s in options.RUN_SETTINGS}
    fields = {f.name for f in dataclasses.fields(RunSettings)}
    others = {a.dest for flag, a in options_of(command).items() if flag not in flags}
    assert not others & fields, f"{command} sets a RunSettings field outside options.py"


@pytest.mark.parametrize("setting", options.RUN_SETTINGS, ids=lambda s: s.flag)
def test_a_run_settings_flag_is_one_definition_in_every_command(setting):
    actions = {c: options_of(c)[setting.flag] for c in SETTINGS_COMMANDS}
    assert len({_definition(a) for a in actions.values()}) == 1, actions
    assert actions["run"].default is None  # not given: the command's default applies (options.py)
    for command, action in actions.items():
        text, _ = DEFAULT.match(action.help).groups()
        assert text == setting.help, command  # the same words in every command, the default aside


RUN_DEFAULTS = {
    "dtype": "float32",
    "steps": "3; 1 for --mode",
    "optimizer": "adamw; sgd for --mode",
    "lr": "0.05 for sgd, 0.001 for adamw",
    "micro_batches": "2",
    "seed": "31",
    "master_weights": "float32 master weights",
    "train": "train, unless no TP parameter requires grad",
    "clip_grad_norm": "no clipping",
    "warmup": "0",
    "float64_run": "auto: on with bfloat16/float16, off with float32/float64",
}
SHOWN = {
    "run": RUN_DEFAULTS,
    "hf": {**RUN_DEFAULTS, "steps": "2", "optimizer": "adamw"},
    "verify": dict.fromkeys(RUN_DEFAULTS, "the case's own"),
}


@pytest.mark.parametrize("command", SETTINGS_COMMANDS)
def test_each_command_says_its_own_defaults(command):
    for setting in options.RUN_SETTINGS:
        _, shown = DEFAULT.match(options_of(command)[setting.flag].help).groups()
        assert shown == SHOWN[command][setting.field], (command, setting.flag)


def test_run_defaults_are_float32_three_adamw_steps_of_two_micro_batches_seed_31():
    from tpcheck.cli import run

    (spec,) = run.matrix_specs(parsed("run"), [2])
    assert spec.run == RunSettings(
        dtype="float32",
        steps=3,
        optimizer="adamw",
        lr=None,
        micro_batches=2,
        seed=31,
        master_weights=True,
    )


def test_run_mode_defaults_are_the_seeds_one_sgd_step():
    from tpcheck.seed_compat import mode_specs

    args = parsed("run", "--mode", "equivalence")
    (spec,) = mode_specs(args.mode, 2, preset=args.preset, **options.given_settings(args))
    run = spec.run
    assert (run.steps, run.optimizer, run.micro_batches, run.seed) == (1, "sgd", 1, 31)


def test_hf_defaults_are_two_steps_and_otherwise_run_settings_own():
    from tpcheck import hf as sweep
    from tpcheck.cli import hf

    assert hf.DEFAULTS["steps"] == sweep.SWEEP_STEPS  # tpcheck.hf's own, which --help skips
    args = parsed("hf", "llama")
    assert options.given_settings(args, hf.DEFAULTS) == {"steps": 2}
    assert options.dtypes(args, hf.DEFAULTS) == ["float32"]
    assert RunSettings(**options.given_settings(args, hf.DEFAULTS)) == RunSettings(steps=2)


def test_verify_defaults_are_the_case_files_own():
    from tpcheck.cli import verify

    args = parsed("verify", CASE_FILE)
    assert options.given_settings(args) == {}
    assert options.dtypes(args, verify.DEFAULTS) == [None]


@pytest.mark.parametrize(
    "command, words", [("run", []), ("verify", [CASE_FILE]), ("hf", ["llama"])]
)
def test_flags_given_are_the_settings_used(command, words):
    args = parsed(
        command,
        *words,
        "--dtype",
        "bf16",
        "fp64",
        "--steps",
        "4",
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        "--micro-batches",
        "3",
        "--seed",
        "7",
        "--no-master-weights",
        "--forward-only",
        "--warmup",
        "6",
    )
    defaults = importlib.import_module(f"tpcheck.cli.{command}").DEFAULTS
    assert options.dtypes(args, defaults) == ["bfloat16", "float64"]
    given = {
        "steps": 4,
        "optimizer": "sgd",
        "lr": 0.5,
        "micro_batches": 3,
        "seed": 7,
        "master_weights": False,
        "train": False,
        "warmup": 6,
    }
    assert options.given_settings(args, defaults or {}) == given
    assert options.run_settings(args, "bfloat16", defaults or {}) == RunSettings(
        dtype="bfloat16", **given
    )


# ------------------------------------------------------------------------------ outputs and device


@pytest.mark.parametrize(
    "flag, commands",
    [
        ("--timeout", SETTINGS_COMMANDS),
        ("--json", SETTINGS_COMMANDS),
        ("--html", SETTINGS_COMMANDS),
        ("--quiet", SETTINGS_COMMANDS),
        ("--device", ("run", "verify")),
    ],
)
def test_output_and_device_flags_are_one_definition(flag, commands):
    actions = [options_of(c)[flag] for c in commands]
    assert len({(*_definition(a), a.help) for a in actions}) == 1


def test_timeout_help_says_the_launchers_bounds_and_default():
    from tpcheck.checker.pool.launch import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, MIN_TIMEOUT_S

    text = options_of("run")["--timeout"].help
    assert f"{MIN_TIMEOUT_S:g}..{MAX_TIMEOUT_S:g} (default {DEFAULT_TIMEOUT_S:g})" in text


# ------------------------------------------------------------------------------ the timeout bounds


class LauncherReached(Exception):
    """Raised by the stand-in launcher: the CLI accepted the timeout."""


def _launcher_refusal(timeout_s: float) -> str | None:
    """The Launcher's message for `timeout_s`, or None when it accepts it (closed at once)."""
    from tpcheck.checker.pool.launch import Launcher
    from tpcheck.resolve import RESOLVER

    try:
        Launcher(RESOLVER, timeout_s).close()
    except UsageError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "value", ["0.5", "0.999", "1", "20", "3600", "3600.5", "3601", "0", "-1", "nan", "inf"]
)
@pytest.mark.parametrize(
    "command",
    [["run", "--world-size", "1"], ["verify", CASE_FILE, "--world-size", "1"]],
    ids=["run", "verify"],
)
def test_the_cli_refuses_exactly_the_timeouts_the_launcher_refuses(
    command, value, monkeypatch, tmp_path, capsys
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the Launcher makes no temp dir
    refusal = _launcher_refusal(float(value))

    def stand_in(timeout_s, *args, **kwargs):
        raise LauncherReached

    monkeypatch.setattr("tpcheck.resolve.launcher", stand_in)
    try:
        code = main([*command, "--timeout", value, "-q"])
    except LauncherReached:
        code = None
    err = capsys.readouterr().err
    assert (code == 2) == (refusal is not None), (value, refusal, err)
    if refusal is not None:  # both name the value given
        assert f"timeout {float(value)!r} must be between" in refusal
        assert f"--timeout {float(value):g} must be between" in err
