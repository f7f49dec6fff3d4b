"""ShortConv with document boundaries (``docs``: their ``doc_pos`` and ``row_starts``, rows that pack several
documents): the torch path against each document run alone from a zero state, one document per row against
``docs=None``, and the fused Triton kernel (interpreter on CPU) against the torch path; values and every
gradient."""
import itertools
from typing import NamedTuple

import pytest
import torch

from kalmix.layers.common import ShortConv
from kalmix.layers.fused import short_conv
from kalmix.ops.common.testing import assert_close, random_functional_grads


def _random_lengths(T: int, gen: torch.Generator) -> list[int]:
    """Document lengths summing to T, about a third of them 1."""
    lengths = []
    while sum(lengths) < T:
        one = torch.rand(1, generator=gen).item() < 0.35
        lengths.append(1 if one else int(torch.randint(2, 14, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - T                 # the overshoot is less than the last length
    return lengths


def _positions(rows: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """doc_pos [B, T] of rows given as lists of document lengths."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]).to(dtype)


class Rows(NamedTuple):
    """Packed documents as ShortConv takes them (a ``Documents`` holds both)."""
    doc_pos: torch.Tensor
    row_starts: int


def _docs(doc_pos: torch.Tensor, extra: int = 0) -> Rows:
    """doc_pos with the most document starts in a row (counted here on the host), plus ``extra``."""
    starts = doc_pos == 0
    starts[:, 0] = True
    return Rows(doc_pos, int(starts.sum(1).max()) + extra)


def _rows(T: int, gen: torch.Generator) -> list[list[int]]:
    """Three rows split differently: two at random, one with length-1 documents at both ends."""
    return [_random_lengths(T, gen), _random_lengths(T, gen), [1, 2, T - 5, 1, 1]]


def _conv(K, bias, activation, dtype, C, seed):
    torch.manual_seed(seed)
    conv = ShortConv(C, K, bias=bias, activation=activation).to(dtype)
    if bias:
        conv.bias.data.normal_()
    return conv


def _with_grads(fn, conv, x, seed):
    """fn(x) -> y; returns y and the gradients of a random linear functional of y w.r.t. x and conv's weight
    and (when it has one) bias."""
    leaves = [x.detach().clone().requires_grad_(), *conv.parameters()]
    y = fn(leaves[0])
    return [y.detach(), *random_functional_grads([y], leaves, seed)]


def _each_document(conv, rows):
    """The reference: every document of every row through the zero-state path on its own (those of one length
    side by side in a batch), put back in place."""
    def fn(x):
        docs = [(r, s, e) for r, row in enumerate(rows)
                for s, e in itertools.pairwise(itertools.accumulate(row, initial=0))]
        out = {}
        for n in {e - s for _, s, e in docs}:
            group = [(r, s) for r, s, e in docs if e - s == n]
            ys = conv(torch.stack([x[r, s:s + n] for r, s in group]))[0]
            out.update(zip(group, ys))
        return torch.stack([torch.cat([y for (r, _), y in sorted(out.items()) if r == row])
                            for row in range(len(rows))])
    return fn


@pytest.mark.parametrize("T", [37, 100])
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", [True, False])
def test_documents_match_separate_runs(T, K, bias, activation):
    """The torch path with doc_pos equals each document run separately and concatenated: y, dx, dw, db in
    fp64 to 1e-12, for three splits of each row (int64 and int32 positions); the new state is still the row's
    last K − 1 inputs. A row that starts inside a document (its first positions not from 0) sees nothing before
    the row, as if the document started there. A larger ``row_starts`` than the rows hold (context parallelism's
    bound) changes no bit."""
    gen = torch.Generator().manual_seed(T * 10 + K)
    conv = _conv(K, bias, activation, torch.float64, 6, K)
    for draw in range(3):
        rows = _rows(T, gen)
        doc_pos = _positions(rows, torch.int32 if draw % 2 else torch.int64)
        x = torch.randn(3, T, 6, generator=gen, dtype=torch.float64)
        got = _with_grads(lambda x, doc_pos=doc_pos: conv(x, docs=_docs(doc_pos))[0], conv, x, draw)
        ref = _with_grads(_each_document(conv, rows), conv, x, draw)
        for name, a, b in zip(("y", "dx", "dw", "db"), got, ref):
            assert_close(f"{name} (rows {rows})", a, b, 1e-12)
        assert torch.equal(conv(x, docs=_docs(doc_pos))[1], conv(x)[1])
        inside = doc_pos.clone()
        inside[0, :rows[0][0]] += 5
        assert torch.equal(conv(x, docs=_docs(inside))[0], conv(x, docs=_docs(doc_pos))[0])
        assert torch.equal(conv(x, docs=_docs(doc_pos, extra=2))[0], conv(x, docs=_docs(doc_pos))[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [1, 4])
def test_one_document_per_row_is_docs_none(dtype, K):
    """doc_pos = arange (every row one document) gives exactly what docs=None gives: y, state and every
    gradient, bit for bit."""
    conv = _conv(K, True, True, dtype, 5, 3)
    x = torch.randn(2, 19, 5, dtype=torch.float64).to(dtype)
    docs = Rows(torch.arange(19).expand(2, 19), 1)
    got = _with_grads(lambda x: conv(x, docs=docs)[0], conv, x, 4)
    ref = _with_grads(lambda x: conv(x)[0], conv, x, 4)
    for name, a, b in zip(("y", "dx", "dw", "db"), got, ref):
        assert torch.equal(a, b), name
    assert torch.equal(conv(x, docs=docs)[1], conv(x)[1])


TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,K,silu,bias,pos_dtype", [(70, 4, True, True, torch.int64),
                                                     (37, 3, True, False, torch.int32),
                                                     (23, 2, False, True, torch.int64)])
def test_fused_kernel_with_documents(dtype, T, K, silu, bias, pos_dtype):
    """The Triton kernel (interpreter) with doc_pos against the torch path with doc_pos: y, dx, dw, db. 40
    channels leave a masked tail in the 128-channel tile; T = 70 spans nine forward and two backward token
    blocks, so documents cross the blocks' edges. The first row starts inside a document."""
    gen = torch.Generator().manual_seed(T + K)
    conv = _conv(K, bias, silu, dtype, 40, K)
    rows = _rows(T, gen)[1:]
    doc_pos = _positions(rows, pos_dtype)
    doc_pos[0, :rows[0][0]] += 2
    x = torch.randn(2, T, 40, generator=gen, dtype=torch.float64).to(dtype)
    got = _with_grads(lambda x: short_conv(x, conv.weight, conv.bias, silu, doc_pos), conv, x, 5)
    ref = _with_grads(lambda x: conv(x, docs=_docs(doc_pos))[0], conv, x, 5)
    for name, a, b in zip(("y", "dx", "dw", "db"), got, ref):
        assert_close(f"{name} (rows {rows})", a, b, TOL[dtype])


def test_docs_with_state_raises():
    conv = ShortConv(4, 4)
    x = torch.randn(1, 6, 4)
    with pytest.raises(ValueError, match="doc_pos"):
        conv(x, torch.zeros(1, 4, 3), docs=Rows(torch.arange(6)[None], 1))
    with pytest.raises(ValueError, match="doc_pos"):
        conv(x, docs=Rows(torch.arange(5)[None], 1))
