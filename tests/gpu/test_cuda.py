"""--device cuda: the ranks on GPUs (one each, NCCL beside gloo). Skipped where no GPU is visible;
run on a GPU machine by benchmarks/gpu_check.sh. GPUs are counted through NVML
(`torch.cuda.device_count`), which leaves the CUDA runtime of this process alone: the pool forks
its ranks from it."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.cli import main
from tpcheck.faults import CATALOGUE

GPUS = torch.cuda.device_count() if torch.backends.cuda.is_built() else 0
pytestmark = pytest.mark.skipif(
    GPUS == 0, reason="no GPU visible: --device cuda runs where one is (benchmarks/gpu_check.sh)"
)
WORLDS = sorted({1, min(2, GPUS)}) if GPUS else [1]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BLOCKS = ("mlp", "attention", "layer", "lm", "embedding", "cross_entropy", "decode")


def _spec(block, world, dtype, **kw):
    return CaseSpec(
        block=block,
        preset="tiny",
        world_size=world,
        run=RunSettings(dtype=dtype),
        device="cuda",
        **kw,
    )


def test_every_block_on_gpus_is_equivalent_in_float32_and_bfloat16():
    specs = [_spec(b, w, d) for b in BLOCKS for w in WORLDS for d in ("float32", "bfloat16")]
    results = check(specs, timeout_s=120)
    for r in results:
        assert r["spec"]["device"] == "cuda" and r["name"].endswith("/cuda")
        assert r["verdict"] == "equivalent", (r["name"], r["summary"])
        assert r["self_test"]["failures"] == [], r["name"]


def test_dropout_on_gpus_is_replayed_and_equivalent():
    overrides = (("dropout", 0.1), ("attention_dropout", 0.1))
    results = check(
        [_spec("layer", w, "float32", overrides=overrides) for w in WORLDS], timeout_s=120
    )
    assert [r["verdict"] for r in results] == ["equivalent"] * len(WORLDS), [
        r["summary"] for r in results
    ]


@pytest.mark.skipif(GPUS < 2, reason="the catalogue's faults need two ranks: two GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_catalogue_is_caught_on_gpus_and_each_twin_passes(dtype):
    specs, twins = [], []
    for fault in CATALOGUE.values():
        if fault.expected_stage == "hang":
            continue
        for block in fault.blocks:
            if fault.applies(block, 2, "adamw", dtype):
                faulty = fault.prepare(_spec(block, 2, dtype))
                specs.append(faulty)
                twins.append(dataclasses.replace(faulty, fault=None, expected=None))
    results = check(specs + twins, timeout_s=120)
    missed = [r["name"] for r in results[: len(specs)] if r["verdict"] != "not equivalent"]
    false_alarms = [
        (r["name"], r["summary"]) for r in results[len(specs) :] if r["verdict"] != "equivalent"
    ]
    assert missed == [] and false_alarms == []


def test_a_case_file_on_gpus(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(
        [
            "verify",
            str(EXAMPLES / "own_module.py"),
            "--device",
            "cuda",
            "--world-size",
            str(WORLDS[-1]),
            "--steps",
            "2",
            "-q",
            "--json",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert report["environment"]["backend"] == "gloo+nccl"
    verdicts = {c["name"].split("/")[0]: c["verdict"] for c in report["cases"]}
    assert verdicts["own_mlp"] == "equivalent"
    if WORLDS[-1] > 1:  # the planted bias-before-reduce shows with two ranks
        assert verdicts["own_mlp_bias_before_reduce"] == "not equivalent" and code == 1


def test_the_pytest_fixture_on_gpus():
    import sys

    from tpcheck.pytest_plugin import TPCheckFixture

    sys.path.insert(0, str(EXAMPLES))
    import own_module

    results = TPCheckFixture(timeout_s=60, world_sizes=WORLDS).verify(
        own_module.correct, steps=2, device="cuda"
    )
    assert [r["spec"]["device"] for r in results] == ["cuda"] * len(WORLDS)
