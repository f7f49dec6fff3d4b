"""`kalmix bench mqar`: the CLI trains, prints a table and appends well-formed JSONL rows."""
import json

import pytest
import torch

from kalmix.bench.mqar import MQARBenchConfig, run
from kalmix.bench.synthetic import scores
from kalmix.cli import main


def test_accuracy_is_per_example_mean_over_scored_positions():
    labels = torch.tensor([[-100, 3, -100, 4], [5, -100, -100, -100]])
    logits = torch.zeros(2, 4, 8)
    logits[0, 1, 3] = 1      # right
    logits[0, 3, 1] = 1      # wrong
    logits[1, 0, 5] = 1      # right
    assert scores(logits.argmax(-1), labels)["accuracy"] == pytest.approx((0.5 + 1.0) / 2)


def test_cli_runs_every_mixer_and_appends_jsonl(tmp_path, capsys):
    out = tmp_path / "res.jsonl"
    argv = ["bench", "mqar", "--steps", "2", "--batch-size", "4", "--train-examples", "16", "--test-examples", "8",
            "--d-model", "16", "--d-state", "4", "--seq-len", "16", "--vocab-size", "32", "--num-kv-pairs", "2",
            "--out", str(out)]
    assert main(argv) == 0
    main(argv[:2] + ["--mixers", "gdn"] + argv[2:])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mixer"] for r in rows] == list(MQARBenchConfig().mixers) + ["gdn"]
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["params"] > 0 and r["state_size"] > 0
        assert r["train_tokens_per_s"] > 0 and r["config.seq_len"] == 16
    table = capsys.readouterr().out
    for name in MQARBenchConfig().mixers:
        assert name in table
    assert "accuracy" in table and "train tok/s" in table


def test_cli_rejects_unknown_mixer_and_bad_values():
    with pytest.raises(SystemExit):
        main(["bench", "mqar", "--mixers", "mamba"])
    with pytest.raises(SystemExit):
        main(["bench", "mqar", "--steps", "many"])


def test_kaczmarz_learns_a_small_recall_task():
    """End to end on CPU (~20 s): a 2-layer Kaczmarz model solves MQAR with 2 pairs at T = 16 (chance ~ 6%)."""
    cfg = MQARBenchConfig(mixers=["kaczmarz"], vocab_size=32, seq_len=16, num_kv_pairs=2, train_examples=4000,
                          test_examples=200, d_model=32, steps=600, batch_size=32, lr=3e-3, out=None)
    (row,) = run(cfg)
    assert row["accuracy"] > 0.9, row
