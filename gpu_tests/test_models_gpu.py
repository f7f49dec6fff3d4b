"""Models on the GPU: the LM loss's kernels against its torch chain, a training step of every mixer under CUDA
autocast and with bf16 weights, and the CUDA-graphed decode step against the eager one and against the full
forward."""
import pytest
import torch
import torch.nn.functional as F

import kalmix.models.loss as loss

from kalmix.layers import MIXER_SPECS, MIXERS
from kalmix.models import KalmixConfig, KalmixForCausalLM
from kalmix.models.decoding import Decoder
from kalmix.ops.common.testing import rel_err

HYBRID = ["kalman", "attention", "gka", "vla", "kaczmarz", "gdn"]


def lm(mixers, dev, dtype=torch.float32, d=256):
    torch.manual_seed(0)
    kw = {m: MIXER_SPECS[m].size_kwargs(heads=4) for m in set(mixers)}
    cfg = KalmixConfig(vocab_size=512, hidden_size=d, num_hidden_layers=len(mixers), mixers=mixers, mixer_kwargs=kw)
    return KalmixForCausalLM(cfg).to(dev, dtype)


@pytest.mark.quick
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("S", [1, 2])
def test_loss_kernels_against_the_torch_chain(S, autocast, dev, monkeypatch):
    """``linear_cross_entropy`` on CUDA (its Triton kernels) and through the torch chain (the CPU path) against
    the fp64 cross-entropy of the logits, at the LM's sizes (8,192 tokens, vocabulary 32,000, width 1024; a tenth
    of the targets ignored): the loss and the gradients of h and W no further from fp64 than the chain's."""
    from kalmix.models.modeling import mc_marginal
    g = torch.Generator(device=dev).manual_seed(S)
    N, d, V = 8192, 1024, 32000
    h = torch.randn(S * N, d, device=dev, generator=g, requires_grad=True)
    w = (torch.randn(V, d, device=dev, generator=g) / d ** 0.5).requires_grad_()
    y = torch.randint(0, V, (N,), device=dev, generator=g)
    y[torch.rand(N, device=dev, generator=g) < 0.1] = -100
    runs = {}
    for name, kernels in (("kernels", loss._kernels(h)), ("chain", None)):
        monkeypatch.setattr(loss, "_kernels", lambda h, k=kernels: k)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            out = loss.linear_cross_entropy(h, w, y, S)
        runs[name] = [out, *torch.autograd.grad(out, (h, w))]
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = F.linear(h64, w64)
    out = F.cross_entropy(logits if S == 1 else mc_marginal(logits, S), y)
    exact = [out, *torch.autograd.grad(out, (h64, w64))]
    errs = {n: (rel_err(a, t), rel_err(b, t)) for n, a, b, t in zip(("loss", "dh", "dW"), *runs.values(), exact)}
    print(f"loss kernels S={S} autocast={autocast}: kernels / chain vs fp64",
          " ".join(f"{n} {a:.1e}/{b:.1e}" for n, (a, b) in errs.items()))
    for a, b in errs.values():
        assert a <= 1.1 * b + (1e-6 if autocast else 1e-7)


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_training_step_under_cuda_autocast_and_bf16_weights(mixer, dev):
    x = torch.randint(0, 512, (4, 512), device=dev)
    m = lm([mixer, mixer], dev)
    with torch.no_grad():
        ref = m(x, labels=x).loss.item()
    losses = {}
    for mode in ("autocast_bf16", "autocast_fp16", "bf16_weights"):
        model = lm([mixer, mixer], dev, torch.bfloat16) if mode == "bf16_weights" else m
        model.zero_grad(set_to_none=True)
        dt = torch.float16 if mode.endswith("fp16") else torch.bfloat16
        with torch.autocast("cuda", dtype=dt, enabled=mode.startswith("autocast")):
            loss = model(x, labels=x).loss
        loss.backward()
        losses[mode] = loss.item()
        for n, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), (mode, n)
    print(f"{mixer}: fp32 loss {ref:.4f}", " ".join(f"{k} {v:.4f}" for k, v in losses.items()))
    assert all(abs(v - ref) < 0.05 for v in losses.values()), losses


@pytest.mark.quick
@pytest.mark.parametrize("mixer", ["gdn", "kaczmarz", "gka", "vla", "kalman"])
def test_recomputed_mixers_train_as_the_kept_ones(mixer, dev):
    """``recompute_mixers`` on the Triton paths under bf16 autocast, packed documents: the loss and every
    gradient of the model that keeps its activations (the kernels rerun on the same inputs; a kernel that sums
    in a varying order may differ in the last bits), and less peak memory for the step."""
    x = torch.randint(0, 512, (2, 4096), device=dev)
    cu = torch.tensor([0, 1000, 4096, 4097, 6000, 8192], device=dev)
    runs = {}
    for recompute in (False, True):
        m = lm([mixer, mixer], dev)
        m.config.recompute_mixers = recompute
        for block in m.model.layers:
            block.mixer.recompute = recompute
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", torch.bfloat16):
            out = m(input_ids=x, labels=x, cu_seqlens=cu)
        out.loss.backward()
        torch.cuda.synchronize()
        runs[recompute] = (out.loss.detach(), [p.grad for p in m.parameters()],
                           torch.cuda.max_memory_allocated() - base)
    (l0, g0, mem0), (l1, g1, mem1) = runs[False], runs[True]
    errs = [rel_err(b, a) for a, b in zip(g0, g1)]
    print(f"recompute {mixer}: loss {l0.item():.6f} / {l1.item():.6f}, worst gradient {max(errs):.1e}, "
          f"peak {mem0 / 2**20:.0f} / {mem1 / 2**20:.0f} MiB")
    assert torch.equal(l0, l1) and max(errs) <= 1e-5
    assert mem1 < mem0


@pytest.mark.parametrize("B", [1, 3])
def test_graphed_decoding_equals_eager_and_the_full_forward(B, dev):
    m = lm(HYBRID, dev).eval()
    x = torch.randint(0, 512, (B, 40), device=dev)
    with torch.no_grad():
        full = m(x).logits[:, 19:]
    res = {}
    for graph in (False, True):
        dec = Decoder(m, B, 40, graph=graph)
        logits = [dec.prefill(x[:, :20]).clone()]
        for t in range(20, 40):
            logits.append(dec.step(x[:, t]).clone())
        res[graph] = torch.stack(logits, 1)
        assert (dec.graph is not None) == graph
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()                # noqa: E731
    errs = {"graphed vs eager": rel(res[True], res[False]), "graphed vs full forward": rel(res[True], full)}
    print(f"B={B}:", ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert errs["graphed vs eager"] < 1e-5 and errs["graphed vs full forward"] < 5e-3, errs
    # a second prompt batch replays the same graph
    dec2 = Decoder(m, B, 40, graph=True)
    first = dec2.generate(x[:, :10], 8)
    again = dec2.generate(x[:, :10], 8)
    assert torch.equal(first, again)


def test_fla_deltanet_hybrid_trains_and_decodes(dev):
    m = lm(["deltanet", "attention", "kaczmarz"], dev)
    x = torch.randint(0, 512, (2, 300), device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    m.eval()
    with torch.no_grad():
        full = m(x[:, :40]).logits
        out = m(x[:, :30], use_cache=True)
        cache, steps = getattr(out, "cache", None) or out.past_key_values, [out.logits]
        for t in range(30, 40):
            out = m(x[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    err = ((torch.cat(steps, 1) - full).norm() / full.norm()).item()
    print(f"deltanet hybrid: cached steps vs full forward {err:.1e}")
    assert err < 1e-3
