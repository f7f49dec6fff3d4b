"""The `kalmix` command."""
from __future__ import annotations

import argparse
import os
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
    decode = tasks.add_parser("decode", help="ms per generated token of whole models: eager, CUDA-graphed and "
                              "the kernels' GPU time", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_decode_flags(decode)
    _add_recipe_parsers(tasks)
    _add_lm_parser(tasks)
    _add_speed_parser(sub)
    _add_generate_parser(sub)
    _add_train_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "speed":
        return _run_speed(args)
    if args.command == "generate":
        return _run_generate(args)
    if args.command == "train":
        return _run_train(args, parser)
    if args.command == "tokenizer":
        return _run_tokenizer(args, parser)
    if args.command == "plot":
        return _run_plot(args, parser)
    if args.task == "decode":
        return _run_decode(args, parser)
    if args.task == "lm":
        from kalmix.bench.lm import main as run_lm
        return run_lm(args, parser)
    if args.task == "run":
        return _run_recipe(args, parser)
    if args.task == "report":
        return _run_report(args, parser)
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


_DECODE_HELP = {
    "mixers": "mixers, one model each (attention is the KV-cache baseline)", "batch_sizes": "batch sizes B",
    "contexts": "tokens prefilled per sequence before the timed steps", "layers": "blocks per model",
    "d_model": "model width", "vocab_size": "vocabulary", "num_heads": "heads of every mixer but Kalman (H = 1)",
    "steps": "decode steps timed", "prefill_chunk": "tokens per prefill call across the batch",
    "dtype": "weights' dtype: bf16, fp16 or fp32", "device": "torch device", "graph": "also time the CUDA graph",
    "compile": "run the step through torch.compile before timing and capturing it",
    "out": "CSV file of the rows",
}


def _add_decode_flags(parser) -> None:
    from kalmix.bench.decode import DecodeBenchConfig
    for name, field in DecodeBenchConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = field.get_default(call_default_factory=True)
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_DECODE_HELP[name])
            continue
        nargs = "+" if typing.get_origin(field.annotation) is list else None
        kind = int if field.annotation in (int, list[int]) else None
        parser.add_argument(flag, nargs=nargs, type=kind, default=default, help=_DECODE_HELP[name])


def _run_decode(args, parser) -> int:
    from kalmix.bench.decode import DecodeBenchConfig, run as run_decode
    values = {k: v for k, v in vars(args).items() if k in DecodeBenchConfig.model_fields}
    try:
        cfg = DecodeBenchConfig.model_validate(values)
    except ValidationError as e:
        parser.error(str(e))
    run_decode(cfg)
    return 0


def _add_lm_parser(tasks) -> None:
    from kalmix.bench.lm import add_arguments
    add_arguments(tasks.add_parser(
        "lm", help="training throughput of whole models side by side (every mixer, a hybrid, fla's DeltaNet, "
        "Llama) at matched parameter counts", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Times each model's training step (forward, backward, fused AdamW; bf16 autocast) at each T "
        "with B x T tokens per step, on plain and packed rows; writes lm.csv and PNG plots to --out and prints a "
        "table. --table CSV prints the markdown table of a CSV instead."))


def _add_recipe_parsers(tasks) -> None:
    r = tasks.add_parser("run", help="a paper's synthetic experiment from a recipe (kalmix/bench/recipes/*.yaml): train every "
                         "grid point, mixer, seed and learning rate; append one JSONL row per run; resumable",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("recipe", help="recipe YAML file, or the name of one shipped with kalmix (kalmix/bench/recipes)")
    r.add_argument("--out", default=None, help="JSONL results file (default: runs/bench/RECIPE.jsonl); runs "
                   "already in it are skipped")
    r.add_argument("--device", default="cuda" if _cuda() else "cpu", help="torch device")
    r.add_argument("--impl", default=None, choices=["naive", "torch", "triton"],
                   help="kalmix ops' backend (default: triton on CUDA, torch otherwise)")
    r.add_argument("--mixers", nargs="+", default=None, help="only these of the recipe's mixer labels")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a recipe field, VALUE as YAML, e.g. --set train.steps=200 --set "
                   "'grid.task.params.num_kv_pairs=[4, 8]' (repeatable)")
    r.add_argument("--dry-run", action="store_true", help="print the resolved recipe and the number of runs")
    rp = tasks.add_parser("report", help="markdown tables and PNG plots from `kalmix bench run` results",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    rp.add_argument("results", nargs="+", help="JSONL results files")
    rp.add_argument("--out", default="runs/bench/report", help="output folder (README.md and PNGs)")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _run_recipe(args, parser) -> int:
    import yaml

    from kalmix.bench.synthetic import load_recipe, run as run_recipe
    from kalmix.bench.synthetic import resolve_recipe
    path = resolve_recipe(args.recipe)
    try:
        recipe = load_recipe(path, args.overrides)
    except (ValidationError, ValueError, FileNotFoundError, yaml.YAMLError) as e:
        parser.error(str(e))
    out = args.out or os.path.join("runs", "bench", recipe.name + ".jsonl")
    n = recipe.planned_runs(len(args.mixers) if args.mixers else None)
    if args.dry_run:
        print(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False), end="")
        print(f"# {n} runs ({len(recipe.points())} grid points), results to {out}")
        return 0
    try:
        run_recipe(recipe, out, device=args.device, impl=args.impl, mixers=args.mixers)
    except ValueError as e:
        parser.error(str(e))
    print(f"results in {out}; `kalmix bench report {out}` renders them")
    return 0


def _run_report(args, parser) -> int:
    from kalmix.bench.report import report
    try:
        report(args.results, args.out)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    print(f"wrote {os.path.join(args.out, 'README.md')}")
    return 0


def _add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="decode text from a saved model (static cache, CUDA-graphed steps)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--model", required=True, help="folder of a saved KalmixForCausalLM (save_pretrained)")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    g.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"], help="weights' dtype")
    g.add_argument("--no-graph", action="store_true", help="run the decode steps eagerly (no CUDA graph)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")


def _run_generate(args) -> int:
    from kalmix.models.decoding import generate_text
    r = generate_text(args.model, args.prompt, max_new_tokens=args.max_new_tokens, tokenizer=args.tokenizer,
                      device=args.device, dtype=args.dtype, graph=False if args.no_graph else None,
                      do_sample=args.sample, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(args.prompt + r["text"])
    print(f"-- {len(r['new_tokens'])} tokens in {r['decode_s']:.3f} s: {r['tokens_per_s']:.1f} tokens/s "
          f"({'CUDA graph' if r['graph'] else 'eager'}; prefill {1e3 * r['prefill_s']:.1f} ms)", file=sys.stderr)
    return 0


def _add_speed_parser(sub) -> None:
    from kalmix.bench.speed import MODES, SpeedConfig
    d = SpeedConfig()
    sp = sub.add_parser("speed", help="time every op and layer against fla and SDPA anchors (GPU; CPU for tiny "
                        "shapes)", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                        description="Times kalmix ops (every available impl) and layers next to fla's chunk_delta_rule,"
                        " chunk_gated_delta_rule, chunk_simple_gla, chunk_gla and GatedDeltaNet layer (CUDA only) and "
                        "SDPA causal attention, in forward, forward+backward and decode modes, at a fixed token "
                        "budget per call. Writes speed.csv and PNG plots to --out and prints a table.")
    sp.add_argument("--device", default=d.device, help="torch device (cuda, or cpu for tiny smoke runs)")
    sp.add_argument("--out", default=d.out, help="output folder for speed.csv and the plots")
    sp.add_argument("--modes", nargs="+", default=list(d.modes), choices=list(MODES),
                    help="what to time")
    sp.add_argument("--seq-lens", nargs="+", type=int, default=list(d.seq_lens), help="sequence lengths T")
    sp.add_argument("--tokens", type=int, default=d.tokens, help="tokens per call: B = tokens // T")
    sp.add_argument("--dtypes", nargs="+", default=list(d.dtypes), choices=["bf16", "fp16", "fp32"],
                    help="activation dtypes")
    sp.add_argument("--heads", type=int, default=d.heads, help="heads of the matrix-state mixers and anchors")
    sp.add_argument("--head-dim", type=int, default=d.head_dim, help="K = V of the matrix-state mixers and anchors")
    sp.add_argument("--d-model", type=int, default=d.d_model, help="layer width (Kalman op: D = 2 * d-model)")
    sp.add_argument("--d-state", type=int, default=d.d_state, help="Kalman state slots N")
    sp.add_argument("--decode-contexts", nargs="+", type=int, default=list(d.decode_contexts),
                    help="context lengths of the decode comparison (KV cache length of attention)")
    sp.add_argument("--ops", nargs="*", default=[],
                    help="only targets whose name contains one of these (layer.kalman, fla, sdpa, ...; decode rows "
                    "too)")
    sp.add_argument("--impls", nargs="*", default=[],
                    help="only these impls (naive, torch, triton, fla, flash, ...); default: all but the naive "
                    "token loops, which take seconds to minutes per call at 32K tokens; decode rows too "
                    "(attention: -)")
    sp.add_argument("--naive-max-len", type=int, default=d.naive_max_len,
                    help="skip the token-loop impls above this T (they take seconds per call)")
    sp.add_argument("--warmup", type=int, default=d.warmup, help="do_bench warm-up (ms)")
    sp.add_argument("--rep", type=int, default=d.rep, help="do_bench repetition time (ms)")
    sp.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    sp.add_argument("--gka-iters", nargs="+", type=int, default=list(d.gka_iters),
                    help="Chebyshev steps of the gated_kalmanet rows, one row each (named "
                    "gated_kalmanet[num_iters=N] but for the op's default)")
    sp.add_argument("--check-values", action="store_true",
                    help="time the ops with their value checks on (each reads its result back: one host "
                    "synchronisation per call; the layers, and by default these timings, skip them)")


def _run_speed(args) -> int:
    from kalmix.bench.speed import SpeedConfig, run as run_speed
    cfg = SpeedConfig(device=args.device, out=args.out, modes=tuple(args.modes), seq_lens=tuple(args.seq_lens),
                      tokens=args.tokens, dtypes=tuple(args.dtypes), heads=args.heads, head_dim=args.head_dim,
                      d_model=args.d_model, d_state=args.d_state, decode_contexts=tuple(args.decode_contexts),
                      ops=tuple(args.ops), impls=tuple(args.impls), naive_max_len=args.naive_max_len,
                      warmup=args.warmup, rep=args.rep, plots=not args.no_plots, check_values=args.check_values,
                      gka_iters=tuple(args.gka_iters))
    run_speed(cfg)
    return 0


def _add_train_parsers(sub) -> None:
    from kalmix.train.config import add_flags, presets
    from kalmix.train.data import DataConfig
    t = sub.add_parser("train", help="pretrain a language model on local text (one process, or torchrun for "
                       "several: DDP or FSDP2)", description="Pretrain a KalmixForCausalLM. CONFIG is a YAML file or "
                       f"a preset name ({', '.join(presets())}); every key can be overridden by its dotted flag, "
                       "e.g. --optim.lr 1e-3 --model.mixer kalman. Under torchrun --nproc_per_node=N the same "
                       "command trains with N processes.")
    t.add_argument("config", nargs="?", default=None, help="YAML config file or preset name (default: the defaults)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_flags(t)
    tok = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = tok.add_subparsers(dest="tokenizer_command", required=True)
    tt = tsub.add_parser("train", help="train a byte-level BPE on local documents and save it as a Hugging Face "
                         "tokenizer folder", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tt.add_argument("--source", default="stdlib", help="'stdlib' (the Python standard library's source), a text "
                    "file or folder, JSONL, parquet or a saved datasets folder")
    tt.add_argument("--format", default="auto", choices=typing.get_args(DataConfig.model_fields["format"].annotation),
                    help="how to read --source (auto: from its suffix or contents)")
    tt.add_argument("--text-field", default="text", help="JSONL field / parquet or datasets column of the text")
    tt.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size")
    tt.add_argument("--out", required=True, help="output folder")
    pl = sub.add_parser("plot", help="loss curves of training runs on one PNG",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    pl.add_argument("runs", nargs="+", help="run directories (or their metrics.jsonl)")
    pl.add_argument("--out", default="runs/loss.png", help="PNG file")
    pl.add_argument("--x", default="step", choices=["step", "tokens"], help="x axis")
    pl.add_argument("--log-y", action="store_true", help="logarithmic loss axis")


def _run_train(args, parser) -> int:
    """Exit 0 when the run is done (or was already complete); 2 with a one-line error for a bad config, data,
    checkpoint or a run_dir in use; 1 when a step's gradient was not finite; 130 / 143 when SIGINT / SIGTERM stopped
    it (after writing a checkpoint)."""
    from kalmix.train.checkpoint import CheckpointError, RunDirInUse
    from kalmix.train.config import load_config
    overrides = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:")}
    try:
        cfg = load_config(args.config, overrides)
        if args.print_config:
            print(cfg.dump(), end="")
            return 0
        from kalmix.train.loop import TrainingInterrupted, train
        train(cfg)
    except (ValueError, FileNotFoundError, CheckpointError, RunDirInUse) as e:    # found before any step
        print(f"kalmix train: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:                 # a diverged step, not written: the checkpoints are intact
        print(f"kalmix train: error: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        if os.environ.get("RANK", "0") == "0":      # under torchrun, one line for the run
            print(f"kalmix train: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def _run_tokenizer(args, parser) -> int:
    from kalmix.train.data import DataConfig, iter_documents
    from kalmix.train.tokenizer import train_tokenizer
    try:
        data = DataConfig(source=args.source, format=args.format, text_field=args.text_field)
        train_tokenizer(iter_documents(data), args.vocab_size, args.out)
    except ValidationError as e:
        why = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        print(f"kalmix tokenizer train: error: {why}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"kalmix tokenizer train: error: {e}", file=sys.stderr)
        return 2
    print(f"tokenizer written to {args.out}")
    return 0


def _run_plot(args, parser) -> int:
    from kalmix.train.plot import plot_runs
    try:
        out = plot_runs(args.runs, args.out, x=args.x, log_y=args.log_y)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
