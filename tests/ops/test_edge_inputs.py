"""Edge inputs of every op on every CPU impl: resets (g = -inf), H_t = 0, non-finite activations, invalid initial
states, unchecked NaN rows, empty sequences."""
import pytest
import torch

from kalmix.ops import gated_kalmanet, kaczmarz_attention, kalman_attention, variational_linear_attention

IMPLS = ["naive", "torch", "triton"]
B, T, H, K, V = 2, 9, 2, 4, 4


def acts(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    q, k, u = (torch.randn(B, T, H, K, dtype=dtype) for _ in range(3))
    v = torch.randn(B, T, H, V, dtype=dtype)
    return q, k, v, u


def gates(dtype=torch.float64):
    g = -0.1 * torch.rand(B, T, H, dtype=dtype)
    g[0, 4, 0] = g[1, 0, 1] = g[1, 5, 1] = float("-inf")                  # resets mid-chunk and at the start
    return g, 0.5 + 0.5 * torch.rand(B, T, H, dtype=dtype)


def test_reset_matches_the_loop():
    q, k, v, _ = acts()
    g, eta = gates()
    ref, S_ref = kaczmarz_attention(q, k, v, g, eta, impl="naive", output_final_state=True)
    o, S = kaczmarz_attention(q, k, v, g, eta, impl="torch", output_final_state=True)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(o, ref)
    torch.testing.assert_close(S, S_ref)
    for num_iters in (None, 8):
        ref, (H_ref, _) = gated_kalmanet(q, k, v, g, eta, num_iters=num_iters, impl="naive", output_final_state=True)
        o, (Hs, _) = gated_kalmanet(q, k, v, g, eta, num_iters=num_iters, impl="torch", output_final_state=True)
        assert torch.isfinite(ref).all()
        torch.testing.assert_close(o, ref)
        torch.testing.assert_close(Hs, H_ref)


def test_reset_gradient_is_finite():
    q, k, v, _ = (x.requires_grad_() for x in acts())
    g, eta = gates()
    g.requires_grad_()
    o = kaczmarz_attention(q, k, v, g, eta, impl="torch")[0] + gated_kalmanet(q, k, v, g, eta, impl="torch")[0]
    o.square().sum().backward()
    for x in (q, k, v, g):
        assert torch.isfinite(x.grad).all()
    assert (g.grad[torch.isneginf(g)] == 0).all()


@pytest.mark.parametrize("op", ["kaczmarz", "gka"])
def test_triton_rejects_reset_by_name(op):
    q, k, v, _ = acts(torch.float32)
    g, eta = gates(torch.float32)
    with pytest.raises(ValueError, match=r"impl='triton' takes no reset g = -inf"):
        if op == "kaczmarz":
            kaczmarz_attention(q, k, v, g, eta, impl="triton")
        else:
            gated_kalmanet(q, k, v, g, eta, impl="triton")


@pytest.mark.parametrize("impl", IMPLS)
def test_gka_empty_history_reads_x_zero(impl):
    """H_t = 0 (zero start state and β = 0, or a reset with β = 0): x_t = 0, so o_t = scale · U_tᵀ (1 − α) q_t."""
    q, k, v, _ = acts(torch.float32)
    beta = torch.ones(B, T, H)
    beta[:, 0] = 0
    beta[0, 4, 0] = 0
    g = torch.zeros(B, T, H)
    g[0, 4, 0] = -1e4 if impl == "triton" else float("-inf")           # triton takes no reset; exp(-1e4) = 0
    iters = [8] if impl == "triton" else [None, 8]
    for num_iters in iters:
        o = gated_kalmanet(q, k, v, g, beta, num_iters=num_iters, impl=impl)[0]
        assert torch.isfinite(o).all()
        assert (o[:, 0] == 0).all() and (o[0, 4, 0] == 0).all()
    U = torch.randn(B, H, K, V)
    alpha = torch.full((B, T, H), 0.25)
    o = gated_kalmanet(q, k, v, None, beta, alpha, num_iters=iters[-1], impl=impl,
                       initial_state=(torch.zeros(B, H, K, K), U))[0]
    torch.testing.assert_close(o[:, 0], K ** -0.5 * torch.einsum("bhk,bhkv->bhv", 0.75 * q[:, 0], U))


def _call(op, q, k, v, u, impl, **kw):
    if op == "kaczmarz":
        g, eta = gates(q.dtype)
        return kaczmarz_attention(q, k, v, g.clamp_min(-1), eta, impl=impl, **kw)
    if op == "gka":
        return gated_kalmanet(q, k, v, impl=impl, num_iters=4, **kw)
    if op == "vla":
        return variational_linear_attention(q, k, v, u, impl=impl, **kw)
    prec = torch.ones(B, T, H, V, dtype=q.dtype)
    return kalman_attention(q, k, v, prec, torch.full((H, K, V), 0.9, dtype=q.dtype),
                            torch.full((H, K, V), 1e-3, dtype=q.dtype), impl=impl, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["kaczmarz", "gka", "vla", "kalman"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_activation_is_rejected(op, impl, name, bad):
    x = dict(zip("qkvu", acts(torch.float32)))
    x[name][1, 3, 0, 1] = bad
    with pytest.raises(ValueError, match=rf"`{name}` contains NaN or Inf; it must be finite"):
        _call(op, *x.values(), impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_gka_initial_h_must_be_symmetric_psd(impl):
    q, k, v, _ = acts(torch.float32)
    X = torch.randn(B, H, K, K)
    U = torch.zeros(B, H, K, V)
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(H\).*must be symmetric"):
        gated_kalmanet(q, k, v, impl=impl, num_iters=4, initial_state=(X, U))
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(H\).*must be positive semi-definite"):
        gated_kalmanet(q, k, v, impl=impl, num_iters=4, initial_state=(X @ X.mT - 50 * torch.eye(K), U))
    o = gated_kalmanet(q, k, v, impl=impl, num_iters=4, initial_state=(X @ X.mT, U))[0]
    assert torch.isfinite(o).all()


def test_gka_psd_tolerance_is_the_state_dtypes_precision():
    """A PSD H rounded to bf16 (a state carried between chunks in bf16) is PSD only to bf16's precision: the check
    takes it; an H with λ_min = -0.05 ‖H‖_F is refused in bf16 too."""
    from kalmix.ops.gka.op import PSD_TOL, psd_ranges
    torch.manual_seed(0)
    X = torch.randn(2, 3, 64, 8, dtype=torch.float64)
    Hs = X @ X.mT                                                   # rank 8: 56 zero eigenvalues
    Hb = Hs.to(torch.bfloat16)
    low = psd_ranges(Hb, torch.float32)[1]
    assert low.x.min() < -PSD_TOL                               # rounding alone breaks the fp32 tolerance...
    assert low.lo <= low.x.min()                               # ...and stays within bf16's
    bad = (Hs - 0.05 * torch.linalg.matrix_norm(Hs)[..., None, None] * torch.eye(64, dtype=torch.float64))
    bad_low = psd_ranges(bad.to(torch.bfloat16), torch.float32)[1]
    assert (bad_low.x < bad_low.lo).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_vla_initial_a_must_be_positive_definite(impl):
    q, k, v, u = acts(torch.float32)
    A = torch.eye(K).repeat(B, H, 1, 1)
    A[1, 0, 2, 2] = -1.0
    state = (torch.zeros(B, H, K, V), A, torch.zeros(B, H, K))
    with pytest.raises(ValueError, match=r"initial_state\[1\] \(A\).*positive definite"):
        variational_linear_attention(q, k, v, u, impl=impl, initial_state=state)
    A = torch.eye(K).repeat(B, H, 1, 1)
    A[0, 1, 0, 3] = 0.5
    with pytest.raises(ValueError, match=r"initial_state\[1\] \(A\).*symmetric"):
        variational_linear_attention(q, k, v, u, impl=impl, initial_state=(state[0], A, state[2]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["q", "k", "v", "u"])
def test_vla_unchecked_nan_stays_in_its_sequence(impl, name):
    x = dict(zip("qkvu", acts(torch.float32)))
    x[name][1, 3, 0, 1] = float("nan")
    o = variational_linear_attention(*x.values(), impl=impl, check_values=False)[0]
    assert torch.isfinite(o[0]).all() and o[1].isnan().any()


@pytest.mark.parametrize("op", ["kaczmarz", "gka", "vla", "kalman"])
def test_empty_sequence_is_a_clear_error(op):
    q, k, v, u = (x[:, :0] for x in acts(torch.float32))
    with pytest.raises(ValueError, match=r"`q` must not be empty, got shape \[2, 0, 2, 4\]"):
        _call(op, q, k, v, u, "torch")
