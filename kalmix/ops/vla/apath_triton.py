"""VLA's A path (the write directions α̂) as sequential Triton kernels, forward and backward.

Per head, A_t = (A_0⁻¹ + Σ_{s≤t} û_s û_sᵀ)⁻¹ and α̂_t = a_t/‖a_t‖ with a_t = A_t k̂_t. One program per (part of a
sequence, head) walks sub-chunks of C = 16 tokens with A [K, K] in fp32; for a sub-chunk with rows û, k̂:

    G = I + U A Uᵀ = R Rᵀ (Cholesky),  Y = R⁻¹ U,  W = Y A (rows w_t = z_t/√δ_t)
    a = K A − tril(K Wᵀ) W,            A ← A − Wᵀ W

Sequences: a batch's rows or packed sequences (``cu_seqlens``), tokens laid out [tokens, H, K] either way, each
sequence's sub-chunks and blocks (SAVE sub-chunks) counted from its own first token (the block table is
``triton_utils.chunk_table``'s), so none crosses a sequence. Parts: with few (sequence, head) pairs the sequences
are cut into parts of whole blocks walked in parallel (``cut``), each from its start
A_p = (A_0⁻¹ + Σ_{t before the part in its sequence} û_t û_tᵀ)⁻¹, formed directly from fp64 Gram sums and Cholesky
factors; a sequence's first part starts from its own A_0, an empty sequence is an empty part.

Backward (README.md, `impl="triton"`). With M_t = A_t⁻¹ = A_0⁻¹ + Σ_{s≤t} û_s û_sᵀ, the gradient with respect to
M_t is the same for every M_t upstream of a token, so −∂L/∂M before token t is the additive
B̃_t = A_T Ā_T A_T + sym Σ_{t'≥t} b_t' a_t'ᵀ with b_t = A_t ∂a_t (∂a_t: the gradient of a_t through α̂ = a/‖a‖):

    ∂k̂_t = b_t = A_0 ∂a_t − Σ_{s≤t} (w_s·∂a_t) w_s                (A_0: the block's start)
    ∂û_s = −2 B̃_s û_s = −Σ_{t≥s in the block} [(a_t·û_s) b_t + (b_t·û_s) a_t] − 2 B̃_(after the block) û_s

so no step of the backward depends on another except through B̃'s sums. ``_apath_bwd_b_kernel`` runs one
program per (block of SAVE sub-chunks, column block, head) for b_t (from the A the forward saved at the block's start),
``_apath_bwd_du_kernel`` the same grid for the block's own terms of ∂û; ``_apath_carry_kernel`` walks the
blocks backwards, per column block of B̃, adding −2 B̃ û_s and then the block's sym Σ b_t a_tᵀ to B̃ (in parts
too: each part's own sum first, then every part from the sums of its sequence's later parts). The initial A's gradient
Ā_0 = A_0⁻¹ B̃_0 A_0⁻¹ would lose its accuracy where A_0 is ill-conditioned (a state carried over a long
sequence), so ``_apath_da0_kernel`` carries Ā itself when it is asked for, by sub-chunks: with
P_t = A_t A_0⁻¹ = I − Σ_{s≤t} w_s y_sᵀ, Y = R⁻¹ U,

    Ā ← P_Cᵀ Ā P_C + sym Σ_t (P_tᵀ ∂a_t)(P_tᵀ k̂_t)ᵀ

The forward keeps A in a per-program [K, K] buffer (L2-resident) and streams it through registers ROW_BLOCK rows
at a time (README.md says why and what it measured). For the backward it saves A every SAVE sub-chunks and, per
token, w_t and ‖a_t‖ (and its row of R⁻¹ when Ā_0 is asked for). Only the symmetric part of dA_0 is meaningful
(A is symmetric; the op differentiates through (A + Aᵀ)/2).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
import triton
import triton.language as tl

from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.triton_utils import (chunk_at, chunk_rows, chunk_starts, chunk_table, dot, dot_acc, load_rows,
                                            load_state, load_tokens, operand_dtype, store_rows, store_state,
                                            store_tokens)
from kalmix.ops.common.varlen import Offsets, batch_offsets, to_device

C_SUB = 16      # tokens per sub-chunk (one unblocked 16×16 Cholesky each)
SAVE = 4        # the forward keeps A every SAVE sub-chunks (a block) for the backward, which runs per block
MAX_K = 128     # the backward holds A [K, K] (and its gradient) in registers (the op checks K)
ROW_BLOCK = 32  # rows of A per streamed block
CARRY_COLS = 32  # columns of B̃ per program of the backward's carry
MIN_PROGRAMS = 128   # the forward cuts sequences into parts until B·H·parts reaches this (one program per SM)
MIN_PART_BLOCKS = 8  # ... with parts of at least this many blocks of SAVE sub-chunks (512 tokens)
CARRY_MIN_PROGRAMS = 512  # the backward's carry cuts the blocks into parts until it has this many programs
GRAM_BYTES = 256 << 20    # the parts' starts copy û to fp64 at most this much at a time
BLOCK_COLS = 64  # columns of b and ∂û per program of the backward's per-block kernels
WARPS = dict(fwd=8, b=4, du=4, carry=8, da0=8)   # (no software pipelining: every sub-chunk depends on the last)


@triton.jit
def _chol_inv(G, rows, cols, C: tl.constexpr):
    """R⁻¹ for the Cholesky factor R (lower) of the SPD [C, C] matrix G, of which only the lower triangle is read.

    Right-looking on G made symmetric from its lower triangle: step j reads row j of the trailing matrix, which
    is also its column j (the downdates are symmetric to the bit), so a step moves one [C] vector across the
    threads instead of extracting a column and a pivot; R⁻¹ is solved by forward substitution in the same steps."""
    G = tl.where(cols <= rows, G, tl.trans(G))
    X = tl.where(rows == cols, 1., G * 0.)                                   # (in G's register layout)
    for j in tl.static_range(C):
        g = tl.sum(tl.where(rows == j, G, 0.), axis=0)                       # row j of the trailing matrix
        lc = tl.broadcast_to(tl.where(rows >= j, g[:, None], 0.), (C, C))    # ... as its column j, in every column
        r_jj = tl.sqrt(tl.sum(tl.where(rows == j, lc, 0.), axis=0))[None, :]  # R[j, j] in every column
        lc = lc / r_jj                                                        # column j of R
        G -= lc * (tl.where(cols >= j, g[None, :], 0.) / r_jj)
        x = tl.sum(tl.where(rows == j, X, 0.), axis=0)[None, :] / r_jj       # row j of R⁻¹
        X = tl.where(rows == j, x, X - lc * x)
    return X


@triton.jit
def _a_rows(K, r0, BR: tl.constexpr, BK: tl.constexpr):
    """Offsets of rows r0..r0+BR of a [K, K] matrix (all BK columns), and their mask."""
    r = r0 + tl.arange(0, BR)[:, None]
    c = tl.arange(0, BK)[None, :]
    return r * K + c, (r < K) & (c < K)


@triton.jit
def _part(parts_ptr, i_p):
    """Part i_p's tokens [ps, pe) and its first block, from the table of ``cut``."""
    return tl.load(parts_ptr + 3 * i_p), tl.load(parts_ptr + 3 * i_p + 1), tl.load(parts_ptr + 3 * i_p + 2)


@triton.jit
def _apath_fwd_kernel(k_ptr, u_ptr, parts_ptr, a_ptr, al_ptr, asv_ptr, rinv_ptr, w_ptr, nrm_ptr, H, K,
                      STORE: tl.constexpr, RINV: tl.constexpr, SAVE: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                      BR: tl.constexpr, DT: tl.constexpr):
    """One (part, head) per program, over the part's sub-chunks: α̂ and A at the part's end, from A at its start in
    ``a_ptr`` [P, H, K, K] (overwritten); with STORE, A at the start of every block of SAVE sub-chunks (``asv_ptr``
    [blocks, H, K, K]) and per token w_t and ‖a_t‖ for the backward (with RINV also the token's row of its
    sub-chunk's R⁻¹, for the initial A's gradient). A stays in ``a_ptr`` (L2-resident) and is streamed through
    registers BR rows at a time, twice per sub-chunk: once for U A and K̂ A, once for A ← A − WᵀW (W read back from
    where it was stored: the backward's buffer, or a per-program [C, K] scratch in ``w_ptr``)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ps, pe, blk0 = _part(parts_ptr, i_p)
    rows, cols = tl.arange(0, C)[:, None], tl.arange(0, C)[None, :]
    a_work = a_ptr + (i_p * H + i_h).to(tl.int64) * K * K
    for j in range(0, tl.cdiv(pe - ps, C)):
        t0, L, _ = chunk_at(ps, pe, j, C)
        Kh = load_rows(k_ptr, t0, L, i_h, H, K, 0, BK, C)
        U = load_rows(u_ptr, t0, L, i_h, H, K, 0, BK, C)
        UA = tl.zeros([C, BK], DT)
        KA = tl.zeros([C, BK], DT)
        # runtime loops over A's row blocks: unrolled, they let the compiler hoist every block's loads and spill
        # (H100, B = 16, T = 2048: this kernel 2.81 -> 2.35 ms with the backward's stores, 3.57 -> 2.26 without)
        for r0 in range(0, BK, BR):
            o, m = _a_rows(K, r0, BR, BK)
            Ar = tl.load(a_work + o, mask=m, other=0.)
            if STORE:
                if j % SAVE == 0:
                    tl.store(asv_ptr + ((blk0 + j // SAVE) * H + i_h).to(tl.int64) * K * K + o, Ar, mask=m)
            UA = dot_acc(load_rows(u_ptr, t0, L, i_h, H, K, r0, BR, C), Ar, UA, DT)
            KA = dot_acc(load_rows(k_ptr, t0, L, i_h, H, K, r0, BR, C), Ar, KA, DT)
        G = dot_acc(U, tl.trans(UA), (rows == cols).to(DT), DT)
        Rinv = _chol_inv(G, rows, cols, C)
        W = dot(Rinv, UA, DT)
        KW = tl.where(cols <= rows, dot(Kh, tl.trans(W), DT), 0.)
        a = dot_acc(-KW, W, KA, DT)
        nrm = tl.maximum(tl.sqrt(tl.sum(a * a, axis=1)), 1e-12)
        store_rows(al_ptr, a / nrm[:, None], t0, L, i_h, H, K, 0, BK, C)
        if RINV:
            store_rows(rinv_ptr, Rinv, t0, L, i_h, H, C, 0, C, C)
        if STORE:
            store_tokens(nrm_ptr, nrm, t0, L, i_h, H, C)
            w0, w_h, w_H = t0, i_h, H                          # W's rows in the backward's [tokens, H, K] buffer
        else:
            w0, w_h, w_H = (i_p * H + i_h) * C, 0, 1           # the program's [C, K] scratch
        store_rows(w_ptr, W, w0, L, w_h, w_H, K, 0, BK, C)
        tl.debug_barrier()
        for r0 in range(0, BK, BR):
            o, m = _a_rows(K, r0, BR, BK)
            Wr = load_rows(w_ptr, w0, L, w_h, w_H, K, r0, BR, C)           # columns r0.. of W
            tl.store(a_work + o, dot_acc(-tl.trans(Wr), W, tl.load(a_work + o, mask=m, other=0.), DT), mask=m)
        tl.debug_barrier()


@triton.jit
def unit_grad(al, dal, nrm):
    """∂a from ∂α̂ through α̂ = a/‖a‖ (rows; ‖a‖ below 1e-12 was clamped, so there the map was a/1e-12)."""
    return tl.where(nrm[:, None] > 1e-12, dal - al * tl.sum(al * dal, axis=1)[:, None], dal) / nrm[:, None]


@triton.jit
def _block_da(al_ptr, nrm_ptr, dal_ptr, t0, L, i_h, H, K, BK: tl.constexpr, C: tl.constexpr):
    """The ∂a rows [C, BK] of C tokens from t0 (L of them real), through α̂ = a/‖a‖."""
    return unit_grad(load_rows(al_ptr, t0, L, i_h, H, K, 0, BK, C), load_rows(dal_ptr, t0, L, i_h, H, K, 0, BK, C),
                      load_tokens(nrm_ptr, t0, L, i_h, H, 1., C))


@triton.jit
def _block_cols(blocks_ptr, K, BC: tl.constexpr, C: tl.constexpr):
    """This program's block (first token, length, from the ``chunk_table`` of blocks) and first column: program 0
    runs (block, column block) pairs, the column blocks of one block next to each other."""
    n_cols = tl.cdiv(K, BC)
    i_s = tl.program_id(0) // n_cols
    bos, L, _, _, _ = chunk_rows(blocks_ptr, i_s, C)
    return i_s, bos, L, (tl.program_id(0) % n_cols) * BC


@triton.jit
def _apath_bwd_b_kernel(al_ptr, asv_ptr, w_ptr, nrm_ptr, dal_ptr, blocks_ptr, dk_ptr, H, K, C: tl.constexpr,
                        BK: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr):
    """One (block of C = SAVE·C_SUB tokens, column block, head) per program, from the A saved at the block's start:
    columns c0.. of the rows b_t = A_t ∂a_t = A_0 ∂a_t − Σ_{s≤t} (w_s·∂a_t) w_s (= ∂k̂_t)."""
    i_s, t0, L, c0 = _block_cols(blocks_ptr, K, BC, C)
    i_h = tl.program_id(1)
    rows, cols = tl.arange(0, C)[:, None], tl.arange(0, C)[None, :]
    da = _block_da(al_ptr, nrm_ptr, dal_ptr, t0, L, i_h, H, K, BK, C)
    P = tl.where(cols <= rows, dot(da, tl.trans(load_rows(w_ptr, t0, L, i_h, H, K, 0, BK, C)), DT), 0.)
    A = load_state(asv_ptr, (i_s * H + i_h).to(tl.int64) * K * K, K, K, c0, BK, BC)
    Bm = dot(da, A, DT) - dot(P, load_rows(w_ptr, t0, L, i_h, H, K, c0, BC, C), DT)
    store_rows(dk_ptr, Bm, t0, L, i_h, H, K, c0, BC, C)


@triton.jit
def _apath_bwd_du_kernel(u_ptr, al_ptr, nrm_ptr, dk_ptr, blocks_ptr, du_ptr, H, K, C: tl.constexpr,
                         BK: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr):
    """One (block of C tokens, column block, head) per program: columns c0.. of ∂û_s's terms from the block's own
    tokens, −Σ_{t≥s in the block} [(a_t·û_s) b_t + (b_t·û_s) a_t]."""
    _, t0, L, c0 = _block_cols(blocks_ptr, K, BC, C)
    i_h = tl.program_id(1)
    rows, cols = tl.arange(0, C)[:, None], tl.arange(0, C)[None, :]
    U = load_rows(u_ptr, t0, L, i_h, H, K, 0, BK, C)
    nrm = load_tokens(nrm_ptr, t0, L, i_h, H, 1., C)[:, None]
    up = cols >= rows
    Ua = tl.where(up, dot(U, tl.trans(load_rows(al_ptr, t0, L, i_h, H, K, 0, BK, C) * nrm), DT), 0.)
    Ub = tl.where(up, dot(U, tl.trans(load_rows(dk_ptr, t0, L, i_h, H, K, 0, BK, C)), DT), 0.)
    dU = dot(Ua, load_rows(dk_ptr, t0, L, i_h, H, K, c0, BC, C), DT) \
        + dot(Ub, load_rows(al_ptr, t0, L, i_h, H, K, c0, BC, C) * nrm, DT)
    store_rows(du_ptr, -dU, t0, L, i_h, H, K, c0, BC, C)


@triton.jit
def _apath_carry_kernel(u_ptr, al_ptr, nrm_ptr, dk_ptr, parts_ptr, b0_ptr, du_ptr, tot_ptr, H, K,
                        HAS_B0: tl.constexpr, TOTAL: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                        BC: tl.constexpr, DT: tl.constexpr):
    """One (part, column block, head) per program (the column blocks of a part next to each other), backwards
    over the part's blocks of C tokens: ∂û_s −= 2 B̃ û_s with B̃ the gradient with respect to A⁻¹ from every later
    token of the sequence, which is the sum of B̃ after the part (in ``b0_ptr`` [P, H, K, K]: A_T Ā_T A_T plus the
    sequence's later parts' totals) and each later block's sym Σ_t b_t a_tᵀ (b_t: the ∂k̂ rows the blocks kernel
    stored). With TOTAL only the part's own sum, from zero, into ``tot_ptr`` [P, H, K, K]."""
    n_cols = tl.cdiv(K, BC)
    i_p, i_h = tl.program_id(0) // n_cols, tl.program_id(1)
    c0 = (tl.program_id(0) % n_cols) * BC
    ps, pe, _first = _part(parts_ptr, i_p)
    base = (i_p * H + i_h).to(tl.int64) * K * K
    if HAS_B0:
        Bt = load_state(b0_ptr, base, K, K, c0, BK, BC)
    else:
        Bt = tl.zeros([BK, BC], dtype=DT)
    n_blk = tl.cdiv(pe - ps, C)
    for i in range(0, n_blk):
        t0, L, _ = chunk_at(ps, pe, n_blk - 1 - i, C)                  # the part's blocks, last first
        if not TOTAL:
            dU = load_rows(du_ptr, t0, L, i_h, H, K, c0, BC, C)
            dU = dot_acc(load_rows(u_ptr, t0, L, i_h, H, K, 0, BK, C), -2. * Bt, dU, DT)
            store_rows(du_ptr, dU, t0, L, i_h, H, K, c0, BC, C)
        nrm = load_tokens(nrm_ptr, t0, L, i_h, H, 1., C)[:, None]
        a = load_rows(al_ptr, t0, L, i_h, H, K, 0, BK, C) * nrm
        Bm = load_rows(dk_ptr, t0, L, i_h, H, K, 0, BK, C)
        sym = dot_acc(tl.trans(a), load_rows(dk_ptr, t0, L, i_h, H, K, c0, BC, C),
                       dot(tl.trans(Bm), load_rows(al_ptr, t0, L, i_h, H, K, c0, BC, C) * nrm, DT), DT)
        Bt += 0.5 * sym
    if TOTAL:
        store_state(tot_ptr, base, Bt, K, K, c0, BK, BC)


@triton.jit
def _apath_da0_kernel(k_ptr, u_ptr, al_ptr, rinv_ptr, w_ptr, nrm_ptr, dal_ptr, daT_ptr, cu_ptr, da0_ptr, H, K,
                      HAS_DAT: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """One (sequence, head) per program, backwards over the sequence's sub-chunks: the gradient Ā of the initial A,
    carried as Ā ← P_Cᵀ Ā P_C + sym Σ_t (P_tᵀ ∂a_t)(P_tᵀ k̂_t)ᵀ with P_tᵀ x = x − Σ_{s≤t} (w_s·x) y_s, Y = R⁻¹ U
    (module docstring: A₀⁻¹ B̃ A₀⁻¹ would lose Ā where A₀ is ill-conditioned). An empty sequence passes Ā_T on."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    bos, eos = tl.load(cu_ptr + i_n), tl.load(cu_ptr + i_n + 1)
    base = (i_n * H + i_h).to(tl.int64) * K * K
    rows, cols = tl.arange(0, C)[:, None], tl.arange(0, C)[None, :]
    if HAS_DAT:
        Ab = load_state(daT_ptr, base, K, K, 0, BK, BK)
    else:
        Ab = tl.zeros([BK, BK], dtype=DT)
    NS = tl.cdiv(eos - bos, C)
    for i in range(0, NS):
        t0, L, _ = chunk_at(bos, eos, NS - 1 - i, C)
        Kh = load_rows(k_ptr, t0, L, i_h, H, K, 0, BK, C)
        W = load_rows(w_ptr, t0, L, i_h, H, K, 0, BK, C)
        Y = dot(load_rows(rinv_ptr, t0, L, i_h, H, C, 0, C, C), load_rows(u_ptr, t0, L, i_h, H, K, 0, BK, C), DT)
        da = _block_da(al_ptr, nrm_ptr, dal_ptr, t0, L, i_h, H, K, BK, C)
        Pd = da - dot(tl.where(cols <= rows, dot(da, tl.trans(W), DT), 0.), Y, DT)
        Pk = Kh - dot(tl.where(cols <= rows, dot(Kh, tl.trans(W), DT), 0.), Y, DT)
        Z = dot(W, Ab, DT)
        Ab += dot(tl.trans(Y), dot(dot(Z, tl.trans(W), DT), Y, DT) - Z, DT) - dot(tl.trans(Z), Y, DT) \
            + 0.5 * (dot(tl.trans(Pd), Pk, DT) + dot(tl.trans(Pk), Pd, DT))
    store_state(da0_ptr, base, Ab, K, K, 0, BK, BK)


def _warps(name: str, width: int) -> int:
    """A kernel's warps; tiles 16 wide run at most 4 (at 8, 16-wide tiles made illegal memory accesses on an H100
    with triton 3.6, as in kalmix/ops/common/delta_triton.py)."""
    return min(WARPS[name], 4 if width <= 16 else 8)


def _config(kh: torch.Tensor):
    K = kh.shape[-1]
    if kh.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"the A path runs in fp32 or fp64, got {kh.dtype}")
    return dict(C=C_SUB, BK=max(16, triton.next_power_of_2(K)), DT=operand_dtype(kh.dtype))


def _part_blocks(n_blocks: int, programs: int, min_programs: int) -> int:
    """Blocks per part for cutting the longest sequence's n_blocks blocks into parts walked in parallel (README.md,
    "Parts"): enough parts that ``programs`` programs per part reach ``min_programs``, each at least MIN_PART_BLOCKS
    blocks long, then as few parts as that many blocks per part needs."""
    n = max(1, min(min_programs // programs, n_blocks // MIN_PART_BLOCKS))
    return triton.cdiv(n_blocks, n)


@dataclasses.dataclass(frozen=True, eq=False)
class Parts:
    """Sequences cut into parts of ``length`` tokens, whole blocks (their last part shorter), walked in parallel
    (``cut``). ``table`` [P, 3] int32: each part's first token, end token and first block (its row in the sequences'
    ``chunk_table`` of blocks). Where some sequence has several parts, int64 indices: ``seq`` [P] each part's
    sequence, ``slot`` [P] its place n·width + l in an [N, width] layout (l: its index in its sequence), ``first``
    and ``last`` [N] each sequence's first and last part, ``later`` the parts with l >= 1; else these are None and
    part n is sequence n (P = N)."""
    table: torch.Tensor
    length: int
    width: int = 1
    seq: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    first: torch.Tensor | None = None
    last: torch.Tensor | None = None
    later: torch.Tensor | None = None


def cut(offsets: Offsets | None, B: int, T: int, first: torch.Tensor, programs: int, min_programs: int) -> Parts:
    """The packed sequences (``offsets``; None: B sequences of T tokens) cut into parts: the longest as
    ``_part_blocks`` cuts it for ``programs`` programs per part, every other one into parts as long (at least one,
    so an empty sequence has an empty part). ``first`` [N]: each sequence's first block (``chunk_table``). Made from
    the host offsets, nothing read back; a batch's are kept per shape."""
    block = SAVE * C_SUB
    longest = T if offsets is None else offsets.max_len
    per = _part_blocks(triton.cdiv(longest, block), programs, min_programs)
    if offsets is None:
        return _batch_cut(B, T, per, block, first.device)
    return _cut(offsets.bounds, offsets.tensor, first, per, block)


@functools.lru_cache(maxsize=64)
def _batch_cut(B: int, T: int, per: int, block: int, device: torch.device) -> Parts:
    """``cut`` of B sequences of T tokens (kept per shape: read only)."""
    return _cut(tuple(range(0, (B + 1) * T, T)), batch_offsets(B, T, device),
                chunk_starts(None, B, T, block, device)[0], per, block)


def _cut(bounds: tuple[int, ...], cu: torch.Tensor, first: torch.Tensor, per: int, block: int) -> Parts:
    """``cut`` into parts of ``per`` blocks of ``block`` tokens of the sequences with host offsets ``bounds`` (``cu``
    on the device)."""
    lens, length = [b - a for a, b in zip(bounds[:-1], bounds[1:])], per * block
    if max(lens) <= length:                             # one part per sequence: the table from the device offsets
        return Parts(torch.stack([cu[:-1], cu[1:], first], 1).to(torch.int32).contiguous(), length)
    counts = [max(1, triton.cdiv(n, length)) for n in lens]
    width, rows, seq, slot, later, blk = max(counts), [], [], [], [], 0
    for n, (a, L, m) in enumerate(zip(bounds, lens, counts)):
        for i in range(m):
            if i:
                later.append(len(seq))
            start = a + i * length
            rows += [start, min(a + L, start + length), blk + i * per]
            seq.append(n)
            slot.append(n * width + i)
        blk += triton.cdiv(L, block)
    ends = list(itertools.accumulate(counts))
    idx = to_device(seq + slot + [e - m for e, m in zip(ends, counts)] + [e - 1 for e in ends] + later, cu.device,
                    torch.int64).split([len(seq), len(seq), len(lens), len(lens), len(later)])
    return Parts(to_device(rows, cu.device).view(-1, 3), length, width, *idx)


def _within(x: torch.Tensor, parts: Parts, reverse: bool) -> torch.Tensor:
    """Per part, the sum of x [P, ...] over the earlier parts of its sequence (the later ones when ``reverse``)."""
    N = parts.first.numel()
    pad = x.new_zeros(N * parts.width, *x.shape[1:]).index_copy_(0, parts.slot, x).unflatten(0, (N, parts.width))
    acc, out = (pad.flip(1).cumsum(1).flip(1) if reverse else pad.cumsum(1)), torch.zeros_like(pad)
    if reverse:
        out[:, :-1] = acc[:, 1:]
    else:
        out[:, 1:] = acc[:, :-1]
    return out.flatten(0, 1).index_select(0, parts.slot)


def _part_starts(uh: torch.Tensor, A0: torch.Tensor, parts: Parts) -> torch.Tensor:
    """A at the start of every part, [P, H, K, K] in A0's dtype (the forward's working buffer): its sequence's A0
    for a first part, else (A0⁻¹ + Σ_{t before the part} û_t û_tᵀ)⁻¹ from fp64 Gram sums and Cholesky factors. An
    A0 that is not positive definite gives NaN starts."""
    if parts.seq is None:
        return A0.clone(memory_format=torch.contiguous_format)
    H, K = uh.shape[-2:]
    P, part_len = parts.table.shape[0], parts.length
    starts = A0.new_empty(P, H, K, K).index_copy_(0, parts.first, A0)
    # the Gram sum of every part that its sequence continues after (so it is part_len tokens long)
    gram, full = uh.new_zeros(P, H, K, K, dtype=torch.float64), parts.later - 1
    tokens, offs = uh.flatten(0, 1), torch.arange(part_len, device=uh.device)
    step = max(1, GRAM_BYTES // (H * part_len * K * 8))              # parts per fp64 copy of û
    for i0 in range(0, full.numel(), step):
        ids = full[i0:i0 + step]
        u = tokens[parts.table[ids, :1].long() + offs].to(torch.float64).transpose(1, 2)   # [parts, H, len, K]
        gram.index_copy_(0, ids, u.mT @ u)
    gram = _within(gram, parts, reverse=False).index_select(0, parts.later)
    # with A0 = L0 L0ᵀ: (A0⁻¹ + G)⁻¹ = L0 N⁻¹ L0ᵀ, N = I + L0ᵀ G L0 = R Rᵀ (eigenvalues >= 1), so A = Zᵀ Z with
    # Z = R⁻¹ L0ᵀ: two factorisations and one triangular solve, no explicit inverse
    seq = parts.seq.index_select(0, parts.later)
    L0, info0 = torch.linalg.cholesky_ex(A0.to(torch.float64))
    L0, info0 = L0.index_select(0, seq), info0.index_select(0, seq)
    N = L0.mT @ gram @ L0
    N.diagonal(dim1=-2, dim2=-1).add_(1.)
    R, info = torch.linalg.cholesky_ex(N)
    Z = torch.linalg.solve_triangular(R, L0.mT, upper=False)
    bad = (info0 != 0) | (info != 0)
    return starts.index_copy_(0, parts.later, (Z.mT @ Z).masked_fill(bad[..., None, None], float("nan")).to(A0.dtype))


def _carry(uh, alpha, nrm, dk, du, bT, offsets: Offsets | None, first: torch.Tensor, kw: dict):
    """∂û −= 2 B̃ û (``_apath_carry_kernel``), with the blocks cut into parts walked in parallel when N·H leaves
    the GPU idle: first each part's own sum of sym b aᵀ, then every part from B̃ after it."""
    B, T, H, K = uh.shape
    BC = min(CARRY_COLS, kw["BK"])
    n_cols = triton.cdiv(K, BC)
    parts = cut(offsets, B, T, first, n_cols * first.numel() * H, CARRY_MIN_PROGRAMS)
    grid = (parts.table.shape[0] * n_cols, H)
    args = dict(BC=BC, num_warps=_warps("carry", BC), num_stages=1, **kw)
    b0 = bT
    if parts.seq is not None:
        tot = uh.new_empty(parts.table.shape[0], H, K, K)
        _apath_carry_kernel[grid](uh, alpha, nrm, dk, parts.table, tot, du, tot, H, K, HAS_B0=False, TOTAL=True,
                                  **args)
        b0 = _within(tot, parts, reverse=True)                     # the sequence's later parts' sums
        if bT is not None:
            b0 += bT.index_select(0, parts.seq)
    _apath_carry_kernel[grid](uh, alpha, nrm, dk, parts.table, du if b0 is None else b0.contiguous(), du, du, H, K,
                              HAS_B0=b0 is not None, TOTAL=False, **args)


class APathFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kh, uh, A0, offsets, grad_enabled: bool):
        B, T, H, K = kh.shape
        kw = _config(kh)
        kh, uh, A0 = kh.contiguous(), uh.contiguous(), A0.contiguous()
        first, blocks = chunk_table(offsets, B, T, SAVE * C_SUB, kh.device)
        parts = cut(offsets, B, T, first, A0.shape[0] * H, MIN_PROGRAMS)
        A = _part_starts(uh, A0, parts)
        alpha = torch.empty_like(kh)
        # (needs_input_grad ignores no_grad)
        store, rinv_needed = grad_enabled and any(ctx.needs_input_grad), grad_enabled and ctx.needs_input_grad[2]
        f = dict(dtype=kh.dtype, device=kh.device)
        if store:
            asv, w, nrm = torch.empty(blocks.shape[0], H, K, K, **f), torch.empty_like(kh), torch.empty(B, T, H, **f)
        else:
            asv = nrm = alpha        # not written
            w = torch.empty(A.shape[0] * H * C_SUB, K, **f)
        rinv = torch.empty(B, T, H, C_SUB, **f) if rinv_needed else alpha
        _apath_fwd_kernel[(A.shape[0], H)](kh, uh, parts.table, A, alpha, asv, rinv, w, nrm, H, K, STORE=store,
                                           RINV=rinv_needed, SAVE=SAVE, BR=min(ROW_BLOCK, kw["BK"]),
                                           num_warps=_warps("fwd", kw["BK"]), num_stages=1, **kw)
        AT = A if parts.last is None else A.index_select(0, parts.last)
        if store:
            cu = batch_offsets(B, T, kh.device) if offsets is None else offsets.tensor
            ctx.save_for_backward(kh, uh, alpha, AT, asv, rinv, w, nrm, cu, first, blocks)
            ctx.offsets = offsets
        ctx.set_materialize_grads(False)
        return alpha, AT

    @staticmethod
    @no_autocast
    def backward(ctx, dalpha, dAT):
        kh, uh, alpha, AT, asv, rinv, w, nrm, cu, first, blocks = ctx.saved_tensors
        B, T, H, K = kh.shape
        kw = _config(kh)
        dalpha = torch.zeros_like(kh) if dalpha is None else dalpha.contiguous()
        if dAT is not None:
            dAT = (0.5 * (dAT + dAT.transpose(-1, -2))).contiguous()
        dk, du = torch.empty_like(kh), torch.empty_like(uh)
        kw_blk = dict(kw, C=SAVE * C_SUB)
        bc = min(BLOCK_COLS, kw["BK"])
        grid = (blocks.shape[0] * triton.cdiv(K, bc), H)
        _apath_bwd_b_kernel[grid](alpha, asv, w, nrm, dalpha, blocks, dk, H, K, BC=bc,
                                  num_warps=_warps("b", kw["BK"]), num_stages=1, **kw_blk)
        _apath_bwd_du_kernel[grid](uh, alpha, nrm, dk, blocks, du, H, K, BC=bc, num_warps=_warps("du", kw["BK"]),
                                   num_stages=1, **kw_blk)
        bT = AT @ dAT @ AT if dAT is not None else None          # the end state's gradient with respect to A⁻¹
        _carry(uh, alpha, nrm, dk, du, bT, ctx.offsets, first, kw_blk)
        dA0 = None
        if ctx.needs_input_grad[2]:
            dA0 = torch.empty_like(AT)
            _apath_da0_kernel[(AT.shape[0], H)](kh, uh, alpha, rinv, w, nrm, dalpha, dalpha if dAT is None else dAT,
                                               cu, dA0, H, K, HAS_DAT=dAT is not None,
                                               num_warps=_warps("da0", kw["BK"]), num_stages=1, **kw)
        return dk, du, dA0, None, None


def write_directions_triton(kh: torch.Tensor, uh: torch.Tensor, A: torch.Tensor, cu_seqlens: Offsets | None = None):
    """α̂ and the final A as ``chunk.write_directions`` computes them (per packed sequence with ``cu_seqlens``), on
    the kernels above.

    Args:
        kh, uh: [B, T, H, K] unit keys and penalty directions (fp32 or fp64); A: [N, H, K, K] symmetric positive
            definite, K <= 128, N = B or the number of packed sequences.
        cu_seqlens: checked ``Offsets`` of packed sequences (B = 1); each starts from its own A.
    Returns:
        alpha [B, T, H, K], A [N, H, K, K] (an empty sequence's is its initial A).
    """
    return APathFunction.apply(kh, uh, A, cu_seqlens, torch.is_grad_enabled())
