"""What kalmix's Triton kernel families share: the chunk tables of (packed) sequences, loads and stores of token rows
and of states, tensor-core products at the operand dtype, gates and decays, and the value check's per-program
extremes.

Layouts: activations [tokens, H, D] (a batch's B·T rows, or packed sequences), per-token scalars [tokens, H], states
[K, V] at a base offset. A chunk of C tokens never crosses a sequence. In the jit helpers a block is addressed by its
first row ``bos``, its valid length ``L``, the head ``i_h`` and the first column ``d0``; rows at or past L and
columns at or past D load as 0 and are not stored.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kalmix.ops.common.varlen import Offsets, batch_offsets

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DOT_FP32 = tl.constexpr("ieee" if INTERPRET else "tf32x3")   # fp32 inputs: products accurate to ~fp32
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
              torch.float64: tl.float64}


def operand_dtype(dtype: torch.dtype):
    """The Triton dtype a kernel multiplies tensors of ``dtype`` in (its ``DT``): the dtype itself, except that the
    interpreter multiplies 16-bit operands in fp32 (its dot overflows on them: numpy has no bf16)."""
    return tl.float32 if INTERPRET and dtype.itemsize == 2 else _TL_DTYPES[dtype]


def _chunk_counts(cu_seqlens: torch.Tensor, C: int) -> torch.Tensor:
    """Chunks of C tokens per packed sequence [N]."""
    return (cu_seqlens[1:] - cu_seqlens[:-1] + C - 1) // C


def chunk_starts(cu_seqlens: Offsets | None, B: int, T: int, C: int,
                 device: torch.device) -> tuple[torch.Tensor, int]:
    """Each sequence's first chunk [N] (int32) and the number of chunks, for chunks of C tokens: of B sequences of T
    tokens (``cu_seqlens`` None: kept per shape, no kernel) or of the packed ``cu_seqlens`` (checked ``Offsets``:
    the number from their host offsets, nothing read back)."""
    if cu_seqlens is None:
        n = triton.cdiv(T, C)
        return batch_offsets(B, n, device)[:-1], B * n      # the starts of B runs of n chunks
    n = _chunk_counts(cu_seqlens.tensor, C)
    return (torch.cumsum(n, 0) - n).to(torch.int32), sum(triton.cdiv(L, C) for L in cu_seqlens.lengths)


def chunk_table(cu_seqlens: Offsets | None, B: int, T: int, C: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_starts``' first chunks [N] and every chunk's token range [bos, eos) [NC, 2], both int32: the tables
    the per-chunk kernels read (``chunk_rows``). A batch's (``cu_seqlens`` None) is kept per shape."""
    if cu_seqlens is None:
        return _batch_table(B, T, C, device)
    first, n_total = chunk_starts(cu_seqlens, B, T, C, device)
    cu = cu_seqlens.tensor
    n = _chunk_counts(cu, C)
    seq = torch.repeat_interleave(torch.arange(len(n), device=device), n, output_size=n_total)
    start = cu[seq] + (torch.arange(n_total, device=device) - first[seq]) * C
    end = torch.minimum(start + C, cu[seq + 1])
    return first, torch.stack([start, end], 1).to(torch.int32).contiguous()


@functools.lru_cache(maxsize=64)
def _batch_table(B: int, T: int, C: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_table`` of B sequences of T tokens, kept per shape: an op call on a batch builds no tables (they took
    ~10 small kernels and their launches per call). The kernels only read them."""
    n = triton.cdiv(T, C)
    start = torch.arange(0, B * T, T)[:, None] + torch.arange(0, n * C, C)[None, :]
    end = torch.minimum(start + C, torch.arange(T, (B + 1) * T, T)[:, None])
    table = torch.stack([start, end], -1).view(-1, 2).to(device=device, dtype=torch.int32)
    return chunk_starts(None, B, T, C, device)[0], table


@triton.jit
def dot_acc(a, b, acc, DT: tl.constexpr):
    """acc + a @ b on tensor cores with both operands in DT (the activations' 16-bit dtype, or fp32 as 3×TF32;
    fp64 stays fp64), accumulated by the tensor-core instruction itself (acc None: a fresh product)."""
    if DT == tl.float32:        # (the interpreter's 16-bit operands are multiplied in fp32)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_FP32)
    elif DT == tl.float64:
        return tl.dot(a, b, acc, out_dtype=tl.float64)
    else:
        return tl.dot(a.to(DT), b.to(DT), acc)


@triton.jit
def dot(a, b, DT: tl.constexpr):
    """a @ b as ``dot_acc`` multiplies."""
    return dot_acc(a, b, None, DT)


@triton.jit
def dot32(a, b, DT: tl.constexpr):
    """a @ b with fp32 operands (a triangular solve's): 3×TF32 for fp32 activations, one TF32 pass for 16-bit
    ones (fp64 stays fp64)."""
    if DT == tl.float32:
        return tl.dot(a, b, input_precision=DOT_FP32)
    elif DT == tl.float64:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision="tf32")


@triton.jit
def to_acc(x):
    """x in the arithmetic dtype: fp64 stays fp64, everything else becomes fp32."""
    if x.dtype == tl.float64:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def chunk_rows(chunks_ptr, i_c, C: tl.constexpr):
    """Token range [bos, bos + L) of chunk i_c of a ``chunk_table`` and its row indices / validity as [C, 1] and
    [1, C] grids and [C]."""
    bos = tl.load(chunks_ptr + 2 * i_c)
    L = tl.load(chunks_ptr + 2 * i_c + 1) - bos
    r = tl.arange(0, C)
    return bos, L, r[:, None], r[None, :], r < L


@triton.jit
def seq_range(cu_ptr, first_ptr, i_n, C: tl.constexpr):
    """Sequence i_n's tokens [bos, eos), its first chunk (``chunk_starts``) and its number of chunks."""
    bos = tl.load(cu_ptr + i_n)
    eos = tl.load(cu_ptr + i_n + 1)
    return bos, eos, tl.load(first_ptr + i_n), tl.cdiv(eos - bos, C)


@triton.jit
def chunk_at(bos, eos, j, C: tl.constexpr):
    """First token, length and row validity [C] of chunk j of the sequence [bos, eos)."""
    t0 = bos + j * C
    r = tl.arange(0, C)
    L = tl.minimum(eos - t0, C)
    return t0, L, r < L


@triton.jit
def row_ptrs(ptr, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """Pointers to rows bos..bos+C of head i_h, columns d0..d0+BD of a [tokens, H, D] tensor (a scalar row base
    plus 32-bit offsets), and the mask of rows < L and columns < D."""
    r = tl.arange(0, C)[:, None]
    d = d0 + tl.arange(0, BD)[None, :]
    return ptr + (bos.to(tl.int64) * H + i_h) * D + (r * (H * D) + d), (r < L) & (d < D)


@triton.jit
def raw_rows(ptr, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """The block of ``row_ptrs`` as [C, BD] in the tensor's dtype (for tensor-core operands: no round trip through
    fp32), 0 outside the rows and columns."""
    p, m = row_ptrs(ptr, bos, L, i_h, H, D, d0, BD, C)
    return tl.load(p, mask=m, other=0.)


@triton.jit
def load_rows(ptr, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """The block of ``row_ptrs`` as fp32 (fp64 for fp64) [C, BD], 0 outside the rows and columns."""
    return to_acc(raw_rows(ptr, bos, L, i_h, H, D, d0, BD, C))


@triton.jit
def raw_cols(ptr, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """The block of ``row_ptrs`` transposed, [BD, C] in the tensor's dtype."""
    r = tl.arange(0, C)[None, :]
    d = d0 + tl.arange(0, BD)[:, None]
    return tl.load(ptr + (bos.to(tl.int64) * H + i_h) * D + (r * (H * D) + d), mask=(r < L) & (d < D), other=0.)


@triton.jit
def load_cols(ptr, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """``raw_cols`` as fp32 (fp64 for fp64)."""
    return to_acc(raw_cols(ptr, bos, L, i_h, H, D, d0, BD, C))


@triton.jit
def store_rows(ptr, x, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """Store x [C, BD] to the block of ``row_ptrs`` (converted to the tensor's dtype; nothing outside it)."""
    p, m = row_ptrs(ptr, bos, L, i_h, H, D, d0, BD, C)
    tl.store(p, x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def load_tokens(ptr, bos, L, i_h, H, other, C: tl.constexpr):
    """Rows bos..bos+C of head i_h of a [tokens, H] tensor as [C], ``other`` past row L."""
    return tl.load(ptr + (bos + tl.arange(0, C)) * H + i_h, mask=tl.arange(0, C) < L, other=other)


@triton.jit
def store_tokens(ptr, x, bos, L, i_h, H, C: tl.constexpr):
    """Store x [C] to rows bos..bos+L of head i_h of a [tokens, H] tensor."""
    tl.store(ptr + (bos + tl.arange(0, C)) * H + i_h, x, mask=tl.arange(0, C) < L)


@triton.jit
def state_ptrs(ptr, base, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Pointers to columns v0..v0+BV of the [K, V] matrix at ``ptr + base``, and their mask."""
    k = tl.arange(0, BK)[:, None]
    v = v0 + tl.arange(0, BV)[None, :]
    return ptr + base + (k * V + v), (k < K) & (v < V)


@triton.jit
def raw_state(ptr, base, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Columns v0..v0+BV of the [K, V] matrix at ``ptr + base`` as [BK, BV] in its dtype."""
    p, m = state_ptrs(ptr, base, K, V, v0, BK, BV)
    return tl.load(p, mask=m, other=0.)


@triton.jit
def load_state(ptr, base, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    """``raw_state`` as fp32 (fp64 for fp64)."""
    return to_acc(raw_state(ptr, base, K, V, v0, BK, BV))


@triton.jit
def raw_state_t(ptr, base, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Columns v0..v0+BV of the [K, V] matrix at ``ptr + base``, transposed ([BV, BK]) in its dtype."""
    k = tl.arange(0, BK)[None, :]
    v = v0 + tl.arange(0, BV)[:, None]
    return tl.load(ptr + base + (k * V + v), mask=(k < K) & (v < V), other=0.)


@triton.jit
def store_state(ptr, base, x, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Store x [BK, BV] to columns v0..v0+BV of the [K, V] matrix at ``ptr + base``."""
    p, m = state_ptrs(ptr, base, K, V, v0, BK, BV)
    tl.store(p, x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def last(G, L, C: tl.constexpr):
    """G at row L − 1 (the chunk's last token) of a [C] vector."""
    return tl.sum(tl.where(tl.arange(0, C) == L - 1, G, 0.), axis=0)


@triton.jit
def gate_rows(g_ptr, beta_ptr, bos, i_h, H, valid, C: tl.constexpr):
    """g_t and β_t of the chunk's rows as [C] fp32 (0 past its end)."""
    r = (bos + tl.arange(0, C)) * H + i_h
    return to_acc(tl.load(g_ptr + r, mask=valid, other=0.)), to_acc(tl.load(beta_ptr + r, mask=valid, other=0.))


@triton.jit
def gates(g_ptr, beta_ptr, bos, L, i_h, H, valid, C: tl.constexpr):
    """G_t (log decay from the chunk start) and β_t as [C] fp32, and G at the chunk's last token."""
    g, beta = gate_rows(g_ptr, beta_ptr, bos, i_h, H, valid, C)
    G = tl.cumsum(g, axis=0)
    return G, beta, last(G, L, C)


@triton.jit
def decay(G, rows, cols, STRICT: tl.constexpr):
    """D[t, s] = exp(G_t − G_s) on s < t (STRICT) or s <= t, else 0 (masked before exp: nothing overflows)."""
    keep = (cols < rows) if STRICT else (cols <= rows)
    return tl.where(keep, tl.exp(tl.where(keep, G[:, None] - G[None, :], 0.)), 0.)


@triton.jit
def inv_den(den):
    """1/den, 0 where den = 0 (the step of a zero key with eps = 0: it writes nothing)."""
    return tl.where(den > 0, 1. / tl.where(den > 0, den, 1.), 0.)


@triton.jit
def inv_sq_norm(k, eps):
    """c² = 1/(‖k‖² + eps) per row of a [R, BK] block (0 where ‖k‖² + eps = 0: such a key writes nothing)."""
    return inv_den(tl.sum(k * k, axis=1) + eps)


@triton.jit
def no_extrema(R: tl.constexpr):
    """Running (min, max, NaN count) per lane of an [R] block before any value: (+inf, −inf, 0)."""
    return tl.full([R], float("inf"), tl.float32), tl.full([R], -float("inf"), tl.float32), tl.zeros([R], tl.float32)


@triton.jit
def add_extrema(ext, x, valid):
    """The running extremes ``ext`` (``no_extrema``) updated with the valid values of the [R] block x (as fp32)."""
    lo, hi, nan = ext
    x = x.to(tl.float32)
    return (tl.minimum(lo, tl.where(valid, x, float("inf"))), tl.maximum(hi, tl.where(valid, x, -float("inf"))),
            nan + (valid & (x != x)).to(tl.float32))


@triton.jit
def store_extrema(out, ext):
    """min, max and NaN count of the running extremes at out[0..2]: one range of a program's row in the
    [programs, n, 3] layout checks.defer_check folds (no atomics, nothing to initialise)."""
    lo, hi, nan = ext
    tl.store(out, tl.min(lo, axis=0))
    tl.store(out + 1, tl.max(hi, axis=0))
    tl.store(out + 2, tl.sum(nan, axis=0))
