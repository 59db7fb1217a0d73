"""Random valid cases over every built-in block that trains (all but the decode block): shapes that
keep every TP divisibility at the drawn world size, with random dtypes, sequence parallelism,
optimizers, steps and micro-batches. Used by the false-alarm sweep (tests/blocks/test_properties.py)
and the bound measurements (benchmarks/bounds.py).

Shape limits, measured: below head dim 4, hidden 8 or a vocabulary of 16, tensors of 2-4 elements
with heavy cancellation make the max-error statistic that calibrates bounds too
noisy to mean anything.
"""

from __future__ import annotations

import dataclasses
import random

from tpcheck.blocks import BLOCKS
from tpcheck.checker.case import CaseSpec
from tpcheck.checker.settings import RunSettings

WORLDS = (1, 2, 3, 4, 5, 6, 7, 8)
DTYPES = ("float32", "bfloat16", "float16")


# the blocks that train; the decode block (checked forward only, no SP) has its own tests
# (tests/faults/test_decode_block.py) and stays out, so a seed draws the cases it always drew
TRAINED = tuple(b for b in BLOCKS if b != "decode")
# the blocks whose input is a hidden state [s, b, h], where an outlier can be planted
HIDDEN_INPUT = ("mlp", "attention", "layer")


def random_spec(
    rng: random.Random, *, worlds=WORLDS, dtypes=DTYPES, blocks=TRAINED, outliers=False
) -> CaseSpec:
    """One random correct case (no fault) that the built-in blocks can build; `outliers`: a hidden
    state block whose input (and target) holds one element of magnitude 10^2-10^3.5 (10^1.5-10^2 in
    float16, whose largest is 65504), either sign."""
    if outliers:
        spec = random_spec(rng, worlds=worlds, dtypes=dtypes, blocks=HIDDEN_INPUT)
        low, high = (1.5, 2) if spec.settings.dtype == "float16" else (2, 3.5)
        value = rng.choice((-1, 1)) * 10 ** rng.uniform(low, high)
        return dataclasses.replace(spec, overrides=(*spec.overrides, ("outlier", value)))
    block, world, sp = rng.choice(blocks), rng.choice(worlds), rng.random() < 0.5
    seq = world * rng.randint(1, 3) if sp else rng.randint(1, 6)
    batch = rng.randint(2 if seq == 1 else 1, 2)  # >= 2 tokens: the LM ignores every 5th label
    run = RunSettings(
        dtype=rng.choice(dtypes),
        seed=rng.randrange(100_000),
        optimizer=rng.choice(("sgd", "adamw")),
        steps=rng.randint(1, 3),
        micro_batches=rng.randint(1, 3),
    )
    if block == "mlp":
        overrides = (
            ("seq", seq),
            ("batch", batch),
            ("hidden", rng.choice((8, 16, 64, 128))),
            ("ffn", world * rng.randint(1, 24)),
        )
        return CaseSpec(
            block=block,
            preset="seed",
            world_size=world,
            sequence_parallel=sp,
            overrides=overrides,
            run=run,
        )
    heads = world * rng.choice((1, 2))
    kv = rng.choice(
        [k for k in range(1, heads + 1) if heads % k == 0 and (k % world == 0 or world % k == 0)]
    )
    head_dim = rng.choice((4, 8)) if heads > 1 else 8
    overrides = (
        ("heads", heads),
        ("kv_heads", kv),
        ("hidden", heads * head_dim),
        ("ffn", world * rng.randint(2, 8)),
        ("vocab", world * rng.randint(max(2, 16 // world), 16)),
        ("seq", seq),
        ("batch", batch),
        ("layers", rng.randint(1, 2)),
    )
    return CaseSpec(
        block=block,
        preset="tiny",
        world_size=world,
        sequence_parallel=sp,
        overrides=overrides,
        run=run,
    )


def random_specs(seed: int, n: int, **kw) -> list[CaseSpec]:
    """`n` random cases from `seed`, grouped by world size (one pool of ranks serves each group)."""
    rng = random.Random(seed)
    return sorted((random_spec(rng, **kw) for _ in range(n)), key=lambda s: s.world_size)
