"""Property tests: over random shapes, world sizes {1, 2, 4}, seeds, fp32/bf16, optimizers and sequence
parallelism, a correct MLP is never flagged, and the seed's two faults are always flagged. One pool of
ranks per world size serves every example."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpcheck import CaseSpec
from tpcheck.blocks import BLOCKS
from tpcheck.check.session import run_specs
from tpcheck.resolve import launcher as pool_launcher


@pytest.fixture(scope="module")
def launcher():
    with pool_launcher(timeout_s=60) as launcher:
        yield launcher


@st.composite
def mlp_specs(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    sp = draw(st.booleans())
    overrides = (("seq", world * draw(st.integers(1, 3)) if sp else draw(st.integers(1, 6))),
                 ("batch", draw(st.integers(1, 3))),
                 ("hidden", draw(st.sampled_from([4, 8, 16, 64, 128]))),
                 ("ffn", world * draw(st.integers(1, 24))))
    return CaseSpec(block="mlp", preset="seed", world_size=world, sequence_parallel=sp, overrides=overrides,
                    dtype=draw(st.sampled_from(["float32", "bfloat16"])), seed=draw(st.integers(0, 10_000)),
                    optimizer=draw(st.sampled_from(["sgd", "adamw"])), steps=draw(st.integers(1, 3)))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=mlp_specs())
def test_no_false_alarm_and_seed_faults_always_flagged(launcher, spec):
    import dataclasses

    specs = [spec]
    if spec.world_size > 1 and not spec.sequence_parallel:
        specs += [dataclasses.replace(spec, fault=f) for f in ("missing_forward_reduce", "missing_backward_reduce")]
    correct, *faulty = run_specs(specs, launcher)
    assert correct["verdict"] == "equivalent", correct["summary"]
    assert correct["self_test"]["flagged"] and correct["self_test"]["sensitive"]
    for r in faulty:
        assert r["verdict"] == "not equivalent", r["summary"]
        assert r["diagnosis"]["signature"] == "partial_sum", r["summary"]


@st.composite
def block_specs(draw):
    """Any block at random valid shapes: heads divisible by the world size, kv heads dividing the heads
    and either sharded or replicated over the ranks, a vocabulary divisible by the world size."""
    world = draw(st.sampled_from([1, 2, 4]))
    sp = draw(st.booleans())
    seq = world * draw(st.integers(1, 3)) if sp else draw(st.integers(1, 6))
    batch = draw(st.integers(2 if seq == 1 else 1, 2))  # >= 2 tokens: the LM ignores every 5th label
    heads = world * draw(st.sampled_from([1, 2]))
    kv = draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0 and (k % world == 0 or world % k == 0)]))
    # head dim >= 4, hidden >= 8, vocab >= 16: below that, tensors of 2-4 elements with heavy cancellation
    # make the max-error statistic that calibrates bounds too noisy (measured: ~1% false alarms at hidden
    # 2-4), and bf16 logits over a vocabulary of 8 at tp 4 get bounds the self-test rejects as too loose
    head_dim = draw(st.sampled_from([4, 8]) if heads > 1 else st.just(8))
    overrides = (("heads", heads), ("kv_heads", kv), ("hidden", heads * head_dim),
                 ("ffn", world * draw(st.integers(2, 8))), ("vocab", world * draw(st.integers(max(2, 16 // world), 16))),
                 ("seq", seq), ("batch", batch), ("layers", draw(st.integers(1, 2))))
    return CaseSpec(block=draw(st.sampled_from([b for b in BLOCKS if b != "mlp"])),  # the MLP: above
                    preset="tiny", world_size=world, sequence_parallel=sp, overrides=overrides,
                    dtype=draw(st.sampled_from(["float32", "bfloat16"])), seed=draw(st.integers(0, 10_000)),
                    optimizer=draw(st.sampled_from(["sgd", "adamw"])), steps=draw(st.integers(1, 2)))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=block_specs())
def test_no_false_alarm_on_any_block(launcher, spec):
    (result,) = run_specs([spec], launcher)
    assert result["verdict"] == "equivalent", result["summary"]
