"""`tpcheck new`: the shipped case-file template written to a new file, to start from (it verifies
as written)."""

from __future__ import annotations

import argparse
import sys
from importlib import resources

from tpcheck.errors import UsageError

EPILOG = """examples:
  tpcheck new my_case.py && tpcheck verify my_case.py --world-size 2 4"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument(
        "path", metavar="CASE.py", help="where to write it (never over an existing file)"
    )


def main(args: argparse.Namespace) -> int:
    """Write the shipped case-file template to a new file."""
    path = args.path
    if not path.endswith(".py"):
        raise UsageError(f"{path!r}: a case file is a Python file; give a name ending in .py")
    template = resources.files("tpcheck").joinpath("templates/case.py").read_text()
    try:
        with open(path, "x") as f:
            f.write(template.replace("THIS_FILE", path))
    except FileExistsError:
        raise UsageError(
            f"{path} exists; tpcheck new never overwrites a file: give a new name"
        ) from None
    except OSError as e:
        raise UsageError(f"cannot write {path!r}: {e.strerror or e}") from None
    print(f"wrote {path}; check it with: tpcheck verify {path} --world-size 2 4", file=sys.stderr)
    return 0
