"""Kaczmarz linear attention as a chunked delta rule: raw keys with β = η / (‖k‖² + eps)."""
from __future__ import annotations

from kalmix.ops.common.delta import chunk_delta_rule
from kalmix.ops.kaczmarz.naive import kaczmarz_coefficient


def kaczmarz_chunk(q, k, v, g, eta, *, state, eps, scale):
    beta = kaczmarz_coefficient(k, eta, eps)
    o, S = chunk_delta_rule(q, k, k, v, g, beta, scale=scale, state=state[0])
    return (o,), (S,)
