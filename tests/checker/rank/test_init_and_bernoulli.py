"""tpcheck's default init and a bernoulli dropout drawn from a generator the module owns
(case_files/init_and_bernoulli.py).

The default init (`seeded_init`) calls a module's `reset_parameters` with tpcheck's generator only
when its first argument is a generator; a `reset_parameters(self, init_std=None)` (Megatron/OLMo
style) or `reset_parameters(self)` is left alone and the weights are drawn by tpcheck; a failing
default init is reported as tpcheck's, naming the module's class. A hand-written dropout
`torch.bernoulli(torch.full_like(x, 1 - p), generator=g)` is replayed in any dtype (bfloat16
included), its TP side's own draw made by torch from that generator, and an RNG placement bug in it
caught with its signature."""

from pathlib import Path

import pytest
import torch

from tpcheck.api import check
from tpcheck.checker.case import seeded_init, takes_generator
from tpcheck.checker.casefile import file_spec, load_module
from tpcheck.checker.rank.masks import MaskBook, _hash
from tpcheck.errors import UsageError
from tpcheck.models.dense import Linear, RMSNorm

CASES = Path(__file__).parent / "case_files" / "init_and_bernoulli.py"
M = load_module(str(CASES))


def _run(names, world, dtype):
    specs = [file_spec(f"{CASES}:{n}", world, dtype=dtype) for n in names]
    return {r["name"].split("/")[0]: r for r in check(specs)}


# ---------------------------------------------------------------- the default init, in process


def test_reset_parameters_is_called_only_when_its_first_argument_is_a_generator():
    assert takes_generator(M.GeneratorResetDense().reset_parameters)  # named `generator`
    assert takes_generator(M.BrokenGeneratorResetDense().reset_parameters)  # annotated
    assert takes_generator(RMSNorm(4, 1e-6).reset_parameters)  # the built-in blocks
    assert takes_generator(Linear(2, 2).reset_parameters)  # `g: torch.Generator | None = None`
    assert not takes_generator(M.InitStdDense().reset_parameters)  # init_std=None
    assert not takes_generator(M.OwnResetDense().reset_parameters)  # no argument
    assert not takes_generator(torch.nn.Linear(2, 2).reset_parameters)

    # init_std=None: not called (it would take the generator for a std); tpcheck's own draws
    mine, plain = M.InitStdDense(), M.Dense()
    seeded_init(mine, torch.Generator().manual_seed(5))
    seeded_init(plain, torch.Generator().manual_seed(5))
    for (name, a), (_, b) in zip(mine.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), name
    assert mine.fc1.bias.abs().min() > 0  # random, not the module's zeros

    # a generator: called with tpcheck's, so its draws are the module's own
    called, direct = M.GeneratorResetDense(), M.GeneratorResetDense()
    seeded_init(called, torch.Generator().manual_seed(5))
    direct.reset_parameters(torch.Generator().manual_seed(5))
    assert torch.equal(called.fc2.weight, direct.fc2.weight)
    assert not torch.equal(called.fc2.weight, plain.fc2.weight)


def test_a_failing_default_init_names_itself_the_module_class_and_the_fix():
    with pytest.raises(UsageError) as e:
        seeded_init(M.BrokenGeneratorResetDense(), torch.Generator().manual_seed(0))
    said = str(e.value)
    assert said.startswith("tpcheck's default init called BrokenGeneratorResetDense.")
    assert "init_and_bernoulli.py:" in said and "init=" in said
    # a parameter its draws cannot write: built under torch.inference_mode()
    with torch.inference_mode():
        frozen = M.Dense()
    with pytest.raises(UsageError) as e:
        seeded_init(frozen, torch.Generator().manual_seed(0))
    assert str(e.value).startswith("tpcheck's default init could not draw Dense's parameter ")
    assert "'fc1.weight'" in str(e.value) and "init=" in str(e.value)


# ------------------------------------------------------------------------ the bernoulli probe


def test_the_probe_makes_torchs_own_bernoulli_draw_from_the_modules_generator_in_bfloat16():
    dense = M.BernoulliDropout(0.25, seed=0)
    tp = M.BernoulliDropout(0.25, seed=7)
    x = torch.randn(4, 2, 8).to(torch.bfloat16)
    book = MaskBook(torch.Generator().manual_seed(3))
    with book.draw(dense):
        dense_out = dense(x)
    state = tp.generator.get_state()
    with book.tp(tp, rank=0, world=1, next_seq=lambda: 0):
        tp_out = tp(x)
    assert torch.equal(tp_out, dense_out)  # the dense side's mask, in bfloat16
    # the draw torch makes: the same generator state after, the same mask recorded
    own = torch.Generator().manual_seed(7)
    torch_mask = torch.bernoulli(torch.full_like(x, 0.75), generator=own)
    assert torch.equal(tp.generator.get_state(), own.get_state())
    (draw,) = book.tp_draws
    assert draw.problem is None and draw.state == _hash(state) and draw.mask == _hash(torch_mask)


# ------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_correct_cases_are_equivalent(world, dtype):
    names = ["init_std", "bernoulli"] + (["own_reset", "generator_reset"] if world == 2 else [])
    r = _run(names, world, dtype)
    for name in names:
        assert r[name]["verdict"] == "equivalent", (name, r[name]["summary"])
    assert any(c["name"].startswith("rng:drop_hidden") for c in r["bernoulli"]["checks"])


def test_bernoulli_rng_bugs_are_caught_with_their_signature_and_the_failing_init_is_named():
    r = _run(["bernoulli_hidden_same_seed", "bernoulli_out_seeded_by_rank"], 2, "bfloat16")
    r |= _run(["broken_generator_reset"], 2, "float32")
    same_seed, by_rank = r["bernoulli_hidden_same_seed"], r["bernoulli_out_seeded_by_rank"]
    assert same_seed["verdict"] == by_rank["verdict"] == "not equivalent"
    assert same_seed["diagnosis"]["signature"] == "rng_not_forked"
    assert same_seed["first_divergence"]["name"] == "rng:drop_hidden: bernoulli #1"
    assert by_rank["diagnosis"]["signature"] == "rng_diverged"
    assert by_rank["first_divergence"]["name"] == "rng:drop_out: bernoulli #1"
    broken = r["broken_generator_reset"]
    assert broken["verdict"] == "invalid"
    assert (
        "tpcheck's default init called BrokenGeneratorResetDense.reset_parameters"
        in (broken["summary"])
    )
    assert "your init" not in broken["summary"]
