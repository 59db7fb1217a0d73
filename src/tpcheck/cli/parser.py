"""tpcheck's argument parser: every command listed, a command's flags added only once it is chosen.

`tpcheck --help` lists the commands from `COMMANDS` without importing any of them; `tpcheck run ...`
imports `tpcheck.cli.run` alone and lets it add its flags. A command module may thus import at its
top what it runs on (the checker, torch): only the chosen one is ever imported (`command_module`).
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

from tpcheck._version import __version__
from tpcheck.torchrun import asks_for_help

# name: (module, its line in `tpcheck --help`), in the order listed
COMMANDS = {
    "run": (
        "tpcheck.cli.run",
        "check built-in blocks (a matrix of blocks x world sizes x dtypes x faults)",
    ),
    "verify": ("tpcheck.cli.verify", "check your own TP code: a case file (docs/case-files.md)"),
    "hf": (
        "tpcheck.cli.hf",
        "check HuggingFace transformers' own TP plans, architecture by "
        "architecture (pip install 'tpcheck[transformers]')",
    ),
    "new": (
        "tpcheck.cli.new",
        "write a commented case file to start from (it verifies as written)",
    ),
    "faults": ("tpcheck.cli.faults", "list the fault catalogue"),
    "report": (
        "tpcheck.cli.report",
        "print the summary of a JSON report, render it as HTML; exits with its verdict (a CI gate)",
    ),
    "torchrun": (
        "tpcheck.cli.torchrun",
        "run a tpcheck command under torchrun's launcher, its "
        "exit code said in one line (no ChildFailedError "
        "traceback)",
    ),
}
DESCRIPTION = (
    "Prove a tensor-parallel implementation computes what its dense model computes; say "
    "where and why when not."
)
EPILOG = """examples:
  tpcheck run --world-size 2 4                       # the built-in MLP block, float32, 3 AdamW \
steps
  tpcheck verify my_case.py --world-size 2 4         # your own TP code (docs/case-files.md)
  tpcheck run --block layer --dtype bf16 --fault all # every catalogue fault that applies, in \
bfloat16
  tpcheck hf llama mistral --world-size 2 4          # HuggingFace transformers' own TP plans
  tpcheck faults                                     # the fault catalogue
  tpcheck torchrun --nproc_per_node 2 -- verify my_case.py --world-size 2   # under torchrun, \
a clean exit"""
RAW = argparse.RawDescriptionHelpFormatter


def command_module(name: str) -> ModuleType:
    """The module of command `name`, imported now: the one place a command is imported."""
    return importlib.import_module(COMMANDS[name][0])


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """tpcheck's parser with every command listed and `command`'s flags (none for None)."""
    parser = argparse.ArgumentParser(
        prog="tpcheck", description=DESCRIPTION, epilog=EPILOG, formatter_class=RAW
    )
    parser.add_argument("--version", action="version", version=f"tpcheck {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, line) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=line, formatter_class=RAW)
        if name == command:
            module = command_module(name)
            module.add_arguments(command_parser)
            command_parser.set_defaults(func=module.main)
    return parser


def chosen_command(argv: list[str]) -> str | None:
    """The command argparse will take from `argv`: its first word that is not an option (tpcheck's
    own options, --help and --version, take no value); None when that is no command (argparse then
    says so)."""
    word = next((a for a in argv if a == "-" or not a.startswith("-")), None)
    return word if word in COMMANDS else None


def parse(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by tpcheck's parser, with the flags of the command it names."""
    return build_parser(chosen_command(argv)).parse_args(argv)


def parse_argv(argv: list[str]) -> argparse.Namespace:
    """argv as argparse reads it, but for `tpcheck torchrun ARGS`: its ARGS are torchrun's and a
    tpcheck command's, which argparse would take for tpcheck's options (help excepted)."""
    if argv[:1] == ["torchrun"]:
        if not asks_for_help(argv[1:]):
            main = command_module("torchrun").main
            return argparse.Namespace(command="torchrun", torchrun_argv=argv[1:], func=main)
        argv = ["torchrun", "--help"]
    return parse(argv)
