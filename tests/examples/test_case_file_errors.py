"""Mistakes in a user's case file: exit 2, a message naming the user's file and line, no traceback
from tpcheck's internals, no hang. All the rank-side ones run in one launch."""

import json

import pytest

from tpcheck.cli import main

HEAD = """
import dataclasses, sys
sys.path.insert(0, {examples!r})
import own_module
from own_module import TPBlock, PLAN
from tpcheck import Plan, Shard
"""
CASES = {
    "missing_param": (
        "case = dataclasses.replace(own_module.correct, plan=Plan(params={k: v for k, v in "
        "PLAN.params.items() if k != 'fc2.bias'}))"
    ),
    "wrong_shard": (
        "case = dataclasses.replace(own_module.correct, plan=Plan(params={**PLAN.params, "
        "'fc1.weight': Shard(1)}))"
    ),
    "rand_like_mask": """
import torch
class Dense(own_module.DenseBlock):
    def forward(self, x):
        out = super().forward(x)
        return out * (torch.rand_like(out) > 0.1)
class TP(TPBlock):
    def forward(self, x):
        out = super().forward(x)
        return out * (torch.rand_like(out) > 0.1)
case = dataclasses.replace(own_module.correct, build_dense=Dense, build_tp=TP)""",
    "one_rank_raises": """
def build_tp(group, dtype):
    if group.rank == 1:
        raise ValueError("rank one is unhappy")
    return TPBlock(group, dtype)
case = dataclasses.replace(own_module.correct, build_tp=build_tp)""",
}


def _write(tmp_path, name, body):
    from paths import REPO

    path = tmp_path / f"{name}.py"
    path.write_text(HEAD.format(examples=str(REPO / "examples")) + body + "\n")
    return path


def test_import_time_errors_name_file_and_line(tmp_path, capsys):
    syntax = tmp_path / "syntax.py"
    syntax.write_text("import torch\ndef case(spec:\n    pass\n")
    boom = tmp_path / "boom.py"
    boom.write_text("import torch\n\nraise RuntimeError('no config here')\n")
    assert main(["verify", str(syntax)]) == 2
    assert "syntax.py:2" in capsys.readouterr().err
    assert main(["verify", str(boom)]) == 2
    err = capsys.readouterr().err
    assert "boom.py:3" in err and "RuntimeError: no config here" in err and "Traceback" not in err
    # import first; listing names needs an importable file
    assert main(["verify", f"{boom}:nope"]) == 2
    several = _write(tmp_path, "several", "a = own_module.correct\nb = own_module.buggy")
    assert main(["verify", f"{several}:c"]) == 2
    assert (
        "available: 'a' (Case name 'own_mlp'), 'b' (Case name 'own_mlp_bias_before_reduce')"
        in capsys.readouterr().err
    )


def test_a_case_is_picked_by_its_variable_or_by_its_case_name(tmp_path, capsys):
    """`file.py:NAME` takes the variable or the Case's own `name` (what every report calls it);
    a name two Cases share is refused, naming their variables."""
    several = _write(tmp_path, "named", "a = own_module.correct\nb = own_module.buggy")
    report = tmp_path / "r.json"
    assert main(["verify", f"{several}:own_mlp", "--steps", "1", "--json", str(report)]) == 0
    (case,) = json.loads(report.read_text())["cases"]
    assert case["name"].startswith("own_mlp/tp2") and case["verdict"] == "equivalent"
    assert main(["verify", f"{several}:own_mlp_bias_before_reduce", "--steps", "1", "-q"]) == 1
    twice = _write(tmp_path, "twice", "a = own_module.correct\nb = own_module.correct")
    assert main(["verify", f"{twice}:own_mlp"]) == 2
    assert "several cases named 'own_mlp' (variables ['a', 'b'])" in capsys.readouterr().err


def test_rank_side_errors_exit_2_with_user_line(tmp_path, capsys):
    paths = {n: _write(tmp_path, n, body) for n, body in CASES.items()}
    code = main(["verify", *map(str, paths.values()), "--world-size", "2", "--timeout", "60"])
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert code == 2
    assert "plan has no placement for dense parameter(s) ['fc2.bias']" in err
    assert "'fc1.weight'" in err and "shape" in err
    lineno = HEAD.count("\n") + 4  # the `raise` line in one_rank_raises.py
    assert (
        "in your build_tp (" in err
        and f"one_rank_raises.py:{lineno}): ValueError: rank one is unhappy" in err
    )
    # a mask tpcheck cannot replay (F.dropout and torch.bernoulli
    # masks are replayed: tests/checker/test_dropout.py)
    assert "other than through the calls tpcheck replays" in err and "torch.rand/rand_like" in err
    assert "draw the mask with torch.bernoulli or F.dropout" in err
    # the model's randomness, not the checker, is named
    assert "checker self-test failed" not in err
    assert "Traceback" not in err
    # a rank-only failure is reported as the user's
    # error, not waited out as a hang of the other ranks
    assert "hang" not in err and "timeout" not in err


def test_correct_file_still_passes_with_overrides(tmp_path, capsys):
    from paths import REPO

    code = main(
        [
            "verify",
            str(REPO / "examples" / "own_module.py:correct"),
            "--world-size",
            "2",
            "--steps",
            "1",
            "--dtype",
            "float64",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    import json

    case = json.loads((tmp_path / "r.json").read_text())["cases"][0]
    assert case["name"] == "own_mlp/tp2/float64" and case["spec"]["steps"] == 1
    assert max(c["step"] for c in case["checks"]) == 1


EXITS = {  # name: (body, what the message must say)
    "sys_exit_at_import": ("\nsys.exit(0)\ncase = own_module.correct", "called sys.exit(0)"),
    "os_exit_at_import": (
        "\nimport os; os._exit(0)\ncase = own_module.correct",
        "ended the process (exit code 0)",
    ),
    "sys_exit_in_case": ("\ndef case(spec):\n    sys.exit(7)", "called sys.exit(7)"),
    "os_exit_in_case": (
        "\ndef case(spec):\n    import os; os._exit(7)",
        "ended the process (exit code 7)",
    ),
    "sys_exit_in_build_tp": (
        "\ndef build_tp(group, dtype):\n    sys.exit(0)\n"
        "case = dataclasses.replace(own_module.correct, build_tp=build_tp)",
        "called sys.exit(0)",
    ),
}


@pytest.mark.parametrize("name", EXITS)
def test_user_code_that_exits_is_invalid_not_a_success(name, tmp_path, capsys):
    """sys.exit / os._exit in a case file, at import, in case(spec) or in a callable on the ranks:
    exit 2 with a message naming it (never the user's exit code, never 0 with no report)."""
    body, words = EXITS[name]
    path = _write(tmp_path, name, body)
    code = main(["verify", str(path), "--world-size", "2", "--json", str(tmp_path / "r.json")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert words in err and "must not" in err and "Traceback" not in err
    # an exception carries the user's line; os._exit leaves no frame behind
    if "os_exit" not in name:
        line = (
            HEAD.count("\n")
            + 1
            + next(i for i, text in enumerate(body.split("\n")) if "exit(" in text)
        )
        assert f"{name}.py:{line})" in err, err


RETURNS = {  # name: (the case's changed field, the message)
    "build_tp_none": (
        "build_tp=lambda group, dtype: None",
        "your build_tp ({file}:{line}) returned None; expected a torch.nn.Module",
    ),
    "build_tp_tensor": (
        "build_tp=lambda group, dtype: torch.zeros(3)",
        "your build_tp ({file}:{line}) returned a torch.Tensor; expected a torch.nn.Module",
    ),
    "make_batch_tensor": (
        "make_batch=lambda g, dtype: torch.zeros(3)",
        "your make_batch ({file}:{line}) returned a "
        "torch.Tensor; expected a pair ({{forward argument name: tensor}}, target)",
    ),
    "loss_float": (
        "loss=lambda out, target: 0.5",
        "your loss ({file}:{line}) returned a float; expected a loss tensor",
    ),
    "loss_unreduced": (
        "loss=lambda out, target: (out - target) ** 2",
        "your loss ({file}:{line}) returned a "
        "torch.Tensor; expected a loss with one element, not of shape [4, 2, 16]: reduce it",
    ),
    "loss_detached": (
        "loss=lambda out, target: ((out - target) ** 2).mean().detach()",
        "your loss ({file}:{line}) "
        "returned a torch.Tensor; expected a loss that requires grad; this one "
        "is cut from the output",
    ),
    "make_batch_int": (
        "make_batch=lambda g, dtype: ({'x': torch.randn(4, 2, 16, generator=g).to(dtype), 'n': 3}, "
        "torch.zeros(4, 2, 16))",
        "your make_batch ({file}:{line}) returned a tuple of 2: (dict, "
        "Tensor); expected every forward input a tensor; {{'n': 'int'}} are not",
    ),
    "dense_ignores_dtype": (
        "build_dense=lambda dtype: own_module.DenseBlock()",
        "your build_dense ({file}:{line}) "
        "returned a own_module.DenseBlock; expected its floating parameters in float64, the dtype "
        "it was asked for (the float64 ground truth), but ['fc1.weight', 'fc1.bias', 'fc2.weight', "
        "'fc2.bias'] are float32",
    ),
}


def test_callables_returning_the_wrong_type_are_invalid_naming_them(tmp_path, capsys):
    paths = {
        n: _write(
            tmp_path, n, f"import torch\ncase = dataclasses.replace(own_module.correct, {field})"
        )
        for n, (field, _) in RETURNS.items()
    }
    code = main(["verify", *map(str, paths.values()), "--world-size", "2"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2
    line = HEAD.count("\n") + 2  # the `case = ...` line, where the lambda is defined
    for name, (_, words) in RETURNS.items():
        assert words.format(file=paths[name], line=line) in err, (name, err)
    assert "Traceback" not in err and err.count("invalid:") == len(RETURNS)


def test_a_typo_in_a_plan_key_is_invalid_naming_it_and_the_real_name(tmp_path, capsys):
    """`Plan(params={'fc1.weigth': ...})`: the case is invalid and its summary names the unknown
    key, the parameter it was meant for ("did you mean") and the fix, not only the real parameter
    left without a placement."""
    typo = _write(
        tmp_path,
        "plan_typo",
        "params = dict(PLAN.params)\nparams['fc1.weigth'] = params.pop('fc1.weight')\n"
        "case = dataclasses.replace(own_module.correct, plan=Plan(params=params))",
    )
    report = tmp_path / "r.json"
    code = main(["verify", str(typo), "--world-size", "2", "--json", str(report)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    import json

    (case,) = json.loads(report.read_text())["cases"]
    assert case["verdict"] == "invalid"
    summary = " ".join(case["summary"].split())
    assert (
        "plan names parameter(s) ['fc1.weigth'] that the dense module does not have (did you mean "
        "'fc1.weight' for 'fc1.weigth'?); rename each to the dense parameter it places" in summary
    ), summary
    assert "no placement for dense parameter(s) ['fc1.weight']" in summary
    assert "did you mean 'fc1.weight' for 'fc1.weigth'?" in err and "Traceback" not in err
