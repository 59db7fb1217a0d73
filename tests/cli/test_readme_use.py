"""The README's "Use" section runs as written, right after its two commands (`make demo`, `make
test`): every line of the fenced bash block under "## Use", run from the repository root with the
venv's bin folder on PATH, exits with the code its comment gives ("exits 1"; no word: 0).

As written, but for three things the test must own: `reports/` (which `make demo` makes) is a
temporary folder here, so the reports the lines write never land in the clone; torchrun's port is a
free one (PET_MASTER_PORT, torchrun's own variable for --master-port), so a torchrun line cannot
collide with another test's; and a line that needs what this machine may lack is skipped with its
reason (SKIP). The lines run two at a time, a line after those whose reports it reads and a torchrun
line after the one before it (about 3 minutes on two busy cores; marked slow)."""

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from paths import REPO

README = REPO / "README.md"
BIN = Path(sys.executable).parent  # the venv's bin folder: tpcheck and torchrun are there
SKIP = {  # a part of a line: why the line cannot run here
    "--device cuda": "needs a GPU for each rank (NCCL); tests/gpu runs it on a GPU machine",
    "--nnodes": "needs a second host (tests/cli/test_multinode.py runs it on 127.0.0.1)",
}
WORKERS = 2
LINE_TIMEOUT_S = 600


def use_lines() -> list[tuple[str, int]]:
    """(command, the exit code its comment gives) for each line of the Use section's bash block."""
    section = README.read_text().split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md: no ```bash block under ## Use"
    lines = []
    for raw in block.group(1).splitlines():
        command, _, comment = raw.partition(" #")
        if not command.strip():
            continue
        said = re.search(r"\bexits (\d+)\b", comment)
        lines.append((command.strip(), int(said.group(1)) if said else 0))
    return lines


def skip_reason(command: str) -> str | None:
    return next((why for part, why in SKIP.items() if part in command), None)


def _written(words: list[str]) -> list[str]:
    return [value for flag, value in zip(words, words[1:]) if flag in ("--json", "--html")]


def dependencies(commands: list[str]) -> list[set[int]]:
    """Per line, the earlier lines it must wait for: those that write a report it names, and for a
    torchrun line the torchrun line before it (one rendezvous port at a time)."""
    writer: dict[str, int] = {}
    last_torchrun = None
    needs = []
    for i, command in enumerate(commands):
        words = shlex.split(command)
        after = {writer[w] for w in words if w in writer}
        if "torchrun" in words:
            if last_torchrun is not None:
                after.add(last_torchrun)
            last_torchrun = i
        for path in _written(words):
            writer[path] = i
        needs.append(after)
    return needs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_use_block_is_what_the_test_runs():
    """Quick (in `make test`): the block parses, says which lines exit 1, writes its reports under
    reports/ only (made by `make demo`; here a temporary folder), and every line it cannot run here
    has a reason."""
    lines = use_lines()
    commands = [c for c, _ in lines]
    assert commands[0] == ". .venv/bin/activate", "the Use block starts by putting tpcheck on PATH"
    assert all(c.split()[0] in (".", "tpcheck", "torchrun") for c in commands), commands
    assert {c for c, code in lines if code} == {
        "tpcheck verify examples/own_module.py:buggy --json reports/buggy.json",
        "tpcheck report reports/buggy.json --html reports/buggy.html",
    }
    for command in commands:
        assert all(p.startswith("reports/") for p in _written(shlex.split(command))), command
    assert [c for c in commands if skip_reason(c)] == [
        "tpcheck run --block layer --preset tiny --world-size 2 --device cuda"
    ]
    buggy = commands.index("tpcheck verify examples/own_module.py:buggy --json reports/buggy.json")
    report = commands.index("tpcheck report reports/buggy.json --html reports/buggy.html")
    assert dependencies(commands)[report] == {buggy}  # it reads what that line wrote


@pytest.fixture(scope="module")
def use_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """Every line that can run here, run once: {line: (its process, its seconds)}."""
    if not (BIN / "tpcheck").exists():
        pytest.skip(f"no tpcheck next to {sys.executable}: install tpcheck in this venv")
    reports = tmp_path_factory.mktemp("reports")
    commands = [c for c, _ in use_lines()]
    needs = dependencies(commands)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    futures = {}

    def run(i: int) -> tuple[subprocess.CompletedProcess, float]:
        for j in needs[i]:
            futures[j].exception()  # waits; its own test says how it went
        line = commands[i].replace("reports/", f"{reports}/")
        start = time.monotonic()
        proc = subprocess.run(
            ["bash", "-c", line],
            capture_output=True,
            text=True,
            timeout=LINE_TIMEOUT_S,
            cwd=REPO,
            env={**env, "PET_MASTER_PORT": str(_free_port())},
        )
        return proc, time.monotonic() - start

    with ThreadPoolExecutor(WORKERS) as pool:
        for i, command in enumerate(commands):
            if not skip_reason(command):
                futures[i] = pool.submit(run, i)
    return {commands[i]: f.result() for i, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("command, code", use_lines(), ids=[c for c, _ in use_lines()])
def test_a_use_line_exits_with_its_documented_code(use_runs, command, code):
    if reason := skip_reason(command):
        pytest.skip(f"{command!r} {reason}")
    if command == ". .venv/bin/activate" and not (REPO / ".venv" / "bin" / "activate").exists():
        pytest.skip(f"no .venv in {REPO}: the test puts {BIN} on PATH itself")
    proc, seconds = use_runs[command]
    shown = (
        f"{command} ({seconds:.0f} s)\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-4000:]}"
    )
    assert proc.returncode == code, shown
    assert "Traceback" not in proc.stderr, shown
