"""Packed documents: a model over rows that hold several documents equals the model run on each document alone
(outputs and gradients), for every mixer and a hybrid; the boundaries' errors."""
import pytest
import torch

import kalmix  # noqa: F401
from kalmix.layers import MIXERS
from kalmix.layers.documents import Documents
from kalmix.models import KalmixConfig, KalmixForCausalLM
from tests.host_reads import HostReads

KW = {"attention": {"num_heads": 2}, "gdn": {"num_heads": 2}, "kaczmarz": {"num_heads": 2}, "gka": {"num_heads": 2},
      "vla": {"num_heads": 2}, "kalman": {"d_state": 4, "expand": 1}, "linear_attention": {"num_heads": 2},
      "gla": {"num_heads": 2}, "mamba2": {"num_heads": 2, "d_state": 4}, "notebook_deltanet": {"num_heads": 2}}


def _model(mixers, seed=0):
    torch.manual_seed(seed)
    cfg = KalmixConfig(vocab_size=48, hidden_size=16, num_hidden_layers=len(mixers), mixers=mixers,
                       mixer_kwargs={m: KW[m] for m in set(mixers)}, intermediate_size=32)
    return KalmixForCausalLM(cfg).double()


def _split(cu, B, T):
    """(row, start, stop) of every document of cu_seqlens over a [B, T] batch."""
    bounds = cu.tolist()
    return [(a // T, a % T, a % T + b - a) for a, b in zip(bounds[:-1], bounds[1:])]


def _packed_case(seed=1):
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 19
    cuts = sorted(set(torch.randint(1, B * T, (9,), generator=g).tolist()) | set(range(0, B * T + 1, T)))
    cu = torch.tensor(cuts)
    ids = torch.randint(0, 48, (B, T), generator=g)
    return ids, cu, B, T


@pytest.mark.parametrize("mixers", [[m, m] for m in MIXERS] + [["kaczmarz", "attention", "kalman"]],
                         ids=lambda m: "+".join(m))
def test_packed_equals_each_document_alone(mixers):
    ids, cu, B, T = _packed_case()
    model = _model(mixers)
    out = model(ids, cu_seqlens=cu).logits
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = torch.zeros_like(out)
    for row, a, b in _split(cu, B, T):
        ref[row, a:b] = model(ids[row, a:b][None]).logits[0]
    (ref * torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).view_as(ref)).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-9, atol=1e-10, msg=n)


def test_position_ids_name_the_same_documents():
    ids, cu, B, T = _packed_case(seed=2)
    pos = torch.cat([torch.arange(b - a) for _, a, b in _split(cu, B, T)]).view(B, T)
    model = _model(["gka", "attention"])
    torch.testing.assert_close(model(ids, position_ids=pos).logits, model(ids, cu_seqlens=cu).logits, rtol=0, atol=0)
    docs = Documents.from_position_ids("t", pos)
    assert docs.cu_seqlens.tolist() == cu.tolist()
    assert torch.equal(docs.doc_pos, pos.int())


def test_loss_skips_predictions_across_a_boundary():
    ids, cu, B, T = _packed_case(seed=3)
    model = _model(["kaczmarz"])
    loss = model(ids, cu_seqlens=cu, labels=ids).loss
    logits = model(ids, cu_seqlens=cu).logits
    docs = Documents("t", cu, B, T)
    targets = ids[:, 1:].masked_fill(docs.doc_pos[:, 1:] == 0, -100)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, ref)
    assert (targets == -100).sum() == len(cu) - 1 - B        # every document start but the rows' first tokens


def test_layer_takes_fla_packed_layout():
    """A layer called the fla way, [1, total] with cu_seqlens, equals each document alone."""
    from kalmix.layers import KaczmarzAttention
    torch.manual_seed(0)
    layer = KaczmarzAttention(16, num_heads=2).double()
    x = torch.randn(1, 30, 16, dtype=torch.double)
    cu = torch.tensor([0, 7, 8, 30])
    with HostReads() as reads:
        o, _, _ = layer(x, cu_seqlens=cu)
    assert reads.count == 1, reads.where                  # the layer's own check of its offsets
    ref = torch.cat([layer(x[:, a:b])[0] for a, b in [(0, 7), (7, 8), (8, 30)]], dim=1)
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cu, match", [
    ([0, 5, 38], r"must contain every row start of the \[2, 19\] batch .*; missing \[19\] in \[0, 5, 38\]"),
    ([0, 19, 10, 38], r"must be non-decreasing .*, got cu_seqlens\[2\] = 10 after 19 in \[0, 19, 10, 38\]"),
    ([0, 19, 30], r"must start at 0 and end at B·T = 38 \(the flattened batch\), got \[0, 19, 30\]"),
    ([0, 19, 38, 40], r"end at B·T = 38 \(the flattened batch\), got \[0, 19, 38, 40\]"),
    ([1, 19, 38], r"start at 0 .*, got \[1, 19, 38\]"),
    ([], r"must start at 0 and end at B·T = 38 \(the flattened batch\), got \[\] \(N \+ 1 >= 2 offsets"),
    ([0], r"must start at 0 .*, got \[0\] \(N \+ 1 >= 2 offsets for N sequences\)"),
    (torch.tensor([0.0, 19, 38]), r"must be a 1-D integer tensor \(int32 or int64\) .*, got a torch.float32 tensor"),
    (torch.tensor([0, 19, 38], dtype=torch.int16), r"must be a 1-D integer tensor .*, got a torch.int16 tensor"),
])
def test_bad_cu_seqlens(cu, match):
    """Each breach of the rule (kalmix/ops/common/varlen.py), named with the offsets given."""
    model = _model(["gdn"])
    cu = cu if isinstance(cu, torch.Tensor) else torch.tensor(cu, dtype=torch.long)
    with pytest.raises(ValueError, match=f"^KalmixModel: `cu_seqlens` (.* )?{match}"):
        model(torch.zeros(2, 19, dtype=torch.long), cu_seqlens=cu)


def test_empty_documents_hold_no_tokens():
    """Equal offsets are an empty document: the rows hold exactly what they hold without it (logits bit for bit,
    and the loss), wherever it falls: first, at a row start, last."""
    ids, cu, B, T = _packed_case(seed=4)
    model = _model(list(MIXERS))
    bounds = cu.tolist()
    for training in (False, True):                  # the loss from the logits; the fused loss (no logits)
        model.train(training)
        ref = model(ids, cu_seqlens=cu, labels=ids)
        assert (ref.logits is None) == training
        for extra in ([0], [T], [bounds[-1]], [bounds[2], bounds[2]]):
            out = model(ids, cu_seqlens=torch.tensor(sorted(bounds + extra)), labels=ids)
            assert torch.equal(out.loss, ref.loss), (training, extra)
            assert training or torch.equal(out.logits, ref.logits), extra


def test_one_host_read_per_packed_forward():
    """Packed documents cost one host read per forward, whichever way they come (``cu_seqlens``, ``position_ids``)
    and however many layers take them: the model checks them once (``Documents``) and every layer, short
    convolution and op below reads nothing back (the op's loop and chunk tables come from the host offsets; every
    op and impl is counted alone in tests/ops/common/test_varlen.py); the backward reads nothing. Counted against
    the same forward without documents, which reads the ids once on the CPU."""
    model = _model(list(MIXERS))
    ids, cu, B, T = _packed_case(seed=5)
    pos = torch.cat([torch.arange(b - a) for _, a, b in _split(cu, B, T)]).view(B, T)
    counts = {}
    for name, kw in (("plain", {}), ("cu_seqlens", {"cu_seqlens": cu}), ("position_ids", {"position_ids": pos})):
        with HostReads() as reads:
            loss = model(ids, labels=ids, **kw).loss
        with HostReads() as backward:
            loss.backward()
        counts[name] = reads.count
        assert backward.count == 0, (name, backward.where)
    assert counts["cu_seqlens"] == counts["position_ids"] == counts["plain"] + 1, counts


def test_one_host_read_per_klaplus_forward():
    """KLA+ (mc_samples > 0) repeats the documents for its samples on the host: still one read."""
    torch.manual_seed(0)
    cfg = KalmixConfig(vocab_size=48, hidden_size=16, num_hidden_layers=2, mixers=["kalman", "attention"],
                       mixer_kwargs={m: KW[m] for m in ("kalman", "attention")}, intermediate_size=32,
                       mc_samples=3)
    model = KalmixForCausalLM(cfg)
    ids, cu, B, T = _packed_case(seed=6)
    with HostReads() as plain:
        model(ids, labels=ids)
    with HostReads() as packed:
        model(ids, labels=ids, cu_seqlens=cu)
    assert packed.count == plain.count + 1, packed.where


def test_packed_documents_refuse_cache_and_padding():
    model = _model(["gdn", "attention"])
    ids = torch.zeros(2, 8, dtype=torch.long)
    cu = torch.tensor([0, 8, 16])
    with pytest.raises(ValueError, match="without a cache"):
        model(ids, cu_seqlens=cu, use_cache=True)
    with pytest.raises(ValueError, match="without a cache"):
        model(ids, cu_seqlens=cu, attention_mask=torch.ones(2, 8))
    with pytest.raises(ValueError, match="one of"):
        model(ids, cu_seqlens=cu, position_ids=torch.arange(8).expand(2, 8))
    with pytest.raises(ValueError, match="count 0, 1, 2"):
        model(ids, position_ids=torch.tensor([[0, 1, 2, 4, 5, 6, 7, 8]] * 2))
    model.eval()                                         # use_cache defaults to on in eval; packed calls turn it off
    assert model(ids, cu_seqlens=cu).logits.shape == (2, 8, 48)
