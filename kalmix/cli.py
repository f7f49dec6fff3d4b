"""The `kalmix` command."""
from __future__ import annotations

import argparse
import sys
import typing

from pydantic import ValidationError

from kalmix.bench.mqar import MIXER_NAMES, MQARBenchConfig, run

_HELP = {
    "mixers": f"mixers to train, any of {', '.join(MIXER_NAMES)}",
    "vocab_size": "MQAR vocabulary (keys from [1, V/2), values from [V/2, V))",
    "seq_len": "sequence length T", "num_kv_pairs": "key-value pairs per sequence",
    "train_examples": "training sequences (sampled with replacement)", "test_examples": "held-out sequences",
    "d_model": "model width", "n_layers": "number of mixer blocks", "num_heads": "heads of the matrix-state mixers",
    "d_state": "Kalman state slots N", "steps": "optimiser steps per mixer", "batch_size": "sequences per step",
    "lr": "peak AdamW learning rate (cosine schedule)", "weight_decay": "AdamW weight decay on matrices",
    "warmup": "fraction of steps of linear warm-up", "seed": "seed of data, init and sampling",
    "device": "torch device, e.g. cpu or cuda", "impl": "op backend: naive, torch or triton (default: by device)",
    "threads": "torch CPU threads (default: torch's choice)",
}


def _add_config_flags(parser: argparse.ArgumentParser, model: type) -> None:
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = field.default
        nargs = "+" if typing.get_origin(field.annotation) is list else None
        parser.add_argument(flag, nargs=nargs, default=default, help=_HELP[name])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kalmix", description="kalmix: attention as online least squares")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="train-and-evaluate benchmarks")
    tasks = bench.add_subparsers(dest="task", required=True)
    mqar = tasks.add_parser("mqar", help="multi-query associative recall: train each mixer, print a table",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_config_flags(mqar, MQARBenchConfig)
    mqar.add_argument("--out", default="runs/mqar.jsonl", help="JSONL file the results are appended to")
    args = parser.parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k in MQARBenchConfig.model_fields}
    values = {k: (None if v in ("None", "none") else v) for k, v in values.items()}
    try:
        cfg = MQARBenchConfig.model_validate(values, strict=False)
    except ValidationError as e:
        parser.error(str(e))
    try:
        run(cfg, args.out)
    except NotImplementedError as e:   # e.g. the default impl of a device that has no kernels yet
        parser.error(f"{e} (on the command line: --impl torch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
