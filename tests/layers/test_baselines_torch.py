"""The pure-PyTorch baselines: gated_linear_attention's chunked impl against its token loop (fp64, every gradient,
strong decays), and the linear_attention, gla, mamba2 and notebook_deltanet mixers inside KalmixForCausalLM (packed
documents, padding, cached decoding)."""
import pytest
import torch
import torch.nn.functional as F

from kalmix.layers import MIXERS
from kalmix.models import KalmixConfig, KalmixForCausalLM
from kalmix.ops import gated_linear_attention
from kalmix.ops.common.testing import assert_close, random_functional_grads

BASELINES = {"linear_attention": dict(num_heads=2), "gla": dict(num_heads=2),
             "mamba2": dict(head_dim=8, d_state=4), "notebook_deltanet": dict(num_heads=2)}
GATES = ["none", "head", "channel"]


def op_inputs(T, gate, B=2, H=2, K=5, V=3, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    g = {"none": None, "head": -torch.rand(B, T, H, generator=gen, dtype=torch.float64),
         "channel": F.logsigmoid(r(B, T, H, K)) / 4}[gate]
    args = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)] + ([] if g is None else [g])
    return [a.to(dtype) for a in args], r(B, H, K, V).to(dtype)


def run_op(args, state, impl):
    leaves = [a.detach().requires_grad_() for a in (*args, state)]
    o, S = gated_linear_attention(*leaves[:-1], initial_state=leaves[-1], output_final_state=True, impl=impl)
    return [o, S] + random_functional_grads([o, S], leaves)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T", [1, 7, 70, 130])
def test_chunked_equals_token_loop_fp64(T, gate):
    args, state = op_inputs(T, gate, seed=T)
    names = ["o", "final state", "dq", "dk", "dv"] + (["dg"] if gate != "none" else []) + ["d initial_state"]
    for name, x, r in zip(names, run_op(args, state, "torch"), run_op(args, state, "naive"), strict=True):
        assert_close(f"{gate} T={T} {name}", x, r, 1e-12)


@pytest.mark.parametrize("g", [
    torch.full((1, 200, 2, 8), -10.0),                                       # logsigmoid(-10) ≈ −10 per step, unnormalised
    F.logsigmoid(torch.full((1, 200, 2, 8), -10.0)) / 16,                    # GLA's normaliser: −0.63 per step
    torch.rand(1, 200, 2, 8, generator=torch.Generator().manual_seed(0)).log() * 20,   # mixed, down to −inf-ish
    -16 * F.softplus(torch.full((1, 200, 2), 5.0)),                          # Mamba-2: A = 16, large Δ ≈ 5
], ids=["gla_-10", "gla_normalised", "gla_mixed", "mamba2_large_dt"])
def test_strong_decays_stay_finite_and_match_the_loop(g):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 200, 2, 8, generator=gen) for _ in range(3))
    o, S = gated_linear_attention(q, k, v, g, output_final_state=True, impl="torch")            # fp32
    ro, rS = gated_linear_attention(*(x.double() for x in (q, k, v, g)), output_final_state=True, impl="naive")
    assert_close("o", o, ro, 1e-5)
    assert_close("state", S, rS, 1e-5)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]
    grads = random_functional_grads(list(gated_linear_attention(*leaves, output_final_state=True)), leaves)
    assert all(torch.isfinite(d).all() for d in grads)


def test_layers_refuse_triton_clearly():
    for name in BASELINES:
        with pytest.raises(ValueError, match="there is no Triton kernel"):
            MIXERS[name](16, impl="triton", **BASELINES[name])


def model(mixer, seed=0):
    torch.manual_seed(seed)
    cfg = KalmixConfig(vocab_size=37, hidden_size=16, num_hidden_layers=2, mixer=mixer,
                       mixer_kwargs={mixer: BASELINES[mixer]}, intermediate_size=32)
    return KalmixForCausalLM(cfg).double()


@pytest.mark.parametrize("mixer", BASELINES)
def test_forward_backward_finite_and_state_size(mixer):
    m = model(mixer)
    ids = torch.randint(0, 37, (2, 70))
    out = m(ids, labels=ids, use_cache=True)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    layer = m.model.layers[0].mixer
    assert out.cache[0]["recurrent_state"].numel() == 2 * layer.state_size()


@pytest.mark.parametrize("mixer", BASELINES)
def test_packed_documents_equal_each_document_alone(mixer):
    m = model(mixer)
    ids = torch.randint(0, 37, (2, 75))
    cu = torch.tensor([0, 9, 75, 76, 140, 150])                # documents across and within the two rows
    out = m(ids, cu_seqlens=cu).logits
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        row, lo = divmod(a, 75)
        alone = m(ids[row:row + 1, lo:lo + b - a]).logits
        torch.testing.assert_close(out[row:row + 1, lo:lo + b - a], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mixer", BASELINES)
def test_padding_mask_equals_unpadded(mixer):
    m = model(mixer)
    ids = torch.randint(1, 37, (3, 70))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0                                              # left padding
    mask[2, 60:] = 0                                             # right padding
    out = m(ids, attention_mask=mask).logits
    for b, (lo, hi) in enumerate([(5, 70), (0, 70), (0, 60)]):
        torch.testing.assert_close(out[b:b + 1, lo:hi], m(ids[b:b + 1, lo:hi]).logits, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mixer", BASELINES)
def test_cached_decoding_equals_the_full_forward(mixer):
    m = model(mixer).eval()
    ids = torch.randint(0, 37, (2, 80))
    full = m(ids).logits
    out = m(ids[:, :67], use_cache=True)                        # prefill past one chunk, then single-token steps
    steps, cache = [out.logits], out.cache
    for t in range(67, 80):
        out = m(ids[:, t:t + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
