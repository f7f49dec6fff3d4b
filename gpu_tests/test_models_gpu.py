"""Models on the GPU: a training step of every mixer under CUDA autocast and with bf16 weights, and the
CUDA-graphed decode step against the eager one and against the full forward."""
import pytest
import torch

from kalmix.layers import MIXER_SPECS, MIXERS
from kalmix.models import KalmixConfig, KalmixForCausalLM
from kalmix.models.decoding import Decoder

HYBRID = ["kalman", "attention", "gka", "vla", "kaczmarz", "gdn"]


def lm(mixers, dev, dtype=torch.float32, d=256):
    torch.manual_seed(0)
    kw = {m: MIXER_SPECS[m].size_kwargs(heads=4) for m in set(mixers)}
    cfg = KalmixConfig(vocab_size=512, hidden_size=d, num_hidden_layers=len(mixers), mixers=mixers, mixer_kwargs=kw)
    return KalmixForCausalLM(cfg).to(dev, dtype)


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
