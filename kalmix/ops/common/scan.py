"""Log-depth (Hillis–Steele) scans along the time axis, used inside custom autograd Functions.

Each pass combines every position with the one ``off`` steps earlier, ``off = 1, 2, 4, ...``: ⌈log2 T⌉
elementwise passes, no Python loop over tokens.
"""
from __future__ import annotations

import torch


def _shifted(x: torch.Tensor, off: int, dim: int, fill: float) -> torch.Tensor:
    """x delayed by ``off`` steps along ``dim``; the first ``off`` positions hold ``fill``."""
    T = x.shape[dim]
    head = torch.full_like(x.narrow(dim, 0, min(off, T)), fill)
    return torch.cat([head, x.narrow(dim, 0, T - min(off, T))], dim=dim)


def affine_scan(c: torch.Tensor, b: torch.Tensor, x0: torch.Tensor | None = None, dim: int = 1,
                reverse: bool = False) -> torch.Tensor:
    """Solve ``x_t = c_t * x_{t-1} + b_t`` for all t (``x_0 = x0``, default 0), elementwise.

    With ``reverse=True`` it runs from the end: ``x_t = c_t * x_{t+1} + b_t`` with ``x_{T+1} = x0``.
    ``c`` and ``b`` broadcast to the same shape; ``x0`` has that shape without ``dim``.
    """
    c, b = torch.broadcast_tensors(c, b)
    if reverse:
        c, b = c.flip(dim), b.flip(dim)
    T = c.shape[dim]
    off = 1
    while off < T:
        # prefix (C, B) at t composes with the prefix ending off steps earlier: (c_t C', c_t B' + b_t)
        b = b + c * _shifted(b, off, dim, 0.0)
        c = c * _shifted(c, off, dim, 1.0)
        off *= 2
    x = b if x0 is None else b + c * x0.unsqueeze(dim)
    return x.flip(dim) if reverse else x


def mobius_scan(m11, m12, m21, m22, x0: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Iterate the Möbius maps ``x_t = (m11 x_{t-1} + m12) / (m21 x_{t-1} + m22)`` from ``x0``, for all t.

    The 2×2 prefix products are renormalised by their trace after every combine (the map is scale-free),
    which keeps them finite; with non-negative entries nothing cancels.
    """
    m11, m12, m21, m22 = torch.broadcast_tensors(m11, m12, m21, m22)
    tr = m11 + m22
    p11, p12, p21, p22 = m11 / tr, m12 / tr, m21 / tr, m22 / tr
    T = p11.shape[dim]
    off = 1
    while off < T:
        q11, q12 = _shifted(p11, off, dim, 1.0), _shifted(p12, off, dim, 0.0)
        q21, q22 = _shifted(p21, off, dim, 0.0), _shifted(p22, off, dim, 1.0)
        # P_t <- P_t @ P_{t-off}  (later maps act last, i.e. on the left)
        n11 = p11 * q11 + p12 * q21
        n12 = p11 * q12 + p12 * q22
        n21 = p21 * q11 + p22 * q21
        n22 = p21 * q12 + p22 * q22
        tr = n11 + n22
        p11, p12, p21, p22 = n11 / tr, n12 / tr, n21 / tr, n22 / tr
        off *= 2
    x0 = x0.unsqueeze(dim)
    return (p11 * x0 + p12) / (p21 * x0 + p22)
