"""``kalmix bench lm --profile`` (kalmix.bench.profile): the CLI run on CPU at tiny sizes, the categories of a GPU
recording built by hand as torch 2.11 and 2.13 build one (kernels listed by their ops, the backward linked to its
forward op), bad arguments, and the mixer op's range costing nothing while nothing records."""
import csv
import gzip
import io
import json
import math
import re
from collections import defaultdict
from contextlib import redirect_stdout

import pytest
import torch
import torch.nn as nn
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from kalmix.bench import profile as prof
from kalmix.cli import main
from kalmix.layers import KaczmarzAttention, base

TINY = ["--device", "cpu", "--layers", "2", "--d-model", "64", "--vocab-size", "256", "--num-heads", "2",
        "--attention-heads", "2", "--tokens", "64", "--seq-lens", "32", "--packing", "plain", "--warmup", "1",
        "--steps", "2", "--tolerance", "0.1"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """attention, kaczmarz (short convolutions), fla's DeltaNet (skipped: CUDA only) and Llama, one training step
    of 2 × 32 tokens recorded twice. -> (rows of profile.csv grouped by model, out folder, printed output)."""
    out = tmp_path_factory.mktemp("bench_lm_profile")
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["bench", "lm", "--profile", *TINY, "--models", "attention", "kaczmarz", "fla_deltanet", "llama",
                   "--out", str(out)])
    assert rc == 0
    by_model = defaultdict(dict)
    with open(out / "profile.csv", newline="") as f:
        for r in csv.DictReader(f):
            by_model[r["model"]][r["category"]] = r
    return by_model, out, buf.getvalue()


def test_every_category_of_every_model_adds_up_to_the_step(cpu_run):
    by_model, _, _ = cpu_run
    assert set(by_model) == {"attention", "kaczmarz", "llama"}          # fla's model needs CUDA: no rows
    for model, cats in by_model.items():
        assert tuple(cats) == prof.CATEGORIES
        ms = {c: float(r["ms_per_step"]) for c, r in cats.items()}
        r = cats["other"]
        busy, step, host = float(r["busy_ms"]), float(r["step_ms"]), float(r["host_ms"])
        assert sum(ms.values()) == pytest.approx(busy, rel=1e-9)
        assert busy == pytest.approx(step, rel=0.05), model            # CPU self times cover the recorded steps
        assert host == pytest.approx(busy, rel=1e-6)
        assert sum(float(r["share"]) for r in cats.values()) == pytest.approx(1)
        for c in ("mixer_op", "gemm", "norm", "elementwise", "loss", "optimizer", "copy_cast"):
            assert ms[c] > 0, (model, c)
        assert (ms["short_conv"] > 0) == (model == "kaczmarz")
        assert r["steps"] == "2" and r["T"] == "32" and r["B"] == "2" and r["device"] == "cpu"
        assert math.isnan(float(r["idle_fraction"])) and math.isnan(float(r["syncs_per_step"]))
        assert math.isnan(float(r["vs_fla_deltanet_ms"]))                # the reference did not run


def test_tables_kernels_and_traces(cpu_run):
    by_model, out, printed = cpu_run
    assert "fla_deltanet  unavailable: needs CUDA (fla's Triton kernels)" in printed
    assert "train, plain rows, T = 32 (B = 2)" in printed
    assert "CPU op self time; a CPU run says nothing of a GPU's" in printed
    line = next(s for s in printed.splitlines() if s.startswith("kaczmarz "))
    cats = by_model["kaczmarz"]
    assert line.split()[1:11] == [f"{float(cats[c]['ms_per_step']):.3f}" for c in prof.CATEGORIES] + [
        f"{float(cats['other']['busy_ms']):.3f}"]
    kernels = (out / "kernels.txt").read_text()
    for model in by_model:
        head = f"{model}, train, plain rows, T = 32: top 20 ops by CPU self time"
        assert head in kernels and head in printed
    top = kernels.split("kaczmarz, train")[1].split("\n\n")[0].splitlines()[2:]
    assert len(top) == 20 and all(re.match(r" *\d+\.\d{3} +\d+\.\d +\d+\.\d%  \w+ +\S", s) for s in top)
    for model in by_model:
        with gzip.open(out / f"trace_{model}_T32_plain_train.json.gz", "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert prof.STEP_RANGE in names and "Optimizer.step#AdamW.step" in names
        assert (base.MIXER_OP_RANGE in names) == (model == "kaczmarz")   # attention: SDPA, named as it is
        assert any(n.startswith("module: Linear ") for n in names if n)


def test_the_backward_of_a_norm_counts_as_the_norm(tmp_path):
    """The backward of torch's RMSNorm on CPU is a chain of elementwise ops (MulBackward0, ...); linked to the
    forward op of each autograd node they count as normalisation, as the forward does."""
    norm = nn.RMSNorm(16)
    x, grad = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16)

    def step():
        x.grad = norm.weight.grad = None                # no accumulation into the last step's gradients
        norm(x).backward(grad)
    b = prof.record(norm, step, torch.device("cpu"), 1, 2, str(tmp_path / "trace.json.gz"))
    nodes = {cat for (name, cat) in b.kernels if name.startswith("autograd::engine::evaluate_function: ")
             and "AccumulateGrad" not in name}
    ops = {cat for (name, cat) in b.kernels if name in ("aten::mul", "aten::pow", "aten::rsqrt", "aten::mean")}
    assert nodes == ops == {"norm"}
    assert ("MulBackward0", "norm") in b.kernels and sum(b.categories.values()) == pytest.approx(b.busy_ms)
    assert (tmp_path / "trace.json.gz").exists() and not (tmp_path / "trace.json").exists()


def _kernel(id, name, start, end, **kw):
    return FunctionEvent(id=id, name=name, thread=0, start_us=start, end_us=end, device_type=DeviceType.CUDA, **kw)


def _cpu(id, name, start, end, children=(), thread=1, launched=(), **kw):
    """A CPU event as torch's recording gives it: ``children`` nested in it; each kernel of ``launched`` linked to
    it (listed in its ``kernels``) and launched from it (a ``cudaLaunchKernel`` child with the kernel's id)."""
    e = FunctionEvent(id=id, name=name, thread=thread, start_us=start, end_us=end, **kw)
    for k in launched:
        e.append_kernel(k.name, k.device_index, k.time_range.elapsed_us())
    launches = [FunctionEvent(id=k.id, name="cudaLaunchKernel", thread=thread, start_us=start, end_us=start)
                for k in launched]
    for c in [*children, *launches]:
        c.set_cpu_parent(e)
        e.append_cpu_child(c)
    return e


def _flat(e):
    return [e] + [d for c in e.cpu_children for d in _flat(c)]


def test_gpu_recording_by_hand():
    """A hand-made recording of one CUDA step, built as torch builds it: kernels counted by the op that lists them
    (the op that launched them) and the ranges around it; the backward's kernels in the scope of their node's
    forward op (sequence number 5: the norm's); a Triton kernel launched outside any op found through its launch
    call (whose id is also an op's, so that torch lists that op's kernels under the call too); a memset whose id is
    also an op's left to its name; GPU annotations not counted; idle time and syncs."""
    k = {i: _kernel(i, name, start, end) for i, name, start, end in [
        (101, "void at::native::vectorized_layer_norm_kernel<float>", 10, 14),             # norm 4
        (102, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", 14, 24),                        # gemm 10
        (103, "void at::native::elementwise_kernel<direct_copy_kernel_cuda>", 24, 27),     # copy 3
        (104, "_kalman_fwd_kernel", 27, 47),                                               # mixer op 20
        (105, "sm90_xmma_gemm_bf16bf16_bf16f32", 47, 52),                                  # gemm 5
        (106, "void at::native::reduce_kernel<512, 1>", 52, 54),                           # loss 2
        (14, "_conv_fwd_kernel", 54, 56),                                                  # conv 2 (launch)
        (107, "void at::native::vectorized_elementwise_kernel<4, MulFunctor>", 60, 66),    # norm 6
        (108, "_kalman_bwd_kernel", 66, 96),                                               # mixer op 30
        (109, "void at::native::multi_tensor_apply_kernel<FusedAdamW>", 100, 108),         # optimizer 8
        (31, "Memset (Device)", 119, 120),                                                 # other 1
    ]}
    triton_launch = _cpu(14, "cuLaunchKernel", 32, 33)
    triton_launch.append_kernel(k[104].name, 0, 20.0)       # torch's doing: the call shares op 14's id
    step = _cpu(1, prof.STEP_RANGE, 0, 100, is_user_annotation=True, children=[
        _cpu(2, "module: RMSNorm model.layers.0.mixer_norm", 1, 5, children=[
            _cpu(11, "aten::rms_norm", 2, 4, sequence_nr=5, launched=[k[101]])]),
        _cpu(3, "module: Linear model.layers.0.mixer.q_proj", 5, 10, children=[
            _cpu(12, "aten::mm", 6, 7, sequence_nr=6, launched=[k[102]]),
            _cpu(13, "aten::copy_", 8, 9, launched=[k[103]])]),
        _cpu(4, base.MIXER_OP_RANGE, 10, 20, children=[
            _cpu(14, "KalmanFusedFunction", 11, 19, sequence_nr=7, launched=[k[104]])]),
        _cpu(5, "_LinearCrossEntropy", 20, 30, sequence_nr=8, children=[
            _cpu(15, "aten::mm", 21, 22, launched=[k[105]]), _cpu(16, "aten::logsumexp", 23, 24, launched=[k[106]])]),
        _cpu(6, "module: ShortConv model.layers.0.mixer.q_conv", 31, 34, children=[triton_launch]),
        _cpu(7, "cudaStreamSynchronize", 35, 36),
        _cpu(8, "Optimizer.step#AdamW.step", 60, 70, is_user_annotation=True, children=[
            _cpu(31, "aten::_fused_adamw_", 61, 69, launched=[k[109]])]),
    ])
    backward = [
        _cpu(20, "autograd::engine::evaluate_function: MulBackward0", 40, 50, thread=2, fwd_thread=1,
             sequence_nr=5, children=[_cpu(21, "aten::mul", 41, 42, thread=2, launched=[k[107]])]),
        _cpu(22, "autograd::engine::evaluate_function: KalmanFusedFunctionBackward", 50, 58, thread=2,
             fwd_thread=1, sequence_nr=7, children=[
                 _cpu(23, "KalmanFusedFunctionBackward", 51, 57, thread=2, launched=[k[108]])]),
    ]
    annotation = _kernel(1, prof.STEP_RANGE, 0, 120, is_user_annotation=True)          # the GPU's: not counted
    events = _flat(step) + [e for b in backward for e in _flat(b)] + list(k.values()) + [annotation]
    b = prof.breakdown(events, 1, "cuda")
    us = {c: 1e3 * v for c, v in b.categories.items()}
    assert us == pytest.approx({"mixer_op": 50, "gemm": 15, "norm": 10, "elementwise": 0, "short_conv": 2,
                                "loss": 2, "optimizer": 8, "copy_cast": 3, "other": 1})
    assert 1e3 * b.busy_ms == pytest.approx(91) and 1e3 * b.step_ms == pytest.approx(120)
    assert 1e3 * b.host_ms == pytest.approx(100)
    assert b.idle_fraction == pytest.approx(1 - 91 / 120) and b.syncs == 1 and b.launches == 10
    assert b.kernels[("_kalman_bwd_kernel", "mixer_op")] == pytest.approx([1, 0.030])
    assert b.kernels[("_kalman_fwd_kernel", "mixer_op")] == pytest.approx([1, 0.020])      # not the call's list
    assert b.kernels[("_conv_fwd_kernel", "short_conv")] == pytest.approx([1, 0.002])      # not op 14's
    assert b.kernels[("Memset (Device)", "other")] == pytest.approx([1, 0.001])            # not op 31's
    with pytest.raises(ValueError, match=r"holds 1 'kalmix.bench.step' ranges where 2 steps were recorded"):
        prof.breakdown(events, 2, "cuda")


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], r"--steps: Input should be greater than or equal to 1 \(got '0'\)"),
    (["--warmup", "-1"], r"--warmup: Input should be greater than or equal to 0 \(got '-1'\)"),
    (["--memory"], r"--memory \(what a forward saves\) and --profile \(where a step's time goes\) are two runs"),
])
def test_bad_arguments_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "lm", "--profile", "--device", "cpu", *args])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_the_mixer_op_range_opens_only_while_the_profiler_records(monkeypatch):
    layer = KaczmarzAttention(32, num_heads=2, impl="torch")
    x = torch.randn(1, 8, 32)
    with torch.profiler.profile() as p:
        layer(x)
    assert [e.name for e in p.events()].count(base.MIXER_OP_RANGE) == 1

    def refuse(name):
        raise AssertionError(f"record_function({name!r}) opened with no profiler recording")
    monkeypatch.setattr(base, "record_function", refuse)
    out, _, _ = layer(x)
    assert out.shape == (1, 8, 32)


def test_a_failing_row_is_reported_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    from kalmix.bench import lm
    real = lm.make_step

    def failing(spec, *args):
        if spec.name == "attention":
            raise RuntimeError("kernel refused\nmore")
        return real(spec, *args)
    monkeypatch.setattr(lm, "make_step", failing)
    rc = main(["bench", "lm", "--profile", *TINY, "--models", "attention", "llama", "--out", str(tmp_path)])
    assert rc == 1
    assert "attention     error: RuntimeError: kernel refused" in capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "profile.csv")))
    assert {r["model"] for r in rows} == {"llama"} and len(rows) == len(prof.CATEGORIES)
