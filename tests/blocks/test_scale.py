"""At a realistic width (hidden 1024, FFN 4096) the same tolerance policy passes a correct MLP in
fp32 and bf16 at world sizes 2 and 4, and flags a 1e-3 relative perturbation of one weight shard."""

import dataclasses

import pytest

from tpcheck import CaseSpec, RunSettings, check

WIDE = (("seq", 8), ("batch", 2), ("hidden", 1024), ("ffn", 4096))


@pytest.mark.slow
def test_wide_mlp_passes_and_a_perturbed_shard_is_flagged():
    specs = []
    for world in (2, 4):
        for dtype in ("float32", "bfloat16"):
            ok = CaseSpec(
                block="mlp",
                preset="seed",
                world_size=world,
                run=RunSettings(dtype=dtype, steps=2),
                overrides=WIDE,
            )
            specs += [ok, dataclasses.replace(ok, fault="stale_shard")]
    results = check(specs, timeout_s=120)
    for spec, r in zip(specs, results):
        if spec.fault is None:
            assert r["verdict"] == "equivalent", r["summary"]
            worst = max(c["error"] / c["bound"] for c in r["checks"] if c["kind"] == "calibrated")
            assert worst < 1.0
        else:
            assert r["verdict"] == "not equivalent", r["summary"]
            first = r["first_divergence"]
            assert (first["stage"], first["name"], first["ranks"]) == (
                "weights",
                "param:gate_up.weight",
                [1],
            )
