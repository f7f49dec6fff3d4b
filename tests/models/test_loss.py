"""``linear_cross_entropy`` (the LM loss without its logits) against ``F.cross_entropy`` of the logits, and the
model's ``fuse_cross_entropy`` path against its plain one: loss and every gradient."""
import pytest
import torch
import torch.nn.functional as F

from kalmix.layers.common import upcast
from kalmix.models import KalmixForCausalLM
from kalmix.models.loss import linear_cross_entropy
from kalmix.models.modeling import mc_marginal
from tests.models.test_models import HYBRID, config


def inputs(S: int, N: int, d: int, V: int, seed: int, dtype=torch.float64, ignored: float = 0.25):
    """Fresh h [S·N, d], W [V, d] (both requiring gradients) and targets [N] with about ``ignored`` of them -100."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(S * N, d, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, d, generator=g, dtype=dtype) / d ** 0.5).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    y[torch.rand(N, generator=g) < ignored] = -100
    return h, w, y


def plain(h, w, y, S=1, reduction="mean"):
    """The loss as the model computes it from its logits (``mc_marginal`` of S samples)."""
    logits = F.linear(h, w)
    return F.cross_entropy(upcast(logits) if S == 1 else mc_marginal(logits, S), y, reduction=reduction)


@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("N, chunk", [(1, None), (37, 5), (37, 1), (37, 37), (100, 64), (100, None)])
def test_loss_and_gradients_equal_the_plain_cross_entropy_in_fp64(S, reduction, N, chunk):
    h, w, y = inputs(S, N, 12, 29, seed=N * 10 + S)
    y[0] = 3                                            # at least one scored token
    got = linear_cross_entropy(h, w, y, S, reduction, chunk_size=chunk)
    want = plain(h, w, y, S, reduction)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got * 1.7, (h, w)), torch.autograd.grad(want * 1.7, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


def test_batched_rows_equal_the_flattened_ones():
    """h [S·B, T, d] with targets [B, T] is h [S·N, d] with targets [N]: the same loss and gradients."""
    h, w, y = inputs(2, 3 * 7, 8, 13, seed=9)
    flat = linear_cross_entropy(h, w, y, 2, chunk_size=4)
    batched = linear_cross_entropy(h.view(6, 7, 8), w, y.view(3, 7), 2, chunk_size=4)
    torch.testing.assert_close(batched, flat, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(batched, (h, w)), torch.autograd.grad(flat, (h, w))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_ignored_rows_get_no_gradient_and_all_ignored_is_nan_with_zero_gradients():
    h, w, y = inputs(1, 40, 8, 17, seed=3, ignored=0.5)
    dh, = torch.autograd.grad(linear_cross_entropy(h, w, y, chunk_size=6), h)
    assert (dh[y == -100] == 0).all() and (dh[y != -100] != 0).any()
    y[:] = -100
    for loss in (linear_cross_entropy(h, w, y, chunk_size=6), plain(h, w, y)):     # F.cross_entropy's behaviour
        assert loss.isnan()
        assert all((g == 0).all() for g in torch.autograd.grad(loss, (h, w)))
    assert linear_cross_entropy(h, w, y, reduction="sum") == 0


def test_bf16_autocast_computes_the_logits_in_bf16_as_the_plain_loss_does():
    """Under autocast the logits are bf16 (upcast for the softmax), as ``F.linear``'s: the loss is the plain loss's
    up to the fp32 summation order, h's gradient bit for bit; W's gradient is summed in fp32 over the chunks where
    the plain one rounds the whole sum to bf16, so it is at least as close to the fp64 gradient."""
    h, w, y = inputs(1, 300, 32, 64, seed=5, dtype=torch.float32)
    with torch.autocast("cpu", torch.bfloat16):
        got = linear_cross_entropy(h, w, y, chunk_size=7)
        want = plain(h, w, y)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    (gh, gw), (ph, pw) = torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))
    assert gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(gh, ph, rtol=0, atol=0)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    _, tw = torch.autograd.grad(plain(h64, w64, y), (h64, w64))
    err = lambda g: ((g.double() - tw).norm() / tw.norm()).item()   # noqa: E731
    assert err(gw) <= err(pw) * 1.05 and err(gw) < 1e-2


def test_without_gradients_only_the_loss_is_computed():
    h, w, y = inputs(2, 30, 8, 11, seed=7)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y, 2, chunk_size=4)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, plain(h, w, y, 2).detach(), rtol=1e-12, atol=0)
    only_w = linear_cross_entropy(h.detach(), w, y, 2)
    assert torch.autograd.grad(only_w, w)[0].shape == w.shape


@pytest.fixture
def loss_kernels():
    """The CUDA path on CPU: ``linear_cross_entropy``'s chunks through its Triton kernels (under the interpreter)."""
    from kalmix.layers.common import fused_kernels_everywhere
    from kalmix.models import loss_kernels as kernels
    with fused_kernels_everywhere():
        yield kernels


@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("N, V, chunk", [(37, 29, 5), (9, 4096 + 37, 4), (1, 3, None)])
def test_the_kernels_equal_the_plain_cross_entropy_in_fp64(loss_kernels, S, reduction, N, V, chunk):
    """The chunks through the kernels: V = 4,133 spans two of their vocabulary blocks (the second partial), V = 3
    pads one; a quarter of the targets ignored (their rows' q = 0, target index 0)."""
    h, w, y = inputs(S, N, 12, V, seed=N + V + S)
    y[0] = V - 1                                        # a scored token in the last (masked) block
    got = linear_cross_entropy(h, w, y, S, reduction, chunk_size=chunk)
    want = plain(h, w, y, S, reduction)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got * 1.7, (h, w)), torch.autograd.grad(want * 1.7, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


def test_the_kernels_under_bf16_autocast_match_the_torch_chain(loss_kernels, monkeypatch):
    """bf16 logits: the kernels read them as they are and compute in fp32 like the chain's upcast copy, so the loss
    agrees to fp32 rounding; the gradients, from logits' gradients rounded to bf16 by both (the interpreter
    truncates where a GPU rounds), are within twice the chain's distance of the fp64 gradients."""
    import kalmix.models.loss as loss
    h, w, y = inputs(1, 300, 32, 64, seed=5, dtype=torch.float32)
    runs = []
    for kernels in (loss_kernels, None):
        monkeypatch.setattr(loss, "_kernels", lambda h, k=kernels: k)
        with torch.autocast("cpu", torch.bfloat16):
            got = linear_cross_entropy(h, w, y, chunk_size=7)
        runs.append([got, *torch.autograd.grad(got, (h, w))])
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-6, atol=0)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = torch.autograd.grad(plain(h64, w64, y), (h64, w64))
    for a, b, t in zip(runs[0][1:], runs[1][1:], exact):
        err = lambda g, t=t: ((g.double() - t).norm() / t.norm()).item()   # noqa: E731
        assert err(a) <= 2 * err(b) + 1e-4 and err(b) < 1e-2, (err(a), err(b))


def test_the_kernels_refuse_a_bad_layout():
    from kalmix.models import loss_kernels
    z = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"z must be a contiguous \[R, V\] tensor and idx int64 \[R\]"):
        loss_kernels.row_lse(z.t(), torch.zeros(6, dtype=torch.int64))


H, W, Y = inputs(1, 6, 4, 5, seed=0)


@pytest.mark.parametrize("args, kw, match", [
    ((H[0], W, Y), {}, r"`h` must be a floating-point tensor \[S·B, ..., d\], got a torch.float64 tensor of shape "
                       r"\[4\]"),
    ((H, W[:, :3], Y), {}, r"`weight` must be a floating-point tensor \[V, d\] = \[V, 4\]"),
    ((H, W, Y[:5]), {}, r"`targets` must be an int64 tensor of h's leading dims .* \[1·B, ..., d\]; got a "
                        r"torch.int64 tensor of shape \[5\] on cpu and h \[6, 4\]"),
    ((H, W, Y), dict(samples=4), r"with the first over samples = 4"),
    ((H.view(2, 3, 4), W, Y), {}, r"got a torch.int64 tensor of shape \[6\] on cpu and h \[2, 3, 4\]"),
    ((H, W, Y.int()), {}, r"`targets` must be an int64 tensor"),
    ((H, W, Y), dict(samples=0), r"`samples` must be an int >= 1, got 0"),
    ((H, W, Y), dict(reduction="none"), r"`reduction` must be 'mean' or 'sum', got 'none'"),
    ((H, W, Y), dict(chunk_size=0), r"`chunk_size` must be None or an int >= 1, got 0"),
    ((H, W.float(), Y), {}, r"`h` is torch.float64 and `weight` torch.float32; cast one"),
    ((H, W, torch.full((6,), 5)), {}, r"`targets` must be token ids in \[0, V = 5\) or ignore_index = -100, got \[5\]"),
    ((H, W, torch.full((6,), -3)), {}, r"got \[-3\]"),
    ((H, W.to("meta"), Y), {}, r"must be on one device, got cpu, meta and cpu"),
])
def test_bad_arguments_are_named(args, kw, match):
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(*args, **kw)


def twins(mixers=HYBRID, seed=0, **kw):
    """(the fused model, the same weights with fuse_cross_entropy=False), fp64, training mode."""
    torch.manual_seed(seed)
    fused = KalmixForCausalLM(config(mixers, **kw)).double().train()
    ref = KalmixForCausalLM(config(mixers, fuse_cross_entropy=False, **kw)).double().train()
    ref.load_state_dict(fused.state_dict())
    return fused, ref


def step(m, seed, **kw):
    """(outputs, {parameter name: gradient}) of one forward and backward; ``seed`` fixes the model's sampling."""
    torch.manual_seed(seed)
    out = m(**kw)
    out.loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    return out, grads


@pytest.mark.parametrize("case", ["plain", "packed", "untied", "klaplus"])
def test_the_fused_model_loss_and_every_gradient_equal_the_plain_path(case):
    kw = {"untied": dict(tie_word_embeddings=False), "klaplus": dict(mc_samples=3)}.get(case, {})
    fused, ref = twins(["kalman", "attention"] if case == "klaplus" else HYBRID, **kw)
    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, 37, (3, 13), generator=g)
    labels = x.clone()
    labels[0, :5] = -100
    labels[2, 7] = -100
    args = dict(input_ids=x, labels=labels)
    if case == "packed":
        args["cu_seqlens"] = torch.tensor([0, 4, 13, 20, 26, 30, 39])
    got, got_grads = step(fused, 1, **args)
    want, want_grads = step(ref, 1, **args)
    assert got.logits is None and want.logits is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-12)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-10, atol=1e-12, msg=n)
    if case != "untied":
        assert fused.lm_head.weight is fused.model.embed_tokens.weight          # one gradient for both uses
    loss, *_ = fused(**args, return_dict=False)
    assert loss.shape == () and len(_) == 0


@pytest.mark.parametrize("case", ["plain", "packed", "untied", "klaplus", "checkpointing"])
def test_targets_give_the_summed_loss_fused_or_from_the_logits(case):
    """``targets`` (labels already shifted, as ``kalmix train`` passes them): in training mode the fused model's
    summed loss and every gradient equal the plain path's with the same targets, and the labels' mean loss times
    the number of scored targets (fp64); in evaluation mode the logits come back with the same loss."""
    kw = {"untied": dict(tie_word_embeddings=False), "klaplus": dict(mc_samples=3)}.get(case, {})
    fused, ref = twins(["kalman", "attention"] if case == "klaplus" else HYBRID, **kw)
    if case == "checkpointing":
        for m in (fused, ref):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(12)
    x = torch.randint(0, 37, (3, 13), generator=g)
    labels = x.clone()
    labels[0, :5] = -100
    labels[2, 7] = -100
    args = {}
    if case == "packed":            # as kalmix train's rows: a document's first label is -100
        args["cu_seqlens"] = torch.tensor([0, 4, 13, 20, 26, 30, 39])
        labels.view(-1)[args["cu_seqlens"][:-1]] = -100
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    count = int((targets != -100).sum())
    got, got_grads = step(fused, 1, input_ids=x, targets=targets, **args)
    plain, plain_grads = step(ref, 1, input_ids=x, targets=targets, **args)
    mean, mean_grads = step(ref, 1, input_ids=x, labels=labels, **args)
    assert got.logits is None and plain.logits is not None
    torch.testing.assert_close(got.loss, plain.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.loss, mean.loss * count, rtol=1e-12, atol=1e-12)
    for n in plain_grads:
        torch.testing.assert_close(got_grads[n], plain_grads[n], rtol=1e-10, atol=1e-12, msg=n)
        torch.testing.assert_close(got_grads[n], mean_grads[n] * count, rtol=1e-10, atol=1e-12, msg=n)
    fused.eval()
    torch.manual_seed(1)
    out = fused(input_ids=x, targets=targets, **args)
    assert out.logits.shape == (3, 13, 37)
    torch.testing.assert_close(out.loss, got.loss, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["plain", "packed", "klaplus"])
def test_num_items_in_batch_divides_the_summed_loss(case):
    """transformers' Trainer passes ``num_items_in_batch`` (the accumulated batch's scored tokens) with labels: the
    loss is the summed cross-entropy over it, fused or from the logits, with every gradient scaled alike (fp64)."""
    fused, ref = twins(["kalman", "attention"] if case == "klaplus" else HYBRID,
                       **({"mc_samples": 3} if case == "klaplus" else {}))
    x = torch.randint(0, 37, (3, 13), generator=torch.Generator().manual_seed(13))
    labels = x.clone()
    labels[1, 2:6] = -100
    args = {"cu_seqlens": torch.tensor([0, 4, 13, 20, 26, 30, 39])} if case == "packed" else {}
    mean, mean_grads = step(ref, 1, input_ids=x, labels=labels, **args)
    scored = labels[:, 1:] != -100
    if case == "packed":                                      # a document's first token is not predicted across
        starts = torch.zeros(labels.numel(), dtype=torch.bool)
        starts[args["cu_seqlens"][:-1]] = True
        scored &= ~starts.view_as(labels)[:, 1:]
    n_scored = int(scored.sum())
    for m in (fused, ref):
        for n_items in (57, torch.tensor(57)):
            got, grads = step(m, 1, input_ids=x, labels=labels, num_items_in_batch=n_items, **args)
            torch.testing.assert_close(got.loss, mean.loss * n_scored / 57, rtol=1e-12, atol=1e-12)
            for n in grads:
                torch.testing.assert_close(grads[n], mean_grads[n] * n_scored / 57, rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("n_items, labels, match", [
    (0, True, "must be an int >= 1 or a 0-d integer tensor"),
    (torch.tensor([3]), True, "must be an int >= 1 or a 0-d integer tensor"),
    (torch.tensor(3.0), True, "must be an int >= 1 or a 0-d integer tensor"),
    (True, True, "must be an int >= 1"),
    (5, False, "divides the summed loss of `labels`"),
])
def test_bad_num_items_in_batch_is_named(n_items, labels, match):
    m = twins()[0]
    x = torch.randint(0, 37, (2, 9))
    with pytest.raises(ValueError, match=match):
        m(input_ids=x, labels=x if labels else None, num_items_in_batch=n_items)


def test_evaluation_mode_without_labels_or_with_the_flag_off_returns_logits():
    fused, ref = twins(["gdn", "attention"])
    x = torch.randint(0, 37, (2, 9))
    assert fused(x).logits.shape == (2, 9, 37)
    fused.eval()
    out = fused(x, labels=x)
    assert out.logits.shape == (2, 9, 37)
    torch.testing.assert_close(out.loss, ref(x, labels=x).loss, rtol=1e-12, atol=1e-12)


def test_the_flag_is_checked_and_saved():
    with pytest.raises(ValueError, match="`fuse_cross_entropy` must be True or False, got 1"):
        config(["gdn"], fuse_cross_entropy=1)
    assert config(["gdn"]).fuse_cross_entropy is True
    assert config(["gdn"], fuse_cross_entropy=False).to_dict()["fuse_cross_entropy"] is False
