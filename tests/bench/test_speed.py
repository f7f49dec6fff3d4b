"""`kalmix speed` on CPU with tiny shapes."""
import csv
import dataclasses
import functools

import pytest
import torch

from kalmix import ops
from kalmix.bench.speed import SpeedConfig, targets
from kalmix.cli import main
from kalmix.ops.common.cost import Shape


def test_cli_on_cpu_writes_csv_and_plots(tmp_path, capsys):
    out = tmp_path / "speed"
    assert main(["speed", "--device", "cpu", "--out", str(out), "--seq-lens", "8", "16", "--tokens", "32",
                 "--heads", "2", "--head-dim", "8", "--d-model", "16", "--d-state", "4", "--decode-contexts", "8",
                 "16", "--warmup", "1", "--rep", "1", "--naive-max-len", "8", "--gka-iters", "0", "30",
                 "--impls", "naive", "torch", "sdpa", "-"]) == 0
    rows = list(csv.DictReader(open(out / "speed.csv")))
    ops = {r["op"] for r in rows}
    assert {"kalman_attention", "gated_kalmanet", "gated_kalmanet[num_iters=0]", "kaczmarz_attention",
            "variational_linear_attention",
            "sdpa_causal", "layer.kalman", "layer.attention", "sdpa_kv_cache"} <= ops
    assert {r["mode"] for r in rows} == {"fwd", "fwdbwd", "decode"}
    decode = {(r["op"], r["impl"], r["T"]) for r in rows if r["mode"] == "decode"}
    assert {("layer.kalman", "torch", "8"), ("layer.kalman", "torch", "16"), ("layer.attention", "-", "16"),
            ("sdpa_kv_cache", "sdpa", "16")} <= decode
    assert not any(impl == "triton" for _, impl, _ in decode)     # --impls selects the decode rows too
    for r in rows:
        assert r["status"] in ("ok", "skipped (naive, T > naive-max-len)"), r
        assert int(r["B"]) * int(r["T"]) == 32 or r["mode"] == "decode"
        if r["status"] == "ok":
            assert float(r["ms_p20"]) <= float(r["ms_p50"]) <= float(r["ms_p80"])
            assert r["torch"] and r["device_name"]
    skipped = [r for r in rows if r["status"].startswith("skipped")]
    assert skipped and all(r["impl"] == "naive" and r["T"] == "16" for r in skipped)
    for mode in ("fwd", "fwdbwd", "decode"):
        png = out / f"speed_{mode}_bf16.png"
        assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "CPU run - these times say nothing about GPU speed" in table
    assert "fp32 FMA" not in table and "nan" not in table    # no fp32 ceiling off CUDA; empty cells print '-'
    assert "with check_values=False, as the layers call them" in table


@pytest.mark.parametrize("check", [False, True])
def test_ops_run_their_value_checks_only_when_asked(monkeypatch, check):
    """Op targets pass check_values as configured (off by default, as the layers call the ops); an op without
    a value check (VLA) is called without it."""
    seen = {}
    real = ops.kaczmarz_attention

    @functools.wraps(real)
    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)
    monkeypatch.setitem(ops.SPECS, "kaczmarz", dataclasses.replace(ops.SPECS["kaczmarz"], fn=spy))
    cpu = torch.device("cpu")
    ts = {t.name: t for t in targets(("kaczmarz", "variational"), ("torch",), 16, 2, 8, 4, cpu, check)}
    for name in ("kaczmarz_attention", "variational_linear_attention"):
        fn, _ = ts[name].build(Shape(1, 8, 2, 8, 8), torch.float32, cpu)
        assert fn().shape == (1, 8, 2, 8)
    assert seen["check_values"] is check
    assert SpeedConfig(device="cpu").check_values is False


def test_fp32_ceiling_kernel_runs_every_fma():
    """The fp32 ceiling's kernel (run by the interpreter here): with x <- x + 1 each of its four chains per element
    takes exactly n_iters × UNROLL steps, so its output counts them."""
    from kalmix.bench.fma import run_chains
    x = torch.rand(2048)
    x0 = x.clone()
    run_chains(x, 3, 5, a=1.0, b=1.0)
    assert torch.allclose(x, 4 * x0 + (0 + 1 + 2 + 3) + 4 * 3 * 5)


def test_gka_rows_per_num_iters(monkeypatch):
    """--gka-iters makes one gated_kalmanet row per step count (the op's default keeps the plain name), each
    calling the op with its count and modelled with its FLOPs."""
    from kalmix.bench.speed import GKA_ITERS, _row
    seen = []
    real = ops.gated_kalmanet

    @functools.wraps(real)
    def spy(*a, **kw):
        seen.append(kw["num_iters"])
        return real(*a, **kw)
    monkeypatch.setitem(ops.SPECS, "gka", dataclasses.replace(ops.SPECS["gka"], fn=spy))
    cpu = torch.device("cpu")
    ts = targets(("gated_kalmanet",), ("torch",), 16, 2, 8, 4, cpu, gka_iters=(0, GKA_ITERS))
    assert [t.name for t in ts] == ["gated_kalmanet[num_iters=0]", "gated_kalmanet"]
    s = Shape(1, 8, 2, 8, 8)
    for t in ts:
        fn, _ = t.build(s, torch.float32, cpu)
        assert fn().shape == (1, 8, 2, 8)
    assert seen == [0, GKA_ITERS]
    ceil = {"copy_GBps": 1.0, "matmul_TFLOPs": 1.0, "fp32_TFLOPs": 1.0}
    rows = [_row(t, "fwd", "fp32", s, (1.0, 1.0, 1.0, 0.0, "ok"), ceil, {}, 4) for t in ts]
    assert [r["TFLOPs"] for r in rows] == [ops.SPECS["gka"].cost.flops(s, "fwd", num_iters=n) / 1e9
                                           for n in (0, GKA_ITERS)]
