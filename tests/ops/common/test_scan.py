"""The chunked scans against plain loops, forward and reverse, at lengths around the chunk size."""
import pytest
import torch

from kalmix.ops.common.scan import affine_scan, mobius_scan


@pytest.mark.parametrize("T", [1, 7, 8, 9, 33])
@pytest.mark.parametrize("reverse", [False, True])
def test_affine_scan_matches_loop(T, reverse):
    gen = torch.Generator().manual_seed(T)
    c = torch.rand(2, T, 3, generator=gen, dtype=torch.float64)
    b = torch.randn(2, T, 3, generator=gen, dtype=torch.float64)
    x0 = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    c_in, b_in = c.clone(), b.clone()
    out = affine_scan(c, b, x0, reverse=reverse)
    assert torch.equal(c, c_in) and torch.equal(b, b_in)            # inputs untouched
    ref, x = torch.empty_like(b), x0
    for t in (reversed(range(T)) if reverse else range(T)):
        x = c[:, t] * x + b[:, t]
        ref[:, t] = x
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 8, 13, 40])
def test_mobius_scan_matches_loop(T):
    gen = torch.Generator().manual_seed(T)
    m = [torch.rand(2, T, 3, generator=gen, dtype=torch.float64) + 0.1 for _ in range(4)]
    x0 = torch.rand(2, 3, generator=gen, dtype=torch.float64)
    out = mobius_scan(*m, x0)
    ref, x = torch.empty_like(m[0]), x0
    for t in range(T):
        x = (m[0][:, t] * x + m[1][:, t]) / (m[2][:, t] * x + m[3][:, t])
        ref[:, t] = x
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
