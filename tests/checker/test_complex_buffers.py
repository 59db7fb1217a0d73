"""Complex buffers (a complex RoPE cache, as torchtitan's Llama 3 keeps) are compared by their real
and imaginary parts: a difference in either part counts, and scales include both."""

import torch

from tpcheck.checker.rank.measure import absmax, maxdiff


def test_a_difference_in_the_imaginary_part_counts():
    a = torch.polar(torch.ones(6), torch.linspace(0, 1, 6))
    b = a.clone()
    assert maxdiff(a, b) == 0.0
    b[3] = torch.complex(a[3].real, a[3].imag + 0.25)
    assert abs(maxdiff(a, b) - 0.25) < 1e-6
    assert abs(maxdiff(a.to(torch.complex128), b.to(torch.complex128)) - 0.25) < 1e-6


def test_the_scale_of_a_complex_tensor_includes_its_imaginary_part():
    t = torch.tensor([0.5 + 3.0j, -1.0 + 0.0j])
    assert absmax(t) == 3.0
