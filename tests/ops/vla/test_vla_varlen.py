"""VLA's triton impl on packed sequences (interpreter on CPU): against the torch impl's loop over them (outputs,
final states, every gradient), each sequence alone, one A-path and one readout call per length bucket, and the
padding of those calls leaving values, final states and gradients exactly as without it."""
import pytest
import torch

from kalmix.ops.common.testing import assert_close, launch_args, random_functional_grads
from kalmix.ops.common.varlen import LengthBuckets, check_offsets
from kalmix.ops.vla import apath_triton, io_triton
from kalmix.ops.vla.apath_triton import write_directions_triton
from kalmix.ops.vla.fused import MIN_BITS
from kalmix.ops.vla.io_triton import readout
from kalmix.ops.vla.op import variational_linear_attention

# buckets [1, 32), [32, 64), [64, 128): length-1 sequences, an empty one, a partial A-path sub-chunk and readout
# chunk in each
LENS = [1, 3, 17, 40, 0, 70, 1, 33]
H = 2


def _draw(lens, K, V, dtype, seed, with_state):
    gen = torch.Generator().manual_seed(seed)
    lens = [lens[i] for i in torch.randperm(len(lens), generator=gen)]
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    N, T = len(lens), sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    acts = [r(1, T, H, K), r(1, T, H, K), r(1, T, H, V), r(1, T, H, K)]
    state = None
    if with_state:
        X = r(N, H, K, K)
        state = (r(N, H, K, V), X @ X.mT / K + 0.5 * torch.eye(K, dtype=torch.float64),
                 torch.rand(N, H, K, generator=gen, dtype=torch.float64))
    return cu, [a.to(dtype) for a in acts], state and tuple(s.to(dtype) for s in state)


def _run(xs, state, impl, cu, write_key):
    """Outputs, final states and the gradients of Σ ⟨r, output⟩ over all of them, for q, k, v, u and the
    initial states."""
    xs = [x.detach().requires_grad_() for x in xs]
    st = None if state is None else tuple(s.detach().requires_grad_() for s in state)
    o, final = variational_linear_attention(*xs, initial_state=st, output_final_state=True, cu_seqlens=cu,
                                            impl=impl, write_key=write_key)
    outs = [o, *final]
    return [x.detach() for x in outs] + random_functional_grads(outs, xs + list(st or ()))


@pytest.mark.parametrize("dtype,K,write_key,with_state", [(torch.float64, 16, "raw", True),
                                                          (torch.float64, 32, "feature", False),
                                                          (torch.float32, 16, "feature", True),
                                                          (torch.float32, 32, "raw", False)])
def test_packed_triton_matches_torch(dtype, K, write_key, with_state, monkeypatch):
    """One A-path forward and one readout forward per bucket, each on its sequences; every value and gradient
    as the torch impl's loop over the sequences."""
    apath = launch_args(monkeypatch, apath_triton._apath_fwd_kernel, "grid")
    reads = launch_args(monkeypatch, io_triton._readout_fwd_kernel, "grid")
    cu, xs, state = _draw(LENS, K, K, dtype, seed=K, with_state=with_state)
    got = _run(xs, state, "triton", cu, write_key)
    assert [g[1] for g in apath] == [g[1] for g in reads] == [4 * H, 2 * H, H]     # (sequences · heads) per bucket
    ref = _run(xs, state, "torch", cu, write_key)
    names = "o S A n dq dk dv du dS0 dA0 dn0".split()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for name, x, r in zip(names, got, ref):
        assert_close(name, x, r, tol)         # (and finite: no NaN in any gradient)


def test_packed_equals_each_sequence_alone():
    """No token sees another sequence: the packed call's outputs and final states are each sequence's own."""
    cu, xs, state = _draw(LENS, 16, 8, torch.float64, seed=3, with_state=True)
    o, final = variational_linear_attention(*xs, initial_state=state, output_final_state=True, cu_seqlens=cu,
                                            impl="triton")
    for i, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        s_i = tuple(s[i:i + 1] for s in state)
        if eos == bos:
            ref_o, ref_final = o[:, bos:eos], s_i
        else:
            ref_o, ref_final = variational_linear_attention(*(x[:, bos:eos] for x in xs), initial_state=s_i,
                                                            output_final_state=True, impl="triton")
        assert_close(f"seq {i} o", o[:, bos:eos], ref_o, 1e-12)
        for name, x, r in zip("SAn", final, ref_final):
            assert_close(f"seq {i} {name}", x[i:i + 1], r, 1e-12)


def test_buckets_pad_and_restore():
    """Lengths below 2^MIN_BITS share the first bucket, the others go by their bit length; each bucket is padded
    to its longest sequence, and unpad/finals invert pad/states."""
    cu = torch.tensor([0, 5, 5, 75, 76, 106, 146])            # lengths 5, 0, 70, 1, 30, 40
    b = LengthBuckets(check_offsets("test", cu, 146), MIN_BITS)
    assert b.shapes == [(3, 30), (1, 40), (1, 70)]
    assert b.seqs.tolist() == [0, 3, 4, 5, 2]
    x = torch.arange(146.).view(1, 146, 1)
    padded = b.pad(x, -1.)
    assert padded[0][:, :, 0].tolist()[1] == [75.] + [-1.] * 29
    assert_close("unpad", b.unpad(padded), x, 0)
    s0 = torch.arange(6.)[:, None]
    # sequence 1 is empty: it keeps its initial state
    assert b.finals(s0, [-s for s in b.states(s0)]).flatten().tolist() == [0., 1., -2., -3., -4., -5.]


def test_right_padding_changes_nothing():
    """The A path and the readout on sequences right-padded as fused.py pads them (k̂ = û = 0; k at the dtype's
    lowest value, q = 0, o_s = 0) give the unpadded values, final states and gradients, and exact zero gradients
    at the padding."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    T, P, K, V = 37, 60, 16, 8                   # 37 real tokens, 60 padded ones (past the next sub-chunk/chunk)
    kh, uh = (torch.nn.functional.normalize(r(2, T, H, K), dim=-1) for _ in range(2))
    X = r(2, H, K, K)
    A0 = X @ X.mT / K + 0.5 * torch.eye(K, dtype=torch.float64)
    o_s, q, k, n0 = r(2, T, H, V), r(2, T, H, K), r(2, T, H, K), torch.rand(2, H, K, generator=gen,
                                                                               dtype=torch.float64)
    lowest = torch.finfo(torch.float64).min
    cases = [(write_directions_triton, [kh, uh, A0], [0., 0., None]),
             (lambda *x: readout(*x, 1e-4), [o_s, q, k, n0], [0., 0., lowest, None])]
    for fn, xs, pads in cases:
        res = []
        for pad in (0, P):
            leaves = [x.clone().requires_grad_() for x in xs]
            padded = [x if v is None else torch.cat([x, x.new_full((2, pad, *x.shape[2:]), v)], 1)
                      for x, v in zip(leaves, pads)]
            out, final = fn(*padded)
            grads = random_functional_grads([out[:, :T], final], leaves + padded)
            assert all(g[:, T:].eq(0).all() for g, v in zip(grads[len(xs):], pads) if v is not None)
            res.append([out[:, :T].detach(), final.detach(), *grads[:len(xs)]])
        for i, (x, ref) in enumerate(zip(*res)):
            assert_close(f"tensor {i}", x, ref, 0)
