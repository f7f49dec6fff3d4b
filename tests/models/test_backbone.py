"""KalmixConfig's backbone options (norm, mlp_act, position, residual_init_scale): their defaults build today's
model exactly; together they build the VLA notebook's ``TinyLM`` (checked against an fp64 forward written from the
notebook, with its softmax attention and its DeltaNet); learned positions follow packed documents, padding and
cached decoding; bad values are ValueErrors.

Source read: Vishal-sys-code/variational-linear-attention @ 71b33b1, notebooks/07-vlav3-benchmark-fixed.ipynb,
cell 4 (``Block``, ``TinyLM``)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kalmix.models import KalmixConfig, KalmixForCausalLM
from kalmix.models.modeling import GeluMLP, RMSNorm, SwiGLU
from kalmix.ops.common.testing import assert_close, random_functional_grads
from tests.host_reads import HostReads
from tests.layers.test_notebook_baselines import deltanet_notebook, deltanet_weights, softmax_notebook

NOTEBOOK = dict(norm="layernorm", mlp_act="gelu", position="learned", max_position_embeddings=64,
                residual_init_scale=False, initializer_range=0.02)
MIXER_KWARGS = {"attention": {"num_heads": 2, "rope": False, "bias": True}, "notebook_deltanet": {"num_heads": 2},
                "gdn": {"num_heads": 2}}


def lm(mixer="attention", seed=0, **options):
    torch.manual_seed(seed)
    cfg = KalmixConfig(vocab_size=37, hidden_size=16, num_hidden_layers=2, mixer=mixer,
                       mixer_kwargs={mixer: MIXER_KWARGS[mixer]}, intermediate_size=32, **options)
    return KalmixForCausalLM(cfg).double()


@pytest.mark.parametrize("mixer", ["gdn", "attention"])
@pytest.mark.parametrize("mlp", [True, False])
def test_defaults_build_todays_model(mixer, mlp):
    """The defaults spelled out give the same weights (same seed) and outputs as the defaults left out, and the
    modules are today's: RMSNorm everywhere, SwiGLU MLPs, no position embedding, GPT-2's residual init scale."""
    implicit = lm(mixer, mlp=mlp)
    explicit = lm(mixer, mlp=mlp, norm="rmsnorm", mlp_act="swiglu", position="none", residual_init_scale=True)
    a, b = implicit.state_dict(), explicit.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 37, (2, 30))
    assert torch.equal(implicit(ids).logits, explicit(ids).logits)
    model = implicit.model
    assert not hasattr(model, "embed_positions")
    norms = [m for m in model.modules() if isinstance(m, (nn.RMSNorm, nn.LayerNorm))]
    assert norms and all(type(m) is RMSNorm for m in norms)
    assert all(type(b.mlp) is SwiGLU for b in model.layers) if mlp else all(b.mlp is None for b in model.layers)
    # the residual-out projections at σ/√(2L) = σ/2 of the other linears (a fixed σ = 0.02 to read it off)
    fixed = lm(mixer, mlp=mlp, initializer_range=0.02).model.layers[0].mixer
    assert abs(fixed.o_proj.weight.std().item() - 0.01) < 0.002


def tinylm_notebook(ids, m, mixer):
    """``TinyLM.forward`` on the kalmix model's weights: x = tok(ids) + pos(arange T); per block x += attn(LN1(x)),
    x += W2 GELU(W1 LN2(x) + b1) + b2; LN_f; the tied head."""
    model, T = m.model, ids.shape[1]
    x = model.embed_tokens.weight[ids] + model.embed_positions.weight[:T]
    ln = lambda n, y: F.layer_norm(y, (y.shape[-1],), n.weight, n.bias, n.eps)        # noqa: E731
    for block in model.layers:
        h = ln(block.mixer_norm, x)
        layer = block.mixer
        if mixer == "attention":
            w = dict(W=layer.qkv_proj.weight, b=layer.qkv_proj.bias, Wo=layer.o_proj.weight, bo=layer.o_proj.bias)
            x = x + softmax_notebook(h, w, layer.num_heads)
        else:
            x = x + deltanet_notebook(h, deltanet_weights(layer), layer.num_heads)[0]
        h = ln(block.mlp_norm, x)
        x = x + F.gelu(h @ block.mlp.up.weight.T + block.mlp.up.bias) @ block.mlp.down.weight.T + block.mlp.down.bias
    return ln(model.norm, x) @ model.embed_tokens.weight.T


@pytest.mark.parametrize("mixer", ["attention", "notebook_deltanet"])
def test_notebook_backbone_is_the_notebooks_tinylm(mixer):
    m = lm(mixer, **NOTEBOOK)
    with torch.no_grad():                           # norms and biases away from their init, so that they count
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    assert all(type(b.mlp) is GeluMLP for b in m.model.layers)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    ids = torch.randint(0, 37, (2, 21))
    leaves = list(m.parameters())
    out, ref = m(ids).logits, tinylm_notebook(ids, m, mixer)
    assert_close("logits", out, ref, 1e-12)
    for (name, _), a, b in zip(m.named_parameters(), random_functional_grads([out], leaves),
                               random_functional_grads([ref], leaves), strict=True):
        assert_close(f"d{name}", a, b, 1e-12)
    shifted = m.model.embed_positions.weight[1:22]
    with torch.no_grad():
        m.model.embed_positions.weight[:21] = shifted.clone()
    assert (m(ids).logits - out).norm() > 1e-3 * out.norm()       # the positions are read


def test_notebook_init():
    """Every linear and both embeddings at std 0.02 with residual_init_scale=False; biases and LayerNorm biases
    zero, LayerNorm weights one."""
    torch.manual_seed(0)
    cfg = KalmixConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, mixer="attention",
                       mixer_kwargs={"attention": {"rope": False, "bias": True}}, intermediate_size=256,
                       **{**NOTEBOOK, "max_position_embeddings": 512})
    model = KalmixForCausalLM(cfg).model
    for name, p in model.named_parameters():
        if p.dim() == 2:
            assert abs(p.std().item() - 0.02) < 0.002, name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert torch.equal(p, torch.ones_like(p)), name


def test_learned_positions_follow_documents_padding_and_decoding():
    m = lm("notebook_deltanet", **NOTEBOOK).eval()
    ids = torch.randint(0, 37, (2, 30))
    full = m(ids).logits
    # packed documents: positions restart at each document, as if each ran alone
    cu = torch.tensor([0, 9, 30, 41, 60])
    packed = m(ids, cu_seqlens=cu).logits
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        row, lo = divmod(a, 30)
        torch.testing.assert_close(packed[row:row + 1, lo:lo + b - a], m(ids[row:row + 1, lo:lo + b - a]).logits,
                                   rtol=1e-10, atol=1e-10)
    # left padding: positions count the real tokens
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    padded = m(ids, attention_mask=mask).logits
    torch.testing.assert_close(padded[:1, 4:], m(ids[:1, 4:]).logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(padded[1:], full[1:], rtol=1e-10, atol=1e-10)
    # cached decoding continues the positions
    out = m(ids[:, :17], use_cache=True)
    steps, cache = [out.logits], out.cache
    for t in range(17, 30):
        out = m(ids[:, t:t + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mixer", ["notebook_deltanet", "attention"])
def test_learned_positions_read_nothing_back(mixer):
    """Learned positions add no host read: a plain forward reads what the default backbone's reads, a packed one
    one more (the documents' check, whose host offsets bound the positions), the backward none."""
    ids, cu = torch.randint(0, 37, (2, 30)), torch.tensor([0, 9, 30, 41, 60])
    counts = {}
    for name, options in (("default", {}), ("notebook", NOTEBOOK)):
        m = lm(mixer, **options)
        for kw in ({}, {"cu_seqlens": cu}):
            with HostReads() as reads:
                loss = m(ids, labels=ids, **kw).loss
            with HostReads() as backward:
                loss.backward()
            counts[name, bool(kw)] = reads.count
            assert backward.count == 0, (name, kw, backward.where)
    assert counts["notebook", False] == counts["default", False], counts
    assert counts["notebook", True] == counts["default", True] == counts["default", False] + 1, counts


def test_learned_positions_refuse_longer_sequences():
    m = lm("attention", **{**NOTEBOOK, "max_position_embeddings": 16})
    m(torch.randint(0, 37, (1, 16)))
    with pytest.raises(ValueError, match=r"reach position 16, but .* max_position_embeddings = 16"):
        m(torch.randint(0, 37, (1, 17)))
    out = m(torch.randint(0, 37, (1, 10)), use_cache=True)
    with pytest.raises(ValueError, match="reach position 16"):
        m(torch.randint(0, 37, (1, 7)), cache=out.cache, use_cache=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(norm="batchnorm"), r"`norm` must be one of \('rmsnorm', 'layernorm'\), got 'batchnorm'"),
    (dict(mlp_act="relu"), r"`mlp_act` must be one of \('swiglu', 'gelu'\), got 'relu'"),
    (dict(position="rope"), r"`position` must be one of \('none', 'learned'\), got 'rope'"),
    (dict(position="learned"), "position='learned' needs `max_position_embeddings`"),
    (dict(position="learned", max_position_embeddings=0), "max_position_embeddings"),
    (dict(residual_init_scale="no"), "`residual_init_scale` must be True or False, got 'no'"),
])
def test_bad_backbone_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KalmixConfig(vocab_size=37, hidden_size=16, num_hidden_layers=1, mixer="gdn", **kwargs)
