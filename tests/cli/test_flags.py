"""Every flag applies or is refused: `run --mode` with options it ignores,
`--mode inspect --world-size`, the timeout's limits (the same for run and verify), an absurd --lr.
Refusals are exit 2 with one line naming the flag, before any rank starts."""

import json

import pytest

from tpcheck.cli import main
from tpcheck.cli.options import MAX_LR

from paths import REPO

CASE_FILE = str(REPO / "examples" / "own_module.py") + ":correct"
COMMANDS = {
    "run": ["run", "--world-size", "1"],
    "verify": ["verify", CASE_FILE, "--world-size", "1"],
}


class LauncherReached(Exception):
    """Raised by the stand-in launcher: every check before the run passed."""


@pytest.fixture
def launcher(monkeypatch):
    """Stands in for the rank pool: records the timeout it is given, then stops the run."""
    seen = []

    def fake(timeout_s, *args, **kwargs):
        seen.append(timeout_s)
        raise LauncherReached

    monkeypatch.setattr("tpcheck.resolve.launcher", fake)
    return seen


def _error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpcheck: error: "), err
    assert "Traceback" not in err and out == ""
    return lines[0]


# ---------------------------------------------------------------- --mode and the options it ignores


@pytest.mark.parametrize(
    "argv, named",
    [
        (
            ["--mode", "equivalence", "--block", "lm", "--dtype", "bfloat16", "--sp"],
            "--block, --dtype, --sp",
        ),
        (["--mode", "all", "--fault", "missing_forward_reduce"], "--fault"),
        (["--mode", "missing_backward_reduce", "--micro-batches", "1"], "--micro-batches"),
        (
            ["--mode", "equivalence", "--block", "mlp"],
            "--block",
        ),  # given, even with the value the mode uses
        (
            ["--mode", "equivalence", "--dt", "float64"],
            "--dtype",
        ),  # an abbreviation argparse accepts
        (["--mode", "inspect", "--preset", "tiny", "--steps", "2"], "--preset, --steps"),
        (
            ["--mode", "inspect", "--optimizer", "sgd", "--lr", "0.1", "--seed", "3"],
            "--optimizer, --lr, --seed",
        ),
        (["--mode", "inspect", "--timeout", "30"], "--timeout"),
    ],
)
def test_mode_refuses_the_options_it_would_ignore(argv, named, capsys, launcher):
    assert main(["run", *argv, "-q"]) == 2
    line = _error_line(capsys)
    assert f"--mode {argv[1]} ignores {named}: " in line, line
    assert launcher == []


@pytest.mark.parametrize(
    "argv",
    [
        [
            "--mode",
            "equivalence",
            "--world-size",
            "1",
            "--preset",
            "seed",
            "--steps",
            "1",
            "--optimizer",
            "sgd",
            "--lr",
            "0.05",
            "--seed",
            "31",
            "--timeout",
            "20",
        ],
        ["--mode", "all", "--world-size", "2", "--preset", "tiny", "--steps", "2"],
    ],
)
def test_mode_accepts_the_options_it_applies(argv, launcher, tmp_path):
    with pytest.raises(LauncherReached):
        main(
            [
                "run",
                *argv,
                "--json",
                str(tmp_path / "r.json"),
                "--html",
                str(tmp_path / "r.html"),
                "-q",
            ]
        )
    assert launcher == [20.0]


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_inspect_honours_the_world_size(world_size, capsys):
    assert main(["run", "--mode", "inspect", "--world-size", str(world_size)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["world_size"] == world_size
    ffn = shown["dense_shapes"]["w_down"][1]  # the seed MLP's FFN width, 12
    assert shown["rank_local_shapes"]["down_weight"][1] == ffn // world_size
    assert shown["rank_local_shapes"]["gate_up_weight"][1] == ffn // world_size
    # the built-in blocks, shown for the same ranks (or why not)
    for block in shown["blocks"].values():
        if "skipped" in block:
            assert f"world size {world_size} " in block["skipped"]
        else:
            assert all(len(p["rank_local"]) == world_size for p in block["params"].values())


@pytest.mark.parametrize(
    "world_size, words",
    [
        (0, "world size 0 is outside"),
        (5, "world size 5 does not divide the FFN width 12"),
        (1000, "world size 1000 is outside"),
        (-2, "world size -2"),
    ],
)
@pytest.mark.parametrize("mode", ["inspect", "all"])
def test_inspect_refuses_world_sizes_a_run_would_refuse(mode, world_size, words, capsys, launcher):
    assert main(["run", "--mode", mode, "--world-size", str(world_size)]) == 2
    assert words in _error_line(capsys)
    assert launcher == []


# ------------------------------------------------------------------------------ --timeout


@pytest.mark.parametrize("value", ["0", "1e-9", "0.001", "0.999", "-1", "nan", "inf", "3601"])
@pytest.mark.parametrize("command", COMMANDS)
def test_timeout_outside_1_to_3600_seconds_is_refused_by_run_and_verify(
    command, value, capsys, launcher
):
    assert main([*COMMANDS[command], "--timeout", value, "-q"]) == 2
    line = _error_line(capsys)
    assert (
        f"--timeout {float(value):g} must be between 1 and 3600 seconds" in line
        and "false hang" in line
    )
    assert launcher == []


@pytest.mark.parametrize("value, used", [(None, 20.0), ("1", 1.0), ("3600", 3600.0), ("7.5", 7.5)])
@pytest.mark.parametrize("command", COMMANDS)
def test_timeout_given_is_the_timeout_used(command, value, used, launcher):
    flag = [] if value is None else ["--timeout", value]
    with pytest.raises(LauncherReached):
        main([*COMMANDS[command], *flag, "-q"])
    assert launcher == [used]


# ------------------------------------------------------------------------------ --lr


@pytest.mark.parametrize("value", ["1e300", "1e30", "1e6", "10.5"])
@pytest.mark.parametrize("command", [*COMMANDS, "mode"])
def test_absurd_learning_rate_is_refused_with_the_reason(command, value, capsys, launcher):
    argv = ["run", "--mode", "equivalence"] if command == "mode" else COMMANDS[command]
    assert main([*argv, "--lr", value, "-q"]) == 2
    line = _error_line(capsys)
    assert f"--lr {float(value):g} is above {MAX_LR:g}" in line and "Inf/NaN" in line
    assert launcher == []


@pytest.mark.parametrize("command", COMMANDS)
def test_learning_rate_up_to_the_limit_is_accepted(command, launcher):
    with pytest.raises(LauncherReached):
        main([*COMMANDS[command], "--lr", f"{MAX_LR:g}", "-q"])


def test_the_cli_and_run_settings_share_the_lr_limit():
    """Case files and the Python API get the limit from RunSettings; the CLI says it, with its own
    message, before any rank starts (tpcheck.cli.options takes RunSettings' MAX_LR)."""
    from tpcheck.checker.settings import MAX_LR as SETTINGS_MAX_LR
    from tpcheck.checker.settings import RunSettings
    from tpcheck.errors import UsageError

    assert SETTINGS_MAX_LR == MAX_LR
    RunSettings(lr=MAX_LR)
    with pytest.raises(UsageError, match="overflow"):
        RunSettings(lr=MAX_LR * 1.01)


@pytest.mark.parametrize(
    "block, words",
    [
        ("attention", "world size 3 does not divide the number of heads 4"),
        ("mlp", "world size 3 does not divide the FFN width 64"),
        ("embedding", "world size 3 does not divide the vocabulary 64"),
        ("layer", "world size 3 does not divide the FFN width 64"),
    ],
)
def test_a_world_size_is_refused_for_what_the_block_splits(block, words, capsys, launcher):
    """Each block is held to the dimensions its TP twin splits: the attention block (no FFN) names
    its heads, never an FFN width it does not have."""
    assert main(["run", "--block", block, "--preset", "tiny", "--world-size", "3"]) == 2
    line = _error_line(capsys)
    assert words in line
    assert block != "attention" or "FFN" not in line
    assert launcher == []
