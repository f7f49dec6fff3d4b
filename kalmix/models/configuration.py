"""``KalmixConfig``: a transformers config for causal LMs over any per-layer mix of mixers."""
from __future__ import annotations

import inspect

import torch
from transformers import PretrainedConfig

from kalmix.layers import ALL_MIXERS as MIXERS
from kalmix.layers.common import check_int, check_real

# arguments the model sets on every mixer itself
_RESERVED = {"d_model", "layer_idx", "impl"}
# the backbone's choices (KalmixConfig's mlp_act, norm, position); the first of each is the default
MLP_ACTS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("none", "learned")


def layer_pattern(num_layers: int, mixer: str, attention_every: int | None = None,
                  attention_layers=()) -> list[str]:
    """Per-layer mixer names: ``mixer`` everywhere, softmax attention in every ``attention_every``-th layer
    (layers k-1, 2k-1, ...) and in ``attention_layers`` (negative indices count from the end).

    ``layer_pattern(12, "gka", attention_every=6)`` -> 5 × gka, attention, 5 × gka, attention;
    ``layer_pattern(4, "kalman", attention_layers=[0, 1, 2])`` -> attention everywhere, Kalman in the last layer.
    """
    types = [mixer] * check_int("layer_pattern", "num_layers", num_layers)
    if attention_every is not None:
        for i in range(check_int("layer_pattern", "attention_every", attention_every) - 1, num_layers,
                       attention_every):
            types[i] = "attention"
    if not isinstance(attention_layers, (list, tuple)):
        raise ValueError(f"layer_pattern: `attention_layers` must be a list of layer indices, got {attention_layers!r}")
    given: dict[int, int] = {}
    for i in attention_layers:
        if isinstance(i, bool) or not isinstance(i, int) or not -num_layers <= i < num_layers:
            raise ValueError(f"layer_pattern: attention layer {i!r} is out of range for {num_layers} layers (allowed: "
                             f"ints in [{-num_layers}, {num_layers}))")
        if i % num_layers in given:
            first = given[i % num_layers]
            same = "" if first == i else f" (as {first}: negative indices count from the end)"
            raise ValueError(f"layer_pattern: attention layer {i} is given twice{same}; give each layer once")
        given[i % num_layers] = i
        types[i] = "attention"
    return types


class KalmixConfig(PretrainedConfig):
    """Configuration of ``KalmixModel`` / ``KalmixForCausalLM``.

    Args:
        vocab_size, hidden_size, num_hidden_layers: sizes.
        mixers: the mixer of each layer, names of the mixer registry ``kalmix.layers.MIXER_SPECS`` (e.g. "attention",
            "kaczmarz", "gka", "vla", "kalman"; fla's "deltanet" CUDA only); default: ``mixer`` in every layer, with
            softmax attention placed by ``attention_every`` / ``attention_layers`` (see ``layer_pattern``). Saved
            resolved.
        mixer_kwargs: per mixer name, keyword arguments of its layer class (e.g. ``{"gka": {"num_heads": 8}}``);
            an unknown name or argument is an error.
        intermediate_size: the MLPs' hidden width (default 8/3 · hidden_size rounded up to a multiple of 64);
            ``mlp=False`` drops the MLPs (the MQAR convention).
        mlp_act: "swiglu" (default): down(silu(gate(x)) · up(x)), no biases; "gelu": down(GELU(up(x))), a plain
            2-layer MLP with biases (GPT-2's, the VLA notebook's FFN).
        norm: "rmsnorm" (default) or "layernorm" (with bias; GPT-2's, the VLA notebook's), for the pre-norms and the
            final norm.
        norm_eps: of those norms.
        position: "none" (default): no position embedding (the recurrent mixers know order; attention rotates q and
            k); "learned": a learned absolute position embedding [max_position_embeddings, hidden_size] added to
            the token embeddings (GPT-2's, the VLA notebook's), position t counted as attention counts it: from the
            start of the sequence, of its packed document, or of its real tokens under left padding. Attention
            layers still rotate q and k unless ``mixer_kwargs`` gives them ``rope=False``.
        max_position_embeddings: the rows of the learned position embedding, the longest sequence the model takes
            (required with position="learned", unused otherwise).
        residual_init_scale: divide the init std of the projections that write into the residual stream by
            √(2 · num_hidden_layers) (GPT-2's; default True); False initialises them as every other linear (the VLA
            notebook's).
        initializer_range: std of the linear and embedding weights; None (default): 1/√(3·fan_in) for each
            linear weight (torch's default scale) and 1/√hidden_size for the embedding, which trains at every
            width (a fixed 0.02, GPT-2's, leaves a width-64 MQAR model's attention near uniform for hundreds of
            steps; 1/√fan_in left a width-32 Kaczmarz model at 60% where this reaches 99.8%).
        embedding_init_std: std of the token (and position) embeddings alone, overriding the rule above for them
            (e.g. 0.02 with the fan-in linears: the Kaczmarz authors' MQAR models); None (default): as above.
        tie_word_embeddings: share the embedding with the LM head.
        impl: the ops' backend for every kalmix mixer (None: triton on CUDA, torch otherwise; a mixer whose op has
            no Triton impl, such as the baselines on ``gated_linear_attention``, refuses "triton").
        mc_samples: S > 0 turns on KLA+, the Kalman paper's probabilistic decoding (App. A, Eq. 24–25):
            ``KalmixForCausalLM`` runs the batch S times, each Kalman layer reading out one posterior sample
            o + √var · ε instead of its mean o, and returns as logits the log of the Monte-Carlo marginal,
            log (1/S) Σ_s softmax(logits_s) (normalised log-probs), so that the cross-entropy of ``labels`` is
            the negative log marginal likelihood of Eq. 25. Costs S× the compute and activations of the layers
            and the LM head; needs a Kalman layer; no cached decoding or ``generate`` (0, the default: the
            posterior mean, ordinary cross-entropy training and decoding).
        fuse_cross_entropy: in training mode with ``labels``, ``KalmixForCausalLM`` computes the loss chunk by
            chunk from the last hidden states (``kalmix.models.loss.linear_cross_entropy``) without materialising
            the logits, and returns ``logits=None`` (fla's flag of the same name; the same loss and gradients, the
            summation order of the LM head's gradient aside). False: the logits are returned and the loss computed
            from them. Evaluation mode and calls without labels always return the logits.
        recompute_mixers: in training (gradients on, no cache), each kalmix mixer keeps only its input projection's
            output for the backward and runs its short convolution, normalisations, gates and op again there
            (``kalmix.layers.base.MixerLayer``): the same loss and gradients with less activation memory, for one
            more forward of those parts (False, the default: everything the op and the layers around it save is
            kept). Softmax attention layers are not affected.
    """

    model_type = "kalmix"

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 1024, num_hidden_layers: int = 8,
                 mixers: list[str] | None = None, mixer: str = "gka", attention_every: int | None = None,
                 attention_layers: list[int] | tuple = (), mixer_kwargs: dict | None = None,
                 intermediate_size: int | None = None, mlp: bool = True, mlp_act: str = "swiglu", norm: str = "rmsnorm",
                 norm_eps: float = 1e-5, position: str = "none", max_position_embeddings: int | None = None,
                 residual_init_scale: bool = True, initializer_range: float | None = None,
                 embedding_init_std: float | None = None, tie_word_embeddings: bool = True, impl: str | None = None, use_cache: bool = True,
                 mc_samples: int = 0, fuse_cross_entropy: bool = True, recompute_mixers: bool = False, **kwargs):
        vocab_size, hidden_size, num_hidden_layers = (check_int("KalmixConfig", arg, value) for arg, value in (
            ("vocab_size", vocab_size), ("hidden_size", hidden_size), ("num_hidden_layers", num_hidden_layers)))
        if mixers is None:
            mixers = layer_pattern(num_hidden_layers, mixer, attention_every, attention_layers)
        elif attention_every is not None or len(attention_layers):
            raise ValueError("KalmixConfig: give either `mixers` or `mixer` with `attention_every` / "
                             "`attention_layers`, not both")
        if not isinstance(mixers, (list, tuple)):
            raise ValueError(f"KalmixConfig: `mixers` must be a list of mixer names, got {mixers!r}")
        mixers = list(mixers)
        if len(mixers) != num_hidden_layers:
            raise ValueError(f"KalmixConfig: `mixers` has {len(mixers)} entries for "
                             f"num_hidden_layers = {num_hidden_layers}")
        for t in mixers:
            if t not in MIXERS:
                raise ValueError(f"KalmixConfig: unknown mixer {t!r} in `mixers`; expected one of {sorted(MIXERS)}")
        mixer_kwargs = {} if mixer_kwargs is None else mixer_kwargs
        if not isinstance(mixer_kwargs, dict) or not all(isinstance(v, dict) for v in mixer_kwargs.values()):
            raise ValueError(f"KalmixConfig: `mixer_kwargs` must map mixer names to dicts of layer arguments, got "
                             f"{mixer_kwargs!r}")
        mixer_kwargs = {k: dict(v) for k, v in mixer_kwargs.items()}
        for name, kw in mixer_kwargs.items():
            if name not in MIXERS:
                raise ValueError(f"KalmixConfig: `mixer_kwargs` names unknown mixer {name!r}; expected one of "
                                 f"{sorted(MIXERS)}")
            allowed = set(inspect.signature(MIXERS[name].__init__).parameters) - _RESERVED - {"self"}
            bad = sorted(set(kw) - allowed)
            if bad:
                raise ValueError(f"KalmixConfig: `mixer_kwargs[{name!r}]` has unknown argument(s) {bad}; "
                                 f"{MIXERS[name].__name__} takes {sorted(allowed)}")
        if impl not in (None, "naive", "torch", "triton"):
            raise ValueError(f"KalmixConfig: `impl` must be None, 'naive', 'torch' or 'triton', got {impl!r}")
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 0:
            raise ValueError(f"KalmixConfig: `mc_samples` must be an int >= 0, got {mc_samples!r}")
        if mc_samples and "kalman" not in mixers:
            raise ValueError(f"KalmixConfig: `mc_samples` = {mc_samples} (KLA+) samples the readout of Kalman "
                             f"layers, and `mixers` has none; set mc_samples = 0")
        if intermediate_size is None:
            intermediate_size = -(-8 * hidden_size // 3 // 64) * 64
        intermediate_size = check_int("KalmixConfig", "intermediate_size", intermediate_size)
        for arg, value in (("mlp", mlp), ("tie_word_embeddings", tie_word_embeddings), ("use_cache", use_cache),
                           ("residual_init_scale", residual_init_scale), ("fuse_cross_entropy", fuse_cross_entropy),
                           ("recompute_mixers", recompute_mixers)):
            if not isinstance(value, bool):
                raise ValueError(f"KalmixConfig: `{arg}` must be True or False, got {value!r}")
        for arg, value, allowed in (("mlp_act", mlp_act, MLP_ACTS), ("norm", norm, NORMS),
                                    ("position", position, POSITIONS)):
            if value not in allowed:
                raise ValueError(f"KalmixConfig: `{arg}` must be one of {allowed}, got {value!r}")
        if max_position_embeddings is not None:
            check_int("KalmixConfig", "max_position_embeddings", max_position_embeddings)
        elif position == "learned":
            raise ValueError("KalmixConfig: position='learned' needs `max_position_embeddings`, the rows of the "
                             "position embedding (the longest sequence the model takes)")
        check_real("KalmixConfig", "norm_eps", norm_eps)
        if initializer_range is not None:
            check_real("KalmixConfig", "initializer_range", initializer_range, note=" (or None: by fan-in)")
        if embedding_init_std is not None:
            check_real("KalmixConfig", "embedding_init_std", embedding_init_std,
                       note=" (or None: initializer_range's rule)")
        for name in dict.fromkeys([*mixers, *mixer_kwargs]):
            _check_layer(name, hidden_size, mixer_kwargs.get(name, {}), impl)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.mixers = mixers
        self.mixer_kwargs = mixer_kwargs
        self.intermediate_size = intermediate_size
        self.mlp = mlp
        self.mlp_act = mlp_act
        self.norm = norm
        self.norm_eps = norm_eps
        self.position = position
        self.max_position_embeddings = max_position_embeddings
        self.residual_init_scale = residual_init_scale
        self.initializer_range = initializer_range
        self.embedding_init_std = embedding_init_std
        self.impl = impl
        self.use_cache = use_cache
        self.mc_samples = mc_samples
        self.fuse_cross_entropy = fuse_cross_entropy
        self.recompute_mixers = recompute_mixers
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def layer_kwargs(self, layer_idx: int) -> dict:
        """The constructor arguments of layer ``layer_idx``'s mixer (besides d_model)."""
        name = self.mixers[layer_idx]
        return dict(self.mixer_kwargs.get(name, {}), layer_idx=layer_idx, **_impl_kwarg(name, self.impl))


def _impl_kwarg(name: str, impl: str | None) -> dict:
    """{"impl": impl} for a mixer whose layer takes the ops' backend, else {}."""
    return {"impl": impl} if "impl" in inspect.signature(MIXERS[name].__init__).parameters else {}


def _check_layer(name: str, hidden_size: int, kwargs: dict, impl: str | None) -> None:
    """Build mixer ``name``'s layer on the meta device (no memory), so that its own constructor refuses bad
    arguments (sizes, heads that do not divide a width, ...) when the config is made; the CPU random stream is left
    as it was, so a model seeded before its config is built gets the same weights. A layer whose package is
    missing (fla's) is checked up to its import; the model then raises the ImportError."""
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            MIXERS[name](hidden_size, **kwargs, **_impl_kwarg(name, impl))
    except ImportError:
        pass
    except (ValueError, TypeError) as e:
        raise ValueError(f"KalmixConfig: the {name!r} layers (hidden_size = {hidden_size}, mixer_kwargs[{name!r}] = "
                         f"{kwargs}): {e}") from None
