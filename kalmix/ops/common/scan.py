"""Chunked parallel scans along the time axis (dim 1), used inside custom autograd Functions.

Three phases: a log-depth (Hillis–Steele) scan inside every chunk of ``chunk`` steps at once, a short loop over
chunks carrying the state across chunk boundaries, and one pass applying each chunk's incoming state. No
Python loop over tokens. Small chunks keep the number of full-size passes low (log2(chunk) + 1).
"""
from __future__ import annotations

import torch

CHUNK = 4


def _chunked(x: torch.Tensor, chunk: int, fill: float, copy: bool = True) -> torch.Tensor:
    """x [B, T, ...] as [B, T/chunk, chunk, ...], the tail padded with ``fill`` (the identity element).

    The scans work in place: a copy is made unless ``copy=False`` says x is a contiguous temporary of the caller.
    """
    B, T = x.shape[:2]
    if T % chunk == 0 and not copy and x.is_contiguous():
        return x.view(B, -1, chunk, *x.shape[2:])
    out = torch.empty((B, -(-T // chunk) * chunk, *x.shape[2:]), dtype=x.dtype, device=x.device)
    out[:, :T] = x
    out[:, T:] = fill
    return out.view(B, -1, chunk, *x.shape[2:])


def _hillis_steele(parts, combine, reverse: bool):
    """In place: inclusive prefix (suffix when ``reverse``) of ``combine(later, earlier)`` along dim 2."""
    C = parts[0].shape[2]
    off = 1
    while off < C:
        head = tuple(p.narrow(2, 0, C - off) for p in parts)
        tail = tuple(p.narrow(2, off, C - off) for p in parts)
        target, source = (head, tail) if reverse else (tail, head)
        new = combine(target, source)                # computed from the old values before any write
        for t, n in zip(target, new):
            t.copy_(n)
        off *= 2
    return parts


def _affine_combine(later, earlier):
    (c2, b2), (c1, b1) = later, earlier
    return c2 * c1, c2 * b1 + b2


def affine_scan(c: torch.Tensor, b: torch.Tensor, x0: torch.Tensor | None = None, reverse: bool = False,
                chunk: int = CHUNK) -> torch.Tensor:
    """Solve ``x_t = c_t * x_{t-1} + b_t`` along dim 1 for all t (``x_0 = x0``, default 0), elementwise.

    With ``reverse=True`` it runs from the end: ``x_t = c_t * x_{t+1} + b_t`` with ``x_{T+1} = x0``.
    ``c`` and ``b`` broadcast to [B, T, ...]; ``x0`` is [B, ...].
    """
    c, b = torch.broadcast_tensors(c, b)
    T = c.shape[1]
    C, Bc = _hillis_steele((_chunked(c, chunk, 1.0), _chunked(b, chunk, 0.0)), _affine_combine, reverse)
    x = torch.zeros_like(b[:, 0]) if x0 is None else x0.expand_as(b[:, 0])
    starts = [None] * C.shape[1]
    last = 0 if reverse else -1
    for j in (reversed(range(C.shape[1])) if reverse else range(C.shape[1])):   # carry across chunks
        starts[j] = x
        x = C[:, j, last] * x + Bc[:, j, last]
    return C.mul_(torch.stack(starts, 1).unsqueeze(2)).add_(Bc).flatten(1, 2)[:, :T]


def _mobius_combine(later, earlier):
    # 2x2 products with the (2, 2) entry kept at 1: [[p11, p12], [p21, 1]] @ [[q11, q12], [q21, 1]], rescaled
    (p11, p12, p21), (q11, q12, q21) = later, earlier
    inv = 1.0 / (p21 * q12 + 1.0)                    # >= 1 before inversion: entries are non-negative
    return (p11 * q11 + p12 * q21) * inv, (p11 * q12 + p12) * inv, (p21 * q11 + q21) * inv


def mobius_scan(m11, m12, m21, m22, x0: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Iterate the Möbius maps ``x_t = (m11 x_{t-1} + m12) / (m21 x_{t-1} + m22)`` along dim 1 from ``x0``.

    Needs non-negative entries and m22 > 0. The map is scale-free, so the 2×2 prefix products are kept with
    their (2, 2) entry at 1 (they are divided by it after every combine, which also keeps them finite); with
    non-negative entries nothing cancels. Entries broadcast to [B, T, ...]; ``x0`` is [B, ...].
    """
    m11, m12, m21, m22 = torch.broadcast_tensors(m11, m12, m21, m22)
    T = m11.shape[1]
    inv = 1.0 / m22
    P = tuple(_chunked(m * inv, chunk, fill, copy=False) for m, fill in zip((m11, m12, m21), (1.0, 0.0, 0.0)))
    p11, p12, p21 = _hillis_steele(P, _mobius_combine, reverse=False)
    x = x0.expand_as(m11[:, 0])
    starts = []
    for j in range(p11.shape[1]):                    # carry across chunks
        starts.append(x)
        x = (p11[:, j, -1] * x + p12[:, j, -1]) / (p21[:, j, -1] * x + 1.0)
    xs = torch.stack(starts, 1).unsqueeze(2)
    return ((p11 * xs + p12) / (p21 * xs + 1.0)).flatten(1, 2)[:, :T]
