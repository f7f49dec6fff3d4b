"""A whole KalmixForCausalLM context-parallel (kalmix.distributed.context_parallel_model) on 2 and 4 gloo ranks
(CPU, fp64, impl "torch").

One process group per world size runs every case: a small model of each kalmix mixer and a hybrid with softmax
attention, its sequence split in unequal pieces (one shorter than the convolutions' kernel on 4 ranks), plain or
with packed documents (``DOCS``) that cross every piece boundary. Rank 0 gathers the pieces' logits, the ranks'
losses and parameter gradients and compares them with one process running the whole sequence: logits laid end to
end, losses and gradients summed over the ranks."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from kalmix.distributed import context_parallel_loss, context_parallel_model
from kalmix.distributed.model import PieceDocuments
from kalmix.layers.documents import Documents, cu_seqlens_from_positions
from kalmix.models import KalmixConfig, KalmixForCausalLM
from tests.distributed.gloo import run_cases
from tests.host_reads import HostReads

B, T, VOCAB = 2, 13, 32
LENGTHS = {2: [5, 8], 4: [3, 4, 1, 5]}      # unequal pieces of T tokens; on 4 ranks one shorter than kernel − 1
MODELS = {"gdn": ["gdn"] * 2, "kaczmarz": ["kaczmarz"] * 2, "gka": ["gka"] * 2, "vla": ["vla"] * 2,
          "kalman": ["kalman"] * 2, "hybrid": ["gdn", "attention"],
          "baselines": ["linear_attention", "gla", "mamba2"], "notebook": ["notebook_deltanet", "attention"]}
MIXER_KWARGS = {"gdn": {"num_heads": 2}, "kaczmarz": {"num_heads": 2}, "gka": {"num_heads": 2},
                "vla": {"num_heads": 2}, "kalman": {"d_state": 4, "num_heads": 2}, "attention": {"num_heads": 2},
                "linear_attention": {"num_heads": 2}, "gla": {"num_heads": 2},
                "mamba2": {"d_state": 4, "head_dim": 8}, "notebook_deltanet": {"num_heads": 2}}
# the VLA notebook's backbone (learned positions: each piece's count from its start, or from its document's)
BACKBONES = {"notebook": dict(norm="layernorm", mlp_act="gelu", position="learned", max_position_embeddings=T)}
COMBINE = ("kaczmarz", "gka", "baselines")     # models whose mixers' ops are affine: also run in combine mode
# packed documents, offsets within each row of T = 13 tokens: documents cross every piece boundary (3, 5, 7, 8); row
# 0 starts one at 2, inside the halo of the piece at 3; [6, 12) and [5, 9) hold the 1-token piece [7, 8) as their
# middle; one-token documents at a row's end and start; row 1's documents start at the boundaries 3 and 5
DOCS = [[0, 2, 6, 12, 13], [0, 1, 3, 5, 9, 13]]
TOL = 1e-10


def _model(mixers: list[str], **backbone) -> KalmixForCausalLM:
    torch.manual_seed(0)                    # the same weights on every rank
    config = KalmixConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=len(mixers),
                          mixers=mixers, mixer_kwargs={m: MIXER_KWARGS[m] for m in set(mixers)}, **backbone)
    return KalmixForCausalLM(config).double().eval()


def _batch(world: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    labels = ids.clone()
    labels[0, LENGTHS[world][0]] = -100     # the first label of rank 1's piece, predicted by rank 0, not scored
    labels[1, 7] = -100
    return ids, labels


def _documents() -> tuple[torch.Tensor, torch.Tensor]:
    """``DOCS`` as (cu_seqlens over the flattened [B, T] batch, position_ids [B, T])."""
    cu = torch.tensor([b * T + x for b, row in enumerate(DOCS) for x in row[:-1]] + [B * T], dtype=torch.int32)
    pos = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(row[:-1], row[1:])]) for row in DOCS])
    return cu, pos


def _case(rank: int, world: int, name: str, mode: str = "relay", varlen: bool = False, docs: str | None = None,
          fused: bool = False, targets: bool = False) -> str:
    """One model on this rank, its mixers' states passed in ``mode``; on rank 0 returns "ok" or what differs from
    the single process. ``varlen``: attention's pieces go through the varlen flash path, its kernel played by the
    CPU stand-in of tests/layers/test_attention_varlen.py. ``docs``: the rows pack ``DOCS``, given to the split
    model as "cu_seqlens" (the whole batch's), "empty" (the same with empty documents added) or "position_ids"
    (the piece's). ``fused``: the split model in training mode, its loss from the hidden states without logits
    (``fuse_cross_entropy``), against the single process's loss from its logits. ``targets``: the split model
    takes its piece of the whole rows' shifted labels (``targets``, as ``kalmix train`` passes them: the next
    piece's first label at a piece's end, none at a document's start) and its summed loss over the number of
    targets of the whole batch is compared."""
    if varlen:
        import kalmix.layers.attention as attention
        from tests.layers.test_attention_varlen import varlen_stand_in
        saved = attention.flash_eligible, attention.varlen_causal
        attention.flash_eligible, attention.varlen_causal = (lambda q: True), varlen_stand_in
        try:
            return _case(rank, world, name, mode, docs=docs)
        finally:
            attention.flash_eligible, attention.varlen_causal = saved
    model = _model(MODELS[name], **BACKBONES.get(name, {}))
    params = [p for p in model.parameters() if p.requires_grad]
    ids, labels = _batch(world)
    cu, pos = _documents()
    if docs == "empty":                             # at a row start, at a piece boundary (3, on 4 ranks), at the end
        cu = torch.sort(torch.cat([cu, torch.tensor([T, T + 3, B * T], dtype=cu.dtype)])).values
    ref = model(input_ids=ids, labels=labels, use_cache=False, **({"cu_seqlens": cu} if docs else {}))
    ref_grads = torch.autograd.grad(ref.loss, params)
    model.train(fused)

    start, length = sum(LENGTHS[world][:rank]), LENGTHS[world][rank]
    cut = slice(start, start + length)
    packed = {"position_ids": {"position_ids": pos[:, cut]}, None: {}}.get(docs, {"cu_seqlens": cu})
    scored = {"labels": labels[:, cut]}
    if targets:
        shifted = F.pad(labels.masked_fill(pos == 0, -100)[:, 1:] if docs else labels[:, 1:], (0, 1), value=-100)
        scored = {"targets": shifted[:, cut]}
    with context_parallel_model(model, mode=mode):  # use_cache defaults to False here, though the model is in eval
        out = model(input_ids=ids[:, cut], **scored, **packed)
        if docs and not fused and not targets:      # the loss on its own, documents given by their positions
            alone = context_parallel_loss(out.logits, labels[:, cut], position_ids=pos[:, cut])
            torch.testing.assert_close(alone, out.loss, rtol=TOL, atol=TOL)
    loss = out.loss / (shifted != -100).sum() if targets else out.loss
    grads = torch.autograd.grad(loss, params, allow_unused=True)    # a backward after the block
    assert (out.logits is None) == fused
    mine = {"logits": None if fused else out.logits.detach(), "loss": loss.detach(),
            "grads": [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]}
    got = [None] * world if rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    if rank != 0:
        return ""
    pairs = {"logits": ([] if fused else [torch.cat([g["logits"] for g in got], 1)], [ref.logits]),
             "loss": ([sum(g["loss"] for g in got)], [ref.loss]),
             "gradients": ([sum(gs) for gs in zip(*(g["grads"] for g in got))], ref_grads)}
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for what, (xs, refs) in pairs.items():
        for i, (x, r) in enumerate(zip(xs, refs)):
            try:
                torch.testing.assert_close(x, r.detach(), rtol=TOL, atol=TOL)
            except AssertionError as e:
                return f"{what} {names[i] if what == 'gradients' else ''}: {e}"
    return "ok"


def _ddp(rank: int, world: int, targets: bool = False) -> str:
    """The hybrid model wrapped in DDP over the same group: with each rank's loss times the group size, DDP's
    averaged gradients are the single process's on every rank. ``targets``: in training mode, each rank's piece
    of the rows' shifted labels (``targets``) gives its summed fused loss, divided by the batch's count."""
    model = _model(MODELS["hybrid"])
    ids, labels = _batch(world)
    ref = model(input_ids=ids, labels=labels, use_cache=False)
    ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))
    ddp = DDP(model.train(targets))
    start = sum(LENGTHS[world][:rank])
    cut = slice(start, start + LENGTHS[world][rank])
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    with context_parallel_model(ddp):
        if targets:
            out = ddp(input_ids=ids[:, cut], targets=shifted[:, cut])
            assert out.logits is None
            loss = out.loss / (shifted != -100).sum()
        else:
            loss = ddp(input_ids=ids[:, cut], labels=labels[:, cut]).loss
    (loss * world).backward()
    msg = "ok"
    for (name, p), r in zip(model.named_parameters(), ref_grads):
        try:
            torch.testing.assert_close(p.grad, r, rtol=TOL, atol=TOL)
        except AssertionError as e:
            msg = f"rank {rank}, {name}: {e}"
    msgs = [None] * world
    dist.all_gather_object(msgs, msg)
    return next((m for m in msgs if m != "ok"), "ok")


def _refusals(rank: int, world: int) -> str:
    """Calls the switch refuses (before any message, so every rank raises alike)."""
    model = _model(["gdn", "attention"])
    ids = torch.zeros(B, LENGTHS[world][rank], dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    calls = {"a cache": dict(use_cache=True), "padding": dict(attention_mask=mask),
             "must be this piece's": dict(position_ids=torch.zeros(B, 20, dtype=torch.long)),
             "must start at 0 and end at B·T": dict(cu_seqlens=torch.tensor([0, 2 * B * T]))}
    with context_parallel_model(model):
        for what, kwargs in calls.items():
            with pytest.raises(ValueError, match=what):
                model(input_ids=ids, **kwargs)
        with pytest.raises(RuntimeError, match="already context-parallel"), context_parallel_model(model):
            pass
        x = torch.zeros(B, ids.shape[1], 16, dtype=torch.float64)
        for block in model.model.layers:            # documents given to a layer, not to the model
            with pytest.raises(ValueError, match="a layer"):
                block.mixer(x, cu_seqlens=torch.arange(B + 1) * ids.shape[1])
        model.gradient_checkpointing_enable()
        model.train()
        with pytest.raises(ValueError, match="gradient checkpointing"):
            model(input_ids=ids)
        model.gradient_checkpointing_disable()
        model.model.layers[0].mixer.recompute = True
        with pytest.raises(ValueError, match="got recompute_mixers"):
            model(input_ids=ids)
        with torch.no_grad():
            model(input_ids=ids)                    # nothing is recomputed without gradients
        model.model.layers[0].mixer.recompute = False
        model.eval()
        model(input_ids=ids, attention_mask=torch.ones_like(ids))       # an all-ones mask is no padding
    return "ok"


def _cases() -> dict:
    return {**{name: functools.partial(_case, name=name) for name in MODELS},
            **{f"{name}-combine": functools.partial(_case, name=name, mode="combine") for name in COMBINE},
            **{f"{name}-docs": functools.partial(_case, name=name, docs="cu_seqlens") for name in MODELS},
            **{f"{name}-combine-docs": functools.partial(_case, name=name, mode="combine", docs="cu_seqlens")
               for name in COMBINE},
            "hybrid-positions": functools.partial(_case, name="hybrid", docs="position_ids"),
            "hybrid-empty-docs": functools.partial(_case, name="hybrid", docs="empty"),
            "hybrid-varlen": functools.partial(_case, name="hybrid", varlen=True),
            "hybrid-varlen-docs": functools.partial(_case, name="hybrid", varlen=True, docs="cu_seqlens"),
            "hybrid-fused": functools.partial(_case, name="hybrid", fused=True),
            "kalman-fused-docs": functools.partial(_case, name="kalman", docs="cu_seqlens", fused=True),
            "hybrid-targets": functools.partial(_case, name="hybrid", targets=True),
            "hybrid-fused-targets": functools.partial(_case, name="hybrid", fused=True, targets=True),
            "kalman-fused-targets-docs": functools.partial(_case, name="kalman", docs="cu_seqlens", fused=True,
                                                           targets=True),
            "ddp": _ddp, "ddp-fused-targets": functools.partial(_ddp, targets=True), "refusals": _refusals}


@functools.cache
def _results(world: int) -> dict:
    return run_cases(world, _cases)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process(world, name):
    """Logits end to end, the ranks' losses and parameter gradients summed equal one process's."""
    assert _results(world)[name] == "ok"


@pytest.mark.parametrize("name", COMBINE)
@pytest.mark.parametrize("world", [2, 4])
def test_combine_matches_single_process(world, name):
    """The same with mode="combine": the mixers' ops all-gather and compose their pieces' state maps."""
    assert _results(world)[f"{name}-combine"] == "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_attention_varlen_pieces_match_single_process(world):
    """The hybrid with attention's pieces through the varlen flash path (its CPU stand-in): each piece's queries
    are the last of the keys up to the piece's end."""
    assert _results(world)["hybrid-varlen"] == "ok"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_match_single_process(world, name):
    """Rows of packed documents crossing every piece boundary (``cu_seqlens`` of the whole batch): logits, loss
    (no document's first token predicted) and gradients equal one process's."""
    assert _results(world)[f"{name}-docs"] == "ok"


@pytest.mark.parametrize("name", COMBINE)
@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_combine_match_single_process(world, name):
    assert _results(world)[f"{name}-combine-docs"] == "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_by_position_ids(world):
    """The hybrid with its documents given as each piece's positions within them."""
    assert _results(world)["hybrid-positions"] == "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_empty_documents(world):
    """The hybrid with empty documents (equal offsets) among its packed ones: the same as one process."""
    assert _results(world)["hybrid-empty-docs"] == "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_attention_varlen_documents_match_single_process(world):
    """The hybrid's attention over packed documents through the varlen path (CPU stand-in): each document
    segment's queries are the last of its document's keys up to the piece's end."""
    assert _results(world)["hybrid-varlen-docs"] == "ok"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["hybrid-fused", "kalman-fused-docs"])
def test_fused_loss_matches_single_process(world, case):
    """In training mode (``fuse_cross_entropy``: the loss without logits) the ranks' losses and gradients summed
    equal one process's plain loss and gradients, the next piece's first label and document starts included."""
    assert _results(world)[case] == "ok"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["hybrid-targets", "hybrid-fused-targets", "kalman-fused-targets-docs"])
def test_targets_match_single_process(world, case):
    """Each piece given its targets (the rows' labels shifted, as ``kalmix train`` passes them), from the logits or
    fused: the ranks' summed losses over the batch's count and their gradients summed equal one process's."""
    assert _results(world)[case] == "ok"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["ddp", "ddp-fused-targets"])
def test_ddp(world, case):
    """Under DDP over the same group, each rank's loss times the group size gives the single-process gradients
    (also in training mode with the fused loss of the pieces' targets)."""
    assert _results(world)[case] == "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_refusals(world):
    """A cache, padding, documents not of the piece or batch, gradient checkpointing and a second switch are
    refused on every rank."""
    assert _results(world)["refusals"] == "ok"


def test_rejects_other_modules():
    with pytest.raises(ValueError, match="`mode` must be one of"):
        with context_parallel_model(_model(["gdn"]), mode="scan"):
            pass
    with pytest.raises(TypeError, match="KalmixModel"):
        with context_parallel_model(nn.Linear(2, 2)):
            pass
    model = _model(["gdn"])
    model.model.layers[0].mixer = nn.Identity()
    with pytest.raises(NotImplementedError, match="cannot run on a sequence split"):
        with context_parallel_model(model):
            pass


@pytest.mark.parametrize("start, length", [(0, 5), (3, 4), (7, 1), (8, 5), (5, 8)])
def test_piece_documents_come_from_the_host(start, length):
    """A piece's documents are built from the whole batch's host offsets without reading anything back, and equal
    what the device computes from the positions: the segments (cut at every document and row start), each row's
    offsets, and the varlen keys (each segment's document from its start to the piece's end). The whole batch
    holds empty documents (equal offsets) too."""
    flat = [b * T + x for b, row in enumerate(DOCS) for x in row[:-1]] + [B * T]      # DOCS' rows end to end
    cu = torch.tensor(sorted(flat + [T, T + 5, B * T]))     # empty documents at a row start, in a row, at the end
    whole = Documents("t", cu, B, T)
    with HostReads() as reads:
        piece = PieceDocuments(whole, start, length)
        keys, cu_keys, max_keys = piece.keys, piece.cu_keys, piece.max_keys
    assert reads.count == 0, reads.where
    assert piece.cu_seqlens.tolist() == cu_seqlens_from_positions(piece.doc_pos).tolist()
    end = start + length
    assert torch.equal(keys, (piece.key_doc >= piece.key_doc[:, start:start + 1]).flatten().nonzero()[:, 0])
    want = piece.cu_seqlens.diff() + piece.doc_pos.flatten()[piece.cu_seqlens[:-1]]
    assert cu_keys.tolist() == [0, *want.cumsum(0).tolist()] and max_keys == int(want.max())
    assert [r.tensor.tolist() for r in piece.rows] == [[x - b * T for x in cu.tolist() if b * T <= x <= (b + 1) * T]
                                                       for b in range(B)]
    assert piece.row_starts == max(int((piece.doc_pos[b] == 0).sum() + (piece.doc_pos[b, 0] != 0)) for b in range(B))
    assert keys.numel() == sum(end - max(x for x in r.bounds if x <= start) for r in piece.rows)
