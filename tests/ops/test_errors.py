"""Bad input is a ValueError that names the argument, what was expected and what was given."""
import pytest
import torch

from kalmix import ops
from kalmix.ops import SPECS
from kalmix.ops.common.checks import resolve_impl


@pytest.fixture
def small(draw):
    """small(name, B=2, dtype=torch.float32): the op's positional inputs at B × 8 tokens, H = 2, K = 4, V = 3."""
    return lambda name, B=2, dtype=torch.float32: draw(name, B, 8, 2, 4, 3, dtype=dtype)[0]


@pytest.mark.parametrize("name", list(SPECS))
def test_unknown_impl(name, small):
    with pytest.raises(ValueError, match=r"unknown impl='fast'"):
        SPECS[name].fn(*small(name), impl="fast")


def test_impl_an_op_lacks_is_an_error_not_a_fallback():
    with pytest.raises(NotImplementedError, match="impl='triton' is not available"):
        resolve_impl("some_op", "triton", torch.device("cpu"), {"torch": lambda: None})


@pytest.mark.parametrize("name", [n for n, spec in SPECS.items() if "triton" in spec.impls])
def test_triton_impl_on_cpu_without_the_interpreter_is_an_error_not_a_fallback(monkeypatch, name, small):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"impl='triton' needs CUDA tensors \(or TRITON_INTERPRET=1\)"):
        SPECS[name].fn(*small(name), impl="triton")


@pytest.mark.parametrize("name", list(SPECS))
def test_wrong_rank_and_size(name, small):
    args = small(name)
    with pytest.raises(ValueError, match=r"`q` must have shape"):
        SPECS[name].fn(args[0][0], *args[1:])
    bad = list(args)
    bad[2] = bad[2][:, :5]
    with pytest.raises(ValueError, match=r"`v` must have shape .*got \[2, 5, 2, 3\]"):
        SPECS[name].fn(*bad)


@pytest.mark.parametrize("name", list(SPECS))
def test_mismatched_dtype_and_device(name, small):
    args = small(name)
    bad = list(args)
    bad[1] = bad[1].double()
    with pytest.raises(ValueError, match=r"`k` has dtype torch.float64"):
        SPECS[name].fn(*bad)
    bad = list(args)
    bad[2] = torch.empty(bad[2].shape, device="meta")
    with pytest.raises(ValueError, match=r"`v` is on meta"):
        SPECS[name].fn(*bad)


@pytest.mark.parametrize("name", list(SPECS))
def test_cu_seqlens_must_end_at_T(name, small):
    args = small(name, B=1)
    with pytest.raises(ValueError, match=r"`cu_seqlens` must .*end at T = 8, got \[0, 3, 7\]"):
        SPECS[name].fn(*args, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match=r"batch size 1, got B = 2"):
        SPECS[name].fn(*small(name), cu_seqlens=torch.tensor([0, 3, 8]))


@pytest.mark.parametrize("name", list(SPECS))
def test_initial_state_shape(name, small):
    args = small(name)
    state = SPECS[name].random_state(3, 2, 4, 3, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"initial_state.*must have shape"):
        SPECS[name].fn(*args, initial_state=state)


def test_kalman_ranges(small):
    q, k, v, w, a, p = small("kalman")
    with pytest.raises(ValueError, match=r"`v_precision` must lie in \(0.0, inf\)"):
        ops.kalman_attention(q, k, v, w.clone().index_fill_(1, torch.tensor([2]), 0.0), a, p)
    with pytest.raises(ValueError, match=r"`decay` must lie in \(0.0, 1.0\]"):
        ops.kalman_attention(q, k, v, w, a + 1.0, p)
    with pytest.raises(ValueError, match=r"`decay` must lie in \(0.0, 1.0\]"):
        ops.kalman_attention(q, k, v, w, torch.zeros_like(a), p)
    with pytest.raises(ValueError, match=r"`process_noise` must lie in \[0.0, inf\)"):
        ops.kalman_attention(q, k, v, w, a, p - 1.0)
    with pytest.raises(ValueError, match=r"`decay` must have shape \[H, N, D\]"):
        ops.kalman_attention(q, k, v, w, a[0], p)
    # all ranges are read back together: a NaN, or a bad initial precision after good tensors, is still named
    with pytest.raises(ValueError, match=r"`v_precision` contains NaN"):
        ops.kalman_attention(q, k, v, w.clone().index_fill_(1, torch.tensor([1]), float("nan")), a, p)
    lam0 = torch.ones(q.shape[0], *a.shape, dtype=q.dtype)
    with pytest.raises(ValueError, match=r"`initial_state\[0\] \(precision\)` must lie in \(0.0, inf\)"):
        ops.kalman_attention(q, k, v, w, a, p, initial_state=(lam0 - 1.0, torch.zeros_like(lam0)))


def test_gate_ranges(small):
    q, k, v, g, eta = small("kaczmarz")
    with pytest.raises(ValueError, match=r"`g` must lie in"):
        ops.kaczmarz_attention(q, k, v, -g + 0.1, eta)
    with pytest.raises(ValueError, match=r"`eta` must lie in \(0.0, 1.0\]"):
        ops.kaczmarz_attention(q, k, v, g, eta + 1.0)
    q, k, v, g, beta, alpha = small("gka")
    with pytest.raises(ValueError, match=r"`beta` must lie in \[0.0, inf\)"):
        ops.gated_kalmanet(q, k, v, g, -beta)
    with pytest.raises(ValueError, match=r"`num_iters` must be None"):
        ops.gated_kalmanet(q, k, v, num_iters=-1)
    with pytest.raises(ValueError, match=r"`ridge` must be > 0"):
        ops.gated_kalmanet(q, k, v, ridge=0.0)
    with pytest.raises(ValueError, match=r"`lambda0` must be > 0"):
        ops.variational_linear_attention(*small("vla"), lambda0=0.0)


def test_check_values_false_skips_only_the_value_checks(small):
    """check_values=False (the layers, whose inputs are in range by construction) reads nothing back: a value
    out of range goes through; a wrong shape is still an error."""
    q, k, v, w, a, p = small("kalman")
    o = ops.kalman_attention(q, k, v, w.clone().index_fill_(1, torch.tensor([1]), float("nan")), a, p,
                             check_values=False)[0]
    assert o.isnan().any()
    with pytest.raises(ValueError, match=r"`decay` must have shape"):
        ops.kalman_attention(q, k, v, w, a[0], p, check_values=False)
    q, k, v, g, eta = small("kaczmarz")
    ops.kaczmarz_attention(q, k, v, g, torch.zeros_like(eta), check_values=False)     # η = 0 writes nothing
    q, k, v, g, beta, alpha = small("gka")
    ops.gated_kalmanet(q, k, v, g + 1.0, beta, alpha, check_values=False)


@pytest.mark.parametrize("name", list(SPECS))
def test_empty_sequence_is_rejected(name, small):
    args = [a[:, :0] if a.dim() >= 3 else a for a in small(name)]
    with pytest.raises(ValueError, match=r"must not be empty"):
        SPECS[name].fn(*args)


def test_gates_may_be_fp32_beside_bf16_activations(small):
    q, k, v, g, eta = small("kaczmarz", dtype=torch.float32)
    o, _ = ops.kaczmarz_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, eta)
    assert o.dtype == torch.bfloat16
    q, k, v, g, beta, alpha = small("gka", dtype=torch.float32)
    o, _ = ops.gated_kalmanet(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, alpha)
    assert o.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"`g` has dtype torch.float64; gates must have q's dtype"):
        ops.kaczmarz_attention(q, k, v, g.double(), beta)
