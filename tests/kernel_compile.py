"""Compile every Triton kernel kalmix launches for an H100 (sm_90) on a machine without a GPU.

The CPU suite runs the kernels in Triton's interpreter, which does not check them as the compiler does (a
loop-carried variable that changes type runs there and fails to compile). Two processes:

    TRITON_INTERPRET=1 python -m tests.kernel_compile record LAUNCHES
    python -m tests.kernel_compile compile LAUNCHES RESULT

``record`` makes the package's launches at small sizes in the interpreter and writes each one to LAUNCHES: the
kernel, its arguments (a tensor as its dtype and 16-byte alignment, what the launcher specialises on) and the launch
options. ``compile`` (without the interpreter, which replaces the ``triton.jit`` functions) compiles each launch as
Triton's launcher would on an H100 (``JITFunction.warmup`` under a driver that names the target) and writes to
RESULT (JSON) every ``@triton.jit`` kernel under kalmix/, those no launch reached and the failures. Each launch goes
to TTIR (the front end: types, shapes, every constexpr branch), and one per kernel through TTGIR, LLIR and PTX to
ptxas's cubin. The launches recorded with the suite's triton compile with another one too (``PYTHONPATH`` to a
triton 3.6, the GPU machines', on the second command).

The launches are those of a GPU: ``operand_dtype`` answers as on a GPU (16-bit operands stay 16-bit) and the
chunked delta rule takes its "narrow" configurations too (a small batch on a GPU with many multiprocessors). Most
calls only record: the kernels do not run and their outputs stay unwritten (NaN), so recording takes seconds; one
call per op and dtype runs them, with the ops' value checks, which read what a kernel computed.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import itertools
import json
import os
import pickle
import textwrap
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ARCH = 90                   # an H100
ROOT = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.bfloat16, torch.float64)     # activations: fp32, the 16-bit path, fp64
H, K, V, D_MODEL = 2, 16, 16, 32    # heads of one 16-wide tile; not 1, which the launcher makes a constant
LENS = (3, 0, 4)            # packed sequences, one empty


@dataclass(frozen=True)
class Pointer:
    """A tensor argument as the launcher specialises on it: its dtype and whether its address is 16-byte
    aligned (``data_ptr`` answers an address with that alignment)."""
    dtype: torch.dtype
    aligned: bool

    def data_ptr(self) -> int:
        return 0 if self.aligned else 8


@dataclass(frozen=True)
class Launch:
    """One launch: the kernel ("module.name"), its positional arguments and its keywords (constexprs and launch
    options such as num_warps), tensors as ``Pointer``."""
    kernel: str
    args: tuple
    kwargs: tuple


def _arg(x):
    return Pointer(x.dtype, x.data_ptr() % 16 == 0) if isinstance(x, torch.Tensor) else x


# ------------------------------------------------------------------------------------------------ phase 1: record
class Recorder:
    """Records every launch of a ``triton.jit`` function while active (TRITON_INTERPRET=1); ``execute`` (False:
    the kernel does not run) is read at each launch."""

    def __init__(self, monkeypatch):
        from triton.runtime.interpreter import InterpretedFunction
        self.launches: dict[Launch, None] = {}
        self.execute = False
        run = InterpretedFunction.run

        def record(fn, *args, grid, warmup, **kwargs):
            self.launches[Launch(f"{fn.fn.__module__}.{fn.fn.__name__}", tuple(map(_arg, args)),
                                 tuple(sorted((k, _arg(v)) for k, v in kwargs.items())))] = None
            return run(fn, *args, grid=grid, warmup=warmup, **kwargs) if self.execute else None

        monkeypatch.setattr(InterpretedFunction, "run", record)

    @contextlib.contextmanager
    def executing(self):
        self.execute = True
        try:
            yield
        finally:
            self.execute = False


def _leaves(args, state):
    states = () if state is None else tuple(state) if isinstance(state, tuple) else (state,)
    return [*args, *states]


def _backward(outs, leaves):
    outs = [x for x in outs if isinstance(x, torch.Tensor) and x.requires_grad]
    torch.autograd.grad(sum(x.float().sum() for x in outs), leaves, allow_unused=True)


def _op_call(spec, dtype, packed, with_state, grad, outputs, heads=(H, K, V), check_values=False, B=2, T=5,
             **options):
    """One call of the op of ``spec`` on its test inputs in ``dtype`` (states fp32, fp64 for fp64) with ``heads``
    (H, K, V) and keyword ``options``: B rows of T tokens or ``LENS`` packed; ``outputs``: its optional outputs
    and final state requested (and differentiated); ``grad``: then its backward."""
    from kalmix.ops.common.testing import flatten_outputs
    gen = torch.Generator().manual_seed(0)
    B, T = (1, sum(LENS)) if packed else (B, T)
    args = [a.to(dtype) for a in spec.inputs(B, T, *heads, torch.float64, gen)]
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    state = spec.random_state(len(LENS) if packed else B, *heads, state_dtype, gen) if with_state else None
    if grad:
        args = [a.requires_grad_() for a in args]
        state = None if state is None else tuple(s.requires_grad_() for s in state) if isinstance(state, tuple) \
            else state.requires_grad_()
    cu = torch.tensor([0, *itertools.accumulate(LENS)]) if packed else None
    flags = {flag: outputs for flag in spec.outputs if flag is not None}
    with torch.set_grad_enabled(grad):
        out = spec.fn(*args, initial_state=state, output_final_state=outputs, cu_seqlens=cu, impl="triton",
                      check_values=check_values, **flags, **{**spec.test_kwargs, **options})
    if grad:
        _backward(flatten_outputs(out), _leaves(args, state))


# (packed, with_state, grad, outputs): every combination, and a training step's and an inference call's
EVERY_CASE = tuple(itertools.product((False, True), repeat=4))
TRAIN_AND_INFER = ((False, False, True, False), (True, True, False, True))


def _op_calls(spec, cases=EVERY_CASE, heads=(H, K, V), dtypes=DTYPES, T=5, **options):
    """The op's calls of ``cases`` in each of ``dtypes`` (rows of T tokens), and a decoding step (T = 1)."""
    for dtype in dtypes:
        for case in cases:
            _op_call(spec, dtype, *case, heads=heads, T=T, **options)
        _op_call(spec, dtype, False, True, False, True, heads=heads, T=1, **options)


def _options(table: dict, name: str):
    """Each keyword option of ``table[name]`` at each of its values, one at a time ({} first: the defaults)."""
    yield {}
    for key, values in table.get(name, {}).items():
        yield from ({key: value} for value in values)


def _layer_calls(spec, **options):
    """A layer's calls on its op's Triton impl: a training step in fp32 and under bf16 autocast (fp32
    parameters), one over packed documents, and a prefill then one decoding step."""
    torch.manual_seed(0)
    layer = spec.layer(D_MODEL, impl="triton", **spec.size_kwargs(heads=H, head_dim=K, d_state=K), **options)
    x = torch.randn(2, 5, D_MODEL, requires_grad=True)
    leaves = [x, *layer.parameters()]
    for autocast in (False, True):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = layer(x)[0]
        _backward([out], leaves)
    _backward([layer(x[:1], cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32))[0]], leaves)
    with torch.no_grad():
        _, _, cache = layer(x[:, :4], use_cache=True)
        layer(x[:, 4:], past_key_values=cache, use_cache=True)


def _other_calls():
    """The launchers no op or layer reaches on a CPU: the short convolution's (CUDA only in ShortConv), the
    norms' (CUDA only in GatedRMSNorm and l2_normalize), the LM loss's (CUDA only in linear_cross_entropy), the
    Kaczmarz step's (fla's engine, CUDA only) and ``kalmix speed``'s FMA rate."""
    from kalmix.bench.fma import run_chains
    from kalmix.layers.fused import l2_normalize, rms_norm, short_conv
    from kalmix.models.loss_kernels import row_lse, softmax_grad_
    from kalmix.ops.kaczmarz.beta_triton import kaczmarz_step, step_extrema
    for dtype in DTYPES:
        params = torch.float64 if dtype == torch.float64 else torch.float32
        x = torch.randn(2, 9, D_MODEL, dtype=dtype, requires_grad=True)
        w = torch.randn(D_MODEL, 4, dtype=params, requires_grad=True)
        for bias, silu, pos_dtype in itertools.product((None, torch.zeros(D_MODEL, dtype=params)), (False, True),
                                                       (None, torch.int32, torch.int64)):
            pos = None if pos_dtype is None else torch.arange(9, dtype=pos_dtype).repeat(2, 1)
            _backward([short_conv(x, w, bias, silu, pos)], [x, w])
        for z in (None, torch.randn(2, 9, 2 * D_MODEL, dtype=dtype)[..., D_MODEL:].requires_grad_()):
            _backward([rms_norm(x, w[:, 0], z)], [x, w] + ([] if z is None else [z]))
        _backward([l2_normalize(x, 1e-6)], [x])
        z, idx = torch.randn(6, 37, dtype=dtype), torch.randint(0, 37, (6,))
        lse, _ = row_lse(z, idx)
        softmax_grad_(z, idx, lse, torch.rand(6, dtype=lse.dtype))
        k = torch.randn(2, 5, H, K, dtype=dtype, requires_grad=True)
        eta, g = torch.rand(2, 5, H, dtype=dtype, requires_grad=True), -torch.rand(2, 5, H, dtype=dtype)
        for ext in (None, step_extrema(eta.numel(), k.device)):
            _backward([kaczmarz_step(k, eta, 1e-6, g, ext)], [k, eta])
    run_chains(torch.rand(1024), n_iters=2, unroll=2)


def record() -> list[Launch]:
    """Every launch the package makes, as on a GPU (module docstring); under TRITON_INTERPRET=1."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _record(monkeypatch)


def _record(monkeypatch) -> list[Launch]:
    import kalmix.ops.common.delta_triton as delta
    import kalmix.ops.common.triton_utils as utils
    from kalmix.layers import MIXER_SPECS
    from kalmix.layers.kalman import NOISE_PARAMS
    from kalmix.ops import SPECS
    from kalmix.ops.common.testing import poison_empty
    from kalmix.ops.vla.op import WRITE_KEYS
    # keyword options that select other kernel code
    op_options = {"gka": {"num_iters": (0,)}, "vla": {"write_key": WRITE_KEYS}}
    layer_options = {"kalman": {"noise_param": NOISE_PARAMS}}
    ops = [spec for spec in SPECS.values() if "triton" in spec.impls]
    layers = [spec for spec in MIXER_SPECS.values() if spec.requires is None and spec.op in ops]
    poison_empty(monkeypatch)
    recorder = Recorder(monkeypatch)
    kernel_modules()            # imported under the interpreter first: some read INTERPRET when they load
    monkeypatch.setattr(utils, "INTERPRET", False)          # operand_dtype: 16-bit operands as on a GPU
    with recorder.executing():
        for spec, dtype in itertools.product(ops, DTYPES):
            _op_call(spec, dtype, False, False, False, False, check_values=True, B=1, T=2)
    for spec in ops:
        for options in _options(op_options, spec.name):
            _op_calls(spec, **options)
        # the op's heads in its layer at 128-wide heads (d_model 256, d_state 16) and rows of 1100 tokens, in
        # the dtypes of training: the launches those sizes choose (a GKA solve's tail kernel, VLA's carry in parts)
        _op_calls(spec, TRAIN_AND_INFER, spec.bench_heads(H, 128, 256, 16), (torch.float32, torch.bfloat16), T=1100)
    for spec in layers:
        for options in _options(layer_options, spec.name):
            _layer_calls(spec, **options)
    _other_calls()
    # the delta rule's sequential kernels take narrow V blocks where (sequences × heads × V blocks) would leave a
    # GPU's multiprocessors idle, as at these sizes (on a CPU they never do)
    monkeypatch.setattr(delta, "_narrow", lambda dtype, *_: "narrow" in delta._config(dtype))
    for spec in ops:
        _op_calls(spec)
    return list(recorder.launches)


# ----------------------------------------------------------------------------------------------- phase 2: compile
class _H100Driver:
    """What Triton's launcher asks the driver, answered for an H100 (nothing else is asked before a launch)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", ARCH, 32)


def _jit(obj):
    """The JITFunction behind a kernel object (through autotune / heuristics wrappers), or None."""
    from triton.runtime.jit import JITFunction, KernelInterface
    while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj if isinstance(obj, JITFunction) else None


def _referenced(fn, namespace) -> list:
    """The module-level objects the source of ``fn`` names (``name`` and ``module.name``)."""
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
        if isinstance(node, ast.Name) and node.id in namespace:
            found.append(namespace[node.id])
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and inspect.ismodule(namespace.get(node.value.id))):
            found.append(getattr(namespace[node.value.id], node.attr, None))
    return found


def kernel_modules() -> list:
    """The modules under kalmix/ that define ``triton.jit`` functions, imported."""
    import kalmix
    package = Path(kalmix.__file__).parent
    return [importlib.import_module(".".join(path.relative_to(package.parent).with_suffix("").parts))
            for path in sorted(package.rglob("*.py")) if "triton.jit" in path.read_text()]


def jit_kernels() -> list[str]:
    """Every ``triton.jit`` function under kalmix/ that no other one calls: the kernels ("module.name")."""
    fns = {}
    for module in kernel_modules():
        for obj in vars(module).values():
            jf = _jit(obj)
            if jf is not None and jf.fn.__module__ == module.__name__:
                fns[f"{module.__name__}.{jf.fn.__name__}"] = jf
    called = {id(_jit(obj)) for jf in fns.values() for obj in _referenced(jf.fn, jf.fn.__globals__)}
    return sorted(name for name, jf in fns.items() if id(jf) not in called)


def _kernel(name: str):
    module, _, attr = name.rpartition(".")
    return _jit(getattr(importlib.import_module(module), attr))


class _FrontEndDone(Exception):
    """Raised where a front-end compilation stops: after TTIR."""


def _stop(src, metadata):
    raise _FrontEndDone


def _front_end_only(*args):
    """Triton's stage hook: the stages after TTIR end the compilation (``_FrontEndDone``). Called with no
    arguments (newer tritons), it names the cut pipeline for the caches' keys."""
    if not args:
        return "front-end-only", "front-end-only"
    stages = args[1]
    names = list(stages)
    for name in names[names.index("ttir") + 1:]:
        stages[name] = _stop


def _full_depth(launches: list[Launch]) -> set[Launch]:
    """Per kernel, the launch that compiles the most code (the most tensors given and flags on), on the tensor
    cores' path where it has one (16-bit tensors), the first such: it goes through every stage."""
    def weight(launch):
        values = [*launch.args, *(v for _, v in launch.kwargs)]
        return (any(isinstance(v, Pointer) and v.dtype.itemsize == 2 for v in values),
                sum(isinstance(v, Pointer) or v is True for v in values))

    best = {}
    for launch in launches:
        if launch.kernel not in best or weight(launch) > weight(best[launch.kernel]):
            best[launch.kernel] = launch
    return set(best.values())


def _compile(job: tuple[Launch, bool]) -> dict | None:
    """Compile one launch for an H100 (``full``: through ptxas, else to TTIR); None, or its failure: the kernel,
    its constexprs and launch options, and the compiler's message."""
    from triton import knobs
    from triton.runtime.driver import driver
    launch, full = job
    driver.set_active(_H100Driver())
    knobs.runtime.add_stages_inspection_hook = None if full else _front_end_only
    jf = _kernel(launch.kernel)
    try:
        jf.warmup(*launch.args, grid=(1,), **dict(launch.kwargs))
    except _FrontEndDone:
        pass
    except Exception as e:              # the compiler's error, whatever its class: reported, not raised
        constexprs = {p.name: a for p, a in zip(jf.params, launch.args) if p.is_constexpr} | dict(launch.kwargs)
        return dict(kernel=launch.kernel, error=f"{type(e).__name__}: {e}",
                    launch=", ".join(f"{k}={v!r}" for k, v in constexprs.items()) + ("" if full else " (to TTIR)"))
    return None


def compile_launches(launches: list[Launch], workers: int) -> list[dict]:
    """Phase 2 (without the interpreter): compile every launch for an H100 in ``workers`` processes, to TTIR
    (the front end: types, shapes and each constexpr branch) and ``_full_depth``'s through TTGIR, LLIR, PTX and
    ptxas's cubin (Triton's on-disk cache keeps those). Returns the failures, one per kernel and message: the
    kernel, the compiler's message and the constexprs and launch options of each launch that failed so."""
    jobs = [(launch, launch in full) for full in [_full_depth(launches)] for launch in launches]
    jobs.sort(key=lambda job: not job[1])           # the slow ones first, spread over the workers
    with ProcessPoolExecutor(workers) as pool:
        results = [f for f in pool.map(_compile, jobs) if f is not None]
    failures = {}
    for f in results:
        failures.setdefault((f["kernel"], f["error"]), dict(kernel=f["kernel"], error=f["error"], launches=[]))
        failures[f["kernel"], f["error"]]["launches"].append(f["launch"])
    return list(failures.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.kernel_compile", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("record", help="record the launches (TRITON_INTERPRET=1)").add_argument("launches")
    compile_ = sub.add_parser("compile", help="compile the recorded launches for sm_90 (no TRITON_INTERPRET)")
    compile_.add_argument("launches")
    compile_.add_argument("result")
    args = parser.parse_args(argv)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if interpreting != (args.command == "record"):
        parser.error(f"`{args.command}` runs {'with' if args.command == 'record' else 'without'} TRITON_INTERPRET=1, "
                     f"got TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")
    if args.command == "record":
        Path(args.launches).write_bytes(pickle.dumps(record()))
        return
    launches = pickle.loads(Path(args.launches).read_bytes())
    kernels = jit_kernels()
    reached = {launch.kernel for launch in launches}
    workers = max(1, min(len(os.sched_getaffinity(0)), 8))
    result = dict(kernels=kernels, unreached=[k for k in kernels if k not in reached],
                  failures=compile_launches(launches, workers))
    Path(args.result).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    from tests.kernel_compile import main as run      # its classes pickled by their module's name, not __main__'s
    run()
