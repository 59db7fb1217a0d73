"""The built-in `decode` block (the tiny LM decoding through a KV cache in its attention's buffers)
and the catalogue's decode-path cache bug: the correct block is equivalent at world 1, 2 and 4 in
float32, bfloat16 and float16, checked forward only with its forward collectives; the cache written
one slot late in the decode path (`decode_cache_offset`) is caught in step 1 at decode pass 2,
never before, in every dtype, beside its passing twin; the row-parallel batch-mixing all-reduce
(`batch_mixing_reduce`) is caught in the prefill; a checker that decodes one pass only ends in
"error" on the cache bug, never "equivalent"."""

import dataclasses
import json
import subprocess
import sys

import pytest

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.blocks import BLOCKS
from tpcheck.blocks.decode import DECODE_STEPS
from tpcheck.checker.rank import forward_only
from tpcheck.errors import UsageError
from tpcheck.faults import CATALOGUE
from tpcheck.resolve import RESOLVER

from paths import REPO

DTYPES = ("float32", "bfloat16", "float16")
PASSES = ["output"] + [f"output:decode{k}" for k in range(1, DECODE_STEPS + 1)]


def _spec(world, dtype="float32", fault=None):
    spec = CaseSpec(block="decode", preset="tiny", world_size=world, run=RunSettings(dtype=dtype))
    return CATALOGUE[fault].prepare(spec) if fault else spec


def _failed(r):
    return {c["name"] for c in r["checks"] if not c["passed"]}


_RESULTS: dict[int, dict] = {}
# world 4 repeats world 2's coverage on more ranks: in the slow suite
WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


def results_at(world: int) -> dict:
    """Every fault that names the decode block at `world` in every dtype and its correct twin (with
    the correct block at world 1 beside world 2's), run once per module."""
    if world not in _RESULTS:
        faults = [n for n, f in CATALOGUE.items() if "decode" in f.blocks]
        specs = [_spec(1, d) for d in DTYPES] if world == 2 else []
        specs += [_spec(world, d, f) for f in [None, *faults] for d in DTYPES]
        _RESULTS[world] = dict(zip(specs, check(specs)))
    return _RESULTS[world]


@pytest.mark.parametrize("world", WORLDS)
def test_the_decode_block_is_equivalent_forward_only_with_its_forward_collectives(world):
    for spec, r in results_at(world).items():
        if spec.fault:
            continue
        assert r["verdict"] == "equivalent" and r["as_expected"], (spec.name, r["summary"])
        assert r["forward_only"] == {
            "reason": f"the case decodes (decode_steps={DECODE_STEPS})",
            "decode_steps": DECODE_STEPS,
            "notes": [],  # several different sequences in the batch
        }
        names = {c["name"] for c in r["checks"]}
        for name in PASSES:  # the prefill and every decode pass, every module output compared
            assert name in names and f"act:layers.1.attention.o{name[6:]}" in names, name
        # forward only: the KV caches are compared as built (buffers, step 0), nothing trains
        assert {c["stage"] for c in r["checks"]} <= {"weights", "buffers", "forward", "replicas"}
        caches = {c["name"] for c in r["checks"] if c["stage"] == "buffers"}
        assert "buffer:layers.0.attention.cache.cache_k" in caches, caches
        assert {c["rank"] for c in r["checks"]} == set(range(spec.world_size))
        assert not r["ledger"]["problems"], r["ledger"]["problems"]
        if spec.world_size > 1:
            # per pass: the embedding's, then o's and down's all-reduce in each of the 2 layers
            per_pass = (1 + DECODE_STEPS) * spec.settings.steps
            assert {
                (e["phase"], e["op"], e["site"]): e["count"] for e in r["ledger"]["expected"]
            } == {
                ("forward", "all_reduce", site): per_pass
                for site in ("embed", "layers.0.attention.o", "layers.0.mlp.down")
                + ("layers.1.attention.o", "layers.1.mlp.down")
            }
            assert set(r["ledger"]["per_rank"]["0"]) == {"forward"}


@pytest.mark.parametrize(
    "overrides,world,dtype",
    [
        ((("tie_embeddings", True),), 2, "float32"),  # the head is the embedding's shard
        ((("kv_heads", 1), ("batch", 3)), 2, "bfloat16"),  # MQA: the kv head cached on both ranks
        ((("kv_heads", 4), ("seq", 1), ("layers", 1)), 4, "float16"),  # a one-token prompt
        ((("seq", 3), ("batch", 4), ("heads", 8), ("hidden", 64), ("vocab", 96)), 2, "float32"),
        ((("dropout", 0.1), ("attention_dropout", 0.1)), 2, "float32"),
    ],
    ids=["tied", "mqa", "one_token_prompt", "wider", "dropout"],
)
def test_the_decode_block_is_equivalent_at_other_shapes(overrides, world, dtype):
    run = RunSettings(dtype=dtype, steps=2)
    spec = CaseSpec(block="decode", preset="tiny", world_size=world, overrides=overrides, run=run)
    (r,) = check([spec])
    assert r["verdict"] == "equivalent", r["summary"]
    assert not r["ledger"]["problems"] and r["forward_only"]["notes"] == []
    assert "output:decode3" in {c["name"] for c in r["checks"]}


def _caught_and_twin_passes(results, faulty):
    r = results[faulty]
    assert r["verdict"] == "not equivalent" and r["as_expected"], r["summary"]
    twin = results[dataclasses.replace(faulty, fault=None)]
    assert twin["verdict"] == "equivalent", twin["summary"]
    return r


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_cache_written_one_slot_late_is_caught_at_decode_pass_2(world, dtype):
    """The prefill and decode pass 1 read only what they wrote themselves: equivalent. Decode pass 2
    reads the slot the first decode pass should have filled: the first failing check."""
    fault = CATALOGUE["decode_cache_offset"]
    r = _caught_and_twin_passes(results_at(world), _spec(world, dtype, fault.name))
    first = r["first_divergence"]
    assert (first["stage"], first["step"]) == (fault.expected_stage, 1), r["summary"]
    assert first["name"].endswith(":decode2"), first["name"]
    if dtype == "float32":  # as the catalogue test: 16 bits read the same numbers more coarsely
        # (bfloat16 at tp 4 sees the shifted slot's values as `permuted`)
        assert r["diagnosis"]["signature"] == fault.expected_signature, r["summary"]
    failed = _failed(r)
    assert {"output:decode2", "output:decode3"} <= failed
    assert not [n for n in failed if not n.endswith((":decode2", ":decode3"))], sorted(failed)
    # the cache bug adds or drops no collective
    assert not r["ledger"]["problems"], r["ledger"]["problems"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_mixing_reduce_is_caught_in_the_prefill(world, dtype):
    fault = CATALOGUE["batch_mixing_reduce"]
    r = _caught_and_twin_passes(results_at(world), _spec(world, dtype, fault.name))
    first = r["first_divergence"]
    assert (first["stage"], first["step"], first["name"]) == (
        "forward",
        1,
        "act:layers.0.mlp.down",
    ), r["summary"]
    assert r["diagnosis"]["signature"] == fault.expected_signature, r["summary"]


def test_the_decode_block_refuses_sequence_parallelism_and_training_faults():
    assert BLOCKS["decode"].sequence_parallel is False
    with pytest.raises(UsageError, match="'decode' does not run under sequence parallelism"):
        RESOLVER.build(
            CaseSpec(block="decode", preset="tiny", world_size=2, sequence_parallel=True)
        )
    with pytest.raises(UsageError, match="needs heads"):
        RESOLVER.build(CaseSpec(block="decode", preset="seed", world_size=1))
    # an optimizer or loss fault has nothing to act on in a block that is never trained
    assert not CATALOGUE["lr_times_world_on_last_rank"].applies("decode", 2)
    assert not CATALOGUE["decode_cache_offset"].applies("lm", 2)


def _decodes_one_pass(case, tp):
    """A broken forward-only checker: it decodes one pass only (where this bug cannot show)."""
    why = forward_only.reason(case, tp)
    if why is None:
        return None
    fo = forward_only.ForwardOnly(why, case.decode_steps)
    run = fo.run

    def run_one_pass(engine):
        fo.decode_steps = 1
        run(engine)
        fo.decode_steps = case.decode_steps

    fo.run = run_one_pass
    return fo


def test_a_checker_that_decodes_one_pass_ends_in_error_on_the_cache_bug(monkeypatch):
    monkeypatch.setattr(forward_only.ForwardOnly, "of", _decodes_one_pass)
    (r,) = check([_spec(2, fault="decode_cache_offset")])
    assert r["verdict"] == "error", r["summary"]
    assert "no check of output:decode2 (forward, step 1) on rank 0" in r["self_test"]["failures"]


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tpcheck", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )


@pytest.mark.slow
def test_the_cli_runs_the_block():
    """The in-process checks above run the block; the command runs it the same way."""
    ok = _cli("run", "--block", "decode", "--preset", "tiny", "--world-size", "2", "-q")
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_the_cli_lists_the_fault_and_refuses_sequence_parallelism():
    run = _cli
    listed = {f["name"]: f for f in json.loads(run("faults", "--json").stdout)}
    assert listed["decode_cache_offset"]["blocks"] == ["decode"]
    assert "decode" in listed["batch_mixing_reduce"]["blocks"]
    sp = run("run", "--block", "decode", "--preset", "tiny", "--world-size", "2", "--sp")
    assert sp.returncode == 2 and "drop --sp" in sp.stderr and "Traceback" not in sp.stderr
