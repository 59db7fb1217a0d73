"""docs/tutorial.md as a reader follows it. The Python blocks of its steps 1 to 3, pasted one below
the other, are the case file `my_mlp.py` (the draft); step 6's block replaces the draft's
`x_tp = x` line (the fix).

Quick: the file imports, its plan places exactly the dense parameters, at world size 1 (no process
group: both collectives are the identity) the TP module computes the dense one's output from the
same weights, and what step 5 quotes is in the output step 4 shows. Slow: `tpcheck verify`, run as
steps 4 and 6 write it, prints what the tutorial shows (floating-point numbers aside: they are this
machine's rounding) and exits with the code it gives."""

import importlib.util
import re
import shlex
import subprocess
import sys

import pytest
import torch

from paths import REPO

TUTORIAL = REPO / "docs" / "tutorial.md"
DRAFT_LINE = re.compile(r"(\s*)x_tp = x(\s+#.*)?")
FLOAT = re.compile(r"\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+")


def sections() -> dict[str, str]:
    """{step number: its text} for the headings `## N. ...`."""
    out = {}
    for part in TUTORIAL.read_text().split("\n## ")[1:]:
        if number := re.match(r"(\d+)\. ", part):
            out[number.group(1)] = part
    return out


def blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of `text` in `language` ("" for a block with none), in order."""
    found, inside, lines = [], None, []
    for line in text.splitlines():
        if inside is None and line.startswith("```"):
            inside, lines = line[3:].strip(), []
        elif inside is not None and line == "```":
            if inside == language:
                found.append("\n".join(lines) + "\n")
            inside = None
        elif inside is not None:
            lines.append(line)
    return found


def case_file(fixed: bool) -> str:
    steps = sections()
    source = "\n\n".join(b for n in ("1", "2", "3") for b in blocks(steps[n], "python"))
    if not fixed:
        return source
    (fix,) = blocks(steps["6"], "python")
    lines = source.splitlines()
    drafts = [i for i, line in enumerate(lines) if DRAFT_LINE.fullmatch(line)]
    assert len(drafts) == 1, f"the draft's `x_tp = x` line, once: {drafts}"
    indent = DRAFT_LINE.fullmatch(lines[drafts[0]]).group(1)
    lines[drafts[0]] = indent + fix.strip()
    return "\n".join(lines) + "\n"


def shown(step: str) -> tuple[list[str], str]:
    """The command a step runs (its bash block) and the output it shows (its plain block)."""
    text = sections()[step]
    (command,) = blocks(text, "bash")
    (output,) = blocks(text, "")
    return shlex.split(command.strip()), output


def load(path):
    spec = importlib.util.spec_from_file_location(f"tutorial_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fixed", [False, True], ids=["draft", "fixed"])
def test_the_case_file_builds_and_matches_its_dense_twin_at_world_1(tmp_path, fixed):
    from tpcheck import TPGroup
    from tpcheck.checker.case import seeded_init

    path = tmp_path / "my_mlp.py"
    path.write_text(case_file(fixed))
    case = load(path).my_mlp
    dense = case.build_dense(torch.float32)
    assert set(case.plan.params) == {n for n, _ in dense.named_parameters()}
    seeded_init(dense, torch.Generator().manual_seed(0))
    tp = case.build_tp(TPGroup.single(), torch.float32)
    tp.load_state_dict(dense.state_dict())  # at world size 1 every shard is the whole tensor
    inputs, target = case.make_batch(torch.Generator().manual_seed(1), torch.float32)
    torch.testing.assert_close(tp(**inputs), dense(**inputs))


def test_the_fix_changes_the_one_draft_line():
    draft, fixed = case_file(False).splitlines(), case_file(True).splitlines()
    changed = [(a, b) for a, b in zip(draft, fixed) if a != b]
    assert len(draft) == len(fixed) and len(changed) == 1, changed
    assert "copy_to_tp(x, self.pg)" in changed[0][1]


def test_what_step_5_quotes_is_in_the_output_step_4_shows():
    _, output = shown("4")
    quoted = re.findall(r"^- `([^`]+)`", sections()["5"], re.M)
    assert len(quoted) >= 4, quoted
    missing = [q for q in quoted if q not in output]
    assert not missing, f"step 5 quotes what step 4's output does not show: {missing}"


def _masked(text: str) -> list[str]:
    return [FLOAT.sub("<x>", line.rstrip()) for line in text.strip().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("step, fixed, code", [("4", False, 1), ("6", True, 0)])
def test_verify_prints_what_the_tutorial_shows(tmp_path, step, fixed, code):
    command, output = shown(step)
    assert command[:2] == ["tpcheck", "verify"], command
    (tmp_path / "my_mlp.py").write_text(case_file(fixed))
    proc = subprocess.run(
        [sys.executable, "-m", "tpcheck", *command[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == code, proc.stdout
    assert _masked(proc.stdout) == _masked(output), proc.stdout
