"""The `kalmix` command.

Every subcommand checks its arguments before any work. A bad argument or input ends it with one message,
``kalmix <command>: error: <what, which value, what is allowed>``, on stderr and exit status 2 (argparse's usage
errors too); any other failure prints a one-line message and exits 1; Ctrl-C exits 130. ``--debug`` (anywhere on
the command line) shows the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types
import typing

import yaml
from pydantic import BaseModel, ValidationError

from kalmix.bench.checks import check_out, validation_lines
from kalmix.ops.common.checks import check_device


def _optional(annotation) -> tuple[object, bool]:
    """(the annotation without None, whether it admits None)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else annotation), True
    return annotation, False


def _choices(annotation) -> tuple | None:
    """The values a Literal (or a list or tuple of Literals) allows; None for other types."""
    if typing.get_origin(annotation) in (list, tuple):
        annotation = typing.get_args(annotation)[0]
    return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(_shown, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _add_config_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One argument per field of ``model``, its help the field's description, allowed values and default (a
    default of None, or made by a factory, is for the description to explain): a field without a default is a
    positional argument, the others ``--field-name`` flags (kebab-case). A list takes one or more values (a
    repeated flag adds more), a bool is ``--flag`` / ``--no-flag``, an optional field also takes ``none``. Values
    reach the config as text, unchecked: ``_flag_config`` validates them all at once."""
    for name, field in model.model_fields.items():
        annotation, _ = _optional(field.annotation)
        help_ = field.description or ""
        choices = _choices(annotation)
        if choices:
            help_ += f" (one of: {', '.join(map(str, choices))})"
        if field.default_factory is None and not field.is_required() and field.default not in (None, [], ()):
            help_ += f" (default: {_shown(field.default)})"
        help_ = help_.replace("%", "%%")
        dest, meta = f"cfg:{name}", name.upper()
        if field.is_required():
            parser.add_argument(dest, metavar=name, help=help_)
        elif annotation is bool:
            parser.add_argument("--" + name.replace("_", "-"), dest=dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_)
        elif typing.get_origin(annotation) in (list, tuple):
            parser.add_argument("--" + name.replace("_", "-"), dest=dest, nargs="+", action="extend", metavar=meta,
                                default=argparse.SUPPRESS, help=help_)
        else:
            parser.add_argument("--" + name.replace("_", "-"), dest=dest, metavar=meta, default=argparse.SUPPRESS,
                                help=help_)


def _config_from_flags(model: type[BaseModel], args: argparse.Namespace):
    """``model`` validated from the arguments ``_add_config_flags`` made (those not given keep the field's
    default; ``none`` is None where a field admits it); an error names each bad flag (a ValueError)."""
    values = {}
    for key, value in vars(args).items():
        if key.startswith("cfg:"):
            name = key[4:]
            optional = _optional(model.model_fields[name].annotation)[1]
            none = optional and isinstance(value, str) and value.lower() in ("none", "null")
            values[name] = None if none else value
    return _flag_config(model, values)


def _flag_config(model: type[BaseModel], values: dict):
    """``model`` validated from ``values`` (field name -> value); an error names each bad flag (a ValueError)."""
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise ValueError(_joined(validation_lines(e, key=lambda loc: _flag_name(model, loc)))) from None


def _flag_name(model: type[BaseModel], loc: tuple) -> str:
    """The argument that gave the value at ``loc`` of ``model`` (``--field-name``; a positional: its name)."""
    if not loc:
        return ""
    name = str(loc[0])
    return name if model.model_fields[name].is_required() else "--" + name.replace("_", "-")


def _add_mqar_parser(tasks) -> None:
    from kalmix.bench.mqar import MQARBenchConfig
    mqar = tasks.add_parser("mqar", help="multi-query associative recall: train each mixer, print a table",
                            parents=[_COMMON])
    _add_config_flags(mqar, MQARBenchConfig)


def _run_mqar(args) -> int:
    from kalmix.bench.mqar import MQARBenchConfig, run
    run(_config_from_flags(MQARBenchConfig, args))
    return 0


# a flag every subcommand takes (its default left to the top-level parser's)
_COMMON = argparse.ArgumentParser(add_help=False)
_COMMON.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                     help="show the traceback of an error instead of its one-line message")

# exceptions that mean a bad argument or input (exit 2); others are failures (exit 1)
_BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError,
              NotImplementedError, yaml.YAMLError)


def main(argv: list[str] | None = None) -> int:
    """Run ``kalmix ARGV``; returns 0 on success. Errors print ``kalmix <command>: error: ...`` on stderr and raise
    SystemExit (2: a bad argument or input, 1: another failure, 130: interrupted), as argparse's do."""
    parser = argparse.ArgumentParser(prog="kalmix", description="kalmix: attention as online least squares")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of its "
                        "one-line message (also taken after the subcommand)")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="train-and-evaluate benchmarks")
    tasks = bench.add_subparsers(dest="task", required=True)
    _add_mqar_parser(tasks)
    _add_decode_parser(tasks)
    _add_recipe_parsers(tasks)
    _add_lm_parser(tasks)
    _add_speed_parser(sub)
    _add_generate_parser(sub)
    _add_train_parsers(sub)
    args, unknown = parser.parse_known_args(argv)
    if unknown:                                     # argparse would name the top-level command, not this one
        print(f"{_command(args)}: error: unrecognized arguments: {' '.join(unknown)} (see {_command(args)} --help)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        return _dispatch(args, sub.choices["train"])
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{_command(args)}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:                                     # the reader went away (`kalmix ... | head`): quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at interpreter exit
        raise SystemExit(141) from None
    except Exception as e:                                      # noqa: BLE001  one message, never a traceback
        if args.debug:
            raise
        message, code = _describe(e)
        print(f"{_command(args)}: error: {message}", file=sys.stderr)
        raise SystemExit(code) from None


def _dispatch(args, train_parser) -> int:
    if args.command == "speed":
        return _run_speed(args)
    if args.command == "generate":
        return _run_generate(args)
    if args.command == "train":
        return _run_train(args, train_parser)
    if args.command == "tokenizer":
        return _run_tokenizer(args)
    if args.command == "plot":
        return _run_plot(args)
    if args.task == "decode":
        return _run_decode(args)
    if args.task == "lm":
        return _run_lm(args)
    if args.task == "run":
        return _run_recipe(args)
    if args.task == "report":
        return _run_report(args)
    return _run_mqar(args)


def _command(args) -> str:
    """``kalmix`` and the subcommand's words, e.g. ``kalmix bench mqar``."""
    words = [args.command] + [getattr(args, k) for k in ("task", "tokenizer_command") if getattr(args, k, None)]
    return " ".join(["kalmix", *words])


def _joined(lines: list[str]) -> str:
    return lines[0] if len(lines) == 1 else "\n  ".join([f"{len(lines)} invalid values:", *lines])


def _describe(e: Exception) -> tuple[str, int]:
    """The message and exit status of an error."""
    if isinstance(e, ValidationError):
        return _joined(validation_lines(e)), 2
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}", 2 if isinstance(e, _BAD_INPUT) else 1
    if isinstance(e, _BAD_INPUT):
        return str(e), 2
    if isinstance(e, ImportError):                 # a missing package: the message names it
        return str(e), 1
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first} (run with --debug for the traceback)", 1


def _add_decode_parser(tasks) -> None:
    from kalmix.bench.decode import DecodeBenchConfig
    decode = tasks.add_parser("decode", help="ms per generated token of whole models: eager, CUDA-graphed and "
                              "the kernels' GPU time", parents=[_COMMON])
    _add_config_flags(decode, DecodeBenchConfig)


def _run_decode(args) -> int:
    from kalmix.bench.decode import DecodeBenchConfig, run as run_decode
    run_decode(_config_from_flags(DecodeBenchConfig, args))
    return 0


def _add_lm_parser(tasks) -> None:
    from kalmix.bench.lm import LMBenchConfig
    lm = tasks.add_parser(
        "lm", help="training throughput of whole models side by side (every mixer, a hybrid, fla's DeltaNet, "
        "Llama) at matched parameter counts",
        description="Times each model's training step (forward, backward, fused AdamW; bf16 autocast) at each T "
        "with B x T tokens per step, on plain and packed rows; writes lm.csv and PNG plots to --out and prints a "
        "table. --table CSV prints the markdown table of a CSV instead.", parents=[_COMMON])
    _add_config_flags(lm, LMBenchConfig)
    lm.add_argument("--table", metavar="CSV", nargs="+", default=None,
                    help="print the markdown table of `kalmix bench lm` CSVs (e.g. committed ones; several: runs of "
                         "one GPU kind and setup, joined; with --memory: of `kalmix bench lm --memory` CSVs) and exit; "
                         "with --out, also draw their plots there")


def _run_lm(args) -> int:
    from kalmix.bench.lm import LMBenchConfig, main as run_lm, markdown_table, plot_csvs
    if args.table:
        if vars(args).get("cfg:memory"):
            from kalmix.bench.memory import markdown_table
        plots = "cfg:out" in vars(args) and not vars(args).get("cfg:memory")
        if plots:
            check_out(vars(args)["cfg:out"], folder=True)
        print(markdown_table(*args.table))
        if plots:
            plot_csvs(args.table, vars(args)["cfg:out"])
        return 0
    return run_lm(_config_from_flags(LMBenchConfig, args))


def _add_recipe_parsers(tasks) -> None:
    from kalmix.bench.synthetic import RunOptions
    r = tasks.add_parser("run", help="a paper's synthetic experiment from a recipe (kalmix/bench/recipes/*.yaml): "
                         "train every grid point, mixer, seed and learning rate; append one JSONL row per run; "
                         "resumable", parents=[_COMMON])
    _add_config_flags(r, RunOptions)
    rp = tasks.add_parser("report", help="markdown tables and PNG plots from `kalmix bench run` results",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter, parents=[_COMMON])
    rp.add_argument("results", nargs="+", help="JSONL results files (each once)")
    rp.add_argument("--out", default="runs/bench/report", help="output folder (README.md and PNGs)")


def _run_recipe(args) -> int:
    from kalmix.bench.synthetic import RunOptions, load_recipe, plan, resolve_recipe, run as run_recipe
    opts = _config_from_flags(RunOptions, args)
    recipe = load_recipe(resolve_recipe(opts.recipe), opts.set)
    out = opts.out_path(recipe)
    if opts.dry_run:
        todo = plan(recipe, out, device=opts.device, impl=opts.impl, mixers=opts.mixers)
        print(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False), end="")
        print(f"# {recipe.planned_runs(len(opts.mixers) if opts.mixers else None)} runs ({len(recipe.points())} grid "
              f"points), {len(todo)} not yet in {out}")
        return 0
    run_recipe(recipe, out, device=opts.device, impl=opts.impl, mixers=opts.mixers)
    print(f"results in {out}; `kalmix bench report {out}` renders them")
    return 0


def _run_report(args) -> int:
    from kalmix.bench.report import report
    report(args.results, args.out)
    print(f"wrote {os.path.join(args.out, 'README.md')}")
    return 0


def _add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="decode text from a saved model (static cache, CUDA-graphed steps)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter, parents=[_COMMON])
    g.add_argument("--model", required=True, help="folder of a saved KalmixForCausalLM (save_pretrained)")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"], help="weights' dtype")
    g.add_argument("--no-graph", action="store_true", help="run the decode steps eagerly (no CUDA graph)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (with --sample; default 1)")
    g.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens (with --sample; "
                   "default: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")


def _check_generate(args) -> None:
    """Every argument of ``kalmix generate``, before the model is loaded: a ValueError naming the flag."""
    if not args.prompt:
        raise ValueError("--prompt is empty; give the text to continue")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.sample and (args.temperature is not None or args.top_k is not None):
        raise ValueError("--temperature and --top-k shape sampling; add --sample (without it decoding is greedy)")
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(f"--temperature must be a positive number, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    if not 0 <= args.seed < 2 ** 63:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.device is not None:
        check_device(args.device)
    _check_folder(f"--model {args.model!r}", args.model)
    config = os.path.join(args.model, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"--model {args.model!r} is not a saved model folder (no config.json there; "
                         "KalmixForCausalLM.save_pretrained writes one)")
    try:
        with open(config) as f:
            saved = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {args.model!r}: config.json is not JSON ({e})") from None
    if not isinstance(saved, dict) or saved.get("model_type") != "kalmix":
        kind = saved.get("model_type") if isinstance(saved, dict) else None
        raise ValueError(f"--model {args.model!r} holds a {kind!r} model, not a kalmix one")
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    if not any(os.path.isfile(os.path.join(args.model, f)) for f in weights):
        raise ValueError(f"--model {args.model!r} holds a config but no weights (model.safetensors); "
                         "KalmixForCausalLM.save_pretrained writes both")
    if "vocab_size" not in saved:
        raise ValueError(f"--model {args.model!r}: its config.json has no vocab_size; KalmixForCausalLM.save_pretrained "
                         "writes it")
    vocab = saved["vocab_size"]
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"--model {args.model!r}: its config.json has vocab_size {vocab!r}, not a whole number >= 1")
    if args.top_k is not None and args.top_k > vocab:
        raise ValueError(f"--top-k {args.top_k} exceeds the model's vocabulary of {vocab}")
    tokenizer = args.model if args.tokenizer is None else args.tokenizer
    where = f"{'--model' if args.tokenizer is None else '--tokenizer'} {tokenizer!r}"
    _check_folder(where, tokenizer)
    if not any(os.path.isfile(os.path.join(tokenizer, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{where} holds no tokenizer (tokenizer.json); save the tokenizer there or pass --tokenizer "
                         "FOLDER")
    from transformers import AutoTokenizer
    try:
        ids = AutoTokenizer.from_pretrained(tokenizer)(args.prompt).input_ids
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: its tokenizer does not load ({str(e).strip().splitlines()[0]})") from None
    if not ids:
        raise ValueError(f"--prompt {args.prompt!r} tokenises to no tokens")
    if max(ids) >= vocab:
        raise ValueError(f"--prompt tokenises to id {max(ids)}, outside the model's vocabulary of {vocab}: is "
                         f"{tokenizer!r} the model's tokenizer?")


def _check_folder(what: str, path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(f"{what}: {'not a folder' if os.path.exists(path) else 'no such folder'}")


def _run_generate(args) -> int:
    from kalmix.models.decoding import generate_text
    _check_generate(args)
    r = generate_text(args.model, args.prompt, max_new_tokens=args.max_new_tokens, tokenizer=args.tokenizer,
                      device=args.device, dtype=args.dtype, graph=False if args.no_graph else None,
                      do_sample=args.sample, temperature=1.0 if args.temperature is None else args.temperature,
                      top_k=args.top_k, seed=args.seed)
    print(args.prompt + r["text"])
    print(f"-- {len(r['new_tokens'])} tokens in {r['decode_s']:.3f} s: {r['tokens_per_s']:.1f} tokens/s "
          f"({'CUDA graph' if r['graph'] else 'eager'}; prefill {1e3 * r['prefill_s']:.1f} ms)", file=sys.stderr)
    return 0


def _add_speed_parser(sub) -> None:
    from kalmix.bench.speed import SpeedConfig
    sp = sub.add_parser("speed", help="time every op and layer against fla and SDPA anchors (GPU; CPU for tiny "
                        "shapes)", parents=[_COMMON],
                        description="Times kalmix ops (every available impl) and layers next to fla's chunk_delta_rule,"
                        " chunk_gated_delta_rule, chunk_simple_gla, chunk_gla and GatedDeltaNet layer (CUDA only) and "
                        "SDPA causal attention, in forward, forward+backward and decode modes, at a fixed token "
                        "budget per call. Writes speed.csv and PNG plots to --out and prints a table.")
    _add_config_flags(sp, SpeedConfig)


def _run_speed(args) -> int:
    from kalmix.bench.speed import SpeedConfig, run as run_speed
    run_speed(_config_from_flags(SpeedConfig, args))
    return 0


def _add_train_parsers(sub) -> None:
    from kalmix.train.config import add_flags, presets
    from kalmix.train.data import DataConfig
    t = sub.add_parser("train", help="pretrain a language model on local text (one process, or torchrun for "
                       "several: DDP or FSDP2)", description="Pretrain a KalmixForCausalLM. CONFIG is a YAML file or "
                       f"a preset name ({', '.join(presets())}); every key can be overridden by its dotted flag, "
                       "e.g. --optim.lr 1e-3 --model.mixer kalman. Under torchrun --nproc_per_node=N the same "
                       "command trains with N processes.", parents=[_COMMON])
    t.add_argument("config", nargs="?", default=None, help="YAML config file or preset name (default: the defaults)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_flags(t)
    tok = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = tok.add_subparsers(dest="tokenizer_command", required=True)
    tt = tsub.add_parser("train", help="train a byte-level BPE on local documents and save it as a Hugging Face "
                         "tokenizer folder", formatter_class=argparse.ArgumentDefaultsHelpFormatter, parents=[_COMMON])
    tt.add_argument("--source", default="stdlib", help="'stdlib' (the Python standard library's source), a text "
                    "file or folder, JSONL, parquet or a saved datasets folder")
    tt.add_argument("--format", default="auto", choices=typing.get_args(DataConfig.model_fields["format"].annotation),
                    help="how to read --source (auto: from its suffix or contents)")
    tt.add_argument("--text-field", default="text", help="JSONL field / parquet or datasets column of the text")
    tt.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size (at most: a small corpus "
                    "gives fewer tokens, which is said)")
    tt.add_argument("--out", required=True, help="output folder")
    pl = sub.add_parser("plot", help="loss curves of training runs on one PNG",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter, parents=[_COMMON])
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


def _run_tokenizer(args) -> int:
    from kalmix.train.data import DataConfig, iter_documents
    from kalmix.train.tokenizer import train_tokenizer
    if not args.source:
        raise ValueError("--source is empty; give 'stdlib', 'python' or a path")
    if not args.out:
        raise ValueError("--out is empty; give the folder to write the tokenizer to")
    check_out(args.out, folder=True)
    data = _flag_config(DataConfig, {"source": args.source, "format": args.format, "text_field": args.text_field})
    tokenizer = train_tokenizer(iter_documents(data), args.vocab_size, args.out)
    print(f"tokenizer written to {args.out}")
    if len(tokenizer) < args.vocab_size:            # the corpus decides: no more pairs seen twice to merge
        print(f"kalmix tokenizer train: note: the vocabulary has {len(tokenizer)} tokens, not the --vocab-size "
              f"{args.vocab_size} asked: the corpus has no more pairs of tokens seen twice to merge", file=sys.stderr)
    return 0


def _run_plot(args) -> int:
    from kalmix.train.plot import plot_runs
    print(f"wrote {plot_runs(args.runs, args.out, x=args.x, log_y=args.log_y)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
