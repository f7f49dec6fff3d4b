"""Training on the GPU: packed documents through the Triton paths equal each document run alone (outputs and
gradients), and `kalmix train` runs a hybrid of every mixer under bf16 autocast end to end."""
import json

import pytest
import torch

from kalmix.layers import MIXER_SPECS, MIXERS
from kalmix.models import KalmixConfig, KalmixForCausalLM


def lm(mixers, dev, d=256):
    torch.manual_seed(0)
    kw = {m: MIXER_SPECS[m].size_kwargs(heads=4) for m in set(mixers)}
    cfg = KalmixConfig(vocab_size=512, hidden_size=d, num_hidden_layers=len(mixers), mixers=mixers, mixer_kwargs=kw)
    return KalmixForCausalLM(cfg).to(dev)


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_packed_documents_equal_each_document_alone(mixer, dev):
    B, T = 2, 300
    g = torch.Generator().manual_seed(1)
    cuts = sorted(set(torch.randint(1, B * T, (7,), generator=g).tolist()) | {0, T, B * T})
    cu = torch.tensor(cuts, device=dev)
    ids = torch.randint(0, 512, (B, T), generator=g).to(dev)
    model = lm([mixer, mixer], dev)
    w = torch.randn(B, T, 512, generator=g).to(dev)
    out = model(ids, cu_seqlens=cu).logits
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pieces = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        row, s = divmod(a, T)
        pieces.append((row, s, s + b - a, model(ids[row:row + 1, s:s + b - a]).logits))
    ref = torch.zeros_like(out)
    for row, s, e, lo in pieces:
        ref[row, s:e] = lo[0]
    (ref * w).sum().backward()
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()     # noqa: E731
    errs = {"logits": rel(out, ref)}
    errs["grads (max)"] = max(rel(grads[n], p.grad) for n, p in model.named_parameters() if p.grad is not None)
    print(f"{mixer}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert errs["logits"] < 1e-5 and errs["grads (max)"] < 1e-4, errs


def test_kalmix_train_runs_a_hybrid_of_every_mixer(tmp_path, dev):
    from kalmix.train.config import load_config
    from kalmix.train.loop import train
    corpus = tmp_path / "docs.jsonl"
    g = torch.Generator().manual_seed(0)
    words = "kalman filter ridge chebyshev delta rule state key value query token".split()
    with open(corpus, "w") as f:
        for _ in range(200):
            n = int(torch.randint(10, 200, (1,), generator=g))
            f.write(json.dumps({"text": " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,),
                                                                                       generator=g))}) + "\n")
    mixers = list(MIXERS)
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "data_dir": str(tmp_path / "data"), "data.source": str(corpus),
        "data.val_fraction": 0.1, "tokenizer.vocab_size": 300, "model.mixers": mixers,
        "model.num_hidden_layers": len(mixers), "model.hidden_size": 128,
        "model.mixer_kwargs": {m: MIXER_SPECS[m].size_kwargs(heads=2) for m in mixers},
        "train.steps": 6, "train.seq_len": 256, "train.global_batch_size": 8, "train.micro_batch_size": 4,
        "train.device": "cuda", "train.dtype": "bf16", "optim.warmup_steps": 2, "eval.every": 6, "eval.rows": 8,
        "checkpoint.every": 6, "log.every": 1, "log.progress": False})
    last = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    print("losses", [round(x, 3) for x in losses], "val", round(last["val_loss"], 3))
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
