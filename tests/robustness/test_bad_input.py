"""Bad input ends with exit 2 and a message naming the value and the fix -- never a traceback from
tpcheck's internals, never a rank process when the parent can tell before forking."""

import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpcheck.api import check, exit_code
from tpcheck.checker.case import CaseSpec, max_world_size
from tpcheck.cli import main
from tpcheck.plan import Replicate, Shard

from robust_helpers import derive

REPO = Path(__file__).resolve().parents[2]

BAD_ARGS = [  # (argv after "run", words the message must contain)
    (["--world-size", "5"], ["world size 5", "FFN width 12"]),
    (["--preset", "tiny", "--world-size", "3"], ["world size 3", "FFN width 64"]),
    (["--world-size", str(max_world_size() + 1)], [f"world size {max_world_size() + 1}", "CPUs"]),
    (["--world-size", "0"], ["world size 0"]),
    (["--world-size", "-2"], ["world size -2"]),
    (["--dtype", "complex64"], ["complex64", "float32"]),
    (["--dtype", "int32"], ["int32"]),
    (["--fault", "no_such_fault"], ["no_such_fault", "tpcheck faults"]),
    (["--preset", "huge"], ["huge", "tiny"]),
    (["--block", "transformer9000"], ["transformer9000", "mlp"]),
    (["--steps", "0"], ["steps", "0"]),
    (["--steps", "-3"], ["steps", "-3"]),
    (["--micro-batches", "0"], ["micro_batches", "0"]),
    (["--lr", "0"], ["learning rate 0"]),
    (["--lr", "nan"], ["learning rate nan"]),
    (["--lr=-inf"], ["learning rate -inf"]),
    (["--timeout", "0"], ["--timeout 0"]),
    (["--timeout", "-1"], ["--timeout -1"]),
    (["--timeout", "nan"], ["--timeout nan"]),
    (["--seed", str(2**70)], ["seed", "range"]),
    (["--mode", "equivalence", "--world-size", "1", "2"], ["--mode takes one --world-size"]),
    (["--dropout", "1.5"], ["dropout must be a probability in [0, 1)", "1.5"]),
    (["--attention-dropout=-0.1"], ["attention_dropout must be a probability", "-0.1"]),
    (["--mode", "equivalence", "--dropout", "0.1"], ["ignores --dropout"]),
]


@pytest.mark.parametrize("args,words", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_flags_exit_2_with_a_clear_message_before_any_fork(args, words, capsys, children):
    before = children()
    assert main(["run", *args, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpcheck: error: ") and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert children() == before


@pytest.mark.parametrize(
    "args",
    [
        ["--world-size", "two"],
        ["--steps", "1.5"],
        ["--optimizer", "lion"],
        ["--bogus-flag"],
        ["--lr", "fast"],
    ],
)
def test_unparseable_flags_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", *args])
    assert e.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_world_size_must_divide_heads_kv_heads_and_vocab(children):
    """The config's divisibility rules of the dimensions each block splits, checked in the
    parent: each case is "invalid", none forks."""
    before = children()
    specs = [
        CaseSpec(block="layer", preset="tiny", world_size=3, overrides=(("ffn", 96),)),
        CaseSpec(
            block="attention",
            preset="tiny",
            world_size=2,
            overrides=(("hidden", 48), ("heads", 6), ("kv_heads", 3)),
        ),
        CaseSpec(block="embedding", preset="tiny", world_size=2, overrides=(("vocab", 63),)),
        CaseSpec(preset="tiny", world_size=2, overrides=(("no_such_field", 1),)),
    ]
    results = check(specs)
    assert [r["verdict"] for r in results] == ["invalid"] * 4
    assert "number of heads 4" in results[0]["summary"]
    assert "kv_heads 3 and world size 2" in results[1]["summary"]
    assert "vocabulary 63" in results[2]["summary"]
    assert "no_such_field" in results[3]["summary"]
    assert exit_code(results) == 2
    assert children() == before


def _nan_batch(case, cfg):
    def make(g, dtype):
        inputs, target = case.make_batch(g, dtype)
        inputs["x"][0, 0, 0] = float("nan")
        return inputs, target

    return make


def _inf_init(case, cfg):
    def init(module, g):
        case.init(module, g)
        module.down.bias.data.fill_(float("inf"))

    return init


def _params(change):
    return derive(
        lambda case, cfg: dataclasses.replace(case.plan, params=change(dict(case.plan.params)))
    )


def test_bad_plans_and_bad_references_are_invalid_not_tp_bugs(register_block):
    blocks = {
        "plan_missing": _params(lambda p: {k: v for k, v in p.items() if k != "down.bias"}),
        "plan_extra": _params(lambda p: {**p, "bogus.weight": Replicate()}),
        "plan_wrong_shard": _params(lambda p: {**p, "down.weight": Shard(0)}),
    }
    for name, plan in blocks.items():
        register_block(name, plan=plan)
    register_block("nan_input", make_batch=derive(_nan_batch))
    register_block("inf_weight", init=derive(_inf_init))
    names = [*blocks, "nan_input", "inf_weight"]
    results = check([CaseSpec(block=n) for n in names], timeout_s=10)
    by = dict(zip(names, results))
    assert all(r["verdict"] == "invalid" for r in results), [
        (r["name"], r["summary"]) for r in results
    ]
    assert "no placement for dense parameter(s) ['down.bias']" in by["plan_missing"]["summary"]
    assert "['bogus.weight']" in by["plan_extra"]["summary"]
    assert (
        "'down.weight'" in by["plan_wrong_shard"]["summary"]
        and "shape" in by["plan_wrong_shard"]["summary"]
    )
    for name in ("nan_input", "inf_weight"):
        assert (
            "NaN/Inf" in by[name]["summary"] and "not the TP implementation" in by[name]["summary"]
        )
    assert not any("traceback" in p for r in results for p in r["problems"])
    assert exit_code(results) == 2


API_BAD = [  # (what is passed to tpcheck.check, words the UsageError must contain)
    (lambda: CaseSpec(), "not one CaseSpec: tpcheck.check([spec])"),
    (lambda: ["mlp"], "item 0 is str 'mlp', not a CaseSpec"),
    (lambda: [CaseSpec(), {"block": "mlp"}], "item 1 is dict"),
    (lambda: "mlp", "not str 'mlp'"),
    (lambda: None, "not NoneType None"),
]


@pytest.mark.parametrize(
    "make,words", API_BAD, ids=["one spec", "a name", "a dict", "a string", "None"]
)
def test_the_python_api_refuses_anything_but_a_list_of_specs_before_any_fork(make, words, children):
    from tpcheck.errors import UsageError

    before = children()
    with pytest.raises(UsageError, match=re.escape(words)):
        check(make(), timeout_s=10)
    assert children() == before


def _forward_returning(side: str, wrap):
    """The seed MLP's dense or TP module, its forward's output passed through `wrap`."""

    def build(case, cfg):
        original = case.build_tp if side == "tp" else case.build_dense

        def make(*args):
            module = original(*args)
            inner = module.forward
            module.forward = lambda *a, **k: wrap(inner(*a, **k))
            return module

        return make

    return derive(build)


def test_a_forward_returning_no_tensor_is_invalid_naming_the_side_and_the_line(register_block):
    """The checker compares one output tensor; a tuple, a dict or None from either side's forward is
    refused naming which side, where its forward is and what it returned -- not an AttributeError
    from the engine. The unwrapped case beside them is equivalent."""
    register_block("tp_tuple", build_tp=_forward_returning("tp", lambda y: (y,)))
    register_block("tp_none", build_tp=_forward_returning("tp", lambda y: None))
    register_block("dense_dict", build_dense=_forward_returning("dense", lambda y: {"logits": y}))
    names = ["tp_tuple", "tp_none", "dense_dict", "mlp"]
    by = dict(zip(names, check([CaseSpec(block=n) for n in names], timeout_s=10)))
    assert by["mlp"]["verdict"] == "equivalent"
    source, first = inspect.getsourcelines(_forward_returning)  # the wrapping lambda's line
    line = f"test_bad_input.py:{first + next(i for i, s in enumerate(source) if 'lambda *a' in s)}"
    for name, side, what in (
        ("tp_tuple", "TP", "a tuple of 1"),
        ("tp_none", "TP", "NoneType"),
        ("dense_dict", "dense", "a dict of 1"),
    ):
        r = by[name]
        assert r["verdict"] == "invalid", (name, r["summary"])
        assert f"the {side} module's forward (" in r["summary"], r["summary"]
        assert f"{line}) returned {what}, not a tensor" in r["summary"], r["summary"]
        assert not any("Traceback" in p or "AttributeError" in p for p in r["problems"]), r[
            "problems"
        ]


@pytest.mark.slow
def test_pure_float16_adamw_reference_overflow_is_reported_as_invalid_in_a_subprocess():
    """Pure float16 parameters (no float32 masters): AdamW's eps underflows in float16 and the dense
    reference itself turns NaN: that is bad input (exit 2, a clear message), not a TP bug. Also:
    other bad input, via the real command line, in parallel, with no traceback."""
    cmds = [
        ["run", "--dtype", "float16", "--no-master-weights", "--world-size", "1", "-q"],
        ["run", "--preset", "huge"],
        ["run", "--world-size", "5"],
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tpcheck", *c],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for c in cmds
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120))
        finally:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2, err
        assert "Traceback" not in err and "tpcheck: error:" in err
    assert (
        "float16" in outs[0][1]
        and "AdamW" in outs[0][1]
        and "not the TP implementation" in outs[0][1]
    )
    assert "--no-master-weights" in outs[0][1]
    assert "huge" in outs[1][1] and "world size 5" in outs[2][1]
