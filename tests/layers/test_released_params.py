"""The layers' options that reproduce the authors' released code, against fp64 token loops written from that code:
VLA's ``write_key="feature"``, GKA's ``beta_scaling="squared"``, Kalman's ``noise_param="p"``. Each test feeds
the same inputs to the loop and to the kalmix layer (or op) with the option, on every path it runs, and checks
that the default computes something else.

Sources read (commit, file, lines):
- VLA: Vishal-sys-code/variational-linear-attention @ 71b33b1, src/models/attention/vla_v3.py, lines 48–87.
- GKA: awslabs/hybrid-model-factory @ 04b6242, training/src/hmf/model/hybrid_zoo/layers/gated_kalmanet/gka.py,
  lines 176–177 and 476–506, and ops/chebyshev/gka_chebyshev_solve.py, lines 225–255 and 373–395.
- Kalman: vaisakh-shaj/kalman-linear-attention @ cb2a550, src/kla/layers/kla_layer.py, lines 164–190, 217–231 and
  311–342, and src/kla/ops/kla_ops.py, lines 54–61 and 293–331.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from kalmix import ops
from kalmix.layers import GatedKalmaNet, KalmanAttention, VariationalLinearAttention
from kalmix.layers.fused import P_MIN, ou_dynamics
from kalmix.ops.common.testing import CASES, assert_close, outputs_and_grads, random_functional_grads

TOL = 1e-12


def _phi(x):
    return F.elu(x) + 1.0


def _differs(a, b, min_rel=1e-3):
    return ((a - b).norm() / b.norm()).item() > min_rel


# ------------------------------------------------------------------------------------------------------------ VLA
def vla_released(q, k, v, u, lambda0=0.1, eps=1e-6):
    """vla_v3.py lines 48–87 per (batch, head), q, k, v, u [B, T, H, K]: features φ = elu + 1 of q and k; u unit
    and scaled by 1/√K; A_0 = I/λ0; per token the Sherman–Morrison downdate with δ clamped at 1e-4, the write along
    k̂ = φ(k)/‖φ(k)‖ with direction A k̂/‖A k̂‖, z += φ(k), o = S φ(q) / max(z·φ(q), 1e-6). Its refresh A += 1e-3 I
    every 20th token is not part of kalmix's op, so the inputs here stay below 20 tokens. S is [V, K] there."""
    B, T, H, K = q.shape
    kf, qf = _phi(k), _phi(q)
    ud = F.normalize(u, dim=-1) / math.sqrt(K)
    A = torch.eye(K, dtype=q.dtype).expand(B, H, K, K) / lambda0
    S = q.new_zeros(B, H, v.shape[-1], K)
    z = q.new_zeros(B, H, K)
    out = []
    assert T < 20
    for t in range(T):
        zs = (A @ ud[:, t, ..., None])[..., 0]
        delta = (1.0 + (ud[:, t] * zs).sum(-1)).clamp_min(1e-4)
        A = A - zs[..., :, None] * zs[..., None, :] / delta[..., None, None]
        kn = F.normalize(kf[:, t], dim=-1)
        an = F.normalize((A @ kn[..., None])[..., 0], dim=-1)
        err = v[:, t] - (S @ kn[..., None])[..., 0]
        S = S + err[..., :, None] * an[..., None, :]
        z = z + kf[:, t]
        o = (S @ qf[:, t, ..., None])[..., 0]
        out.append(o / (z * qf[:, t]).sum(-1, keepdim=True).clamp_min(eps))
    return torch.stack(out, 1)


@pytest.mark.parametrize("impl", ["naive", "torch", "triton"])
def test_vla_feature_write_key_is_the_released_recurrence(impl):
    """The layer with write_key="feature" (and eps = 1e-6, the released clamp) against the released loop on the
    layer's own projections, read out by its out projection; the default λ0 = 0.1·head_dim with unit u is the
    released λ0 = 0.1 with u/√head_dim."""
    torch.manual_seed(0)
    layer = VariationalLinearAttention(16, num_heads=2, eps=1e-6, write_key="feature", impl=impl).double()
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    with torch.no_grad():
        q, k, v, u = layer.project(x, None)[0]
        ref = layer.o_proj(vla_released(q, k, v, u).flatten(2))
        out = layer(x)[0]
        assert_close("out", out, ref, TOL)
        layer.write_key = "raw"
        assert _differs(layer(x)[0], ref)


def test_vla_op_write_key_every_impl():
    """The op's write_key="feature" on every impl: outputs against the released loop from the default state, and
    outputs and gradients of torch and triton against naive from a random state."""
    gen = torch.Generator().manual_seed(1)
    case = CASES["vla"]
    args = case.inputs(2, 19, 2, 20, 12, torch.float64, gen)
    state = case.state(2, 2, 20, 12, torch.float64, gen)
    q, k, v, u = args
    ref = vla_released(q, k, v, u)
    for impl in ("naive", "torch", "triton"):
        o, _ = ops.variational_linear_attention(q, k, v, u, lambda0=0.1 * 20, eps=1e-6, write_key="feature",
                                                impl=impl)
        assert_close(f"o {impl}", o, ref, TOL)
    naive = outputs_and_grads(case, args, state, "naive", write_key="feature")
    for impl in ("torch", "triton"):
        res = outputs_and_grads(case, args, state, impl, write_key="feature")
        for i, (a, b) in enumerate(zip(res[0] + res[1], naive[0] + naive[1])):
            assert_close(f"{impl} output/gradient {i}", a, b, TOL)
    raw = outputs_and_grads(case, args, state, "naive")
    assert _differs(raw[0][0], naive[0][0])


# ------------------------------------------------------------------------------------------------------------ GKA
def chebyshev_released(Hs, q, ridge, num_iters):
    """gka_chebyshev_solve.py lines 226–255: λ = ridge·‖H‖_F, step 2/(2λ + ‖H‖_F), ρ²/4 = (‖H‖_F/(2λ + ‖H‖_F)/2)²,
    x_0 = step·q, x_{-1} = 0, ω_0 = 2; ω ← 1/(1 − ρ²/4·ω), x ← ωx − (step·ω·((H + λI)x − q) + (ω − 1)x_prev)."""
    fro = torch.linalg.matrix_norm(Hs)[..., None]
    lam = ridge * fro
    step = 2 / (2 * lam + fro)
    r = (fro / (2 * lam + fro) / 2) ** 2
    x_prev, x, omega = torch.zeros_like(q), step * q, 2.0
    for _ in range(num_iters):
        omega = 1.0 / (1.0 - r * omega)
        grad = step * omega * ((Hs @ x[..., None])[..., 0] + lam * x - q) + (omega - 1) * x_prev
        x_prev, x = x, omega * x - grad
    return x


def gka_released(q, k, v, g, beta, alpha, ridge, num_iters):
    """gka.py lines 486–490: k and v scaled by β + 1e-6; then per token the decode path (lines 373–395 of
    gka_chebyshev_solve.py): H ← e^g H + k kᵀ (line 225), x = Chebyshev (or the exact solve for num_iters None),
    q ← q + α(x − q), U ← e^g U + k vᵀ, o = D^{-1/2} Uᵀ q (simple GLA with gla_scale, gka.py line 177)."""
    B, T, H, D = q.shape
    k = (beta[..., None] + 1e-6) * k
    v = (beta[..., None] + 1e-6) * v
    Hs = q.new_zeros(B, H, D, D)
    Us = q.new_zeros(B, H, D, v.shape[-1])
    out = []
    for t in range(T):
        gam = g[:, t].exp()[..., None, None]
        Hs = gam * Hs + k[:, t, ..., :, None] * k[:, t, ..., None, :]
        Us = gam * Us + k[:, t, ..., :, None] * v[:, t, ..., None, :]
        if num_iters is None:
            lam = ridge * torch.linalg.matrix_norm(Hs)[..., None, None]
            x = torch.linalg.solve(Hs + lam * torch.eye(D, dtype=q.dtype), q[:, t])
        else:
            x = chebyshev_released(Hs, q[:, t], ridge, num_iters)
        qt = q[:, t] + alpha[:, t, ..., None] * (x - q[:, t])
        out.append(D ** -0.5 * (Us.transpose(-1, -2) @ qt[..., None])[..., 0])
    return torch.stack(out, 1)


@pytest.mark.parametrize("impl,num_iters", [("naive", 30), ("torch", 30), ("triton", 30), ("torch", None)])
def test_gka_squared_beta_is_the_released_recurrence(impl, num_iters):
    """The layer with beta_scaling="squared" against the released recurrence on the layer's unit q, k, its v, decay,
    α and raw β = sigmoid(in_proj's β part + beta_bias), through the layer's readout. (The released layer normalises q, k as
    x/(‖x‖ + 1e-6), kalmix as x/max(‖x‖, 1e-6): both loops start from kalmix's unit q, k.)"""
    torch.manual_seed(0)
    layer = GatedKalmaNet(16, num_heads=2, num_iters=num_iters, beta_scaling="squared", impl=impl).double()
    with torch.no_grad():
        layer.beta_bias.normal_()                         # β spread over (0, 1)
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    with torch.no_grad():
        (q, k, v, g, _, alpha), gate, _ = layer.project(x, None)
        beta = torch.sigmoid(layer.in_proj(x).split(layer.splits, dim=-1)[2] + layer.beta_bias)
        o = gka_released(q, k, v, g, beta, alpha, layer.ridge, num_iters)
        ref = layer.readout(o, None, gate)[0]
        assert_close("out", layer(x)[0], ref, TOL)
        layer.beta_scaling = "linear"
        assert _differs(layer(x)[0], ref)


# --------------------------------------------------------------------------------------------------------- Kalman
def kalman_released(q, k, v, w, A_log, delta, p, z, gate, skip, w_out):
    """kla_layer.py lines 164–190: a = −exp(lambda_log), Δ = softplus(delta) + 1e-7, p clamped at 1e-7,
    ā = exp(Δa), p̄ = p/(2|a|)·(1 − exp(−2|a|Δ)); kla_ops.py lines 54–61 and 293–331 per token from precision 1,
    mean 0: φ = Λv k², r = v Λv k, den = ā² + p̄λ, λ ← λ/den + φ, η ← (ā/den) η + r, y = Σ_s q_s η/λ,
    y_var = Σ_s q_s²/λ (the 1e-12 floors there never bind here); kla_layer.py lines 332–342: (y + skip·z)·SiLU(gate)
    through out_proj, y_var·SiLU(gate)² through out_proj's squared weights. Layout [B, M, S] (M channels, S state
    slots), the parameters [M, S]; q, k [B, T, S] shared by the channels (one head)."""
    a = -torch.exp(A_log)
    dt = F.softplus(delta) + 1e-7
    pc = p.clamp_min(1e-7)
    a_bar = torch.exp(dt * a)
    lam_pos = a.abs().clamp_min(1e-8)
    p_bar = pc / (2 * lam_pos) * -torch.expm1(-2 * lam_pos * dt)
    B, T, M = v.shape
    lam = v.new_ones(B, M, k.shape[-1])
    eta = torch.zeros_like(lam)
    ys, yvars = [], []
    for t in range(T):
        phi = w[:, t, :, None] * k[:, t, None, :] ** 2
        r = (v[:, t] * w[:, t])[..., None] * k[:, t, None, :]
        den = a_bar ** 2 + p_bar * lam
        lam = lam / den + phi
        eta = a_bar / den * eta + r
        ys.append(torch.einsum("bms,bs->bm", eta / lam, q[:, t]))
        yvars.append(torch.einsum("bms,bs->bm", 1 / lam, q[:, t] ** 2))
    y, y_var = torch.stack(ys, 1), torch.stack(yvars, 1)
    g = F.silu(gate)
    return F.linear((y + skip * z) * g, w_out), F.linear(y_var * g ** 2, w_out ** 2)


def _inv_softplus(y):
    return y + torch.log(-torch.expm1(-y))


@pytest.mark.parametrize("impl", ["naive", "torch", "triton"])
def test_kalman_linear_noise_is_the_released_recurrence(impl):
    """The layer with noise_param="p" (impl="triton": the fused kernels, the OU one included) against the released
    layer's dynamics, filter and readout on the layer's sensor outputs. The released parameters (lambda_log, delta,
    p) map to kalmix's as A_log = lambda_log, softplus(dt_raw) = softplus(delta) + 1e-7, p = p; some p are below
    the clamp."""
    torch.manual_seed(0)
    layer = KalmanAttention(8, d_state=4, noise_param="p", impl=impl).double()
    M, N = layer.d_inner, layer.d_state
    gen = torch.Generator().manual_seed(1)
    lambda_log = torch.rand(M, N, generator=gen, dtype=torch.float64) * 2 - 1
    delta = _inv_softplus(torch.exp(torch.rand(M, N, generator=gen, dtype=torch.float64) * 4.6 - 6.9))
    p = torch.rand(M, N, generator=gen, dtype=torch.float64) * 0.6 - 0.1
    with torch.no_grad():
        layer.A_log.copy_(lambda_log.T[None])
        layer.dt_raw.copy_(_inv_softplus(F.softplus(delta) + 1e-7).T[None])
        layer.p.copy_(p.T[None])
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    with torch.no_grad():
        (q, k, v, w), (z, gate), _ = layer.project(x, None)
        ref = kalman_released(q[:, :, 0], k[:, :, 0], v.flatten(2), w.flatten(2), lambda_log, delta, p, z, gate,
                              layer.skip, layer.out_proj.weight)
        out, var, _ = layer(x, output_variance=True)
        assert_close("out", out, ref[0], TOL)
        assert_close("variance", var, ref[1], TOL)
        layer.noise_param = "p2"
        assert _differs(layer(x, output_variance=True)[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ou_dynamics_linear_p(dtype):
    """The fused OU kernel with linear_p against the torch chain: values and every gradient, p on both sides of
    the 1e-7 clamp and exactly at it (where clamp_min passes the gradient)."""
    gen = torch.Generator().manual_seed(3)
    n = 1100
    dt = torch.exp(torch.rand(n, generator=gen, dtype=torch.float64) * 10 - 9)
    dt_raw = _inv_softplus(dt).to(dtype)
    A_log = (torch.rand(n, generator=gen, dtype=torch.float64) * 5 - 2).to(dtype)
    p = torch.rand(n, generator=gen, dtype=torch.float64) * 0.1 - 0.02
    p[:5] = torch.tensor([0.0, -1.0, 1e-8, 1e-6, P_MIN], dtype=torch.float64)
    p = p.to(dtype)
    assert (p < P_MIN).any() and (p == torch.tensor(P_MIN, dtype=dtype)).any()

    def chain(A_log, dt_raw, p):
        a = A_log.double().exp()
        d = F.softplus(dt_raw.double())
        return torch.exp(-a * d), p.double().clamp_min(P_MIN) / (2 * a) * -torch.expm1(-2 * a * d)

    res = []
    for fn in (lambda *x: ou_dynamics(*x, linear_p=True), chain):
        xs = [t.view(11, 4, 25).detach().clone().requires_grad_() for t in (A_log, dt_raw, p)]
        outs = fn(*xs)
        res.append([o.detach().double() for o in outs] + [d.double() for d in random_functional_grads(outs, xs)])
    tol = {torch.float64: 1e-12, torch.float32: 2e-6}[dtype]
    for name, a, b in zip(("ā", "p̄", "dA_log", "ddt_raw", "dp"), *res):
        assert_close(name, a, b, tol)
    assert (res[0][4].flatten()[p < P_MIN] == 0).all()


# --------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("cls,kw,allowed", [
    (VariationalLinearAttention, dict(write_key="elu"), "('raw', 'feature')"),
    (GatedKalmaNet, dict(beta_scaling="released"), "('linear', 'squared')"),
    (KalmanAttention, dict(noise_param="p^2"), "('p2', 'p')"),
])
def test_unknown_option_values_are_refused(cls, kw, allowed):
    with pytest.raises(ValueError, match=f"{next(iter(kw))} must be one of {allowed}".replace("(", r"\(")
                       .replace(")", r"\)")):
        cls(16, **kw)


def test_op_refuses_unknown_write_key():
    q = torch.randn(1, 3, 1, 4)
    with pytest.raises(ValueError, match=r"write_key.*\('raw', 'feature'\)"):
        ops.variational_linear_attention(q, q, q, q, write_key="elu")
