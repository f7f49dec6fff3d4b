"""``kalmix bench lm --memory`` (kalmix.bench.memory): the saved-tensor account on hand-counted modules, its split
into bytes per token and fixed bytes, and the CLI run on CPU."""
import csv
import io
from contextlib import redirect_stdout

import pytest
import torch
import torch.nn as nn

from kalmix.bench.memory import account, by_part, part, saved_tensors, step_peak_bytes
from kalmix.cli import main
from kalmix.models import KalmixConfig, KalmixForCausalLM


class Toy(nn.Module):
    """lin saves its input x (fp32 [N, 4]) and its weight (a parameter: no bytes); relu saves its output [N, 3];
    the product outside both saves relu's output again (shared) and the scale [3] (not a parameter)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3, bias=False)
        self.act = nn.ReLU()
        self.scale = torch.ones(3, requires_grad=True)

    def forward(self, x):
        y = self.act(self.lin(x))
        return y * self.scale


def test_saved_tensors_counts_each_storage_once_and_parameters_not_at_all():
    model = Toy()
    x = torch.randn(5, 4, requires_grad=True)
    rows = {(r["module"], r["dtype"]): r for r in saved_tensors(model, lambda: model(x).sum())}
    lin = rows[("lin", "fp32")]
    assert (lin["tensors"], lin["bytes"], lin["shared"], lin["shared_with"]) == (2, 5 * 4 * 4, 1, "(parameter)")
    act = rows[("act", "fp32")]
    assert (act["tensors"], act["bytes"], act["shared"]) == (1, 5 * 3 * 4, 0)
    top = rows[("", "fp32")]
    assert (top["type"], top["tensors"], top["bytes"], top["shared"], top["shared_with"]) == ("Toy", 2, 12, 1, "act")
    assert top["shapes"] in ("[3] [5, 3]", "[5, 3] [3]")


def test_a_view_is_charged_its_whole_storage_and_a_second_save_is_shared():
    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Tanh(), nn.Tanh()

        def forward(self, x):
            z = x * 2                                   # [6, 8] fp32, saved by neither
            return self.a(z)[:, :2].exp().sum() + self.b(z).sum()

    model = Views()
    rows = {r["module"]: r for r in saved_tensors(model, lambda: model(torch.randn(6, 8, requires_grad=True)))}
    assert rows["a"]["bytes"] == 6 * 8 * 4          # tanh's output
    assert rows[""]["bytes"] == 6 * 2 * 4           # exp's output (a new storage)
    assert rows["b"]["bytes"] == 6 * 8 * 4


def test_account_splits_bytes_per_token_from_fixed_bytes():
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16))

        def forward(self, x):                           # x [B, T, 16]
            return (torch.sigmoid(x) * self.w.exp()).sum()    # sigmoid's output grows with T, exp(w) does not

    model = Fixed()
    rows = account(model, lambda T: model(torch.randn(2, T, 16, requires_grad=True)), 2, 5)
    (row,) = rows
    assert row["bytes_per_token"] == pytest.approx(16 * 4)
    assert row["fixed_bytes"] == pytest.approx(16 * 4)
    parts = by_part([dict(row, module="model.layers.0.mixer"), dict(row, module="model.layers.1.mixer.proj")])
    assert parts == {"mixer": {"fp32": pytest.approx(64), "fixed": pytest.approx(64)}}


def test_parts():
    assert part("model.layers.3.mixer.q_proj") == ("mixer", 3)
    assert part("model.layers.12") == ("block", 12)
    assert part("model.norm") == ("model.norm", None)
    assert part("") == ("loss", None)


def test_saved_tensors_refuses_no_grad():
    model = Toy()
    with torch.no_grad(), pytest.raises(ValueError, match="gradients are disabled"):
        saved_tensors(model, lambda: model(torch.randn(2, 4)))


def test_the_fused_loss_saves_the_hidden_states_gradient_not_the_logits():
    """Training with labels under bf16 autocast: the fused loss keeps dh (fp32 [N, d], 4·d bytes per token; the LM
    head's gradient is fixed), the plain loss its log-softmax (fp32 [N, V], 4·V bytes per token), and the peak of a
    whole step (forward and backward) drops by more than 3× at V = 64·d."""
    d, V = 64, 4096
    loss, peak = {}, {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = KalmixForCausalLM(KalmixConfig(vocab_size=V, hidden_size=d, num_hidden_layers=1, mixers=["gdn"],
                                               mixer_kwargs={"gdn": {"num_heads": 2}}, intermediate_size=32,
                                               fuse_cross_entropy=fused)).train()

        def forward(T):
            ids = torch.randint(0, V, (2, T))
            with torch.autocast("cpu", torch.bfloat16):
                return model(ids, labels=ids).loss

        loss[fused] = sum(r["bytes_per_token"] for r in account(model, forward, 2, 16) if part(r["module"])[0] ==
                          "loss")
        peak[fused] = step_peak_bytes(lambda: forward(256).backward())
    assert loss[True] == pytest.approx(4 * d)
    assert loss[False] >= 4 * V
    assert 3 * peak[True] < peak[False]


def test_cli_memory_run_writes_rows_and_prints_parts(tmp_path):
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["bench", "lm", "--memory", "--device", "cpu", "--layers", "2", "--d-model", "64", "--vocab-size",
                   "256", "--num-heads", "2", "--attention-heads", "2", "--tokens", "64", "--seq-lens", "32",
                   "--packing", "plain", "packed", "--doc-median", "8", "--tolerance", "0.1", "--models", "gdn",
                   "llama", "fla_deltanet", "--impl", "torch", "--out", str(tmp_path)])
    assert rc == 0
    printed = buf.getvalue()
    assert "gdn (gdn ×2), B × T = 2 × 32, packed rows" in printed
    assert "fla_deltanet (fla DeltaNet ×2), B × T = 2 × 32, plain rows: unavailable: needs CUDA" in printed
    with open(tmp_path / "memory.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["model"], r["packing"]) for r in rows} == {(m, p) for m in ("gdn", "llama") for p in ("plain",
                                                                                                       "packed")}
    gdn = [r for r in rows if r["model"] == "gdn" and r["packing"] == "plain"]
    mixers = {r["module"] for r in gdn if part(r["module"])[0] == "mixer"}
    assert {"model.layers.0.mixer", "model.layers.1.mixer.in_proj"} <= mixers
    assert all(float(r["bytes_per_token"]) >= 0 for r in rows) and {r["impl"] for r in rows} == {"torch"}
    assert sum(float(r["bytes_per_token"]) for r in gdn if part(r["module"])[0] == "loss") == pytest.approx(4 * 64)


def test_memory_table_from_csv(tmp_path, capsys):
    rc = main(["bench", "lm", "--memory", "--device", "cpu", "--layers", "2", "--d-model", "64", "--vocab-size", "256",
               "--num-heads", "2", "--attention-heads", "2", "--tokens", "32", "--seq-lens", "32", "--packing",
               "plain", "--tolerance", "0.1", "--models", "gdn", "llama", "--out", str(tmp_path)])
    assert rc == 0
    capsys.readouterr()
    assert main(["bench", "lm", "--memory", "--table", str(tmp_path / "memory.csv")]) == 0
    text = capsys.readouterr().out
    assert "`kalmix bench lm --memory` on cpu" in text
    assert "d_model = 64 (2 heads of 32), B × T = 1 × 32 and 1 × 64" in text
    with open(tmp_path / "memory.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == "gdn"]
    parts = by_part([{**r, "bytes_per_token": float(r["bytes_per_token"]), "fixed_bytes": float(r["fixed_bytes"])}
                     for r in rows])
    line = next(x for x in text.splitlines() if x.startswith("| gdn | default | plain | "))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    per = {p: sum(v for k, v in d.items() if k != "fixed") for p, d in parts.items()}
    assert cells[3].startswith(f"{per['mixer']:,.0f} (")
    assert cells[4] == f"{per['mlp']:,.0f}" and cells[5] == f"{per['mixer_norm'] + per['mlp_norm']:,.0f}"
    assert cells[7] == f"{per['loss'] + per['model.norm'] + per['model.embed_tokens']:,.0f}"
    assert any(x.startswith("| llama | default | plain | ") for x in text.splitlines())
    bad = tmp_path / "bad.csv"
    bad.write_text("model,impl\nx,y\n")
    with pytest.raises(SystemExit) as e:
        main(["bench", "lm", "--memory", "--table", str(bad)])
    assert e.value.code == 2
    assert "is not a `kalmix bench lm --memory` CSV; it lacks the column(s) ['packing'" in capsys.readouterr().err
