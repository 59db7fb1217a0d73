"""Property tests: random command lines and random case configs never crash tpcheck's internals,
never hang, and always end with exit code 0, 1 or 2 (2 with a one-line message for bad input).

Run in-process through `main(argv)` (argparse's SystemExit(2) counts as exit 2); a SIGALRM watchdog
turns a hang into a test failure instead of a stuck suite."""

import contextlib
import signal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpcheck.api import check
from tpcheck.checker.case import CaseSpec
from tpcheck.checker.settings import RunSettings
from tpcheck.cli import main

FLAGS = {  # flag -> values (valid and garbage); a list value means nargs="+"
    "--world-size": st.lists(
        st.sampled_from(["1", "2", "3", "4", "0", "-1", "999", "x", "1e3"]), min_size=1, max_size=2
    ),
    "--block": st.sampled_from([["mlp"], ["nope"], ["mlp", "nope"], [""]]),
    "--preset": st.sampled_from(["seed", "tiny", "nope", "", "llama"]),
    "--dtype": st.lists(
        st.sampled_from(["float32", "float64", "bfloat16", "float16", "complex64", "int8", "f"]),
        min_size=1,
        max_size=2,
    ),
    "--fault": st.lists(
        st.sampled_from(["missing_forward_reduce", "missing_backward_reduce", "nope", "?"]),
        min_size=1,
        max_size=1,
    ),
    "--steps": st.sampled_from(["1", "2", "0", "-1", "x", "1.5", str(10**12)]),
    "--micro-batches": st.sampled_from(["1", "2", "0", "-4", str(10**9)]),
    "--optimizer": st.sampled_from(["sgd", "adamw", "lion"]),
    "--lr": st.sampled_from(["0.01", "0", "-1", "nan", "inf", "1e300", "x"]),
    "--seed": st.sampled_from(["0", "31", "-1", str(2**70), "x"]),
    "--timeout": st.sampled_from(["10", "0", "-1", "nan", "inf", "x"]),
    "--mode": st.sampled_from(["equivalence", "inspect", "all", "bogus"]),
    "--sp": st.just(None),
    "--zzz": st.just("1"),  # an unknown flag
}


@st.composite
def argvs(draw):
    argv = ["run", "-q"]
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=5, unique=True)):
        value = draw(FLAGS[flag])
        argv += (
            [flag]
            if value is None
            else [flag, *value]
            if isinstance(value, list)
            else [f"{flag}={value}"]
        )
    return argv


@contextlib.contextmanager
def watchdog(seconds: int):
    def fire(*_):
        raise TimeoutError(f"no result within {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_main(argv) -> int:
    try:
        with watchdog(90):
            return main(argv)
    except SystemExit as e:  # argparse
        return e.code


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(argv=argvs())
def test_random_command_lines(argv, capsys, children):
    before = children()
    code = run_main(argv)
    err = capsys.readouterr().err
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        assert "error" in err, (argv, err)  # bad input always says why
    assert children() == before


SIZES = st.sampled_from([1, 2, 3, 4, 6, 8, 0, -1])


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    seq=SIZES,
    batch=SIZES,
    hidden=SIZES,
    ffn=st.sampled_from([4, 8, 12, 6, 5, -2]),
    layout=st.sampled_from(["stacked", "concat", "stacked", "concat", "zigzag"]),
    world=st.sampled_from([1, 2, 3, 4]),
    sp=st.booleans(),
    dtype=st.sampled_from(["float32", "float64", "bfloat16"]),
)
def test_random_case_configs_are_equivalent_or_invalid(
    seq, batch, hidden, ffn, layout, world, sp, dtype, children
):
    """A correct implementation on any config it accepts is equivalent; a config it cannot take is
    "invalid" with a message. Never an internal error (which would be "error" with a traceback)."""
    before = children()
    spec = CaseSpec(
        world_size=world,
        run=RunSettings(dtype=dtype, steps=1),
        sequence_parallel=sp,
        overrides=(
            ("seq", seq),
            ("batch", batch),
            ("hidden", hidden),
            ("ffn", ffn),
            ("gate_up_layout", layout),
        ),
    )
    with watchdog(90):
        (result,) = check([spec], timeout_s=10)
    assert result["verdict"] in ("equivalent", "invalid"), (spec, result["summary"])
    if result["verdict"] == "invalid":
        assert not any("traceback" in p for p in result["problems"]), result["problems"]
    assert children() == before
