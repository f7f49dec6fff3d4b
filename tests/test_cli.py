"""`kalmix`: every subcommand answers a bad argument or input with `kalmix <command>: error: <message>` and exit
status 2 before any work, never a traceback; other failures exit 1 with a one-line message, Ctrl-C 130; --debug
shows the traceback; every command the README shows is there."""
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import kalmix.cli as cli
from kalmix.bench import synthetic
from kalmix.ops.common.checks import check_device
from kalmix.cli import main
from kalmix.models import KalmixConfig, KalmixForCausalLM
from tests.bench.test_synthetic import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths the table's arguments name: a saved model with its tokenizer, one without, one whose vocabulary is
    smaller than its tokenizer's, results and metrics files good and bad, a recipe."""
    d = tmp_path_factory.mktemp("cli")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    for name, vocab in (("model", bpe.get_vocab_size()), ("notok", bpe.get_vocab_size()), ("small", 256)):
        cfg = KalmixConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, mixer="kaczmarz",
                           mixer_kwargs={"kaczmarz": {"num_heads": 2}})
        KalmixForCausalLM(cfg).save_pretrained(d / name)
        if name != "notok":
            tok.save_pretrained(d / name)
    (d / "llama").mkdir()
    (d / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    (d / "norecipe.jsonl").write_text('{"mixer": "gdn", "accuracy": 0.5}\n')
    (d / "empty.jsonl").write_text("")
    (d / "cut.jsonl").write_text('{"mixer": "gdn"}\n{"mixer": "kal')
    (d / "nonjson.jsonl").write_text("{not json\n")
    (d / "list.jsonl").write_text("[1, 2]\n")
    (d / "startonly.jsonl").write_text('{"kind": "start", "step": 0}\n')
    (d / "noloss.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (d / "good.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
    (d / "bad.yaml").write_text("name: x\n  bad: [\n")
    (d / "recipe.yaml").write_text(yaml.safe_dump(tiny()))
    (d / "noweights").mkdir()
    for f in os.listdir(d / "model"):
        if not f.endswith(".safetensors"):
            (d / "noweights" / f).write_bytes((d / "model" / f).read_bytes())
    for name, vocab in (("novocab", None), ("badvocab", "300")):
        (d / name).mkdir()
        for f in os.listdir(d / "model"):
            (d / name / f).write_bytes((d / "model" / f).read_bytes())
        config = json.loads((d / name / "config.json").read_text())
        if vocab is None:
            del config["vocab_size"]
        else:
            config["vocab_size"] = vocab
        (d / name / "config.json").write_text(json.dumps(config))
    (d / "badjson").mkdir()
    (d / "badjson" / "config.json").write_text("{model_type")
    row = {"recipe": "tiny", "spec": {**tiny(), "train": {"steps": 0, "lrs": [1e-3]}}, "key": "k", "point": {},
           "mixer": "gdn", "lr": 1e-3, "seed": 0, "status": "ok", "time": "2026-01-01T00:00:00"}
    (d / "badspec.jsonl").write_text(json.dumps(row) + "\n")
    (d / "run").mkdir()
    return {k: str(d / v) for k, v in {
        "tmp": ".", "model": "model", "notok": "notok", "small": "small", "llama": "llama", "nope": "nope",
        "norecipe": "norecipe.jsonl", "empty": "empty.jsonl", "nonjson": "nonjson.jsonl", "list": "list.jsonl",
        "startonly": "startonly.jsonl", "noloss": "noloss.jsonl", "good": "good.jsonl", "badyaml": "bad.yaml",
        "recipe": "recipe.yaml", "run": "run", "badjson": "badjson", "badspec": "badspec.jsonl", "cut": "cut.jsonl", "noweights": "noweights",
        "novocab": "novocab", "badvocab": "badvocab"}.items()}


G = "generate --model {model} --prompt the --device cpu"
MQAR = "bench mqar --steps 1 --train-examples 4 --test-examples 4 --batch-size 2 --out {tmp}/m.jsonl"
DECODE = ("bench decode --device cpu --mixers kaczmarz --layers 1 --d-model 16 --vocab-size 32 --steps 1 --contexts 4 "
          "--out {tmp}/d.csv")
SPEED = "speed --device cpu --out {tmp}/speed --seq-lens 8 --tokens 16 --heads 2 --head-dim 4 --d-model 8"
RUN = "bench run {recipe} --out {tmp}/r.jsonl --dry-run"

CASES = [
    # kalmix generate
    (G.replace("--prompt the", "--prompt ''"), "--prompt is empty"),
    (G + " --max-new-tokens 0", "--max-new-tokens must be >= 1, got 0"),
    (G + " --max-new-tokens -3", "--max-new-tokens must be >= 1, got -3"),
    (G + " --max-new-tokens x", "argument --max-new-tokens: invalid int value: 'x'"),
    (G.replace("cpu", "cuda"), "device 'cuda': "),
    (G.replace("cpu", "tpu"), "device 'tpu' is not one of cpu, cuda or cuda:N"),
    (G + " --sample --temperature 0", "--temperature must be a positive number, got 0.0"),
    (G + " --sample --temperature nan", "--temperature must be a positive number, got nan"),
    (G + " --sample --top-k 0", "--top-k must be >= 1, got 0"),
    (G + " --sample --top-k 100000", "--top-k 100000 exceeds the model's vocabulary of"),
    (G + " --top-k 5", "--temperature and --top-k shape sampling; add --sample"),
    (G + " --temperature 0.5", "add --sample"),
    (G + " --seed -1", "--seed must be in [0, 2**63), got -1"),
    (G.replace("{model}", "{good}"), "--model '{good}': not a folder"),
    (G.replace("{model}", "{badjson}"), "config.json is not JSON"),
    (G + " --tokenizer {good}", "--tokenizer '{good}': not a folder"),
    (G + " --tokenizer ''", "--tokenizer '': no such folder"),
    (G.replace("{model}", "{nope}"), "--model '{nope}': no such folder"),
    (G.replace("{model}", "{tmp}"), "is not a saved model folder (no config.json there"),
    (G.replace("{model}", "{llama}"), "holds a 'llama' model, not a kalmix one"),
    (G.replace("{model}", "{noweights}"), "--model '{noweights}' holds a config but no weights (model.safetensors)"),
    (G.replace("{model}", "{notok}"), "--model '{notok}' holds no tokenizer"),
    (G.replace("{model}", "{novocab}"), "--model '{novocab}': its config.json has no vocab_size"),
    (G.replace("{model}", "{badvocab}"), "--model '{badvocab}': its config.json has vocab_size '300', not a whole "
     "number >= 1"),
    (G.replace("{model}", "{notok}") + " --tokenizer {nope}", "--tokenizer '{nope}': no such folder"),
    (G.replace("{model}", "{small}") + " --prompt 'the quick'", "outside the model's vocabulary of 256"),
    (G + " --dtype fp8", "argument --dtype: invalid choice: 'fp8'"),
    # kalmix bench mqar
    (MQAR + " --num-kv-pairs 40", "the MQAR task: need 4 * num_kv_pairs <= seq_len, got 4 * 40 > 32"),
    (MQAR + " --vocab-size 8", "the MQAR task: vocab_size must exceed seq_len"),
    (MQAR + " --device cuda", "device 'cuda': "),
    (MQAR + " --device cuda:x", "device 'cuda:x' is not one of"),
    (MQAR + " --d-model 63", "`num_heads` = 2 must divide d_model = 63"),
    (MQAR + " --num-heads 3", "`num_heads` = 3 must divide d_model = 64"),
    (MQAR + " --steps 0", "--steps: Input should be greater than or equal to 1 (got '0')"),
    (MQAR + " --batch-size -2", "--batch-size: Input should be greater than or equal to 1 (got '-2')"),
    (MQAR + " --seq-len x", "--seq-len: Input should be a valid integer"),
    (MQAR + " --lr -1", "--lr: Input should be greater than 0"),
    (MQAR + " --lr nan", "--lr: Input should be a finite number"),
    (MQAR + " --warmup 1", "--warmup: Input should be less than 1"),
    (MQAR + " --threads 0", "--threads: Input should be greater than or equal to 1"),
    (MQAR + " --seed -1", "--seed: Input should be greater than or equal to 0"),
    (MQAR + " --mixers mamba", "--mixers: Input should be 'attention', 'gdn'"),
    (MQAR + " --impl cuda", "--impl: Input should be 'naive', 'torch' or 'triton'"),
    (MQAR + " --out {tmp}", "output file '{tmp}' is a folder"),
    (MQAR + " --out ''", "the output file is an empty path"),
    (MQAR.replace("{tmp}/m.jsonl", "{cut}"), "output file '{cut}' ends in a cut-off line (no newline after it)"),
    (MQAR + " --out {good}/m.jsonl", "output file '{good}/m.jsonl': {good} is a file, not a folder"),
    (MQAR + " --seed 9223372036854775808", "--seed: Input should be less than 9223372036854775808"),
    (MQAR + " --mixers gdn --d-model 99999999999999999999999", "`num_heads` = 2 must divide d_model = "
     "99999999999999999999999 into equal heads; allowed: a divisor of it"),
    (MQAR + " --steps 0 --lr 0", "2 invalid values:\n  --steps: "),
    (MQAR + " --bogus 1", "unrecognized arguments: --bogus 1"),
    # kalmix bench decode
    ("bench decode --mixers kaczmarz --device cuda", "device 'cuda': "),
    (DECODE + " --batch-sizes -1", "--batch-sizes: Input should be greater than 0 (got '-1')"),
    (DECODE + " --contexts 0", "--contexts: Input should be greater than 0"),
    (DECODE + " --layers 0", "--layers: Input should be greater than 0"),
    (DECODE + " --layers 99999999999999999999999", "99999999999999999999999 layers and vocabulary 32 does not build"),
    (DECODE + " --steps x", "--steps: Input should be a valid integer"),
    (DECODE + " --mixers nope", "--mixers: Input should be 'attention'"),
    (DECODE + " --dtype fp8", "--dtype: Input should be 'bf16', 'fp16' or 'fp32' (got 'fp8')"),
    (DECODE + " --graph", "graph=True (a CUDA graph) needs a CUDA device, got device 'cpu'"),
    (DECODE + " --d-model 15 --num-heads 2 --mixers attention", "`num_heads` = 2 must divide d_model = 15"),
    (DECODE + " --out {tmp}", "output file '{tmp}' is a folder"),
    (DECODE + " --out ''", "the output file is an empty path"),
    # kalmix speed
    ("speed", "device 'cuda': "),
    (SPEED + " --seq-lens -4", "--seq-lens: Input should be greater than 0 (got '-4')"),
    (SPEED + " --tokens 0", "--tokens: Input should be greater than 0"),
    (SPEED + " --rep 0", "--rep: Input should be greater than 0"),
    (SPEED + " --gka-iters -1", "--gka-iters: Input should be greater than or equal to 0"),
    (SPEED + " --ops nothing", "ops: 'nothing' is in no target's name on cpu"),
    (SPEED + " --impls nothing", "--impls: Input should be '-', 'fla'"),
    (SPEED + " --impls triton --ops layer.gla", "select nothing to time on cpu"),
    (SPEED + " --modes decode --ops gated_kalmanet", "select nothing to time on cpu"),
    (SPEED + " --heads 3 --ops layer.attention", "`num_heads` = 3 must divide d_model = 8"),
    (SPEED + " --head-dim 99999999999999999999999 --ops layer.vla", "layer.vla with {{'num_heads': 2, 'head_dim': "
     "99999999999999999999999}} does not build"),
    (SPEED + " --dtypes fp8", "--dtypes: Input should be 'bf16', 'fp16' or 'fp32' (got 'fp8')"),
    (SPEED.replace("{tmp}/speed", "{good}"), "output folder '{good}' is a file"),
    (SPEED.replace("{tmp}/speed", "''"), "the output folder is an empty path"),
    (SPEED.replace("{tmp}/speed", "{good}/speed"), "output folder '{good}/speed': {good} is a file, not a folder"),
    # kalmix bench lm
    ("bench lm --device cpu --out {good}", "output folder '{good}' is a file"),
    ("bench lm --device cpu --memory --out {good}/lm", "output folder '{good}/lm': {good} is a file, not a folder"),
    ("bench lm --device cpu --profile --out ''", "the output folder is an empty path"),
    ("bench lm --table " + os.path.join(ROOT, "docs", "results", "speed-lm", "lm_64k.csv") + " --out {good}",
     "output folder '{good}' is a file"),
    # kalmix bench run
    ("bench run nope --dry-run", "recipe 'nope' is neither a file nor a shipped recipe; shipped: gka_mqar"),
    ("bench run {tmp} --dry-run", "recipe '{tmp}' is a folder"),
    ("bench run {badyaml} --dry-run", "{badyaml}: not valid YAML: mapping values are not allowed here at line 2"),
    ("bench run {empty} --dry-run", "a recipe is a YAML mapping"),
    (RUN + " --mixers nope", "recipe tiny has no mixer(s) ['nope']; it has ['gdn', 'kla']"),
    (RUN + " --device cuda", "device 'cuda': "),
    (RUN + " --device tpu", "device 'tpu' is not one of cpu, cuda or cuda:N"),
    (RUN + " --impl fast", "--impl: Input should be 'naive', 'torch' or 'triton' (got 'fast')"),
    (RUN + " --set train.steps", "override 'train.steps' is not PATH=VALUE"),
    (RUN + " --set =3", "override '=3' is not PATH=VALUE"),
    (RUN + " --set train.steps=-1", "train.steps: Input should be greater than 0 (got -1)"),
    (RUN + " --set train.steps=[", "override 'train.steps=[': VALUE is not valid YAML"),
    (RUN + " --set task.eval_lengths=[-3]", "task.eval_lengths[0]: Input should be greater than 0 (got -3)"),
    (RUN + " --set train.optimizer=sgd", "train.optimizer: Extra inputs are not permitted"),
    (RUN + " --set train.seeds=[1,2,1]", "train.seeds: seeds [1, 2, 1] gives 1 more than once; give each value once"),
    (RUN + " --set train.lrs=[1e-3,1e-3]", "train.lrs: lrs [0.001, 0.001] gives 0.001 more than once"),
    (RUN + " --set grid.model.d_model=[16,16]", "grid['model.d_model'] gives 16 more than once; give each value once"),
    (RUN + " --set train.steps.x=1", "'train.steps.x': 'steps' holds a value, not fields"),
    (RUN + " --set task.params.num_kv_pairs=40", "need 4 * num_kv_pairs <= seq_len"),
    (RUN + " --set model.d_model=15 --set 'mixers.att={{mixer: attention, kwargs: {{num_heads: 2}}}}'",
     "must divide d_model = 15 into equal heads"),
    ("bench run gka_mqar --dry-run --out {tmp}/g.jsonl --set model.d_model=63",
     "the grid sets model.d_model at every point; override the axis instead, e.g. grid.model.d_model=[63]"),
    ("bench run gka_mqar --dry-run --out {tmp}/g.jsonl --set grid.model.d_model=[63] --mixers attention",
     "mixer attention at seq_len=256 d_model=63: KalmixConfig: the 'attention' layers"),
    (RUN.replace("{tmp}/r.jsonl", "{norecipe}"), "{norecipe}:1: not a `kalmix bench run` result row"),
    (RUN.replace("{tmp}/r.jsonl", "{tmp}"), "output file '{tmp}' is a folder"),
    (RUN.replace("{tmp}/r.jsonl", "''"), "the output file is an empty path"),
    (RUN.replace("{tmp}/r.jsonl", "{cut}"), "output file '{cut}' ends in a cut-off line (no newline after it), which "
     "the rows appended would join; complete or remove that line"),
    # kalmix bench report
    ("bench report {badspec} {good} {badspec} --out {tmp}/rep", "results file '{badspec}' is given twice: its runs "
     "would count twice; give each file once"),
    ("bench report {badspec} {tmp}/./badspec.jsonl --out {tmp}/rep", "is given twice (as '{badspec}')"),
    ("bench report {norecipe} --out {tmp}/rep", "{norecipe}:1: not a `kalmix bench run` result row (it lacks recipe"),
    ("bench report {list} --out {tmp}/rep", "{list}:1: not a `kalmix bench run` result row"),
    ("bench report {empty} --out {tmp}/rep", "{empty}: no result rows (an empty file)"),
    ("bench report {nope} --out {tmp}/rep", "results file '{nope}' does not exist"),
    ("bench report {nonjson} --out {tmp}/rep", "{nonjson}:1: not JSON"),
    ("bench report {tmp} --out {tmp}/rep", "'{tmp}' is a folder; give the JSONL files"),
    ("bench report {nonjson} --out {good}", "output folder '{good}' is a file"),
    ("bench report {nonjson} --out ''", "the output folder is an empty path"),
    ("bench report {badspec} --out {tmp}/rep", "recipe tiny: the recipe its newest row ran is not valid here: "
     "train.steps: Input should be greater than 0 (got 0)"),
    # kalmix tokenizer train
    ("tokenizer train --source {nope} --out {tmp}/tok", "data source not found: {nope}"),
    ("tokenizer train --vocab-size 10 --out {tmp}/tok", "a vocabulary of 10 is too small: a byte-level BPE needs at least 257"),
    ("tokenizer train --vocab-size 99999999999 --out {tmp}/tok", "a vocabulary of 99,999,999,999 is too large: at most "
     "4,294,967,296 entries (2**32: the token shards hold uint32 ids)"),
    ("tokenizer train --vocab-size x --out {tmp}/tok", "argument --vocab-size: invalid int value: 'x'"),
    ("tokenizer train --format xml --out {tmp}/tok", "argument --format: invalid choice: 'xml'"),
    ("tokenizer train --out {model}", "{model} already exists and is not an empty directory"),
    ("tokenizer train --source '' --out {tmp}/tok", "--source is empty"),
    ("tokenizer train --source stdlib --format text --out {tmp}/tok", "leave format 'auto'"),
    ("tokenizer train --out ''", "--out is empty; give the folder to write the tokenizer to"),
    ("tokenizer train --out {good}/tok", "output folder '{good}/tok': {good} is a file, not a folder"),
    ("tokenizer train --source {good} --format parquet --out {tmp}/tok", "{good}: not a parquet file ("),
    # kalmix plot
    ("plot {run} --out {tmp}/p.png", "{run}: no metrics.jsonl"),
    ("plot {startonly} --out {tmp}/p.png", "{startonly}: no train or eval rows yet"),
    ("plot {list} --out {tmp}/p.png", "{list}:1: not a JSON object"),
    ("plot {nonjson} --out {tmp}/p.png", "{nonjson}:1: not a JSON line"),
    ("plot {noloss} --out {tmp}/p.png", "{noloss}:1: a train row without loss"),
    ("plot {good} --out {tmp}/p.xyz", "the file's suffix names its format, one of"),
    ("plot {good} --out {tmp}", "output file '{tmp}' is a folder"),
    ("plot {good} --out {good}/loss.png", "output file '{good}/loss.png': {good} is a file, not a folder"),
    ("plot {good} --x epoch", "argument --x: invalid choice: 'epoch'"),
    ("plot {good} --x tokens --out {tmp}/p.png", "{good}: --x tokens needs the tokens_per_step of the run's start "
     "row, which its metrics.jsonl lacks; plot it with --x step"),
    # kalmix train (the common path: unknown flags name the subcommand)
    ("train --train.stepz 3 --print-config", "unrecognized arguments: --train.stepz"),
]


def _argv(line: str, files: dict) -> list[str]:
    import shlex
    return [a.format(**files) for a in shlex.split(line)]


@pytest.fixture
def no_cuda(monkeypatch):
    """The same answers on a GPU machine: CUDA absent."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("line, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_named_error(line, fragment, files, capsys, no_cuda):
    argv = _argv(line, files)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    command = "kalmix " + " ".join(argv[:2] if argv[0] in ("bench", "tokenizer") else argv[:1])
    assert e.value.code == 2, err
    assert f"{command}: error: " in err and fragment.format(**files) in err, err
    assert "Traceback" not in err
    assert not os.path.exists(os.path.join(files["tmp"], "tok"))       # nothing was made
    assert not os.path.exists(os.path.join(files["tmp"], "speed", "speed.csv"))


def test_impl_triton_on_cpu_without_the_interpreter(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["bench", "mqar", "--impl", "triton"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "kalmix bench mqar: error: impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1)" in err


def test_a_cuda_index_the_machine_lacks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device 'cuda:2': this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        check_device("cuda:2")
    with pytest.raises(ValueError, match="device 'mps' is not one of cpu, cuda or cuda:N"):
        check_device("mps")


def test_unexpected_errors_interrupts_and_debug(monkeypatch, capsys, files):
    def boom(args):
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setattr(cli, "_run_plot", boom)
    with pytest.raises(SystemExit) as e:
        main(["plot", files["good"]])
    assert e.value.code == 1
    assert capsys.readouterr().err == "kalmix plot: error: RuntimeError: boom (run with --debug for the traceback)\n"
    with pytest.raises(RuntimeError, match="boom"):
        main(["plot", files["good"], "--debug"])
    with pytest.raises(RuntimeError, match="boom"):
        main(["--debug", "plot", files["good"]])

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_run_plot", interrupted)
    with pytest.raises(SystemExit) as e:
        main(["plot", files["good"]])
    assert e.value.code == 130 and capsys.readouterr().err == "kalmix plot: interrupted\n"

    def missing(args):
        raise ImportError("reading parquet needs pyarrow: pip install pyarrow")
    monkeypatch.setattr(cli, "_run_plot", missing)
    with pytest.raises(SystemExit) as e:
        main(["plot", files["good"]])
    assert e.value.code == 1
    assert capsys.readouterr().err == "kalmix plot: error: reading parquet needs pyarrow: pip install pyarrow\n"
    with pytest.raises(ValueError, match="--prompt is empty"):
        main(["--debug", "generate", "--model", files["model"], "--prompt", ""])


def test_the_command_prints_no_traceback(files):
    """The real entry point, in a process of its own: the message, exit status 2, no traceback; --debug shows it."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    argv = [sys.executable, "-m", "kalmix.cli", "bench", "report", files["nope"], "--out", files["tmp"]]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr == f"kalmix bench report: error: results file '{files['nope']}' does not exist\n"
    r = subprocess.run(argv + ["--debug"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "Traceback" in r.stderr and "FileNotFoundError" in r.stderr


def test_good_arguments_still_run(files, capsys):
    """The checks let valid commands through: sampling with --temperature and --top-k, and a plot."""
    assert main(["generate", "--model", files["model"], "--prompt", "the quick", "--device", "cpu",
                 "--max-new-tokens", "3", "--sample", "--temperature", "0.7", "--top-k", "5"]) == 0
    assert "3 tokens in" in capsys.readouterr().err
    out = os.path.join(files["tmp"], "loss.png")
    assert main(["plot", files["good"], "--out", out]) == 0
    assert open(out, "rb").read(4) == b"\x89PNG"


def test_bench_run_reports_progress(tmp_path, capsys):
    """A start line (runs to do, runs already recorded), then one line per finished run, also off a terminal."""
    recipe = synthetic.Recipe.model_validate(tiny(train={"steps": 2, "lrs": [1e-3], "eval_every": 2}))
    out = str(tmp_path / "r.jsonl")
    synthetic.run(recipe, out, mixers=["gdn"], progress=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"tiny: 1 runs to do, 0 of 1 already in {out}"
    assert lines[1].startswith("[1/1] -          gdn lr=0.001    seed=0    val=") and " steps=2 " in lines[1]
    synthetic.run(recipe, out, progress=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"tiny: 1 runs to do, 1 of 2 already in {out}" and lines[1].startswith("[1/1] -          kla")


def test_dry_run_counts_what_is_left(files, capsys):
    assert main(["bench", "run", files["recipe"], "--dry-run", "--out", files["nope"]]) == 0
    assert f"# 4 runs (1 grid points), 4 not yet in {files['nope']}" in capsys.readouterr().out


def _configs():
    from kalmix.bench.decode import DecodeBenchConfig
    from kalmix.bench.lm import LMBenchConfig
    from kalmix.bench.mqar import MQARBenchConfig
    from kalmix.bench.speed import SpeedConfig
    from kalmix.bench.synthetic import RunOptions
    return [("bench mqar", MQARBenchConfig, set()), ("bench run", RunOptions, set()),
            ("bench decode", DecodeBenchConfig, set()), ("bench lm", LMBenchConfig, {"table"}),
            ("speed", SpeedConfig, set())]


@pytest.mark.parametrize("command, config, extra", _configs(), ids=[c[0] for c in _configs()])
def test_flags_come_from_the_configs(command, config, extra, capsys):
    """One argument per config field, its help the field's description; no argument that is not a field (but
    ``extra``)."""
    with pytest.raises(SystemExit) as e:
        main([*command.split(), "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    flags = set(re.findall(r"--([a-z][a-z-]*)", text.split("options:")[1])) - {"help", "debug"}
    expected = set(extra)
    for name, field in config.model_fields.items():
        assert field.description, f"{config.__name__}.{name} has no description"
        assert " ".join(field.description.split()) in text, name
        if not field.is_required():
            expected.add(name.replace("_", "-"))
            expected |= {f"no-{name.replace('_', '-')}"} if field.annotation in (bool, bool | None) else set()
    assert flags == expected


def test_repeated_list_flags_add_up_and_none_is_none(files, capsys):
    assert main(["bench", "run", files["recipe"], "--dry-run", "--out", files["nope"], "--set", "train.steps=3",
                 "--set", "train.seeds=[0, 1]", "--impl", "none", "--mixers", "gdn", "--mixers", "kla"]) == 0
    out = capsys.readouterr().out
    assert f"# 8 runs (1 grid points), 8 not yet in {files['nope']}" in out
    assert yaml.safe_load(out)["train"]["steps"] == 3


def test_every_command_the_readme_shows_is_installed(capsys):
    """matplotlib (kalmix plot, bench report, speed's plots) is a dependency, not an extra; each `kalmix ...`
    command in a code block of the README and the docs answers --help."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert any(re.match(r"matplotlib\b", d) for d in project["dependencies"])
    assert project["scripts"]["kalmix"] == "kalmix.cli:main"
    shown = set()
    for path in ["README.md", *(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")))]:
        if path.endswith(".md"):
            code = open(os.path.join(ROOT, path)).read().split("```")[1::2]      # the fenced blocks
            shown |= {m for block in code for m in re.findall(r"^kalmix ((?:bench |tokenizer )?[a-z]+)", block, re.M)}
    assert {"bench mqar", "bench run", "bench report", "train", "plot", "generate", "speed"} <= shown
    for command in sorted(shown):
        with pytest.raises(SystemExit) as e:
            main([*command.split(), "--help"])
        assert e.value.code == 0, command


def test_output_piped_into_a_reader_that_stops_early_is_quiet(tmp_path):
    """``kalmix ... | head -1``: the closed pipe ends the command with 141 (SIGPIPE's shell status), no message and
    no traceback. The table (3,000 models, ~200 kB) is far larger than a pipe's buffer, so the write hits the closed pipe."""
    import csv
    src = os.path.join(os.path.dirname(__file__), "..", "docs", "results", "speed-lm", "lm_64k.csv")
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    big = tmp_path / "lm.csv"
    with open(big, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({**rows[i % len(rows)], "model": f"model{i}"} for i in range(3000))
    proc = subprocess.Popen([sys.executable, "-m", "kalmix.cli", "bench", "lm", "--table", str(big)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()                                         # the reader goes away before the table is written
    err = proc.stderr.read().decode()
    assert proc.wait() == 141, err
    assert err == ""
