"""impl="triton" of Gated KalmaNet: chunked Triton kernels, forward and an implicit-differentiation backward.

Per chunk of C tokens with start states (H_c, U_c), G_t the log decay since the chunk start, Γ_t = e^{G_t} and
M[t, s] = β_s e^{G_t − G_s} (s <= t), every H_t acts without being formed (README of kalmix/ops/gka):

    H_t x_t = Γ_t H_c x_t + Σ_s M[t, s] (k_s · x_t) k_s       all t at once: Γ ⊙ (X H_c) + (M ⊙ X Kᵀ) K
    ‖H_t‖² = Γ_t² ‖H_c‖² + 2 Γ_t Σ_s M[t, s] k_sᵀ H_c k_s + Σ_{s, s'} M[t, s] M[t, s'] (k_s · k_s')²

so Chebyshev runs the whole chunk's systems together on tensor cores (the iterate in fp32, operands in the
activations' dtype; fp32 inputs as 3×TF32). The backward differentiates the solve implicitly: with
dq̃_t = scale·U_t do_t and dx_t = α_t dq̃_t, it solves y_t = (H_t + λ_t I)⁻¹ dx_t with the same solver, and
the solve hands H_t the gradient dH_t = −y_t x_tᵀ + c_t H_t, c_t = −ridge (x_t · y_t)/‖H_t‖. The state adjoints
run backwards over chunks as D_c = Γ_C D_{c+1} + Σ_t Γ_t dH_t (U's likewise); every chunk then differentiates
its own equations (README, "Triton kernels").

Kernels (every tensor laid out [tokens, H, *] with packed sequences; a chunk never crosses a sequence):
    _states_kernel    per (sequence, head, column block of H or U), forward over chunks: chunk-start states
    _fwd_kernel       per (chunk, head): ‖H_t‖, the Chebyshev solve, q̃, o
    _solve_bwd_kernel per (chunk, head): dq̃, the adjoint solve y, dq, dα, c_t, m_s = Σ_t M[t, s] c_t Γ_t and
                      the other terms that need H_c
    _dstates_kernel   per (sequence, head, column block), backward over chunks: chunk-end state gradients
    _grads_u_kernel   per (chunk, head): dv and U's shares of dk, dβ, dg
    _grads_h_kernel   per (chunk, head): H's shares, then dk, dβ, dg
Chunk-start states are recomputed by the backward, never stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kalmix.ops.common.carveout import prefer_l1
from kalmix.ops.common.checks import compute_dtype, fail
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.triton_utils import (DOT_FP32, chunk_at, chunk_rows, chunk_table, decay, dot, dot32, dot_acc,
                                            gates, load_rows, load_state, load_tokens, operand_dtype, raw_rows,
                                            raw_state, seq_range, store_rows, store_state)
from kalmix.ops.common.varlen import batch_offsets
from kalmix.ops.gka.step import gka_step_fused

_OP = "gated_kalmanet"
# H_c [K, K] is one register tile; at K = 128 the adjoint solve takes 224 of the 227 KB of shared memory an H100 gives
# a block (fp32 and fp64; `python benchmarks/kernel_report.py --ops limits`). V is walked in column blocks.
MAX_K = 128
# above this K the adjoint solve's tail runs as its own kernel: fused, it makes ptxas serialise the solve's tensor-core
# instructions (at K = 64 the split solve is the serialised one). `python benchmarks/kernel_report.py --ops gka` prints
# ptxas's warning; gpu_tests/test_ops_gpu.py::test_gka_solves_keep_their_tensor_core_pipeline fails on it
TAIL_MIN_K = 64
# per operand width (16-bit activations, or fp32/fp64): the chunk length C, the column block of the states and of
# V, and each kernel's warps, or (warps, pipeline stages) (else 1 stage). fp32's 3×TF32 operands need twice the
# shared memory, hence the smaller tiles; the solves run one warpgroup for the chunk's 64 rows. Each value measured
# the fastest of those tried at B = 16, T = 2048 and B = 4, T = 8192 on an H100; `python benchmarks/gka_triton.py
# --configs fwd=8 ...` times other warps against them
CONFIGS = {16: dict(C=64, BV=64, states=(4, 2), fwd=(4, 2), solve_bwd=4, solve_tail=8, dstates=8, grads_u=(8, 2),
                    grads_h=4),
           32: dict(C=32, BV=32, states=4, fwd=8, solve_bwd=8, solve_tail=8, dstates=4, grads_u=8, grads_h=8)}


@triton.jit
def _dotf(a, b):
    """a @ b of fp32 operands to about fp32 accuracy (3×TF32; fp64 stays fp64): the norm's terms."""
    if a.dtype == tl.float64:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision=DOT_FP32)


@triton.jit
def _scan(x_ptr, D, d0, k_ptr, g_ptr, beta_ptr, s0_ptr, h_ptr, sT_ptr, cu_ptr, coff_ptr, i_nh, H, K,
          C: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr):
    """Columns d0..d0+BD of S_t = γ_t S_{t−1} + β_t k_t x_tᵀ ([K, D]) at every chunk start of one sequence."""
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, c0, n_c = seq_range(cu_ptr, coff_ptr, i_n, C)
    S = load_state(s0_ptr, i_nh.to(tl.int64) * K * D, K, D, d0, BK, BD)
    for j in range(0, n_c):
        t0, L, valid = chunk_at(bos, eos, j, C)
        store_state(h_ptr, ((c0 + j).to(tl.int64) * H + i_h) * K * D, S, K, D, d0, BK, BD)
        G, beta, G_end = gates(g_ptr, beta_ptr, t0, L, i_h, H, valid, C)
        Kd = load_rows(k_ptr, t0, L, i_h, H, K, 0, BK, C) * (beta * tl.exp(G_end - G))[:, None]
        S = tl.exp(G_end) * S + dot(tl.trans(Kd), raw_rows(x_ptr, t0, L, i_h, H, D, d0, BD, C), DT)
    store_state(sT_ptr, i_nh.to(tl.int64) * K * D, S, K, D, d0, BK, BD)


@triton.jit
def _states_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, u0_ptr, cu_ptr, coff_ptr, h_ptr, u_ptr, hT_ptr, uT_ptr,
                   H, K, V, NBK, C: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr):
    """H's column blocks first (values k), then U's (values v)."""
    i_b, i_nh = tl.program_id(0), tl.program_id(1)
    if i_b < NBK:
        _scan(k_ptr, K, i_b * BD, k_ptr, g_ptr, beta_ptr, h0_ptr, h_ptr, hT_ptr, cu_ptr, coff_ptr, i_nh, H, K,
              C, BK, BD, DT)
    else:
        _scan(v_ptr, V, (i_b - NBK) * BD, k_ptr, g_ptr, beta_ptr, u0_ptr, u_ptr, uT_ptr, cu_ptr, coff_ptr, i_nh, H,
              K, C, BK, BD, DT)


@triton.jit
def _hnorm(Kc, Hc, M, Gam, DT: tl.constexpr):
    """‖H_t‖_F per row from the chunk expansion (every term >= 0 for PSD H_c)."""
    kHk = tl.sum(dot(Kc, Hc, DT) * Kc, axis=1)
    Kg = dot(Kc, tl.trans(Kc), DT)
    Hf = Hc.to(Gam.dtype)
    sq = (Gam * Gam * tl.sum(tl.sum(Hf * Hf, axis=1), axis=0) + 2. * Gam * tl.sum(M * kHk[None, :], axis=1)
          + tl.sum(_dotf(M, Kg * Kg) * M, axis=1))
    return tl.sqrt(tl.maximum(sq, 0.))


@triton.jit
def _chebyshev(R, Hc, Kc, M, Gam, hnorm, coef_ptr, n_iters, DT: tl.constexpr):
    """X ≈ (H_t + ridge‖H_t‖ I)⁻¹ r_t for every row t of R [C, K]; coef holds 2/(1 + 2 ridge), ridge, then per
    step (ω_i, the weight of ξ_{i−1}) as in kalmix/ops/common/chebyshev.py."""
    step = tl.where(hnorm > 0, tl.load(coef_ptr) / hnorm, 0.)  # 2/(L + μ) per row; 0 keeps x = 0 where H_t = 0
    X = step[:, None] * R
    X_prev = tl.zeros_like(X)
    for i in range(n_iters):
        omega = tl.load(coef_ptr + 2 + 2 * i)
        keep = tl.load(coef_ptr + 3 + 2 * i)
        # the residual H_t x_t − r_t of every row in one accumulator: −R, + (M ⊙ X Kᵀ) K, + (Γ X) H_c (one [C, K]
        # fp32 tile fewer live in a kernel at its register limit)
        E = dot_acc(M * dot(X, tl.trans(Kc), DT), Kc, -R.to(X.dtype), DT)
        E = dot_acc(Gam[:, None] * X, Hc, E, DT)
        X, X_prev = keep * X + (1. - omega) * X_prev - (omega * step)[:, None] * E, X
    return X


@triton.jit
def _chunk(g_ptr, beta_ptr, chunks_ptr, i_c, i_h, H, C: tl.constexpr):
    """The chunk's rows, its G, β, G at its last token, Γ = e^G and M[t, s] = β_s e^{G_t − G_s} (s <= t)."""
    bos, L, rows, cols, valid = chunk_rows(chunks_ptr, i_c, C)
    G, beta, G_end = gates(g_ptr, beta_ptr, bos, L, i_h, H, valid, C)
    Md = decay(G, rows, cols, False)
    return bos, L, rows, cols, valid, G, beta, G_end, tl.exp(G), Md, Md * beta[None, :]


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alpha_ptr, chunks_ptr, h_ptr, u_ptr, coef_ptr, o_ptr, x_ptr,
                hn_ptr, scale, n_iters, H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                DT: tl.constexpr, SOLVE: tl.constexpr, STORE: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid, G, beta, G_end, Gam, Md, M = _chunk(g_ptr, beta_ptr, chunks_ptr, i_c, i_h, H, C)
    # tiles stored in the operand dtype stay in it (exact; half the registers)
    Q = load_rows(q_ptr, bos, L, i_h, H, K, 0, BK, C).to(DT)
    Kc = load_rows(k_ptr, bos, L, i_h, H, K, 0, BK, C).to(DT)
    base = i_c.to(tl.int64) * H + i_h
    if SOLVE:
        Hc = load_state(h_ptr, base * K * K, K, K, 0, BK, BK).to(DT)
        hnorm = _hnorm(Kc, Hc, M, Gam, DT)
        X = _chebyshev(Q, Hc, Kc, M, Gam, hnorm, coef_ptr, n_iters, DT)
        alpha = load_tokens(alpha_ptr, bos, L, i_h, H, 0., C)
        Qt = Q + alpha[:, None] * (X - Q)
        if STORE:
            store_rows(x_ptr, X, bos, L, i_h, H, K, 0, BK, C)
            tl.store(hn_ptr + (bos + tl.arange(0, C)) * H + i_h, hnorm, mask=valid)
    else:
        Qt = Q
    P = M * dot(Qt, tl.trans(Kc), DT)
    for v0 in range(0, V, BV):
        U0 = raw_state(u_ptr, base * K * V, K, V, v0, BK, BV)
        out = dot_acc(Gam[:, None] * Qt, U0, dot(P, raw_rows(v_ptr, bos, L, i_h, H, V, v0, BV, C), DT), DT)
        store_rows(o_ptr, scale * out, bos, L, i_h, H, V, v0, BV, C)


@triton.jit
def _solve_bwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alpha_ptr, chunks_ptr, h_ptr, u_ptr, coef_ptr, x_ptr,
                      hn_ptr, do_ptr, dq_ptr, dalpha_ptr, y_ptr, c_ptr, m_ptr, khk_ptr, dgam_ptr, dkp_ptr, scale,
                      n_iters, H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                      SOLVE: tl.constexpr, TAIL: tl.constexpr):
    """dq̃ (into dkp's rows) and the adjoint solve's y_t, then ``_tail`` unless TAIL (_solve_tail_kernel runs it:
    at K = 128 anything after the solve here, even dq's elementwise update, made ptxas serialise every
    tensor-core instruction of the kernel, its C7515 warning; at K = 64 splitting it off did). Without SOLVE: dq
    and dα."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid, G, beta, G_end, Gam, Md, M = _chunk(g_ptr, beta_ptr, chunks_ptr, i_c, i_h, H, C)
    Kc = load_rows(k_ptr, bos, L, i_h, H, K, 0, BK, C).to(DT)
    base = i_c.to(tl.int64) * H + i_h
    dQt = tl.zeros([C, BK], dtype=G.dtype)          # scale·U_t do_t = Γ dO U_cᵀ + (M ⊙ dO Vᵀ) K
    for v0 in range(0, V, BV):
        U0 = raw_state(u_ptr, base * K * V, K, V, v0, BK, BV)
        dO = raw_rows(do_ptr, bos, L, i_h, H, V, v0, BV, C)
        Vc = raw_rows(v_ptr, bos, L, i_h, H, V, v0, BV, C)
        dQt = dot_acc(M * dot(dO, tl.trans(Vc), DT), Kc, dot_acc(Gam[:, None] * dO, tl.trans(U0), dQt, DT), DT)
    dQt = scale * dQt
    r = tl.arange(0, C)
    tok = (bos + r) * H + i_h
    if SOLVE:
        Hc = load_state(h_ptr, base * K * K, K, K, 0, BK, BK).to(DT)
        hnorm = tl.load(hn_ptr + tok, mask=valid, other=1.)
        alpha = load_tokens(alpha_ptr, bos, L, i_h, H, 0., C)
        # dq̃ waits in dkp's rows (overwritten by _tail) while the solve runs on its right-hand side in the
        # operand dtype (like the forward's q)
        store_rows(dkp_ptr, dQt, bos, L, i_h, H, K, 0, BK, C)
        Y = _chebyshev((alpha[:, None] * dQt).to(DT), Hc, Kc, M, Gam, hnorm, coef_ptr, n_iters, DT)
        store_rows(y_ptr, Y, bos, L, i_h, H, K, 0, BK, C)
        if not TAIL:
            _tail(q_ptr, x_ptr, coef_ptr, dq_ptr, dalpha_ptr, c_ptr, m_ptr, khk_ptr, dgam_ptr, dkp_ptr, Y, Hc, Kc,
                  alpha, hnorm, M, Gam, bos, L, i_h, H, K, valid, tok, C, BK, DT)
    else:
        tl.store(dalpha_ptr + tok, tl.zeros([C], dtype=G.dtype), mask=valid)
        store_rows(dq_ptr, dQt, bos, L, i_h, H, K, 0, BK, C)


@triton.jit
def _tail(q_ptr, x_ptr, coef_ptr, dq_ptr, dalpha_ptr, c_ptr, m_ptr, khk_ptr, dgam_ptr, dkp_ptr, Y, Hc, Kc, alpha,
          hnorm, M, Gam, bos, L, i_h, H, K, valid, tok, C: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """After the adjoint solve, per chunk: dq = (1 − α) dq̃ + y (dq̃ from dkp's rows), dα, c_t, m_s = Σ_t M[t, s]
    c_t Γ_t, and what needs H_c in _grads_h_kernel: k_sᵀH_c k_s, the H_c terms of ∂/∂Γ_t (−y_tᵀH_c x_t + c_t
    (Γ_t ‖H_c‖² + Σ_s M[t, s] k_sᵀH_c k_s)), and dk's 2 m_s H_c k_s (into dkp; _grads_u_kernel adds to it)."""
    dQt = load_rows(dkp_ptr, bos, L, i_h, H, K, 0, BK, C)
    store_rows(dq_ptr, (1. - alpha)[:, None] * dQt + Y, bos, L, i_h, H, K, 0, BK, C)
    X = load_rows(x_ptr, bos, L, i_h, H, K, 0, BK, C)
    tl.store(dalpha_ptr + tok, tl.sum(dQt * (X - load_rows(q_ptr, bos, L, i_h, H, K, 0, BK, C)), axis=1), mask=valid)
    cvec = tl.where(valid & (hnorm > 0), -tl.load(coef_ptr + 1) * tl.sum(X * Y, axis=1) / hnorm, 0.)
    dgam = -tl.sum(dot(Y, Hc, DT) * X, axis=1)
    mvec = tl.sum(M * (cvec * Gam)[:, None], axis=0)
    KH = dot(Kc, Hc, DT)
    kHk = tl.sum(KH * Kc, axis=1)
    store_rows(dkp_ptr, 2. * mvec[:, None] * KH, bos, L, i_h, H, K, 0, BK, C)
    Hf = Hc.to(Gam.dtype)
    dgam += cvec * (Gam * tl.sum(tl.sum(Hf * Hf, axis=1), axis=0) + tl.sum(M * kHk[None, :], axis=1))
    tl.store(c_ptr + tok, cvec, mask=valid)
    tl.store(m_ptr + tok, mvec, mask=valid)
    tl.store(khk_ptr + tok, kHk, mask=valid)
    tl.store(dgam_ptr + tok, dgam, mask=valid)


@triton.jit
def _solve_tail_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, alpha_ptr, chunks_ptr, h_ptr, coef_ptr, x_ptr, hn_ptr, y_ptr,
                       dq_ptr, dalpha_ptr, c_ptr, m_ptr, khk_ptr, dgam_ptr, dkp_ptr, H, K, C: tl.constexpr,
                       BK: tl.constexpr, DT: tl.constexpr):
    """``_tail`` of _solve_bwd_kernel's chunk, as its own kernel (TAIL)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid, G, beta, G_end, Gam, Md, M = _chunk(g_ptr, beta_ptr, chunks_ptr, i_c, i_h, H, C)
    tok = (bos + tl.arange(0, C)) * H + i_h
    Hc = load_state(h_ptr, (i_c.to(tl.int64) * H + i_h) * K * K, K, K, 0, BK, BK).to(DT)
    Kc = load_rows(k_ptr, bos, L, i_h, H, K, 0, BK, C).to(DT)
    _tail(q_ptr, x_ptr, coef_ptr, dq_ptr, dalpha_ptr, c_ptr, m_ptr, khk_ptr, dgam_ptr, dkp_ptr,
          load_rows(y_ptr, bos, L, i_h, H, K, 0, BK, C), Hc, Kc, load_tokens(alpha_ptr, bos, L, i_h, H, 0., C),
          tl.load(hn_ptr + tok, mask=valid, other=1.), M, Gam, bos, L, i_h, H, K, valid, tok, C, BK, DT)


@triton.jit
def _dscan(D, d0, dsT_ptr, ds0_ptr, dst_ptr, s_ptr, dge_ptr, q_ptr, k_ptr, x_ptr, y_ptr, alpha_ptr, c_ptr, m_ptr,
           do_ptr, g_ptr, beta_ptr, cu_ptr, coff_ptr, scale, i_nh, H, K, IS_H: tl.constexpr, C: tl.constexpr,
           BK: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr, SOLVE: tl.constexpr, HAS_DST: tl.constexpr):
    """Columns d0..d0+BD of the chunk-end gradients of H (IS_H: D_c = Γ_C D_{c+1} + Σ_t Γ_t dH_t) or of U
    (E_c = Γ_C E_{c+1} + scale Σ_t Γ_t q̃_t do_tᵀ), backwards over one sequence's chunks; adds these columns'
    share of ⟨D_{c+1}, H_c⟩ + ⟨E_{c+1}, U_c⟩ (the Γ_C-derivative of the chunk-end states) to dge."""
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, c0, n_c = seq_range(cu_ptr, coff_ptr, i_n, C)
    if HAS_DST:
        S = load_state(dsT_ptr, i_nh.to(tl.int64) * K * D, K, D, d0, BK, BD)
    else:
        S = tl.zeros([BK, BD], dtype=ds0_ptr.dtype.element_ty)        # the compute dtype
    for jj in range(0, n_c):
        j = n_c - 1 - jj
        t0, L, valid = chunk_at(bos, eos, j, C)
        base = (c0 + j).to(tl.int64) * H + i_h
        store_state(dst_ptr, base * K * D, S, K, D, d0, BK, BD)
        S0 = raw_state(s_ptr, base * K * D, K, D, d0, BK, BD)
        tl.atomic_add(dge_ptr + base, tl.sum(tl.sum(S * S0, axis=1), axis=0))
        G, beta, G_end = gates(g_ptr, beta_ptr, t0, L, i_h, H, valid, C)
        Gam = tl.exp(G)
        S = tl.exp(G_end) * S
        if IS_H:
            if SOLVE:
                # Σ_t Γ_t dH_t = −(ΓY)ᵀX + (Σ_t Γ_t² c_t) H_c + Kᵀ diag(m) K
                cvec = load_tokens(c_ptr, t0, L, i_h, H, 0., C)
                mvec = load_tokens(m_ptr, t0, L, i_h, H, 0., C)
                Y = load_rows(y_ptr, t0, L, i_h, H, K, 0, BK, C)
                Xd = load_rows(x_ptr, t0, L, i_h, H, K, d0, BD, C)
                Kc = raw_rows(k_ptr, t0, L, i_h, H, K, 0, BK, C)
                Kd = raw_rows(k_ptr, t0, L, i_h, H, K, d0, BD, C)
                S += (tl.sum(Gam * Gam * cvec, axis=0) * S0 - dot(tl.trans(Gam[:, None] * Y), Xd, DT)
                      + dot(tl.trans(Kc * mvec[:, None]), Kd, DT))
        else:
            Q = load_rows(q_ptr, t0, L, i_h, H, K, 0, BK, C)
            if SOLVE:
                alpha = load_tokens(alpha_ptr, t0, L, i_h, H, 0., C)
                Q += alpha[:, None] * (load_rows(x_ptr, t0, L, i_h, H, K, 0, BK, C) - Q)
            S += scale * dot(tl.trans(Gam[:, None] * Q), raw_rows(do_ptr, t0, L, i_h, H, D, d0, BD, C), DT)
    store_state(ds0_ptr, i_nh.to(tl.int64) * K * D, S, K, D, d0, BK, BD)


@triton.jit
def _dstates_kernel(q_ptr, k_ptr, x_ptr, y_ptr, alpha_ptr, c_ptr, m_ptr, do_ptr, g_ptr, beta_ptr, h_ptr, u_ptr,
                    dhT_ptr, duT_ptr, cu_ptr, coff_ptr, dh_ptr, du_ptr, dh0_ptr, du0_ptr, dge_ptr, scale, H, K, V,
                    NBK, C: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr,
                    SOLVE: tl.constexpr, HAS_DST: tl.constexpr):
    i_b, i_nh = tl.program_id(0), tl.program_id(1)
    if i_b < NBK:
        _dscan(K, i_b * BD, dhT_ptr, dh0_ptr, dh_ptr, h_ptr, dge_ptr, q_ptr, k_ptr, x_ptr, y_ptr, alpha_ptr, c_ptr,
               m_ptr, do_ptr, g_ptr, beta_ptr, cu_ptr, coff_ptr, scale, i_nh, H, K, True, C, BK, BD, DT, SOLVE,
               HAS_DST)
    else:
        _dscan(V, (i_b - NBK) * BD, duT_ptr, du0_ptr, du_ptr, u_ptr, dge_ptr, q_ptr, k_ptr, x_ptr, y_ptr,
               alpha_ptr, c_ptr, m_ptr, do_ptr, g_ptr, beta_ptr, cu_ptr, coff_ptr, scale, i_nh, H, K, False, C, BK,
               BD, DT, SOLVE, HAS_DST)


@triton.jit
def _grads_u_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alpha_ptr, chunks_ptr, u_ptr, du_ptr, x_ptr, do_ptr,
                    dkp_ptr, e_ptr, dGp_ptr, dbp_ptr, dv_ptr, scale, H, K, V, C: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, DT: tl.constexpr, SOLVE: tl.constexpr):
    """Per chunk, through o_t = scale (Γ_t U_cᵀ q̃_t + Σ_s M[t, s] (q̃_t · k_s) v_s) and the chunk-end U (its
    gradient E, write weights b_s = β_s e^{G_C − G_s}): dv; dk's share, added to dkp; per token k_sᵀ E v_s, and
    this path's shares of dG and dβ."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid, G, beta, G_end, Gam, Md, M = _chunk(g_ptr, beta_ptr, chunks_ptr, i_c, i_h, H, C)
    Kc = load_rows(k_ptr, bos, L, i_h, H, K, 0, BK, C).to(DT)
    Qt = load_rows(q_ptr, bos, L, i_h, H, K, 0, BK, C)
    if SOLVE:
        alpha = load_tokens(alpha_ptr, bos, L, i_h, H, 0., C)
        Qt += alpha[:, None] * (load_rows(x_ptr, bos, L, i_h, H, K, 0, BK, C) - Qt)
    Qt = Qt.to(DT)                                  # only multiplied in DT
    base = i_c.to(tl.int64) * H + i_h
    QtK = dot(Qt, tl.trans(Kc), DT)
    dOV = QtK * 0.                                  # dO Vᵀ
    VE = tl.zeros([C, BK], dtype=G.dtype)           # V Eᵀ
    e = Gam * 0.                                    # k_sᵀ E v_s
    dGam = Gam * 0.                                 # ∂/∂Γ_t of the Γ_t U_cᵀ q̃_t term
    bend = beta * tl.exp(G_end - G)
    for v0 in range(0, V, BV):
        U0 = raw_state(u_ptr, base * K * V, K, V, v0, BK, BV)
        E = raw_state(du_ptr, base * K * V, K, V, v0, BK, BV)
        Vc = raw_rows(v_ptr, bos, L, i_h, H, V, v0, BV, C)
        dO = raw_rows(do_ptr, bos, L, i_h, H, V, v0, BV, C)
        dOV += dot(dO, tl.trans(Vc), DT)
        dGam += tl.sum(dO * dot(Qt, U0, DT), axis=1)
        KE = dot(Kc, E, DT)
        e += tl.sum(KE * Vc, axis=1)
        VE += dot(Vc, tl.trans(E), DT)
        store_rows(dv_ptr, scale * dot(tl.trans(M * QtK), dO, DT) + bend[:, None] * KE, bos, L, i_h, H, V, v0,
                    BV, C)
    dK = scale * dot(tl.trans(M * dOV), Qt, DT) + bend[:, None] * VE
    if SOLVE:
        dK += load_rows(dkp_ptr, bos, L, i_h, H, K, 0, BK, C)
    store_rows(dkp_ptr, dK, bos, L, i_h, H, K, 0, BK, C)
    dM = scale * dOV * QtK
    P = dM * M
    tok = (bos + tl.arange(0, C)) * H + i_h
    tl.store(e_ptr + tok, e, mask=valid)
    tl.store(dGp_ptr + tok, tl.sum(P, axis=1) - tl.sum(P, axis=0) + scale * Gam * dGam, mask=valid)
    tl.store(dbp_ptr + tok, tl.sum(dM * Md, axis=0), mask=valid)


@triton.jit
def _grads_h_kernel(k_ptr, g_ptr, beta_ptr, chunks_ptr, dh_ptr, x_ptr, y_ptr, c_ptr, khk_ptr, dgam_ptr, dkp_ptr,
                    e_ptr, dGp_ptr, dbp_ptr, dge_ptr, dk_ptr, dg_ptr, dbeta_ptr, H, K, C: tl.constexpr,
                    BK: tl.constexpr, DT: tl.constexpr, SOLVE: tl.constexpr):
    """Per chunk, through H_t = Γ_t H_c + Σ_s M[t, s] k_s k_sᵀ (its gradient dH_t = −y_t x_tᵀ + c_t H_t; the
    H_c terms came from _solve_bwd_kernel) and the chunk-end H (gradient D): dk, and dβ, dg with the U path's
    shares; dg is the reverse cumulative sum of dG (G_t = Σ_{r<=t} g_r)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid, G, beta, G_end, Gam, Md, M = _chunk(g_ptr, beta_ptr, chunks_ptr, i_c, i_h, H, C)
    Kc = load_rows(k_ptr, bos, L, i_h, H, K, 0, BK, C).to(DT)
    base = i_c.to(tl.int64) * H + i_h
    bend = beta * tl.exp(G_end - G)
    Dm = raw_state(dh_ptr, base * K * K, K, K, 0, BK, BK).to(DT)
    KD = dot(Kc, Dm, DT)
    e = load_tokens(e_ptr, bos, L, i_h, H, 0., C) + tl.sum(KD * Kc, axis=1)
    dK = load_rows(dkp_ptr, bos, L, i_h, H, K, 0, BK, C) + bend[:, None] * (KD + dot(Kc, tl.trans(Dm), DT))
    dG = load_tokens(dGp_ptr, bos, L, i_h, H, 0., C)
    dbeta = load_tokens(dbp_ptr, bos, L, i_h, H, 0., C)
    if SOLVE:
        X = load_rows(x_ptr, bos, L, i_h, H, K, 0, BK, C).to(DT)         # only multiplied in DT
        Y = load_rows(y_ptr, bos, L, i_h, H, K, 0, BK, C).to(DT)
        cvec = load_tokens(c_ptr, bos, L, i_h, H, 0., C)
        kHk = load_tokens(khk_ptr, bos, L, i_h, H, 0., C)
        # each [C, C] term is reduced as soon as it is formed (fewer live tiles)
        XK = dot(X, tl.trans(Kc), DT)
        YK = dot(Y, tl.trans(Kc), DT)
        dK -= dot(tl.trans(M * XK), Y, DT) + dot(tl.trans(M * YK), X, DT)
        dM = -YK * XK
        Kg = dot(Kc, tl.trans(Kc), DT)
        dK += 2. * dot(dot32(tl.trans(M * cvec[:, None]), M, DT) * Kg, Kc, DT)      # Mᵀ diag(c) M
        dM += cvec[:, None] * (Gam[:, None] * kHk[None, :] + dot32(M, Kg * Kg, DT))
        P = dM * M
        dG += tl.sum(P, axis=1) - tl.sum(P, axis=0) + Gam * load_tokens(dgam_ptr, bos, L, i_h, H, 0., C)
        dbeta += tl.sum(dM * Md, axis=0)
    store_rows(dk_ptr, dK, bos, L, i_h, H, K, 0, BK, C)
    eb = e * bend
    r = tl.arange(0, C)
    dG += tl.where(r == L - 1, tl.sum(eb, axis=0) + tl.exp(G_end) * tl.load(dge_ptr + base), 0.) - eb
    dG = tl.where(valid, dG, 0.)
    dg = tl.sum(dG, axis=0) - tl.cumsum(dG, axis=0) + dG
    tl.store(dg_ptr + (bos + r) * H + i_h, dg, mask=valid)
    tl.store(dbeta_ptr + (bos + r) * H + i_h, dbeta + e * tl.exp(G_end - G), mask=valid)


def _coefficients(ridge: float, n_iters: int, dtype, device) -> torch.Tensor:
    """[2/(1 + 2 ridge), ridge, then (ω_i, the weight of ξ_{i−1}) for i = 1..n] in fp64 arithmetic."""
    rho2 = (1.0 / (1.0 + 2.0 * ridge)) ** 2
    coef, omega = [2.0 / (1.0 + 2.0 * ridge), ridge], 2.0
    for _ in range(n_iters):
        omega = 4.0 / (4.0 - rho2 * omega)
        coef += [omega, omega * (1.0 - 2.0 * ridge / (1.0 + 2.0 * ridge))]
    return torch.tensor(coef, dtype=dtype, device=device)


def _config(dtype: torch.dtype) -> dict:
    return CONFIGS[16 if dtype.itemsize == 2 else 32]


def _launch(dtype: torch.dtype, K: int, V: int):
    """(BK, BD, {kernel: launch keywords}) for activations of ``dtype``."""
    cfg = _config(dtype)
    BK = max(16, triton.next_power_of_2(K))
    BD = max(16, min(cfg["BV"], triton.next_power_of_2(V)))
    kw = dict(C=cfg["C"], BK=BK, DT=operand_dtype(dtype))
    return BK, BD, {k: dict(kw, num_warps=w[0], num_stages=w[1]) if isinstance(w, tuple) else
                    dict(kw, num_warps=w, num_stages=1) for k, w in cfg.items() if k not in ("C", "BV")}


def _states(k, v, g, beta, h0, u0, cu, coff, NC):
    """Chunk-start states h [NC, H, K, K], u [NC, H, K, V] (in the activations' dtype) and the final states."""
    Ttot, H, K = k.shape
    V = v.shape[-1]
    BK, BD, kw = _launch(k.dtype, K, V)
    N = cu.numel() - 1
    act = dict(dtype=k.dtype, device=k.device)
    h, u = torch.empty(NC, H, K, K, **act), torch.empty(NC, H, K, V, **act)
    hT, uT = torch.empty_like(h0), torch.empty_like(u0)
    nbk = triton.cdiv(K, BD)
    prefer_l1(_states_kernel[(nbk + triton.cdiv(V, BD), N * H)](k, v, g, beta, h0, u0, cu, coff, h, u, hT, uT, H, K,
                                                                V, nbk, BD=BD, **kw["states"]))
    return h, u, hT, uT


def _forward(q, k, v, g, beta, alpha, h0, u0, cu, coff, chunks, scale, ridge, n_iters, store):
    Ttot, H, K = q.shape
    V = v.shape[-1]
    BK, BD, kw = _launch(q.dtype, K, V)
    NC = chunks.shape[0]
    h, u, hT, uT = _states(k, v, g, beta, h0, u0, cu, coff, NC)
    acc = dict(dtype=compute_dtype(q), device=q.device)
    o = torch.empty_like(v)
    x = torch.empty(Ttot, H, K, **acc) if store else o
    hn = torch.empty(Ttot, H, **acc) if store else o
    coef = _coefficients(ridge, n_iters, acc["dtype"], q.device)
    prefer_l1(_fwd_kernel[(NC, H)](q, k, v, g, beta, alpha, chunks, h, u, coef, o, x, hn, scale, n_iters, H, K, V,
                                   BV=BD, SOLVE=n_iters > 0, STORE=store, **kw["fwd"]))
    return o, hT, uT, x, hn


def _flatten(q, k, v, g, beta, alpha, offsets):
    """[B·T, H, *] contiguous views and the chunk table (of the packed sequences' ``Offsets``, or of the batch)."""
    B, T = q.shape[:2]
    flat = [x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta, alpha)]
    return flat, chunk_table(offsets, B, T, _config(q.dtype)["C"], q.device)


class GKAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, alpha, h0, u0, cu, offsets, scale, ridge, n_iters):
        B, T, H, K = q.shape
        V = v.shape[-1]
        flat, (coff, chunks) = _flatten(q, k, v, g, beta, alpha, offsets)
        o, hT, uT, x, hn = _forward(*flat, h0, u0, cu, coff, chunks, scale, ridge, n_iters, store=True)
        ctx.save_for_backward(*flat, h0, u0, cu, coff, chunks, x, hn)
        ctx.args, ctx.shape = (scale, ridge, n_iters), (B, T, H, K, V)
        ctx.set_materialize_grads(False)
        return o.view(B, T, H, V), hT, uT

    @staticmethod
    @no_autocast
    def backward(ctx, do, dhT, duT):
        q, k, v, g, beta, alpha, h0, u0, cu, coff, chunks, x, hn = ctx.saved_tensors
        scale, ridge, n_iters = ctx.args
        B, T, H, K, V = ctx.shape
        BK, BD, kw = _launch(q.dtype, K, V)
        NC, N = chunks.shape[0], cu.numel() - 1
        h, u, _, _ = _states(k, v, g, beta, h0, u0, cu, coff, NC)
        do = torch.zeros_like(v) if do is None else do.reshape(B * T, H, V).contiguous()
        acc = compute_dtype(q)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dalpha, dg, dbeta = torch.empty_like(alpha), torch.empty_like(g), torch.empty_like(beta)
        y, dkp = torch.empty_like(x), torch.empty_like(x)
        cvec, mvec, khk, dgam = (torch.empty_like(hn) for _ in range(4))
        coef = _coefficients(ridge, n_iters, acc, q.device)
        solve = n_iters > 0
        tail = solve and K > TAIL_MIN_K
        prefer_l1(_solve_bwd_kernel[(NC, H)](q, k, v, g, beta, alpha, chunks, h, u, coef, x, hn, do, dq, dalpha, y,
                                             cvec, mvec, khk, dgam, dkp, scale, n_iters, H, K, V, BV=BD, SOLVE=solve,
                                             TAIL=tail, **kw["solve_bwd"]))
        if tail:
            prefer_l1(_solve_tail_kernel[(NC, H)](q, k, g, beta, alpha, chunks, h, coef, x, hn, y, dq, dalpha, cvec,
                                                  mvec, khk, dgam, dkp, H, K, **kw["solve_tail"]))
        # the chunk-end state gradients only feed tensor-core products (operands in the activations' dtype):
        # stored in that dtype, as the states are
        dh, du = torch.empty(NC, H, K, K, dtype=q.dtype, device=q.device), torch.empty_like(u)
        dh0, du0 = torch.empty_like(h0), torch.empty_like(u0)
        dge = torch.zeros(NC, H, dtype=acc, device=q.device)
        has_dst = dhT is not None or duT is not None
        dhT = torch.zeros_like(h0) if dhT is None else dhT.contiguous()
        duT = torch.zeros_like(u0) if duT is None else duT.contiguous()
        nbk = triton.cdiv(K, BD)
        prefer_l1(_dstates_kernel[(nbk + triton.cdiv(V, BD), N * H)](
            q, k, x, y, alpha, cvec, mvec, do, g, beta, h, u, dhT, duT, cu, coff, dh, du, dh0, du0, dge, scale, H, K,
            V, nbk, BD=BD, SOLVE=solve, HAS_DST=has_dst, **kw["dstates"]))
        e, dGp, dbp = (torch.empty_like(hn) for _ in range(3))
        prefer_l1(_grads_u_kernel[(NC, H)](q, k, v, g, beta, alpha, chunks, u, du, x, do, dkp, e, dGp, dbp, dv, scale,
                                           H, K, V, BV=BD, SOLVE=solve, **kw["grads_u"]))
        prefer_l1(_grads_h_kernel[(NC, H)](k, g, beta, chunks, dh, x, y, cvec, khk, dgam, dkp, e, dGp, dbp, dge, dk, dg,
                                           dbeta, H, K, SOLVE=solve, **kw["grads_h"]))
        shape = lambda t: t.view(B, T, *t.shape[1:])  # noqa: E731
        return (shape(dq), shape(dk), shape(dv), shape(dg), shape(dbeta), shape(dalpha), dh0, du0,
                None, None, None, None, None)


def max_head_sizes(dtype: torch.dtype, device: torch.device) -> dict[str, tuple[int, str]]:
    """{"K": (the largest K the kernels take, why)}, for ``checks.check_head_sizes``."""
    return {"K": (MAX_K, "the kernels hold H_c [K, K] in one register tile")}


def gka_fused(q, k, v, g, beta, alpha, *, state, scale, ridge, num_iters, cu_seqlens=None):
    """The op on GPU tensors (or under TRITON_INTERPRET), sequences packed by ``cu_seqlens`` (checked ``Offsets``)
    in the kernels.

    Args:
        q, k: [B, T, H, K] (K <= MAX_K, which the op checks); v: [B, T, H, V], one dtype (bf16/fp16/fp32; fp64
            runs in fp64);
        g, beta, alpha: [B, T, H]; state: (H [N, H, K, K], U [N, H, K, V]) in the compute dtype.
    Returns:
        o [B, T, H, V] in v's dtype, (H, U) final states in the compute dtype.
    """
    B, T, H, K = q.shape
    if num_iters is None:
        fail(_OP, "num_iters=None (the exact solve, a reference) runs with impl='torch' or 'naive' only")
    cu = batch_offsets(B, T, q.device) if cu_seqlens is None else cu_seqlens.tensor
    acc = compute_dtype(q)
    h0, u0 = (s.to(acc).contiguous() for s in state)
    g, beta, alpha = (x.to(acc) for x in (g, beta, alpha))
    packed, ridge, num_iters = cu_seqlens is not None, float(ridge), int(num_iters)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, alpha, h0, u0)):
        o, hT, uT = GKAFunction.apply(q, k, v, g, beta, alpha, h0, u0, cu, cu_seqlens, scale, ridge, num_iters)
    elif T == 1 and not packed:                             # decoding: one launch (step.py)
        o, hT, uT = gka_step_fused(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], alpha[:, 0], h0, u0,
                                   scale=scale, ridge=ridge, num_iters=num_iters)
        o = o[:, None]
    else:                                                   # inference: nothing kept for a backward
        flat, (coff, chunks) = _flatten(q, k, v, g, beta, alpha, cu_seqlens)
        o, hT, uT, _, _ = _forward(*flat, h0, u0, cu, coff, chunks, scale, ridge, num_iters, store=False)
        o = o.view(v.shape)
    return o, (hT, uT)
