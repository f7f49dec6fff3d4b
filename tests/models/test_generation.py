"""Generation: cached step-by-step logits equal the full forward; generate() with greedy and sampled decoding,
left-padded batches and chunked prefill."""
import pytest
import torch

from kalmix.models import KalmixCache
from kalmix.models.decoding import Decoder
from tests.models.test_models import HYBRID, SMALL, model

CASES = [[m] for m in SMALL] + [HYBRID]
IDS = [m[0] for m in CASES[:-1]] + ["hybrid"]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("mixers", CASES, ids=IDS)
def test_teacher_forced_steps_equal_the_full_forward(mixers, dtype, tol):
    m = model(mixers * 2 if len(mixers) == 1 else mixers, dtype=dtype)
    x = torch.randint(0, 37, (2, 17))
    full = m(x).logits
    out = m(x[:, :6], use_cache=True)
    cache, steps = out.cache if hasattr(out, "cache") else out.past_key_values, [out.logits]
    assert isinstance(cache, KalmixCache) and cache.get_seq_length() == 6
    for t in range(6, 17):
        out = m(x[:, t:t + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=tol, atol=tol)


def greedy_by_full_forwards(m, prompt, n):
    x = prompt
    for _ in range(n):
        x = torch.cat([x, m(x).logits[:, -1:].argmax(-1)], 1)
    return x


@pytest.mark.parametrize("mixers", [["gka", "attention"], HYBRID], ids=["gka+attention", "hybrid"])
def test_greedy_generate_equals_argmax_of_full_forwards(mixers):
    m = model(mixers)
    prompt = torch.randint(0, 37, (2, 7))
    out = m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(out, greedy_by_full_forwards(m, prompt, 6), rtol=0, atol=0)


def test_left_padded_batch_generates_what_each_prompt_generates_alone():
    m = model(HYBRID)
    prompts = [torch.randint(1, 37, (1, n)) for n in (9, 4, 6)]
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:] = p
        mask[i, width - p.shape[1]:] = 1
    batch = m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = m.generate(p, max_new_tokens=5, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(batch[i:i + 1, width:], alone[:, p.shape[1]:], rtol=0, atol=0)


@pytest.mark.parametrize("padded", [False, True])
def test_chunked_prefill_equals_one_prefill(padded):
    m = model(HYBRID)
    x = torch.randint(1, 37, (2, 20))
    mask = torch.ones_like(x)
    if padded:
        mask[0, :8] = 0                                               # the first chunk is all padding for row 0
    one = m(x, attention_mask=mask, use_cache=True)
    cache = KalmixCache()
    for lo, hi in [(0, 7), (7, 8), (8, 15), (15, 20)]:
        piece = m(x[:, lo:hi], attention_mask=mask[:, :hi], cache=cache, use_cache=True)
    torch.testing.assert_close(piece.logits[:, -1], one.logits[:, -1], rtol=1e-10, atol=1e-10)
    nxt = torch.randint(1, 37, (2, 1))
    mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    one_cache = one.cache if hasattr(one, "cache") else one.past_key_values
    a = m(nxt, attention_mask=mask, cache=one_cache, use_cache=True).logits
    b = m(nxt, attention_mask=mask, cache=cache, use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_sampling_is_reproducible_and_in_vocabulary():
    m = model(HYBRID, dtype=torch.float32)
    prompt = torch.randint(0, 37, (3, 5))
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(m.generate(prompt, max_new_tokens=8, do_sample=True, top_k=10, temperature=0.8, pad_token_id=0))
    assert torch.equal(outs[0], outs[1]) and outs[0].shape == (3, 13)
    assert ((outs[0] >= 0) & (outs[0] < 37)).all() and torch.equal(outs[0][:, :5], prompt)


def test_a_cache_refuses_another_batch_size():
    m = model(["kaczmarz", "attention"])
    out = m(torch.randint(0, 37, (2, 5)), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    with pytest.raises(ValueError, match="holds the states of 2 sequences.*batch of 3"):
        m(torch.randint(0, 37, (3, 1)), cache=cache, use_cache=True)


@pytest.mark.parametrize("mixers", [["gka", "attention", "kalman"], HYBRID], ids=["gka+attention+kalman", "hybrid"])
def test_static_cache_decoder_equals_generate(mixers):
    """``Decoder``'s static-cache step (the one it captures in a CUDA graph), run eagerly, decodes what
    ``generate`` decodes: plain and left-padded prompts, and a second prompt batch through the same buffers."""
    m = model(mixers)
    dec = Decoder(m, batch_size=2, max_length=20, graph=False)
    for padded in (False, True):
        prompt = torch.randint(1, 37, (2, 7))
        mask = torch.ones_like(prompt)
        if padded:
            mask[0, :3] = 0
        ref = m.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(dec.generate(prompt, 6, attention_mask=mask), ref, rtol=0, atol=0)
    first = dec.prefill(prompt).clone()
    dec.step(prompt[:, 0])
    torch.testing.assert_close(dec.prefill(prompt), first, rtol=0, atol=0)   # a new prompt starts afresh
    with pytest.raises(ValueError, match="exceed max_length = 20"):
        dec.generate(prompt, 14)
    with pytest.raises(ValueError, match="built for batch size 2"):
        dec.generate(prompt[:1], 2)


def test_static_steps_give_the_full_forward_logits():
    m = model(HYBRID)
    x = torch.randint(0, 37, (2, 12))
    full = m(x).logits
    dec = Decoder(m, batch_size=2, max_length=12, graph=False)
    logits = [dec.prefill(x[:, :5])]
    for t in range(5, 12):
        logits.append(dec.step(x[:, t]).clone())
    torch.testing.assert_close(torch.stack(logits, 1), full[:, 4:], rtol=1e-10, atol=1e-10)
