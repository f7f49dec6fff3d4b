"""KalmixConfig / KalmixModel / KalmixForCausalLM: configs, Auto classes, save/load, loss, mixed precision."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from kalmix.layers import MIXERS
from kalmix.models import KalmixConfig, KalmixForCausalLM, KalmixModel, layer_pattern

SMALL = {
    "attention": dict(num_heads=2),
    "gdn": dict(num_heads=2),
    "kaczmarz": dict(num_heads=2),
    "gka": dict(num_heads=2, num_iters=8),
    "vla": dict(num_heads=2),
    "kalman": dict(d_state=4, num_heads=2),
}
HYBRID = ["kalman", "attention", "gka", "vla", "kaczmarz", "gdn"]


def config(mixers, **kw):
    mixers = [mixers] if isinstance(mixers, str) else mixers
    base = dict(vocab_size=37, hidden_size=16, num_hidden_layers=len(mixers), mixers=mixers,
                mixer_kwargs={m: SMALL[m] for m in set(mixers)}, intermediate_size=32)
    return KalmixConfig(**{**base, **kw})


def model(mixers, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    return KalmixForCausalLM(config(mixers, **kw)).to(dtype).eval()


def test_layer_patterns():
    assert layer_pattern(12, "gka", attention_every=6) == ["gka"] * 5 + ["attention"] + ["gka"] * 5 + ["attention"]
    assert layer_pattern(4, "kalman", attention_layers=[0, 1, 2]) == ["attention"] * 3 + ["kalman"]
    assert KalmixConfig(num_hidden_layers=3, mixer="vla", attention_layers=[-1]).mixers == ["vla", "vla", "attention"]


@pytest.mark.parametrize("kw, match", [
    (dict(mixers=["gka", "mamba"]), "unknown mixer 'mamba'"),
    (dict(mixers=["gka"]), "has 1 entries for num_hidden_layers = 2"),
    (dict(mixer_kwargs={"gka": {"num_head": 2}}), r"unknown argument\(s\) \['num_head'\]"),
    (dict(mixer_kwargs={"gka": {"layer_idx": 2}}), r"unknown argument\(s\) \['layer_idx'\]"),
    (dict(mixer_kwargs={"mamba": {}}), "names unknown mixer 'mamba'"),
    (dict(mixers=["gka", "gka"], attention_every=2), "either `mixers` or"),
    (dict(attention_every=0), "`attention_every` must be an int >= 1, got 0"),
    (dict(impl="cuda"), "`impl` must be"),
])
def test_config_errors_name_the_problem(kw, match):
    with pytest.raises(ValueError, match=match):
        KalmixConfig(num_hidden_layers=2, **kw)


def test_auto_classes_and_config_round_trip(tmp_path):
    cfg = config(HYBRID, tie_word_embeddings=False)
    cfg.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, KalmixConfig)
    assert loaded.to_diff_dict() == {**cfg.to_diff_dict(), "_name_or_path": str(tmp_path)} or \
        loaded.to_diff_dict() == cfg.to_diff_dict()
    assert type(AutoModelForCausalLM.from_config(cfg)) is KalmixForCausalLM
    assert type(AutoModel.from_config(cfg)) is KalmixModel
    assert [type(b.mixer) for b in KalmixModel(cfg).layers] == [MIXERS[m] for m in HYBRID]


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_load_round_trip_exactly(tmp_path, tie):
    m = model(HYBRID, dtype=torch.float32, tie_word_embeddings=tie)
    m.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (m2.lm_head.weight is m2.model.embed_tokens.weight) == tie
    sd, sd2 = m.state_dict(), m2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    x = torch.randint(0, 37, (2, 9))
    assert torch.equal(m(x).logits, m2(x).logits)


@pytest.mark.parametrize("fixed", [None, 0.02])
def test_initialisation_scheme(fixed):
    m = KalmixForCausalLM(config(["gka", "attention"] * 4, initializer_range=fixed, hidden_size=64,
                                 intermediate_size=256))
    std = lambda t: t.float().std().item()                                 # noqa: E731
    fan_in = lambda n: fixed if fixed is not None else (3 * n) ** -0.5    # noqa: E731
    assert abs(std(m.model.embed_tokens.weight) / (fixed or 64 ** -0.5) - 1) < 0.1
    assert abs(std(m.model.layers[0].mixer.in_proj.weight) / fan_in(64) - 1) < 0.1
    assert abs(std(m.model.layers[1].mixer.o_proj.weight) / (fan_in(64) / 4) - 1) < 0.1    # 1 / sqrt(2 * 8)
    assert abs(std(m.model.layers[0].mlp.down.weight) / (fan_in(256) / 4) - 1) < 0.1
    gate = m.model.layers[0].mixer.decay
    assert gate.A_log.exp().min() >= 1 and gate.A_log.exp().max() <= 16     # the layer's own (Mamba-2) init kept


def test_embedding_init_std_sets_the_embeddings_alone():
    m = KalmixForCausalLM(config(["gdn"] * 2, embedding_init_std=0.02, hidden_size=64, intermediate_size=256,
                                 position="learned", max_position_embeddings=32))
    std = lambda t: t.float().std().item()                                 # noqa: E731
    assert abs(std(m.model.embed_tokens.weight) / 0.02 - 1) < 0.1
    assert abs(std(m.model.embed_positions.weight) / 0.02 - 1) < 0.1
    assert abs(std(m.model.layers[0].mixer.in_proj.weight) / (3 * 64) ** -0.5 - 1) < 0.1     # linears by fan-in


def test_labels_give_the_shifted_cross_entropy_and_logits_to_keep_slices():
    m = model(HYBRID)
    x = torch.randint(0, 37, (3, 11))
    labels = x.clone()
    labels[0, :4] = -100
    out = m(x, labels=labels)
    ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, 37), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, ref)
    torch.testing.assert_close(m(x, logits_to_keep=1).logits, out.logits[:, -1:])
    torch.testing.assert_close(m(x, logits_to_keep=torch.tensor([2, 5])).logits, out.logits[:, [2, 5]])
    with pytest.raises(ValueError, match="labels"):
        m(x, labels=labels, logits_to_keep=1)


def test_gradient_checkpointing_gives_the_same_gradients():
    x = torch.randint(0, 37, (2, 10))
    grads = []
    for ckpt in (False, True):
        m = model(HYBRID).train()
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert m.model.gradient_checkpointing
        m(x, labels=x).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("mixer", list(SMALL))
@pytest.mark.parametrize("precision", ["fp32", "autocast_bf16", "autocast_fp16", "bf16_weights"])
def test_mixed_precision_forward_and_backward(mixer, precision):
    """Every mixer trains under CPU autocast and with bf16 weights; its loss stays near the fp32 model's."""
    ref = model([mixer, "attention"] if mixer != "attention" else mixer, dtype=torch.float32).train()
    x = torch.randint(0, 37, (2, 13))
    with torch.no_grad():
        ref_loss = ref(x, labels=x).loss
    m = ref
    if precision == "bf16_weights":
        m = model([mixer, "attention"] if mixer != "attention" else mixer, dtype=torch.bfloat16).train()
    if precision.startswith("autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16 if precision.endswith("bf16") else torch.float16):
            out = m(x, labels=x)                        # training with labels: no logits (fuse_cross_entropy)
            assert m(x).logits.dtype != torch.float32
    else:
        out = m(x, labels=x)
    out.loss.backward()
    assert abs(out.loss.item() - ref_loss.item()) < (1e-5 if precision == "fp32" else 0.05)
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def test_fla_deltanet_mixes_in_and_refuses_cpu_tensors_clearly():
    m = KalmixForCausalLM(KalmixConfig(vocab_size=37, hidden_size=16, num_hidden_layers=2,
                                       mixers=["deltanet", "attention"], mixer_kwargs={"deltanet": {"num_heads": 2}}))
    assert m.model.layers[0].mixer.state_size() == 2 * 8 * 8
    with pytest.raises(ValueError, match="FlaDeltaNet runs fla's Triton kernels, which need CUDA"):
        m(torch.randint(0, 37, (1, 5)))
