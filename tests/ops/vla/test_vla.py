"""Variational linear attention against an explicit matrix inverse per token."""
import pytest
import torch
import torch.nn.functional as F

from kalmix import ops
from kalmix.ops import SPECS
from kalmix.ops.common.testing import assert_close


def inverse_reference(q, k, v, u, lambda0, eps):
    """A_t = (λ0 I + Σ_{s≤t} û_s û_sᵀ)^{-1} by torch.linalg.inv; the RLS recursion for S; n by cumsum."""
    B, T, H, K = q.shape
    kh, uh = F.normalize(k, dim=-1), F.normalize(u, dim=-1)
    S = torch.zeros(B, H, K, v.shape[-1], dtype=q.dtype)
    n = (F.elu(k) + 1).cumsum(1)
    os = []
    for t in range(T):
        M = lambda0 * torch.eye(K, dtype=q.dtype) + torch.einsum("bshi,bshj->bhij", uh[:, :t + 1], uh[:, :t + 1])
        ak = torch.einsum("bhij,bhj->bhi", torch.linalg.inv(M), kh[:, t])
        alpha = ak / ak.norm(dim=-1, keepdim=True)
        S = S + torch.einsum("bhk,bhv->bhkv", alpha, v[:, t] - torch.einsum("bhk,bhkv->bhv", kh[:, t], S))
        fq = F.elu(q[:, t]) + 1
        os.append(torch.einsum("bhk,bhkv->bhv", fq, S) / (fq * n[:, t]).sum(-1).clamp_min(eps)[..., None])
    return torch.stack(os, 1)


@pytest.mark.parametrize("impl", ["naive", "torch"])
@pytest.mark.parametrize("lambda0", [0.1, 2.0])
def test_matches_explicit_inverse(impl, lambda0):
    gen = torch.Generator().manual_seed(0)
    args = SPECS["vla"].inputs(2, 150, 2, 6, 4, torch.float64, gen)
    o, (S, A, n) = ops.variational_linear_attention(*args, lambda0=lambda0, output_final_state=True, impl=impl)
    assert_close("o", o, inverse_reference(*args, lambda0, 1e-4), 1e-9)
    uh = F.normalize(args[3], dim=-1)
    M = lambda0 * torch.eye(6, dtype=torch.float64) + torch.einsum("bshi,bshj->bhij", uh, uh)
    assert_close("A", A, torch.linalg.inv(M), 1e-10)


def test_fp32_long_sequence_matches_fp64():
    gen = torch.Generator().manual_seed(0)
    args = SPECS["vla"].inputs(1, 2048, 2, 16, 16, torch.float64, gen)
    ref, _ = ops.variational_linear_attention(*args, impl="torch")
    o, _ = ops.variational_linear_attention(*[a.float() for a in args], impl="torch")
    assert_close("o", o, ref, 1e-3)
