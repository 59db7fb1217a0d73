"""What a new user meets first: the version, examples in the help, dtype aliases, world sizes before
the case file, a quiet closed pipe, a case file that imports the package next to it and defines
several cases, forward arguments with any names, torch's own placements in a Plan, and a module
without a seeded `reset_parameters`. Each ends in a check or in a message about the user's input,
never in a traceback from tpcheck."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tpcheck import Plan, __version__
from tpcheck.checker.case import seeded_init
from tpcheck.cli import main
from tpcheck.errors import UsageError

CASE = """
import torch
from torch import nn
from torch.distributed.tensor import Replicate
from tpcheck import Case, Plan
{extra}

class Dense(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc = nn.Linear(8, 8, dtype=dtype)
    def forward(self, {arg}):
        return self.fc({arg})

def make_batch(g, dtype):
    x, target = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    return {{"{arg}": x.to(dtype)}}, target.to(dtype)

PLAN = Plan(params={{"fc.weight": Replicate(), "fc.bias": Replicate()}})
first = Case(name="first", build_dense=Dense, build_tp=lambda group, dtype: Dense(dtype), plan=PLAN,
             make_batch=make_batch)
second = Case(name="second", build_dense=Dense, build_tp=lambda group, dtype: Dense(dtype),
              plan=PLAN, make_batch=make_batch)
"""


def _case_file(folder, arg="hidden_states", extra=""):
    path = folder / "my_case.py"
    path.write_text(CASE.format(arg=arg, extra=extra))
    return path


def test_version_and_examples_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tpcheck {__version__}"
    for command in ([], ["run"], ["verify"], ["faults"], ["report"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        out = capsys.readouterr().out
        assert "examples:\n  tpcheck" in out, command
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for flag in ("--optimizer", "--lr", "--seed"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(flag))
        assert len(line.split(None, 2)) > 1, line  # help text after the flag


def test_several_cases_any_argument_names_torch_placements_default_init_aliases_world_sizes(
    tmp_path, capsys
):
    """One file, two cases, `hidden_states` as the forward argument, torch's Replicate in the plan,
    the default init on a module whose reset_parameters takes no generator, bf16, and the world
    sizes typed before the file: both cases run and are equivalent."""
    path = _case_file(tmp_path)
    out = tmp_path / "r.json"
    code = main(
        [
            "verify",
            "--world-size",
            "1",
            "2",
            str(path),
            "--dtype",
            "bf16",
            "fp32",
            "--steps",
            "1",
            "--json",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    names = sorted(c["name"] for c in json.loads(out.read_text())["cases"])
    assert names == sorted(
        f"{n}/tp{w}/{d}"
        for n in ("first", "second")
        for w in (1, 2)
        for d in ("bfloat16", "float32")
    )


def test_case_file_imports_the_package_next_to_it(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("WIDTH = 8\n")
    path = _case_file(tmp_path, extra="import mypkg\nassert mypkg.WIDTH == 8")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tpcheck.cli import main; "
            f"sys.exit(main(['verify', {str(path) + ':first'!r}, '--world-size', "
            "'1', '--steps', '1']))",
        ],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--world-size", "2", "x"], "--world-size x: a world size is a whole number"),
        (["--world-size", "2"], "verify needs a case file"),
    ],
)
def test_world_size_mistakes_are_messages(argv, words, capsys):
    assert main(["verify", *argv]) == 2
    assert words in capsys.readouterr().err


def test_a_closed_pipe_is_a_quiet_exit():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpcheck", "faults", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.read(10)
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == b""


def test_torch_placements_in_a_plan():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from tpcheck.plan import Replicate as OurReplicate
    from tpcheck.plan import Shard as OurShard

    plan = Plan(params={"a": Shard(1), "b": Replicate()})
    assert plan.params == {"a": OurShard(1), "b": OurReplicate()}
    with pytest.raises(UsageError, match=r"Plan params\['w'\] is torch's Partial\(\)"):
        Plan(params={"w": Partial()})
    with pytest.raises(
        UsageError, match=r"Plan activations\['out'\] is 'shard' \(builtins.str\), not a placement"
    ):
        Plan(params={}, activations={"out": "shard"})


def test_seeded_init_fills_a_plain_module_reproducibly():
    def build():
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))

    a, b = build(), build()
    seeded_init(a, torch.Generator().manual_seed(3))
    seeded_init(b, torch.Generator().manual_seed(3))
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    gain, bias = a[1].weight, a[1].bias
    # a gain near 1, not all ones
    assert not torch.equal(gain, torch.ones(6)) and (gain - 1).abs().max() < 1
    assert bias.abs().max() > 0  # a bias that is not zero: a bias added twice shows


def test_grad_inputs_naming_a_missing_input_is_a_message(tmp_path, capsys):
    path = tmp_path / "c.py"
    path.write_text(
        CASE.format(arg="input_ids", extra="")
        + textwrap.dedent("""
        import dataclasses
        first = dataclasses.replace(first, grad_inputs=("x",))
        del second
    """)
    )
    assert main(["verify", str(path), "--world-size", "1", "--steps", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "grad_inputs names ['x'] but make_batch gives the forward inputs ['input_ids']" in err
    assert "Traceback" not in err


def test_piped_summary_lines_are_not_wrapped(tmp_path, capsys):
    """Off a terminal, a case's summary is one line however long (grep-able CI logs)."""
    path = tmp_path / "c.py"
    path.write_text(
        CASE.format(arg="x", extra="")
        + textwrap.dedent("""
        class Twice(Dense):
            def forward(self, x):
                return self.fc(x) + self.fc.bias
        first = dataclasses.replace(first, build_tp=lambda group, dtype: Twice(dtype))
        del second
    """).replace("class Twice", "import dataclasses\nclass Twice")
    )
    out = tmp_path / "r.json"
    assert main(["verify", str(path), "--world-size", "1", "--steps", "1", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    summary = json.loads(out.read_text())["cases"][0]["summary"]
    assert len(summary) > 200  # longer than the table's width
    assert f"first/tp1/float32: {summary}" in err.splitlines()


def test_one_broken_target_is_one_invalid_case_and_the_rest_run(tmp_path, capsys):
    good = _case_file(tmp_path)
    broken = tmp_path / "broken.py"
    broken.write_text("import a_package_that_is_not_there\n")
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "verify",
                str(broken),
                f"{good}:first",
                "--world-size",
                "1",
                "--steps",
                "1",
                "--json",
                str(out),
            ]
        )
        == 2
    )
    cases = {c["name"]: c for c in json.loads(out.read_text())["cases"]}
    assert cases["first/tp1/float32"]["verdict"] == "equivalent"
    (bad,) = [c for n, c in cases.items() if n.startswith(str(broken))]
    assert bad["verdict"] == "invalid" and "importing your case file failed (" in bad["summary"]
    assert "broken.py:1): ModuleNotFoundError" in bad["summary"]
    capsys.readouterr()
    # alone: the message at once, nothing run
    assert main(["verify", str(broken), "--world-size", "1"]) == 2
    assert capsys.readouterr().err.startswith("tpcheck: error: importing your case file failed")


def test_new_writes_a_case_file_that_verifies_and_never_overwrites(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["new", "mine.py"]) == 0
    assert "tpcheck verify mine.py --world-size 2 4" in capsys.readouterr().err
    assert "tpcheck verify mine.py --world-size 2 4" in (tmp_path / "mine.py").read_text()
    assert (
        main(
            [
                "verify",
                "mine.py",
                "--world-size",
                "1",
                "2",
                "--dtype",
                "float32",
                "bf16",
                "--steps",
                "2",
            ]
        )
        == 0
    )
    capsys.readouterr()
    before = (tmp_path / "mine.py").read_text()
    assert main(["new", "mine.py"]) == 2
    assert "mine.py exists; tpcheck new never overwrites a file" in capsys.readouterr().err
    assert (tmp_path / "mine.py").read_text() == before
    assert main(["new", "mine.txt"]) == 2


def test_a_target_dict_reaches_the_loss(tmp_path, capsys):
    """Labels and a mask beside each other: the loss sees the dict (cast to the working dtype)."""
    path = tmp_path / "c.py"
    path.write_text(
        CASE.format(arg="x", extra="")
        + textwrap.dedent("""
        import dataclasses
        def make_batch_dict(g, dtype):
            inputs, target = make_batch(g, dtype)
            return inputs, {"labels": target, "mask": (torch.rand(4, 8, generator=g) > 0.5)}
        def masked(out, target):
            assert isinstance(target, dict) and target["mask"].dtype == torch.bool
            return ((out - target["labels"]) ** 2 * target["mask"]).mean()
        first = dataclasses.replace(first, make_batch=make_batch_dict, loss=masked)
        del second
    """)
    )
    code = main(
        [
            "verify",
            str(path),
            "--world-size",
            "1",
            "2",
            "--dtype",
            "float32",
            "bf16",
            "--steps",
            "2",
        ]
    )
    assert code == 0, capsys.readouterr().err


def test_make_batch_gets_the_case_dtype(tmp_path, capsys):
    """`make_batch(generator, dtype)` is called with the case's working dtype: a batch built for
    that dtype (a mask value from its finfo, say) is the batch every side sees; the float64 truth
    gets the same values, upcast exactly."""
    path = tmp_path / "c.py"
    path.write_text(
        CASE.format(arg="x", extra="")
        + textwrap.dedent("""
        import dataclasses
        SEEN = []
        def make_batch_for(g, dtype):
            if dtype != torch.bfloat16:
                raise ValueError(f"make_batch got {dtype}")
            inputs, target = make_batch(g, dtype)
            assert inputs["x"].dtype == torch.bfloat16
            return inputs, target
        first = dataclasses.replace(first, make_batch=make_batch_for)
        del second
    """)
    )
    code = main(["verify", str(path), "--world-size", "2", "--dtype", "bf16", "--steps", "1"])
    assert code == 0, capsys.readouterr().err
