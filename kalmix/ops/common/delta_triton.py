"""The generalised delta rule of delta.py as chunked Triton kernels, forward and backward (tensor-core form).

Per head, with a write key w_t, an erase key e_t, a step β_t and a log-decay g_t:

    S_t = γ_t S_{t-1} + β_t w_t (v_t − γ_t S_{t-1}ᵀ e_t)ᵀ,    o_t = scale · S_tᵀ q_t          S: [K, V]

Per chunk of C tokens with start state S_0, G_t = Σ_{r≤t} g_r (inside the chunk) and D[t, s] = exp(G_t − G_s)
for s ≤ t (0 above the diagonal):

    A = strictly_lower(diag(β) (E Wᵀ) ⊙ D),   T = (I + A)⁻¹
    W̃ = T diag(β e^G) E,   Ũ = T diag(β) V,   U = Ũ − W̃ S_0                  (the pseudo-values u_t)
    O = scale · (diag(e^G) Q S_0 + ((Q Wᵀ) ⊙ D) U)
    S_C = e^{G_C} S_0 + (diag(e^{G_C − G}) W)ᵀ U

The backward runs the adjoint of these equations (README of kalmix/ops/kaczmarz, "Chunked form"): the
chunk-end state gradients dS_C go backwards over chunks with dU = scale·Pᵀ dO + diag(e^{G_C−G}) W dS_C and
dS_0 = scale·Qᵀ diag(e^G) dO + e^{G_C} dS_C − W̃ᵀ dU, and every chunk then differentiates its own equations,
through T by dA = −(Tᵀ dŨ) Ũᵀ − (Tᵀ dW̃) W̃ᵀ. Chunk-start states are recomputed, never stored by the forward;
T, W̃ and Ũ are (T in the activations' dtype: it only ever feeds tensor-core products).

Kernels (every tensor laid out [tokens, H, *] with packed sequences; a chunk never crosses a sequence; the row,
state and chunk helpers are triton_utils'):
    _prep_kernel      per (chunk, head): G, T, W̃, Ũ (kept by the forward for the backward); with ``step_eps``
                      the step itself from the chunk's keys
    _states_kernel    per (sequence, head, V block), forward over chunks: chunk-start states h, U, final state
    _output_kernel    per (chunk, head): O
    _dv_local_kernel  per (chunk, head): dU's term from the chunk's own outputs, scale·Pᵀ dO
    _dstates_kernel   per (sequence, head, V block), backward over chunks: the rest of dU, dS_C per chunk, dS_0
    _grads_qw_kernel  per (chunk, head): dq, dw and dg's terms from o and S_C, dW̃
    _grads_wy_kernel  per (chunk, head): through T, W̃, Ũ: dv, de, dβ, the rest of dw, dg
The backward recomputes the states (one pass over the chunks) but not the chunk systems.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kalmix.ops.common.checks import compute_dtype
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.triton_utils import (add_extrema, chunk_at, chunk_rows, chunk_table, decay, dot, dot32,
                                            dot_acc, gate_rows, gates, inv_den, inv_sq_norm, last, load_cols,
                                            load_rows, load_state, no_extrema, operand_dtype, raw_cols, raw_rows,
                                            raw_state, raw_state_t, seq_range, store_extrema, store_rows,
                                            store_state, to_acc)
from kalmix.ops.common.varlen import Offsets, batch_offsets

CHUNK = 64
# per operand width (16-bit activations, or fp32/fp64): the V block, the pipeline depth and each kernel's warps
# (or warps and its own pipeline depth). fp32 operands need twice the shared memory, and the backward's per-chunk
# kernels hold three [C, K] fp32 accumulators, hence the smaller fp32 tiles. "narrow": the V block and launches of
# the two kernels that walk each (sequence, head) through its chunks in order, used when their programs at the usual
# V block would not fill the GPU (``_narrow``; at B = 4, T = 8192 on an H100). Each value measured the fastest of
# those tried at 32K tokens, K = V = 128 (H100, H200): `python benchmarks/delta_triton.py --configs prep=8 ...` times
# others against them
CONFIGS = {16: dict(BV=64, stages=2, prep=(4, 3), states=(4, 3), output=4, dv_local=4, dstates=(8, 3),
                    grads_qw=(8, 3), grads_wy=4, narrow=dict(BV=32, states=(4, 4), dstates=(4, 3))),
           32: dict(BV=32, stages=1, prep=8, states=8, output=8, dv_local=4, dstates=8, grads_qw=8, grads_wy=8)}

# the largest K per activation dtype: every kernel holds K in one tile (BK, K rounded up to a power of two), and at the
# next power of two one of them needs more shared memory than an H100 gives a block (227 KB): bf16 _states_kernel
# 249 KB at K = 256, fp32 _output_kernel 384 KB at K = 512, fp64 _grads_wy_kernel 288 KB at K = 128 (compiled for
# sm_90 with their launches above: `python benchmarks/kernel_report.py --ops limits`). V is walked in V blocks.
MAX_K = {torch.bfloat16: 128, torch.float16: 128, torch.float32: 256, torch.float64: 64}


def max_head_size(dtype: torch.dtype) -> tuple[int, str]:
    """(the largest K the kernels take for activations of ``dtype``, why), for ``checks.check_head_sizes``."""
    return MAX_K[dtype], (f"kalmix's chunked delta-rule kernels hold K in one tile; for {str(dtype)[6:]} "
                          "activations a wider one needs more shared memory than an H100 gives a block")


@triton.jit
def _merge(Tm, A, rows, cols, size: tl.constexpr, DT: tl.constexpr):
    """T for blocks of ``size`` from Tm, T of their four sub-blocks: with N = Tm·(A's sub-blocks below the diagonal
    inside each block), nilpotent of order 4, T = (I + N)⁻¹ Tm = (I − N)(I + N²) Tm."""
    sub: tl.constexpr = size // 4
    N = dot32(Tm, tl.where((rows // size == cols // size) & (rows // sub != cols // sub), A, 0.), DT)
    X = Tm - dot32(N, Tm, DT)
    return X + dot32(N, dot32(N, X, DT), DT)


@triton.jit
def _system(KW, G, beta, rows, cols, C: tl.constexpr, DT: tl.constexpr):
    """T = (I + A)⁻¹ for A = strictly_lower(diag(β) KW ⊙ D), KW = E Wᵀ: the diagonal blocks of 4 by forward
    substitution (the blocks' rows i together), then two merges of four blocks each (4 → 16 → 64)."""
    tl.static_assert(C == 64)
    A = KW * decay(G, rows, cols, True) * beta[:, None]
    eye = (rows == cols).to(G.dtype)
    Tm = eye
    for i in tl.static_range(1, 4):
        sel = (rows % 4) == i
        Tm = tl.where(sel, eye - dot32(tl.where(sel & (rows // 4 == cols // 4), A, 0.), Tm, DT), Tm)
    return _merge(_merge(Tm, A, rows, cols, 16, DT), A, rows, cols, 64, DT)


@triton.jit
def _prep_kernel(w_ptr, e_ptr, v_ptr, g_ptr, beta_ptr, chunks_ptr, Gc_ptr, T_ptr, wt_ptr, ut_ptr, step_ptr, ext_ptr,
                 step_eps, H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                 STEP: tl.constexpr, CHECK: tl.constexpr):
    """Per (chunk, head): G, T, W̃, Ũ. STEP (w is e = k, ``beta`` is η): the step β = η/(‖k‖² + eps), ‖k_t‖² read
    off the diagonal of K Kᵀ (which the system needs anyway), stored to ``step``. CHECK: g's then η's min, max and
    NaN count over the chunk into this program's [2, 3] row of ``ext`` ([programs, 2, 3], the step pass's
    layout)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid = chunk_rows(chunks_ptr, i_c, C)
    g, beta = gate_rows(g_ptr, beta_ptr, bos, i_h, H, valid, C)
    G = tl.cumsum(g, axis=0)
    E = load_rows(e_ptr, bos, L, i_h, H, K, 0, BK, C)
    W = E if STEP else load_rows(w_ptr, bos, L, i_h, H, K, 0, BK, C)
    KW = dot(E, tl.trans(W), DT)
    r = tl.arange(0, C)
    if STEP:
        eta = beta
        beta = eta * inv_den(tl.sum(tl.where(rows == cols, KW, 0.), axis=1) + step_eps)
        tl.store(step_ptr + (bos + r) * H + i_h, beta, mask=valid)
    Tm = _system(KW, G, beta, rows, cols, C, DT)
    tl.store(Gc_ptr + (bos + r) * H + i_h, G, mask=valid)
    store_rows(T_ptr, Tm, bos, L, i_h, H, C, 0, C, C)
    store_rows(wt_ptr, dot(Tm, E * (beta * tl.exp(G))[:, None], DT), bos, L, i_h, H, K, 0, BK, C)
    for v0 in range(0, V, BV):
        Vt = load_rows(v_ptr, bos, L, i_h, H, V, v0, BV, C)
        store_rows(ut_ptr, dot(Tm, Vt * beta[:, None], DT), bos, L, i_h, H, V, v0, BV, C)
    if CHECK:
        row = ext_ptr + (i_c * tl.num_programs(1) + i_h) * 6
        store_extrema(row, add_extrema(no_extrema(C), g, valid))
        store_extrema(row + 3, add_extrema(no_extrema(C), eta, valid))


@triton.jit
def _chunk_gate(Gc_ptr, t0, L, i_h, H, valid, C: tl.constexpr):
    """The stored G of the chunk at t0 as [C] and its value at the last token. Rows past the chunk's end hold
    G_end, as a cumulative sum over zero gates would: with 0 there, D = exp(G_t − G_s) of a padded row t
    overflowed once |G| > 88 (inf · 0 = NaN in the products over rows)."""
    G = tl.load(Gc_ptr + (t0 + tl.arange(0, C)) * H + i_h, mask=valid, other=0.)
    G_end = last(G, L, C)
    return tl.where(valid, G, G_end), G_end


@triton.jit
def _states_kernel(w_ptr, wt_ptr, ut_ptr, Gc_ptr, s0_ptr, cu_ptr, coff_ptr, h_ptr, u_ptr, sT_ptr, H, K, V,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, HAS_S0: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    v0 = i_v * BV
    bos, eos, c0, n_c = seq_range(cu_ptr, coff_ptr, i_n, C)
    if HAS_S0:
        S = load_state(s0_ptr, i_nh.to(tl.int64) * K * V, K, V, v0, BK, BV)
    else:
        S = tl.zeros([BK, BV], dtype=sT_ptr.dtype.element_ty)
    for j in range(0, n_c):
        t0, L, valid = chunk_at(bos, eos, j, C)
        store_state(h_ptr, ((c0 + j).to(tl.int64) * H + i_h) * K * V, S, K, V, v0, BK, BV)
        U = load_rows(ut_ptr, t0, L, i_h, H, V, v0, BV, C) - dot(
            raw_rows(wt_ptr, t0, L, i_h, H, K, 0, BK, C), S, DT)
        store_rows(u_ptr, U, t0, L, i_h, H, V, v0, BV, C)
        G, G_end = _chunk_gate(Gc_ptr, t0, L, i_h, H, valid, C)
        # the decay e^{G_C − G} scales U's [C, BV] rows rather than W's [C, K] ones; W stays in its dtype
        S = tl.exp(G_end) * S + dot(tl.trans(raw_rows(w_ptr, t0, L, i_h, H, K, 0, BK, C)),
                                     U * tl.exp(G_end - G)[:, None], DT)
    store_state(sT_ptr, i_nh.to(tl.int64) * K * V, S, K, V, v0, BK, BV)


@triton.jit
def _chunk_scores(q_ptr, w_ptr, Gc_ptr, chunks_ptr, i_c, i_h, H, K, C: tl.constexpr, BK: tl.constexpr,
                  DT: tl.constexpr):
    """Chunk i_c's first token and length, G, Q and the decayed scores P = (Q Wᵀ) ⊙ D (the output's intra-chunk
    term, and in the backward the one dU gets from the chunk's own outputs). Q in its dtype (a tensor-core
    operand only)."""
    bos, L, rows, cols, valid = chunk_rows(chunks_ptr, i_c, C)
    G, _ = _chunk_gate(Gc_ptr, bos, L, i_h, H, valid, C)
    Q = raw_rows(q_ptr, bos, L, i_h, H, K, 0, BK, C)
    W = raw_rows(w_ptr, bos, L, i_h, H, K, 0, BK, C)
    return bos, L, G, Q, dot(Q, tl.trans(W), DT) * decay(G, rows, cols, False)


@triton.jit
def _output_kernel(q_ptr, w_ptr, u_ptr, Gc_ptr, h_ptr, chunks_ptr, o_ptr, scale, H, K, V,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """Per (chunk, head), over its V blocks: O (P once per chunk)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, G, Q, P = _chunk_scores(q_ptr, w_ptr, Gc_ptr, chunks_ptr, i_c, i_h, H, K, C, BK, DT)
    eG = scale * tl.exp(G)[:, None]
    P = scale * P
    for v0 in range(0, V, BV):
        S0 = raw_state(h_ptr, (i_c.to(tl.int64) * H + i_h) * K * V, K, V, v0, BK, BV)
        U = raw_rows(u_ptr, bos, L, i_h, H, V, v0, BV, C)
        store_rows(o_ptr, eG * dot(Q, S0, DT) + dot(P, U, DT), bos, L, i_h, H, V, v0, BV, C)


@triton.jit
def _dv_local_kernel(q_ptr, w_ptr, Gc_ptr, do_ptr, chunks_ptr, du_ptr, scale, H, K, V,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """Per (chunk, head), over its V blocks: dU's term from the chunk's own outputs, scale·Pᵀ dO with
    P = (Q Wᵀ) ⊙ D (_dstates_kernel adds the term from the later chunks)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, _, _, P = _chunk_scores(q_ptr, w_ptr, Gc_ptr, chunks_ptr, i_c, i_h, H, K, C, BK, DT)
    Pt = scale * tl.trans(P)
    for v0 in range(0, V, BV):
        dO = raw_rows(do_ptr, bos, L, i_h, H, V, v0, BV, C)
        store_rows(du_ptr, dot(Pt, dO, DT), bos, L, i_h, H, V, v0, BV, C)


@triton.jit
def _dstates_kernel(q_ptr, w_ptr, wt_ptr, Gc_ptr, do_ptr, dsT_ptr, cu_ptr, coff_ptr, du_ptr, dh_ptr, ds0_ptr,
                    scale, H, K, V, C: tl.constexpr, BH: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                    HAS_DST: tl.constexpr, HAS_DS0: tl.constexpr):
    """Per (sequence, head, V block), backward over chunks: dS_C of every chunk, and dU = (the local term that
    _dv_local_kernel left in du) + diag(e^{G_C − G}) W dS_C, in place; dS_0 when HAS_DS0 (there is an initial
    state). dS is held as two blocks of BH rows of K (the second one empty when K <= BH)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    v0 = i_v * BV
    bos, eos, c0, n_c = seq_range(cu_ptr, coff_ptr, i_n, C)
    base = i_nh.to(tl.int64) * K * V
    if HAS_DST:
        dS1 = load_state(dsT_ptr, base, K, V, v0, BH, BV)
        dS2 = load_state(dsT_ptr, base + BH * V, K - BH, V, v0, BH, BV)
    else:
        dS1 = tl.zeros([BH, BV], dtype=Gc_ptr.dtype.element_ty)
        dS2 = tl.zeros([BH, BV], dtype=Gc_ptr.dtype.element_ty)
    for jj in range(0, n_c):
        j = n_c - 1 - jj
        t0, L, valid = chunk_at(bos, eos, j, C)
        hb = ((c0 + j).to(tl.int64) * H + i_h) * K * V
        store_state(dh_ptr, hb, dS1, K, V, v0, BH, BV)
        store_state(dh_ptr, hb + BH * V, dS2, K - BH, V, v0, BH, BV)
        G, G_end = _chunk_gate(Gc_ptr, t0, L, i_h, H, valid, C)
        dU = dot(raw_rows(w_ptr, t0, L, i_h, H, K, 0, BH, C), dS1, DT) + dot(
            raw_rows(w_ptr, t0, L, i_h, H, K, BH, BH, C), dS2, DT)
        dU = load_rows(du_ptr, t0, L, i_h, H, V, v0, BV, C) + tl.exp(G_end - G)[:, None] * dU
        store_rows(du_ptr, dU, t0, L, i_h, H, V, v0, BV, C)
        dO = raw_rows(do_ptr, t0, L, i_h, H, V, v0, BV, C)
        eG = tl.exp(G)[None, :]
        dS1 = (scale * dot(load_cols(q_ptr, t0, L, i_h, H, K, 0, BH, C) * eG, dO, DT) + tl.exp(G_end) * dS1
               - dot(raw_cols(wt_ptr, t0, L, i_h, H, K, 0, BH, C), dU, DT))
        dS2 = (scale * dot(load_cols(q_ptr, t0, L, i_h, H, K, BH, BH, C) * eG, dO, DT) + tl.exp(G_end) * dS2
               - dot(raw_cols(wt_ptr, t0, L, i_h, H, K, BH, BH, C), dU, DT))
    if HAS_DS0:
        store_state(ds0_ptr, base, dS1, K, V, v0, BH, BV)
        store_state(ds0_ptr, base + BH * V, dS2, K - BH, V, v0, BH, BV)


@triton.jit
def _grads_qw_kernel(q_ptr, w_ptr, g_ptr, beta_ptr, chunks_ptr, h_ptr, dh_ptr, u_ptr, du_ptr, do_ptr,
                     dq_ptr, dw_ptr, dwt_ptr, dG_ptr, scale, H, K, V,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """Per chunk: dq; the parts of dw (dwp) and of dG from o and S_C; dW̃ = −dU S_0ᵀ for _grads_wy_kernel."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid = chunk_rows(chunks_ptr, i_c, C)
    G, beta, G_end = gates(g_ptr, beta_ptr, bos, L, i_h, H, valid, C)
    base = (i_c.to(tl.int64) * H + i_h) * K * V
    dQ = tl.zeros([C, BK], dtype=G.dtype)           # Σ_v dO S_0ᵀ
    dWs = tl.zeros([C, BK], dtype=G.dtype)          # Σ_v U dS_Cᵀ
    dWt = tl.zeros([C, BK], dtype=G.dtype)          # Σ_v dU S_0ᵀ (dW̃ is its negative)
    dP = tl.zeros([C, C], dtype=G.dtype)            # Σ_v dO Uᵀ
    dGe = tl.zeros([BK], dtype=G.dtype)             # Σ_v (S_0 ⊙ dS_C) summed over V
    for v0 in range(0, V, BV):
        S0t = raw_state_t(h_ptr, base, K, V, v0, BK, BV)
        dSCt = raw_state_t(dh_ptr, base, K, V, v0, BK, BV)
        U = raw_rows(u_ptr, bos, L, i_h, H, V, v0, BV, C)
        dO = raw_rows(do_ptr, bos, L, i_h, H, V, v0, BV, C)
        dQ = dot_acc(dO, S0t, dQ, DT)
        dP = dot_acc(dO, tl.trans(U), dP, DT)
        dWs = dot_acc(U, dSCt, dWs, DT)
        dWt = dot_acc(raw_rows(du_ptr, bos, L, i_h, H, V, v0, BV, C), S0t, dWt, DT)
        dGe += tl.sum(to_acc(S0t) * to_acc(dSCt), axis=0)
    dG_end = tl.sum(dGe, axis=0)
    store_rows(dwt_ptr, -dWt, bos, L, i_h, H, K, 0, BK, C)
    Q = raw_rows(q_ptr, bos, L, i_h, H, K, 0, BK, C)
    W = raw_rows(w_ptr, bos, L, i_h, H, K, 0, BK, C)
    # S_C's terms e^{G_C} S_0 + (e^{G_C − G} W)ᵀ U
    dWs = tl.exp(G_end - G)[:, None] * dWs
    dG_end = dG_end * tl.exp(G_end) + tl.sum(tl.sum(to_acc(W) * dWs, axis=1), axis=0)
    # o = scale·e^G Q S_0 + scale·((Q Wᵀ) ⊙ D) U: dq and dw in full, then dG = Σ_k q dq − Σ_k w dw per row (the
    # decay's derivative, as each e^{G_t − G_s} pairs q_t with w_s; S_C's term enters through dw with its sign)
    dPD = scale * dP * decay(G, rows, cols, False)
    dQ = dot_acc(dPD, W, scale * tl.exp(G)[:, None] * dQ, DT)
    dWs = dot_acc(tl.trans(dPD), Q, dWs, DT)
    dG = tl.sum(to_acc(Q) * dQ, axis=1) - tl.sum(to_acc(W) * dWs, axis=1)
    store_rows(dq_ptr, dQ, bos, L, i_h, H, K, 0, BK, C)
    store_rows(dw_ptr, dWs, bos, L, i_h, H, K, 0, BK, C)
    r = tl.arange(0, C)
    tl.store(dG_ptr + (bos + r) * H + i_h, dG + tl.where(r == L - 1, dG_end, 0.), mask=valid)


@triton.jit
def _grads_wy_kernel(w_ptr, e_ptr, v_ptr, g_ptr, beta_ptr, chunks_ptr, T_ptr, du_ptr, dwt_ptr, dG_ptr, dwp_ptr,
                     dw_ptr, de_ptr, dv_ptr, dg_ptr, dbeta_ptr, step_eps, H, K, V,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, STEP: tl.constexpr):
    """Per chunk, through Ũ = T diag(β) V, W̃ = T diag(β e^G) E and T = (I + A)⁻¹: dv, de, dβ, the rest of dw
    and dG, and dg (the reverse cumulative sum of dG: G_t = Σ_{r≤t} g_r). STEP (w = e = k, β = η c² with
    c² = 1/(‖k‖² + step_eps)): one key gradient dw + de − 2 β c² dβ k, and dη = c² dβ in place of dβ. Ũ and
    W̃ are recomputed from T (H100: loading the forward's instead took 0.417 ms against 0.356)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid = chunk_rows(chunks_ptr, i_c, C)
    G, beta, G_end = gates(g_ptr, beta_ptr, bos, L, i_h, H, valid, C)
    eG = tl.exp(G)
    Tm = raw_rows(T_ptr, bos, L, i_h, H, C, 0, C, C)
    Tt = tl.trans(Tm)
    dA = tl.zeros([C, C], dtype=G.dtype)            # −Σ_v (Tᵀ dŨ) Ũᵀ
    dbeta = tl.zeros([C], dtype=G.dtype)
    for v0 in range(0, V, BV):
        Vt = load_rows(v_ptr, bos, L, i_h, H, V, v0, BV, C)
        dXv = dot(Tt, raw_rows(du_ptr, bos, L, i_h, H, V, v0, BV, C), DT)                   # Tᵀ dŨ
        store_rows(dv_ptr, dXv * beta[:, None], bos, L, i_h, H, V, v0, BV, C)
        dbeta += tl.sum(Vt * dXv, axis=1)
        dA = dot_acc(-dXv, tl.trans(dot(Tm, Vt * beta[:, None], DT)), dA, DT)
    E = load_rows(e_ptr, bos, L, i_h, H, K, 0, BK, C)
    W = load_rows(w_ptr, bos, L, i_h, H, K, 0, BK, C)
    dXe = dot(Tt, raw_rows(dwt_ptr, bos, L, i_h, H, K, 0, BK, C), DT)                       # Tᵀ dW̃
    t_e = eG * tl.sum(E * dXe, axis=1)
    dbeta += t_e
    r = tl.arange(0, C)
    dG = tl.load(dG_ptr + (bos + r) * H + i_h, mask=valid, other=0.) + beta * t_e
    dA = dot_acc(-dXe, tl.trans(dot(Tm, E * (beta * eG)[:, None], DT)), dA, DT)
    # A = strictly_lower(diag(β)(E Wᵀ) ⊙ D)
    D = decay(G, rows, cols, True)
    dA = tl.where(cols < rows, dA, 0.)
    M = dA * D * dot(E, tl.trans(W), DT)
    dbeta += tl.sum(M, axis=1)
    M = M * beta[:, None]
    dG += tl.sum(M, axis=1) - tl.sum(M, axis=0)
    dAD = dA * D * beta[:, None]
    dE = (beta * eG)[:, None] * dXe + dot(dAD, W, DT)
    dW = load_rows(dwp_ptr, bos, L, i_h, H, K, 0, BK, C) + dot(tl.trans(dAD), E, DT)
    if STEP:
        c2 = inv_sq_norm(E, step_eps)
        store_rows(dw_ptr, dW + dE - (2. * beta * c2 * dbeta)[:, None] * E, bos, L, i_h, H, K, 0, BK, C)
        dbeta = c2 * dbeta
    else:
        store_rows(de_ptr, dE, bos, L, i_h, H, K, 0, BK, C)
        store_rows(dw_ptr, dW, bos, L, i_h, H, K, 0, BK, C)
    dg = tl.sum(dG, axis=0) - tl.cumsum(dG, axis=0) + dG
    tl.store(dg_ptr + (bos + r) * H + i_h, dg.to(dg_ptr.dtype.element_ty), mask=valid)
    tl.store(dbeta_ptr + (bos + r) * H + i_h, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _config(dtype: torch.dtype) -> dict:
    """CONFIGS' entry for activations of ``dtype`` (16-bit, or fp32/fp64)."""
    return CONFIGS[16 if dtype.itemsize == 2 else 32]


def _narrow(dtype: torch.dtype, V: int, n_seq_heads: int, device: torch.device) -> bool:
    """Whether the sequential kernels (states, dstates) take CONFIGS' "narrow" V blocks: when their
    (sequence, head, V block) programs at the usual V block would leave streaming multiprocessors idle."""
    cfg = _config(dtype)
    return ("narrow" in cfg and device.type == "cuda"
            and n_seq_heads * triton.cdiv(V, cfg["BV"]) < _sm_count(device))


def _launch(dtype: torch.dtype, K: int, V: int, narrow: bool = False) -> dict:
    """{kernel: launch keywords} for activations of ``dtype`` and head sizes K, V (the grids over V blocks read
    kw[kernel]["BV"]); ``narrow``: the states and dstates kernels take CONFIGS' "narrow" V block and launches."""
    cfg = _config(dtype)
    # 16-bit tiles at least 32 wide: with K = V = 16 (16-wide tiles) the bf16 kernels returned garbage (H200,
    # triton 3.6); the padding is masked
    low = 32 if dtype.itemsize == 2 else 16
    BK = max(low, triton.next_power_of_2(K))
    BV = max(low, min(cfg["BV"], triton.next_power_of_2(V)))
    kw = dict(C=CHUNK, BK=BK, BV=BV, DT=operand_dtype(dtype), num_stages=cfg["stages"])
    # 16-wide tiles at 8 warps made illegal memory accesses on an H200 (triton 3.6: the fp32 output kernel, and
    # the 16-bit grads_wy kernel at 8 warps) with K = V = 16: small heads run at most 4 warps
    cap = 4 if min(BK, BV) <= 16 else 8
    sub = cfg["narrow"] if narrow and "narrow" in cfg else {}
    kws = {}
    for k, w in cfg.items():
        if k not in ("BV", "stages", "narrow"):
            w = sub.get(k, w)
            warps, stages = w if isinstance(w, tuple) else (w, cfg["stages"])
            kws[k] = dict(kw, num_warps=min(warps, cap), num_stages=stages)
            if k in sub:
                kws[k]["BV"] = max(low, min(sub["BV"], triton.next_power_of_2(V)))
    kws["dstates"]["BH"] = max(low, kws["dstates"].pop("BK") // 2)      # dS in two blocks of rows
    return kws


def _prep(w, e, v, g, beta, chunks, step_eps=None, check=False):
    """Per chunk: G [tokens, H] (fp32), T [tokens, H, C] and the WY factors W̃, Ũ (the activations' dtype: the
    tensor-core operands they feed are). With ``step_eps`` (w is e, ``beta`` is η) also the step β [tokens, H]
    (fp32) the kernel computed, and with ``check`` the extremes of g and η ([programs, 2, 3]); else None."""
    Ttot, H, K = w.shape
    V = v.shape[-1]
    kw = _launch(w.dtype, K, V)
    act = dict(dtype=w.dtype, device=w.device)
    Gc = torch.empty(Ttot, H, dtype=compute_dtype(w), device=w.device)
    Tm, wt, ut = torch.empty(Ttot, H, CHUNK, **act), torch.empty(Ttot, H, K, **act), torch.empty(Ttot, H, V, **act)
    step = torch.empty_like(Gc) if step_eps is not None else None
    ext = torch.empty(chunks.shape[0] * H, 2, 3, device=w.device) if check else None
    _prep_kernel[(chunks.shape[0], H)](w, e, v, g, beta, chunks, Gc, Tm, wt, ut, step, ext,
                                       0. if step_eps is None else step_eps, H, K, V, STEP=step is not None,
                                       CHECK=check, **kw["prep"])
    return Gc, Tm, wt, ut, step, ext


def _states(w, wt, ut, Gc, s0, cu, coff, n_chunks):
    """Chunk-start states h [NC, H, K, V] and pseudo-values U (the activations' dtype), final state (fp32); s0
    None: zero initial states."""
    Ttot, H, K = w.shape
    V = ut.shape[-1]
    N = cu.numel() - 1
    kw = _launch(w.dtype, K, V, _narrow(w.dtype, V, N * H, w.device))["states"]
    act = dict(dtype=w.dtype, device=w.device)
    h, U = torch.empty(n_chunks, H, K, V, **act), torch.empty(Ttot, H, V, **act)
    sT = torch.empty(N, H, K, V, dtype=compute_dtype(w), device=w.device)
    _states_kernel[(triton.cdiv(V, kw["BV"]), N * H)](w, wt, ut, Gc, s0, cu, coff, h, U, sT, H, K, V,
                                                      HAS_S0=s0 is not None, **kw)
    return h, U, sT


def _output(q, w, U, Gc, h, chunks, scale):
    Ttot, H, K = q.shape
    V = U.shape[-1]
    kw = _launch(q.dtype, K, V)
    o = torch.empty_like(U)
    _output_kernel[(chunks.shape[0], H)](q, w, U, Gc, h, chunks, o, scale, H, K, V, **kw["output"])
    return o


class ChunkDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, e, v, g, beta, s0, offsets, scale, step_eps, check):
        B, T, H, K = q.shape
        V = v.shape[-1]
        flat = [x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, w, e, v, g, beta)]
        cu = batch_offsets(B, T, q.device) if offsets is None else offsets.tensor
        coff, chunks = chunk_table(offsets, B, T, CHUNK, q.device)
        s0 = None if s0 is None else s0.contiguous()
        Gc, Tm, wt, ut, step, ext = _prep(*flat[1:], chunks, step_eps, check)
        if step is not None:                    # beta was η; the backward takes the step η/(‖k‖² + eps)
            flat[5] = step
        h, U, sT = _states(flat[1], wt, ut, Gc, s0, cu, coff, chunks.shape[0])
        o = _output(flat[0], flat[1], U, Gc, h, chunks, scale)
        # the backward reuses the chunk systems (their solve is the forward's costliest kernel) and recomputes
        # only the states
        ctx.save_for_backward(*flat, s0, cu, coff, chunks, Gc, Tm, wt, ut)
        ctx.scale, ctx.shape, ctx.step_eps, ctx.beta_dtype = scale, (B, T, H, K, V), step_eps, beta.dtype
        ctx.set_materialize_grads(False)
        if ext is None:
            return o.view(B, T, H, V), sT
        ctx.mark_non_differentiable(ext)
        return o.view(B, T, H, V), sT, ext

    @staticmethod
    @no_autocast
    def backward(ctx, do, dsT, *_):
        q, w, e, v, g, beta, s0, cu, coff, chunks, Gc, Tm, wt, ut = ctx.saved_tensors
        B, T, H, K, V = ctx.shape
        NC, N = chunks.shape[0], cu.numel() - 1
        kw = _launch(q.dtype, K, V, _narrow(q.dtype, V, N * H, q.device))
        h, U, _ = _states(w, wt, ut, Gc, s0, cu, coff, NC)
        do = torch.zeros_like(v) if do is None else do.reshape(B * T, H, V).contiguous()
        dU, dh = torch.empty_like(U), torch.empty_like(h)
        ds0 = None if s0 is None else Gc.new_empty(N, H, K, V)
        _dv_local_kernel[(NC, H)](q, w, Gc, do, chunks, dU, ctx.scale, H, K, V, **kw["dv_local"])
        _dstates_kernel[(triton.cdiv(V, kw["dstates"]["BV"]), N * H)](
            q, w, wt, Gc, do, dU if dsT is None else dsT.contiguous(), cu, coff, dU, dh, ds0, ctx.scale, H, K, V,
            HAS_DST=dsT is not None, HAS_DS0=s0 is not None, **kw["dstates"])
        step = ctx.step_eps is not None
        dq, dw, dv = (torch.empty_like(x) for x in (q, w, v))
        de = dw if step else torch.empty_like(e)                # STEP writes the one key's gradient to dw
        dg, dbeta = torch.empty_like(g), torch.empty_like(beta, dtype=ctx.beta_dtype)    # (η's dtype for step_eps)
        # dW̃ only feeds a tensor-core product (operands in the activations' dtype) and dw's partial sum dwp is
        # stored as dw is (as fla stores dk's): both are kept in the activations' dtype (H100: grads_qw 421 -> 404
        # us for a 16-bit dwp)
        dwp, dwt, dG = torch.empty_like(w), torch.empty_like(w), torch.empty_like(g, dtype=compute_dtype(q))
        _grads_qw_kernel[(NC, H)](q, w, g, beta, chunks, h, dh, U, dU, do, dq, dwp, dwt, dG, ctx.scale, H, K, V,
                                  **kw["grads_qw"])
        _grads_wy_kernel[(NC, H)](w, e, v, g, beta, chunks, Tm, dU, dwt, dG, dwp, dw, de, dv, dg, dbeta,
                                  0. if ctx.step_eps is None else ctx.step_eps, H, K, V, STEP=step, **kw["grads_wy"])
        shape = lambda x: x.view(B, T, *x.shape[1:])  # noqa: E731
        return (shape(dq), shape(dw), None if step else shape(de), shape(dv), shape(dg), shape(dbeta),
                ds0, None, None, None, None)


def chunk_delta_rule_triton(q, w, e, v, g, beta, *, scale: float, state: torch.Tensor | None,
                            cu_seqlens: Offsets | None = None, step_eps: float | None = None,
                            check: bool = False):
    """The rule of the module docstring on GPU tensors (or under TRITON_INTERPRET).

    Args:
        q, w, e: [B, T, H, K]; v: [B, T, H, V], all of one dtype (bf16/fp16/fp32; fp64 runs in fp64);
        g (log γ <= 0), beta: [B, T, H], any float dtype (their gradients come in it).
        state: [N, H, K, V] initial states (N = B, or the number of packed sequences), or None (zeros).
        cu_seqlens: the checked offsets of packed sequences (B = 1).
        step_eps: the Kaczmarz rule: w and e are one tensor k, ``beta`` is η and the step is
            η/(‖k‖² + step_eps) (0 where that denominator is 0), computed by the first kernel from the keys it
            loads anyway; gradients reach k (on w) and η.
        check: with ``step_eps``, that kernel also writes the extremes of g and η per (chunk, head), for
            ``checks.defer_check`` ([programs, 2, 3]: g's then η's min, max and NaN count).
    Returns:
        o [B, T, H, V] in v's dtype, final state [N, H, K, V] in fp32 (fp64 for fp64 inputs), and with ``check``
        the extremes.
    """
    if step_eps is not None and w is not e:
        raise ValueError("chunk_delta_rule_triton: step_eps needs the write and erase keys to be one tensor")
    if check and step_eps is None:
        raise ValueError("chunk_delta_rule_triton: check reads the extremes of g and η, which need step_eps")
    acc = compute_dtype(q)
    # the kernels read the gates in fp32 whatever they are stored in; fp64 runs are converted to keep fp64
    g, beta = (x if acc == torch.float32 else x.to(acc) for x in (g, beta))
    state = None if state is None else state.to(acc)
    return ChunkDeltaRuleFunction.apply(q, w, e, v, g, beta, state, cu_seqlens, scale, step_eps, check)
