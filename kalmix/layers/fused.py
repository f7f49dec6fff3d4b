"""Fused Triton kernels for the elementwise work around the layers' ops, forward and backward.

A training step of the Kalman layer at d_model 512 launched ~150 kernels, most of them small elementwise ones,
and took longer to enqueue on the host than to run on the GPU. These three autograd Functions replace the
torch chains the layer runs in ``project``, ``dynamics`` and ``readout`` (``kalmix/layers/kalman.py`` keeps
those chains as its CPU path and as the reference the tests compare with):

- ``sensor_split``: the sensor projection [R, 2M + 2HN] -> v, Λv = 1/(softplus(s) + 1e-4), k/‖k‖, q/‖q‖
  per head (``F.normalize``: x / max(‖x‖, 1e-12)), and in the backward the whole gradient of the projection.
- ``ou_dynamics``: ā = exp(−aΔ), p̄ = p²/(2a)·(1 − exp(−2aΔ)) with a = exp(A_log), Δ = softplus(dt_raw)
  (or p̄ = max(p, 1e-7)/(2a)·(1 − exp(−2aΔ)), the released code's noise, with ``linear_p``).
- ``gated_skip``: y = (o + skip·z)·SiLU(gate), with the gradient of the scalar skip reduced per program.

and every layer's short convolution (``ShortConv`` without a state, on CUDA) runs ``short_conv``: causal
depthwise conv + bias + SiLU in one kernel, and in the backward dx, dw, db in one more (the SiLU's input is
recomputed, dw and db reduced per program and summed on the host).

The arithmetic is fp32 (fp64 for fp64 inputs); outputs are in the inputs' dtype (the dynamics in fp32 or
fp64, like the torch chain's ``upcast``). They run under TRITON_INTERPRET on CPU, which is how CI tests them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kalmix.layers.common import P_MIN
from kalmix.ops.common.precision import no_autocast

_ROWS = 16          # rows (tokens) per program
_COLS = 256         # channels per program in the [R, M] parts
_EPS_NORM = tl.constexpr(1e-12)   # F.normalize's eps
_EPS_PREC = tl.constexpr(1e-4)    # Λv = 1 / (softplus(s) + 1e-4)


def _acc(x: torch.Tensor):
    return tl.float64 if x.dtype == torch.float64 else tl.float32


@triton.jit
def _log1p(u):
    """log(1 + u) for u >= 0 without losing small u (Goldberg: log(1 + u) · u / ((1 + u) − 1))."""
    y = 1. + u
    return tl.where(y == 1., u, tl.log(y) * u / tl.where(y == 1., 1., y - 1.))


@triton.jit
def _softplus(s):
    """torch's softplus (threshold 20) computed as max(s, 0) + log1p(exp(−|s|))."""
    return tl.where(s > 20., s, tl.maximum(s, 0.) + _log1p(tl.exp(-tl.abs(s))))


@triton.jit
def _sigmoid(s):
    e = tl.exp(-tl.abs(s))
    return tl.where(s >= 0, 1. / (1. + e), e / (1. + e))


@triton.jit
def _series_below(ACC: tl.constexpr):
    """Where the series below take over: there the 13-term series is exact to the dtype, above it the direct
    formula loses at most ~3 ulp to cancellation."""
    return 1. if ACC == tl.float32 else 0.1


@triton.jit
def _one_minus_exp(y, ACC: tl.constexpr):
    """1 − exp(−y) for y >= 0; below the switch y(1 − y/2(1 − y/3(1 − …))), the torch chain's −expm1(−y)."""
    s = tl.full(y.shape, 1., ACC)
    for i in tl.static_range(12):
        s = 1. - y / (13 - i) * s
    return tl.where(y < _series_below(ACC), y * s, 1. - tl.exp(-y))


@triton.jit
def _one_minus_exp_times(y, ACC: tl.constexpr):
    """1 − (1 + y)·exp(−y) for y >= 0 = Σ_{n>=2} (−1)^n (n − 1) yⁿ/n!, summed below the switch (term ratio
    −y·n/((n − 1)(n + 1)))."""
    s = tl.full(y.shape, 1., ACC)
    for i in tl.static_range(11):
        s = 1. - y * ((12 - i) / ((11 - i) * (13 - i))) * s
    return tl.where(y < _series_below(ACC), 0.5 * y * y * s, 1. - (1. + y) * tl.exp(-y))


# ---------------------------------------------------------------------------------------------- sensor split
@triton.jit
def _cols(row0, col0, R, M, BR: tl.constexpr, BC: tl.constexpr):
    r = row0 + tl.arange(0, BR)[:, None]
    c = col0 + tl.arange(0, BC)[None, :]
    return r.to(tl.int64), c, (r < R) & (c < M)


@triton.jit
def _heads(row0, R, H, N, BR: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr):
    r = row0 + tl.arange(0, BR)[:, None, None]
    h = tl.arange(0, BH)[None, :, None]
    n = tl.arange(0, BN)[None, None, :]
    return r.to(tl.int64), h * N + n, (r < R) & (h < H) & (n < N)


@triton.jit
def _sensor_fwd_kernel(p_ptr, v_ptr, w_ptr, k_ptr, q_ptr, R, M, H, N, BR: tl.constexpr, BC: tl.constexpr,
                       BH: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr):
    """Programs (row block, column block); the last column block normalises the rows' k and q."""
    row0, cb = tl.program_id(0) * BR, tl.program_id(1)
    WP = 2 * M + 2 * H * N
    if cb * BC < M:
        r, c, m = _cols(row0, cb * BC, R, M, BR, BC)
        tl.store(v_ptr + r * M + c, tl.load(p_ptr + r * WP + c, mask=m), mask=m)
        s = tl.load(p_ptr + r * WP + M + c, mask=m, other=0.).to(ACC)
        tl.store(w_ptr + r * M + c, (1. / (_softplus(s) + _EPS_PREC)).to(w_ptr.dtype.element_ty), mask=m)
    else:
        rh, jh, mh = _heads(row0, R, H, N, BR, BH, BN)
        for which in tl.static_range(2):
            x = tl.load(p_ptr + rh * WP + 2 * M + which * H * N + jh, mask=mh, other=0.).to(ACC)
            nrm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=2, keep_dims=True)), _EPS_NORM)
            out = k_ptr if which == 0 else q_ptr
            tl.store(out + rh * (H * N) + jh, (x / nrm).to(out.dtype.element_ty), mask=mh)


@triton.jit
def _sensor_bwd_kernel(p_ptr, dv_ptr, dw_ptr, dk_ptr, dq_ptr, dp_ptr, R, M, H, N, BR: tl.constexpr,
                       BC: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, HAS_DV: tl.constexpr,
                       HAS_DW: tl.constexpr, HAS_DK: tl.constexpr, HAS_DQ: tl.constexpr, ACC: tl.constexpr):
    """dP = [dv | −dΛv·Λv²·σ(s) | (dk̂ − k̂(k̂·dk̂))/‖k‖ | same for q] (dx = dŷ/eps where ‖x‖ <= eps)."""
    row0, cb = tl.program_id(0) * BR, tl.program_id(1)
    WP = 2 * M + 2 * H * N
    if cb * BC < M:
        r, c, m = _cols(row0, cb * BC, R, M, BR, BC)
        if HAS_DV:
            dv = tl.load(dv_ptr + r * M + c, mask=m)
        else:
            dv = tl.zeros((BR, BC), ACC)
        tl.store(dp_ptr + r * WP + c, dv.to(dp_ptr.dtype.element_ty), mask=m)
        if HAS_DW:
            s = tl.load(p_ptr + r * WP + M + c, mask=m, other=0.).to(ACC)
            w = 1. / (_softplus(s) + _EPS_PREC)
            ds = -tl.load(dw_ptr + r * M + c, mask=m, other=0.).to(ACC) * w * w * _sigmoid(s)
        else:
            ds = tl.zeros((BR, BC), ACC)
        tl.store(dp_ptr + r * WP + M + c, ds.to(dp_ptr.dtype.element_ty), mask=m)
    else:
        rh, jh, mh = _heads(row0, R, H, N, BR, BH, BN)
        for which in tl.static_range(2):
            has = HAS_DK if which == 0 else HAS_DQ
            col = 2 * M + which * H * N + jh
            if has:
                dy_ptr = dk_ptr if which == 0 else dq_ptr
                x = tl.load(p_ptr + rh * WP + col, mask=mh, other=0.).to(ACC)
                dy = tl.load(dy_ptr + rh * (H * N) + jh, mask=mh, other=0.).to(ACC)
                nrm = tl.sqrt(tl.sum(x * x, axis=2, keep_dims=True))
                big = nrm > _EPS_NORM
                inv = 1. / tl.where(big, nrm, _EPS_NORM)
                y = x * inv
                dx = tl.where(big, (dy - y * tl.sum(y * dy, axis=2, keep_dims=True)) * inv, dy * inv)
            else:
                dx = tl.zeros((BR, BH, BN), ACC)
            tl.store(dp_ptr + rh * WP + col, dx.to(dp_ptr.dtype.element_ty), mask=mh)


def _sensor_meta(R, M, H, N, x):
    grid = (triton.cdiv(R, _ROWS), triton.cdiv(M, _COLS) + 1)
    return grid, dict(BR=_ROWS, BC=_COLS, BH=triton.next_power_of_2(H), BN=triton.next_power_of_2(N), ACC=_acc(x))


class _SensorSplit(torch.autograd.Function):
    @staticmethod
    @no_autocast
    def forward(ctx, p, H, N):
        R = p.numel() // p.shape[-1]
        M = (p.shape[-1] - 2 * H * N) // 2
        p = p.contiguous()
        v, w = p.new_empty(R, M), p.new_empty(R, M)
        k, q = p.new_empty(R, H * N), p.new_empty(R, H * N)
        grid, meta = _sensor_meta(R, M, H, N, p)
        _sensor_fwd_kernel[grid](p, v, w, k, q, R, M, H, N, **meta)
        ctx.save_for_backward(p)
        ctx.dims = H, N
        return v, w, k, q

    @staticmethod
    @no_autocast
    def backward(ctx, dv, dw, dk, dq):
        (p,) = ctx.saved_tensors
        H, N = ctx.dims
        R = p.numel() // p.shape[-1]
        M = (p.shape[-1] - 2 * H * N) // 2
        grads = [g.contiguous() if g is not None else p for g in (dv, dw, dk, dq)]     # p: an unread placeholder
        dp = torch.empty_like(p)
        grid, meta = _sensor_meta(R, M, H, N, p)
        _sensor_bwd_kernel[grid](p, *grads, dp, R, M, H, N, HAS_DV=dv is not None, HAS_DW=dw is not None,
                                 HAS_DK=dk is not None, HAS_DQ=dq is not None, **meta)
        return dp, None, None


def sensor_split(p: torch.Tensor, num_heads: int, d_state: int):
    """p [B, T, 2M + 2·H·N] (the sensor projection: v | s | k | q) -> v, Λv [B, T, M] and unit-norm k, q
    [B, T, H, N], all in p's dtype, Λv = 1 / (softplus(s) + 1e-4) computed in fp32."""
    B, T, _ = p.shape
    v, w, k, q = _SensorSplit.apply(p, num_heads, d_state)
    M = v.shape[-1]
    return v.view(B, T, M), w.view(B, T, M), k.view(B, T, num_heads, d_state), q.view(B, T, num_heads, d_state)


# ---------------------------------------------------------------------------------------------- OU dynamics
_BLOCK = 1024
_P_MIN = tl.constexpr(P_MIN)


@triton.jit
def _p_min(p):
    """P_MIN in p's dtype (a bare float constant would be rounded to fp32 first)."""
    return tl.full(p.shape, _P_MIN, p.dtype)


@triton.jit
def _noise_scale(p, LINEAR_P: tl.constexpr):
    """s(p) = p̄ / ((1 − e^{−2aΔ})/(2a)): p², or max(p, P_MIN) with LINEAR_P."""
    if LINEAR_P:
        return tl.maximum(p, _p_min(p))
    return p * p


@triton.jit
def _noise_scale_grad(p, LINEAR_P: tl.constexpr):
    """s'(p): 2p, or with LINEAR_P 1 where p >= P_MIN and 0 below (``clamp_min``'s gradient)."""
    if LINEAR_P:
        return tl.where(p >= _p_min(p), 1., 0.).to(p.dtype)
    return 2. * p


@triton.jit
def _ou_fwd_kernel(alog_ptr, dtr_ptr, p_ptr, dec_ptr, noise_ptr, n, LINEAR_P: tl.constexpr, BLOCK: tl.constexpr,
                   ACC: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.exp(tl.load(alog_ptr + i, mask=m, other=0.).to(ACC))
    dt = _softplus(tl.load(dtr_ptr + i, mask=m, other=0.).to(ACC))
    p = tl.load(p_ptr + i, mask=m, other=0.).to(ACC)
    x = a * dt
    tl.store(dec_ptr + i, tl.exp(-x), mask=m)
    tl.store(noise_ptr + i, _noise_scale(p, LINEAR_P) * _one_minus_exp(2. * x, ACC) / (2. * a), mask=m)


@triton.jit
def _ou_bwd_kernel(alog_ptr, dtr_ptr, p_ptr, ddec_ptr, dnoise_ptr, dalog_ptr, ddtr_ptr, dp_ptr, n,
                   LINEAR_P: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """With x = aΔ, f = (1 − e^{−2x})/(2a), p̄ = s(p) f (s = p², or max(p, P_MIN) with LINEAR_P):
    ∂ā/∂A_log = −x ā, ∂ā/∂Δ = −a ā; ∂f/∂A_log = −(1 − (1 + 2x)e^{−2x})/(2a) (no cancellation),
    ∂f/∂Δ = e^{−2x}; ∂Δ/∂dt_raw = σ(dt_raw); ∂p̄/∂p = s'(p) f."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    alog = tl.load(alog_ptr + i, mask=m, other=0.).to(ACC)
    dtr = tl.load(dtr_ptr + i, mask=m, other=0.).to(ACC)
    p = tl.load(p_ptr + i, mask=m, other=0.).to(ACC)
    gd = tl.load(ddec_ptr + i, mask=m, other=0.).to(ACC)
    gn = tl.load(dnoise_ptr + i, mask=m, other=0.).to(ACC)
    a = tl.exp(alog)
    dt = _softplus(dtr)
    x = a * dt
    dec = tl.exp(-x)
    f = _one_minus_exp(2. * x, ACC) / (2. * a)
    pp = _noise_scale(p, LINEAR_P) * gn
    tl.store(dalog_ptr + i, (-x * dec * gd - pp * _one_minus_exp_times(2. * x, ACC) / (2. * a)).to(
        dalog_ptr.dtype.element_ty), mask=m)
    tl.store(ddtr_ptr + i, (_sigmoid(dtr) * (-a * dec * gd + pp * dec * dec)).to(ddtr_ptr.dtype.element_ty),
             mask=m)
    tl.store(dp_ptr + i, (_noise_scale_grad(p, LINEAR_P) * f * gn).to(dp_ptr.dtype.element_ty), mask=m)


class _OUDynamics(torch.autograd.Function):
    @staticmethod
    @no_autocast
    def forward(ctx, A_log, dt_raw, p, linear_p: bool):
        A_log, dt_raw, p = A_log.contiguous(), dt_raw.contiguous(), p.contiguous()
        dt = torch.promote_types(A_log.dtype, torch.float32)
        dec, noise = torch.empty(A_log.shape, dtype=dt, device=A_log.device), torch.empty(
            A_log.shape, dtype=dt, device=A_log.device)
        n = A_log.numel()
        _ou_fwd_kernel[(triton.cdiv(n, _BLOCK),)](A_log, dt_raw, p, dec, noise, n, LINEAR_P=linear_p, BLOCK=_BLOCK,
                                                  ACC=_acc(dec))
        ctx.save_for_backward(A_log, dt_raw, p)
        ctx.linear_p = linear_p
        return dec, noise

    @staticmethod
    @no_autocast
    def backward(ctx, ddec, dnoise):
        A_log, dt_raw, p = ctx.saved_tensors
        acc = torch.promote_types(A_log.dtype, torch.float32)
        ddec = torch.zeros(A_log.shape, dtype=acc, device=A_log.device) if ddec is None else ddec.contiguous()
        dnoise = torch.zeros(A_log.shape, dtype=acc, device=A_log.device) if dnoise is None else dnoise.contiguous()
        grads = torch.empty_like(A_log), torch.empty_like(dt_raw), torch.empty_like(p)
        n = A_log.numel()
        _ou_bwd_kernel[(triton.cdiv(n, _BLOCK),)](A_log, dt_raw, p, ddec, dnoise, *grads, n, LINEAR_P=ctx.linear_p,
                                                  BLOCK=_BLOCK, ACC=_acc(ddec))
        return (*grads, None)


def ou_dynamics(A_log: torch.Tensor, dt_raw: torch.Tensor, p: torch.Tensor, linear_p: bool = False):
    """(ā, p̄) of the OU prior from the layer's parameters (all [H, N, D], same dtype), in fp32 (fp64 for fp64);
    ``linear_p``: p̄ from max(p, P_MIN) instead of p²."""
    return _OUDynamics.apply(A_log, dt_raw, p, linear_p)


# ---------------------------------------------------------------------------------------------- gated skip
@triton.jit
def _gate_fwd_kernel(o_ptr, z_ptr, g_ptr, skip_ptr, y_ptr, R, M, g_stride, BR: tl.constexpr, BC: tl.constexpr,
                     ACC: tl.constexpr):
    r, c, m = _cols(tl.program_id(0) * BR, tl.program_id(1) * BC, R, M, BR, BC)
    skip = tl.load(skip_ptr).to(ACC)
    o = tl.load(o_ptr + r * M + c, mask=m, other=0.).to(ACC)
    z = tl.load(z_ptr + r * M + c, mask=m, other=0.).to(ACC)
    g = tl.load(g_ptr + r * g_stride + c, mask=m, other=0.).to(ACC)
    tl.store(y_ptr + r * M + c, ((o + skip * z) * g * _sigmoid(g)).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gate_bwd_kernel(o_ptr, z_ptr, g_ptr, skip_ptr, dy_ptr, do_ptr, dz_ptr, dg_ptr, dskip_ptr, R, M, g_stride,
                     BR: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr):
    """do = dy·SiLU(g), dz = skip·do, dg = dy·(o + skip·z)·σ(g)(1 + g(1 − σ(g))); Σ do·z per program."""
    r, c, m = _cols(tl.program_id(0) * BR, tl.program_id(1) * BC, R, M, BR, BC)
    skip = tl.load(skip_ptr).to(ACC)
    o = tl.load(o_ptr + r * M + c, mask=m, other=0.).to(ACC)
    z = tl.load(z_ptr + r * M + c, mask=m, other=0.).to(ACC)
    g = tl.load(g_ptr + r * g_stride + c, mask=m, other=0.).to(ACC)
    dy = tl.load(dy_ptr + r * M + c, mask=m, other=0.).to(ACC)
    sg = _sigmoid(g)
    do = dy * g * sg
    tl.store(do_ptr + r * M + c, do.to(do_ptr.dtype.element_ty), mask=m)
    tl.store(dz_ptr + r * M + c, (skip * do).to(dz_ptr.dtype.element_ty), mask=m)
    tl.store(dg_ptr + r * M + c, (dy * (o + skip * z) * sg * (1. + g * (1. - sg))).to(dg_ptr.dtype.element_ty),
             mask=m)
    tl.store(dskip_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(do * z, 1), 0))


def _rows_of(x: torch.Tensor, M: int) -> torch.Tensor:
    """x [..., M] with unit channel stride as a 2-D [R, M] view with any row stride (no copy when possible)."""
    x2 = x.reshape(-1, M)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


class _GatedSkip(torch.autograd.Function):
    @staticmethod
    @no_autocast
    def forward(ctx, o, z, gate, skip):
        M = o.shape[-1]
        o2, z2, g2 = o.reshape(-1, M).contiguous(), z.reshape(-1, M).contiguous(), _rows_of(gate, M)
        R = o2.shape[0]
        y = torch.empty_like(o2)
        grid = (triton.cdiv(R, _ROWS), triton.cdiv(M, _COLS))
        _gate_fwd_kernel[grid](o2, z2, g2, skip, y, R, M, g2.stride(0), BR=_ROWS, BC=_COLS, ACC=_acc(o2))
        ctx.save_for_backward(o2, z2, g2, skip)
        ctx.shape = o.shape
        return y.view(o.shape)

    @staticmethod
    @no_autocast
    def backward(ctx, dy):
        o2, z2, g2, skip = ctx.saved_tensors
        R, M = o2.shape
        grid = (triton.cdiv(R, _ROWS), triton.cdiv(M, _COLS))
        do, dz, dg = torch.empty_like(o2), torch.empty_like(z2), torch.empty_like(o2)
        acc = torch.promote_types(o2.dtype, torch.float32)
        part = torch.empty(grid[0] * grid[1], dtype=acc, device=o2.device)
        _gate_bwd_kernel[grid](o2, z2, g2, skip, dy.reshape(R, M).contiguous(), do, dz, dg, part, R, M,
                               g2.stride(0), BR=_ROWS, BC=_COLS, ACC=_acc(o2))
        shape = ctx.shape
        return do.view(shape), dz.view(shape), dg.view(shape), part.sum().to(skip.dtype)


def gated_skip(o: torch.Tensor, z: torch.Tensor, gate: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """(o + skip·z)·SiLU(gate) for o, z, gate [..., M] of one dtype (gate may be a strided view) and a scalar
    parameter skip; computed in fp32, returned in o's dtype."""
    return _GatedSkip.apply(o, z, gate, skip)


# ---------------------------------------------------------------------------------------------- short conv
_CONV_FWD = 8, 128, 4            # tokens, channels per program, warps
_CONV_BWD = 4, 128, 4, 16        # the same and the token blocks one program walks (its dw, db share)


@triton.jit
def _doc_pos(pos_ptr, b, t, T, HAS_POS: tl.constexpr):
    """doc_pos at tokens t [BT, 1] of row b (0 past T) in int32; unread zeros without documents (both branches
    return one type, which the compiler checks)."""
    if HAS_POS:
        return tl.load(pos_ptr + b * T + t, mask=t < T, other=0).to(tl.int32)
    return tl.zeros(t.shape, tl.int32)


@triton.jit
def _tap(x, shift, pos, HAS_POS: tl.constexpr):
    """x where a tap that reaches ``shift`` tokens back stays in the document (shift <= doc_pos), else 0."""
    if HAS_POS:
        return tl.where(shift <= pos, x, 0.)
    return x


@triton.jit
def _conv_pre(x_ptr, w_ptr, b_ptr, pos_ptr, b, t, c, T, C, W: tl.constexpr, HAS_B: tl.constexpr,
              HAS_POS: tl.constexpr, ACC: tl.constexpr):
    """Pre-activation Σ_j w[c, j] x[t − (W − 1) + j, c] + bias at tokens t [BT, 1], channels c [1, BC], with
    HAS_POS only the taps j whose shift W − 1 − j is at most doc_pos[t]."""
    acc = tl.zeros((t.shape[0], c.shape[1]), ACC)
    pos = _doc_pos(pos_ptr, b, t, T, HAS_POS)
    for j in tl.static_range(W):
        ts = t - (W - 1) + j
        m = (ts >= 0) & (ts < T) & (c < C)
        if HAS_POS:
            m = m & (W - 1 - j <= pos)
        xs = tl.load(x_ptr + (b * T + ts) * C + c, mask=m, other=0.).to(ACC)
        acc += xs * tl.load(w_ptr + c * W + j, mask=c < C, other=0.).to(ACC)
    if HAS_B:
        acc += tl.load(b_ptr + c, mask=c < C, other=0.).to(ACC)
    return acc


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, b_ptr, pos_ptr, y_ptr, T, C, W: tl.constexpr, BT: tl.constexpr,
                     BC: tl.constexpr, HAS_B: tl.constexpr, HAS_POS: tl.constexpr, SILU: tl.constexpr,
                     ACC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]
    c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    b = tl.program_id(2).to(tl.int64)
    a = _conv_pre(x_ptr, w_ptr, b_ptr, pos_ptr, b, t, c, T, C, W, HAS_B, HAS_POS, ACC)
    if SILU:
        a = a * _sigmoid(a)
    tl.store(y_ptr + (b * T + t) * C + c, a.to(y_ptr.dtype.element_ty), mask=(t < T) & (c < C))


@triton.jit
def _conv_bwd_kernel(x_ptr, w_ptr, b_ptr, pos_ptr, dy_ptr, dx_ptr, part_ptr, T, C, n_sub, W: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr, HAS_B: tl.constexpr, HAS_POS: tl.constexpr,
                     SILU: tl.constexpr, ACC: tl.constexpr):
    """With da the gradient of the pre-activation: dx[t] = Σ_s w[W − 1 − s] da[t + s], the later tokens' da
    recomputed here from the 2W − 1 shifted x tiles around t (loaded once each). A program walks n_sub blocks of
    BT tokens (small tiles, many warps in flight) and writes its share of dw[c, j] = Σ_t da[t] x[t − (W − 1) + j]
    and db[c] = Σ_t da[t] to part[program]. With HAS_POS a tap of shift s at token u counts only where
    s <= doc_pos[u], in the recomputed pre-activation at u = t + s, in dx and in dw."""
    c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    b = tl.program_id(2).to(tl.int64)
    cm = c < C
    ws = ()
    for j in tl.static_range(W):
        ws = ws + (tl.load(w_ptr + c * W + j, mask=cm, other=0.).to(ACC),)
    if HAS_B:
        bias = tl.load(b_ptr + c, mask=cm, other=0.).to(ACC)
    sums = ()                                          # Σ da·x[shift j] for j < W, then Σ da
    for j in tl.static_range(W + 1):
        sums = sums + (tl.zeros((BT, BC), ACC),)
    for sub in range(n_sub):
        t = (tl.program_id(0) * n_sub + sub) * BT + tl.arange(0, BT)[:, None]
        xs = ()                                        # xs[i]: x at t + i − (W − 1)
        for i in tl.static_range(2 * W - 1):
            ts = t + i - (W - 1)
            xs = xs + (tl.load(x_ptr + (b * T + ts) * C + c, mask=(ts >= 0) & (ts < T) & cm, other=0.).to(ACC),)
        dx = tl.zeros((BT, BC), ACC)
        for s in tl.static_range(W):                   # da at t + s
            da = tl.load(dy_ptr + (b * T + t + s) * C + c, mask=(t + s < T) & cm, other=0.).to(ACC)
            pos = _doc_pos(pos_ptr, b, t + s, T, HAS_POS)
            if SILU:
                a = _tap(xs[s], W - 1, pos, HAS_POS) * ws[0]
                for j in tl.static_range(1, W):
                    a += _tap(xs[s + j], W - 1 - j, pos, HAS_POS) * ws[j]
                if HAS_B:
                    a += bias
                sg = _sigmoid(a)
                da = da * sg * (1. + a * (1. - sg))
            dx += ws[W - 1 - s] * _tap(da, s, pos, HAS_POS)
            if s == 0:
                new = ()
                for j in tl.static_range(W):
                    new = new + (sums[j] + da * _tap(xs[j], W - 1 - j, pos, HAS_POS),)
                sums = new + (sums[W] + da,)
        tl.store(dx_ptr + (b * T + t) * C + c, dx.to(dx_ptr.dtype.element_ty), mask=(t < T) & cm)
    prog = (tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    for j in tl.static_range(W + 1):
        tl.store(part_ptr + (prog * (W + 1) + j) * C + c, tl.sum(sums[j], axis=0, keep_dims=True), mask=cm)


class _ShortConv(torch.autograd.Function):
    @staticmethod
    @no_autocast
    def forward(ctx, x, weight, bias, silu, doc_pos):
        B, T, C = x.shape
        W = weight.shape[1]
        x, weight = x.contiguous(), weight.contiguous()
        pos = doc_pos.contiguous() if doc_pos is not None else weight       # weight: an unread placeholder
        y = torch.empty_like(x)
        BT, BC, warps = _CONV_FWD
        meta = dict(W=W, HAS_B=bias is not None, HAS_POS=doc_pos is not None, SILU=silu, ACC=_acc(x))
        _conv_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC), B)](
            x, weight, bias if bias is not None else weight, pos, y, T, C, BT=BT, BC=BC, num_warps=warps, **meta)
        ctx.save_for_backward(x, weight, bias, pos)
        ctx.meta = meta
        return y

    @staticmethod
    @no_autocast
    def backward(ctx, dy):
        x, weight, bias, pos = ctx.saved_tensors
        B, T, C = x.shape
        W = weight.shape[1]
        BT, BC, warps, nsub = _CONV_BWD
        nsub = min(nsub, triton.cdiv(T, BT))
        grid = (triton.cdiv(T, BT * nsub), triton.cdiv(C, BC), B)
        dx = torch.empty_like(x)
        part = torch.empty(B * grid[0], W + 1, C, dtype=torch.promote_types(x.dtype, torch.float32),
                           device=x.device)
        _conv_bwd_kernel[grid](x, weight, bias if bias is not None else weight, pos, dy.contiguous(), dx, part, T,
                               C, nsub, BT=BT, BC=BC, num_warps=warps, **ctx.meta)
        part = part.sum(0)
        dw = part[:W].t().to(weight.dtype)
        return dx, dw, part[W].to(bias.dtype) if bias is not None else None, None, None


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool,
               doc_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution from a zero state: y[t, c] = Σ_j weight[c, j] x[t − (W − 1) + j, c]
    (+ bias[c]), then SiLU if ``silu``. x [B, T, C]; weight [C, W]; returns y [B, T, C] in x's dtype.
    ``doc_pos`` [B, T] (int32 or int64, not differentiated): each token's position in its document, for rows
    that pack documents; then only the taps with W − 1 − j <= doc_pos[t] count, as if every document started
    from a zero state."""
    if doc_pos is not None and (doc_pos.shape != x.shape[:2] or doc_pos.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"short_conv: `doc_pos` must be an int32 or int64 [B, T] = {list(x.shape[:2])} tensor, "
                         f"got {doc_pos.dtype} of shape {list(doc_pos.shape)}")
    return _ShortConv.apply(x, weight, bias, silu, doc_pos)


# ---------------------------------------------------------------------------------------------- row norms
_NORM_TILE = 4096        # elements of a program's [rows, D] tile
_NORM_BLOCKS = 16        # row tiles one backward program walks (the weight's gradient is summed over them)


def _norm_meta(R: int, D: int, backward: bool = False):
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, _NORM_TILE // BD))
    blocks = min(_NORM_BLOCKS, triton.cdiv(R, BR)) if backward else 1
    return (triton.cdiv(R, BR * blocks),), BR, BD, blocks


@triton.jit
def _rms_fwd_kernel(x_ptr, z_ptr, w_ptr, y_ptr, rstd_ptr, R, D, z_stride, eps, HAS_Z: tl.constexpr,
                    BR: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    r, c, m = _cols(tl.program_id(0) * BR, 0, R, D, BR, BD)
    x = tl.load(x_ptr + r * D + c, mask=m, other=0.).to(ACC)
    rstd = 1. / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    y = x * rstd[:, None] * tl.load(w_ptr + c, mask=c < D, other=0.).to(ACC)
    if HAS_Z:
        z = tl.load(z_ptr + r * z_stride + c, mask=m, other=0.).to(ACC)
        y = y * z * _sigmoid(z)
    tl.store(y_ptr + r * D + c, y.to(y_ptr.dtype.element_ty), mask=m)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    tl.store(rstd_ptr + rows, rstd, mask=rows < R)


@triton.jit
def _rms_bwd_kernel(x_ptr, z_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dz_ptr, dw_ptr, R, D, z_stride,
                    HAS_Z: tl.constexpr, BLOCKS: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                    ACC: tl.constexpr):
    """With x̂ = x·rstd and u = dy·SiLU(z) (dy without a gate): dz = dy·x̂w·σ(z)(1 + z(1 − σ(z))),
    dx = rstd·(uw − x̂·mean(uw·x̂)); Σ u·x̂ over this program's rows into its row of dw."""
    cols = tl.arange(0, BD)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.).to(ACC)[None, :]
    dw = tl.zeros([BD], ACC)
    for i in tl.static_range(BLOCKS):
        row0 = (tl.program_id(0) * BLOCKS + i) * BR
        r, c, m = _cols(row0, 0, R, D, BR, BD)
        x = tl.load(x_ptr + r * D + c, mask=m, other=0.).to(ACC)
        dy = tl.load(dy_ptr + r * D + c, mask=m, other=0.).to(ACC)
        rows = row0 + tl.arange(0, BR)
        rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.).to(ACC)[:, None]
        xhat = x * rstd
        if HAS_Z:
            z = tl.load(z_ptr + r * z_stride + c, mask=m, other=0.).to(ACC)
            sz = _sigmoid(z)
            tl.store(dz_ptr + r * D + c, (dy * xhat * w * sz * (1. + z * (1. - sz))).to(dz_ptr.dtype.element_ty),
                     mask=m)
            dy = dy * z * sz
        dw += tl.sum(dy * xhat, 0)
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, 1) / D)[:, None])
        tl.store(dx_ptr + r * D + c, dx.to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + tl.program_id(0) * D + cols, dw, mask=cols < D)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    @no_autocast
    def forward(ctx, x, weight, z, eps):
        D = x.shape[-1]
        x2, weight = x.reshape(-1, D).contiguous(), weight.contiguous()
        z2 = _rows_of(z, D) if z is not None else x2                     # x2: an unread placeholder
        R = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(R, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        grid, BR, BD, _ = _norm_meta(R, D)
        _rms_fwd_kernel[grid](x2, z2, weight, y, rstd, R, D, z2.stride(0), eps, HAS_Z=z is not None, BR=BR, BD=BD,
                              ACC=_acc(x2))
        ctx.save_for_backward(x2, weight, z2 if z is not None else None, rstd)
        ctx.shapes = x.shape, None if z is None else z.shape
        return y.view(x.shape)

    @staticmethod
    @no_autocast
    def backward(ctx, dy):
        x2, weight, z2, rstd = ctx.saved_tensors
        R, D = x2.shape
        grid, BR, BD, blocks = _norm_meta(R, D, backward=True)
        dx = torch.empty_like(x2)
        dz = torch.empty(R, D, dtype=z2.dtype, device=x2.device) if z2 is not None else None
        part = torch.empty(grid[0], D, dtype=rstd.dtype, device=x2.device)
        _rms_bwd_kernel[grid](x2, z2 if z2 is not None else x2, weight, rstd, dy.reshape(R, D).contiguous(), dx,
                              dz if dz is not None else dx, part, R, D, z2.stride(0) if z2 is not None else D,
                              HAS_Z=z2 is not None, BLOCKS=blocks, BR=BR, BD=BD, ACC=_acc(x2))
        x_shape, z_shape = ctx.shapes
        return dx.view(x_shape), part.sum(0).to(weight.dtype), dz.view(z_shape) if dz is not None else None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None = None, eps: float = 1e-5):
    """RMSNorm over the last dimension, times SiLU(z) when a gate is given: ``x·rsqrt(mean(x²) + eps)·weight
    (·SiLU(z))`` for x [..., D], weight [D], z of x's shape (any row stride, e.g. a split of a projection);
    computed in fp32 (fp64 for fp64 x), returned in x's dtype. The backward keeps x, z and one fp32 rstd per
    row."""
    return _RMSNorm.apply(x, weight, z, eps)


@triton.jit
def _l2_fwd_kernel(x_ptr, y_ptr, norm_ptr, R, D, eps, BR: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    r, c, m = _cols(tl.program_id(0) * BR, 0, R, D, BR, BD)
    x = tl.load(x_ptr + r * D + c, mask=m, other=0.).to(ACC)
    norm = tl.sqrt(tl.sum(x * x, 1))
    tl.store(y_ptr + r * D + c, (x / tl.maximum(norm, eps)[:, None]).to(y_ptr.dtype.element_ty), mask=m)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    tl.store(norm_ptr + rows, norm, mask=rows < R)


@triton.jit
def _l2_bwd_kernel(y_ptr, norm_ptr, dy_ptr, dx_ptr, R, D, eps, BR: tl.constexpr, BD: tl.constexpr,
                   ACC: tl.constexpr):
    """y = x / max(‖x‖, eps): dx = (dy − y·Σ dy·y) / ‖x‖ where ‖x‖ > eps, dy / eps where the clamp holds; from
    the output y and ‖x‖, not x."""
    r, c, m = _cols(tl.program_id(0) * BR, 0, R, D, BR, BD)
    y = tl.load(y_ptr + r * D + c, mask=m, other=0.).to(ACC)
    dy = tl.load(dy_ptr + r * D + c, mask=m, other=0.).to(ACC)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    norm = tl.load(norm_ptr + rows, mask=rows < R, other=1.).to(ACC)[:, None]
    n = tl.maximum(norm, eps)
    dx = tl.where(norm > eps, (dy - y * tl.sum(dy * y, 1)[:, None]) / n, dy / n)
    tl.store(dx_ptr + r * D + c, dx.to(dx_ptr.dtype.element_ty), mask=m)


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    @no_autocast
    def forward(ctx, x, eps):
        D = x.shape[-1]
        x2 = _rows_of(x, D)
        R = x2.shape[0]
        y = torch.empty(R, D, dtype=x.dtype, device=x.device)
        norm = torch.empty(R, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        grid, BR, BD, _ = _norm_meta(R, D)
        _l2_fwd_kernel[grid](x2, y, norm, R, D, eps, BR=BR, BD=BD, ACC=_acc(x2))
        ctx.save_for_backward(y, norm)
        ctx.eps, ctx.shape = eps, x.shape
        return y.view(x.shape)

    @staticmethod
    @no_autocast
    def backward(ctx, dy):
        y, norm = ctx.saved_tensors
        R, D = y.shape
        dx = torch.empty_like(y)
        grid, BR, BD, _ = _norm_meta(R, D)
        _l2_bwd_kernel[grid](y, norm, dy.reshape(R, D).contiguous(), dx, R, D, ctx.eps, BR=BR, BD=BD,
                             ACC=_acc(y))
        return dx.view(ctx.shape), None


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``F.normalize(x, dim=-1, eps=eps)``, x / max(‖x‖, eps) over the last dimension, in one kernel each way:
    x [..., D] (rows of any stride, e.g. a head view of a split); computed in fp32 (fp64 for fp64 x), returned in
    x's dtype. The backward keeps the output (which the op that takes it usually keeps too) and ‖x‖ per row, not
    x, as fla's l2norm does: in bf16 its gradient is computed from the rounded output."""
    return _L2Normalize.apply(x, eps)
