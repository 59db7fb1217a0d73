"""`tpcheck torchrun TORCHRUN_ARGS -- COMMAND`, its command line. The launcher itself (the split at
`--`, torchrun in this process, the exit code in one line) is tpcheck/torchrun.py. `parse_argv`
hands `tpcheck torchrun ...` over before argparse, which would take torchrun's options for its own:
this parser only prints the help and lists the command."""

from __future__ import annotations

import argparse

from tpcheck import torchrun
from tpcheck.cli.parser import parse

EPILOG = (
    "Everything before `--` is torchrun's (python -m torch.distributed.run --help lists it), "
    "everything\n"
    "after it the tpcheck command each rank runs (run, verify or hf). The exit code is the "
    "verdict's, said in\n"
    "one line per outcome, without torchrun's ChildFailedError traceback and failure summary.\n"
    "\n"
    "examples:\n"
    "  tpcheck torchrun --nproc_per_node 2 -- verify case.py --world-size 2 --json r.json\n"
    "  tpcheck torchrun --nproc_per_node 4 -- run --block layer --world-size 4\n"
    "  tpcheck torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d "
    "--rdzv_endpoint HOST0:29500 \\\n"
    "      --rdzv_id c1 -- verify case.py --world-size 2      # on each host"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.usage = "%(prog)s [-h] [TORCHRUN_ARGS ...] -- {run,verify,hf} [ARGS ...]"
    parser.add_argument(
        "torchrun_argv",
        nargs=argparse.REMAINDER,
        metavar="TORCHRUN_ARGS -- COMMAND",
        help="torchrun's arguments (e.g. --nproc_per_node 2), `--`, then a tpcheck "
        "command (run, verify or hf) and its arguments",
    )


def main(args: argparse.Namespace) -> int:
    """torchrun's launcher in this process; the tpcheck command after `--` is parsed here first, so
    that its flag errors are said once, before any rank starts."""
    return torchrun.main(args.torchrun_argv, parse)
