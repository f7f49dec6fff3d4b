"""VLA's triton impl on packed sequences (interpreter on CPU): against the fp64 torch impl's loop over them (outputs,
final states, every gradient), each sequence alone, one launch of each kernel for all sequences, and the A path's
parts (a long sequence cut into parts beside short ones) with nothing read back to the host."""
import pytest
import torch
import torch.nn.functional as F

from kalmix.ops.common.testing import assert_close, launch_args, random_functional_grads
from kalmix.ops.common.varlen import check_offsets
from kalmix.ops.vla import apath_triton, io_triton
from kalmix.ops.vla.apath_triton import write_directions_triton
from kalmix.ops.vla.chunk import write_directions
from kalmix.ops.vla.op import variational_linear_attention
from tests.host_reads import HostReads

# empty sequences first, last and two in a row; length 1; around the A path's sub-chunk (16) and block (64), the
# readout's chunk (32) and the delta rule's chunk (64)
LENS = [0, 1, 17, 63, 0, 0, 65, 16, 33, 1, 0]
H = 2


def _draw(lens, K, V, seed, with_state):
    """cu_seqlens and fp64 activations [1, T, H, *] and states [N, H, *] (None: the op's default)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    N, T = len(lens), sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    acts = [r(1, T, H, K), r(1, T, H, K), r(1, T, H, V), r(1, T, H, K)]
    state = None
    if with_state:
        X = r(N, H, K, K)
        state = (r(N, H, K, V), X @ X.mT / K + 0.5 * torch.eye(K, dtype=torch.float64),
                 torch.rand(N, H, K, generator=gen, dtype=torch.float64))
    return cu, acts, state


def _run(xs, state, impl, cu, write_key="raw"):
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
def test_packed_triton_matches_fp64_torch(dtype, K, write_key, with_state, monkeypatch):
    """One launch of each A-path and readout kernel for all sequences (one A-path program per sequence and head,
    an empty one's included; one readout program per chunk of 32 tokens of a sequence and head), every value and
    gradient as the fp64 torch impl's loop over the sequences on the same inputs."""
    apath = launch_args(monkeypatch, apath_triton._apath_fwd_kernel, "grid")
    carry = launch_args(monkeypatch, apath_triton._apath_carry_kernel, "grid")
    reads = launch_args(monkeypatch, io_triton._readout_fwd_kernel, "grid")
    cu, xs, state = _draw(LENS, K, K, seed=K, with_state=with_state)
    xs, state = [x.to(dtype) for x in xs], state and tuple(s.to(dtype) for s in state)
    got = _run(xs, state, "triton", cu, write_key)
    assert apath == [(len(LENS), H)] and len(carry) == 1
    assert reads == [(sum(-(-n // 32) for n in LENS), H)]
    ref = _run([x.double() for x in xs], state and tuple(s.double() for s in state), "torch", cu, write_key)
    names = "o S A n dq dk dv du dS0 dA0 dn0".split()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for name, x, r in zip(names, got, ref):
        assert_close(name, x, r.to(x.dtype), tol)         # (and finite: no NaN in any gradient)


def test_packed_equals_each_sequence_alone():
    """No token sees another sequence: the packed call's outputs and final states are each sequence's own, run
    alone as a batch of one; an empty sequence returns its initial state."""
    cu, xs, state = _draw(LENS, 16, 8, seed=3, with_state=True)
    o, final = variational_linear_attention(*xs, initial_state=state, output_final_state=True, cu_seqlens=cu,
                                            impl="triton")
    for i, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        s_i = tuple(s[i:i + 1] for s in state)
        if eos == bos:
            ref_o, ref_final = o[:, bos:eos], (s_i[0], 0.5 * (s_i[1] + s_i[1].mT), s_i[2])
        else:
            ref_o, ref_final = variational_linear_attention(*(x[:, bos:eos] for x in xs), initial_state=s_i,
                                                            output_final_state=True, impl="triton")
        assert_close(f"seq {i} o", o[:, bos:eos], ref_o, 1e-12)
        for name, x, r in zip("SAn", final, ref_final):
            assert_close(f"seq {i} {name}", x[i:i + 1], r, 1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_a_path_parts_of_packed_sequences(dtype, tol, monkeypatch):
    """With parts of one block (64 tokens) the 150-token sequence runs as three parts, the 65-token one as two,
    the others as one each (an empty one as an empty part); the forward starts each later part from its
    sequence's fp64 Gram sums and the backward's carry sums each sequence's later parts only. Values, the final
    A and every gradient (the initial A's included) as the torch A path per sequence in fp64; forward and backward
    read nothing back to the host."""
    monkeypatch.setattr(apath_triton, "MIN_PART_BLOCKS", 1)
    monkeypatch.setattr(apath_triton, "MIN_PROGRAMS", 1000)
    monkeypatch.setattr(apath_triton, "CARRY_MIN_PROGRAMS", 1000)
    monkeypatch.setattr(apath_triton, "GRAM_BYTES", 1)              # the Gram sums one part at a time
    grids = launch_args(monkeypatch, apath_triton._apath_fwd_kernel, "grid")
    carries = launch_args(monkeypatch, apath_triton._apath_carry_kernel, "TOTAL")
    lens, K = [150, 0, 1, 65, 17, 0], 16
    gen = torch.Generator().manual_seed(9)
    kh, uh = (F.normalize(torch.randn(1, sum(lens), H, K, generator=gen, dtype=torch.float64), dim=-1)
              for _ in range(2))
    X = torch.randn(len(lens), H, K, K, generator=gen, dtype=torch.float64)
    A0 = X @ X.mT / K + 0.5 * torch.eye(K, dtype=torch.float64)
    offsets = check_offsets("test", torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]), sum(lens))

    r_alpha = torch.randn(kh.shape, generator=gen, dtype=torch.float64)
    r_A = torch.randn(A0.shape, generator=gen, dtype=torch.float64)

    def grads(alpha, A, leaves):
        """α̂, the final A and the gradients of ⟨r_alpha, α̂⟩ + ⟨r_A, A⟩ (the initial A's: its symmetric part)."""
        loss = (alpha * r_alpha.to(alpha.dtype)).sum() + (A * r_A.to(A.dtype)).sum()
        g = torch.autograd.grad(loss, leaves)
        return [alpha.detach(), A.detach(), g[0], g[1], 0.5 * (g[2] + g[2].mT)]

    leaves = [x.to(dtype).requires_grad_() for x in (kh, uh, A0)]
    with HostReads() as reads:
        got = grads(*write_directions_triton(*leaves, offsets), leaves)
    assert reads.count == 0, reads.where
    assert grids == [(3 + 1 + 1 + 2 + 1 + 1, H)] and carries == [True, False]
    leaves = [x.clone().requires_grad_() for x in (kh, uh, A0)]
    alphas, finals = [], []
    for i, (bos, eos) in enumerate(zip(offsets.bounds[:-1], offsets.bounds[1:])):
        a, f = (leaves[0][:, bos:eos], leaves[2][i:i + 1]) if bos == eos else \
            write_directions(leaves[0][:, bos:eos], leaves[1][:, bos:eos], leaves[2][i:i + 1])
        alphas.append(a)
        finals.append(f)
    ref = grads(torch.cat(alphas, 1), torch.cat(finals), leaves)
    for name, x, r in zip("alpha A dk du dA0".split(), got, ref):
        assert_close(name, x, r.to(x.dtype), tol)
