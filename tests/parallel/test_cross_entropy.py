"""Vocab-parallel cross-entropy at world size 1 (no communication) against F.cross_entropy; world
sizes 2 and 4 are checked by the `cross_entropy` and `lm` blocks
(tests/distributed/test_blocks.py)."""

import pytest
import torch
import torch.nn.functional as F

from tpcheck.parallel.cross_entropy import vocab_parallel_cross_entropy
from tpcheck.parallel.group import TPGroup


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 3, 11, generator=g)).to(dtype)
    labels = torch.randint(0, 11, (5, 3), generator=g)
    labels[0, 1] = labels[3, 2] = -100
    return logits, labels


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
def test_matches_torch_loss_and_grad(smoothing):
    logits, labels = _data()
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(a, labels, TPGroup.single(), label_smoothing=smoothing)
    ref = F.cross_entropy(
        b.reshape(-1, 11), labels.reshape(-1), ignore_index=-100, label_smoothing=smoothing
    )
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)  # float64: only reordering
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    # ignored tokens get no grad
    assert torch.all(a.grad[0, 1] == 0) and torch.all(a.grad[3, 2] == 0)


def test_gradcheck():
    logits, labels = _data()
    logits = logits[:2].clone().requires_grad_()
    fn = lambda x: vocab_parallel_cross_entropy(
        x, labels[:2], TPGroup.single(), label_smoothing=0.2
    )  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logits,))


def test_bfloat16_logits_are_computed_in_float32():
    logits, labels = _data(torch.bfloat16)
    ours = vocab_parallel_cross_entropy(logits, labels, TPGroup.single())
    truth = F.cross_entropy(logits.double().reshape(-1, 11), labels.reshape(-1))
    assert ours.dtype == torch.bfloat16
    # one bf16 rounding of the result
    assert abs(float(ours) - float(truth)) <= 2**-8 * abs(float(truth))


def test_large_logits_do_not_overflow():
    logits = torch.tensor([[1e4, 0.0, -1e4]])
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([1]), TPGroup.single())
    assert torch.isfinite(loss) and abs(float(loss) - 1e4) < 1e-2


def test_bad_labels_shape():
    with pytest.raises(ValueError, match="do not match"):
        vocab_parallel_cross_entropy(
            torch.zeros(4, 3), torch.zeros(3, dtype=torch.long), TPGroup.single()
        )
