"""Measured prototype: one LSTM layer's recurrence as a persistent CUDA C++ kernel
(``lstm_layer.cu``), compiled at run time with NVRTC, against the plain-PyTorch
reference, our Triton persistent kernel and cuDNN.

    PYTHONPATH=src python benchmarks/persistent_cuda/prototype.py --out DIR
        [--dtypes bf16,fp32] [--hidden 512,1024] [--batch 1,4,20] [--T 100]
        [--skip-check] [--skip-timing] [--budget-s 170]

On a GPU (sm_80 or later; written for sm_90): (1) checks the kernel's y, h_n and c_n
against ``reference_forward`` in float64 on the same rounded inputs, fp32 (TF32
products) and bf16, at hidden 96/520/1024 x batch 1/3/20 x T 1/35, with the
tolerances of ``TOLERANCE`` (cuDNN's own error is printed beside ours); (2) times the
layer forward (no grad) at T steps, reporting microseconds per step (total / T, CUDA
events around many back-to-back calls, median of rounds) for: the kernel alone
(``cuda-kernel``), the kernel less its grid barrier or less its recurrent product
(``cuda-kernel-no-barrier`` / ``-no-product``: wrong results, their differences to
``cuda-kernel`` are those parts' shares of a step), the kernel whose barrier runs no
``__threadfence`` (``cuda-kernel-no-fences``; the check reports its error too), the
layer with its input GEMM
(``cuda-layer``),
``mirrorgrad.nn.LSTM(impl="persistent")`` (``triton-persistent``) and
``torch.nn.LSTM`` (``cudnn``); (3) prints one table and writes ``prototype.json``.
Neither TF32 switch is touched: cuDNN's fp32 runs TF32 (``cudnn.allow_tf32`` is on by
default), as this kernel's fp32 does.

Compilation and launch go through ``cuda.bindings`` (cuda-python's NVRTC and driver
API): ``cuLaunchCooperativeKernel`` refuses a grid whose CTAs cannot all be resident,
so the kernel's spin barrier cannot wait on a CTA that never started; the kernel's
barrier also gives up after 1 s (status flag) and the host waits with a timeout, so no
mistake hangs. torch's ``torch.cuda._compile_kernel`` compiles with NVRTC too but has no
cooperative launch and is private. Nothing here is installed with mirrorgrad.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

SOURCE = Path(__file__).with_name("lstm_layer.cu")
KERNEL = "lstm_persistent_forward"
THREADS = 256  # lstm_layer.cu's WARPS * 32
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Largest error allowed against the float64 reference, as |ours - ref| / (1 + |ref|):
# bf16 rounds h to 8 bits every step (2^-9 ~ 2e-3 relative), fp32 runs the products in
# TF32 (2^-11 ~ 5e-4 relative per operand). A misplaced fragment gives errors of 0.1-1.
TOLERANCE = {"fp32": 3e-3, "bf16": 3e-2}
CHECK_HIDDEN = (96, 520, 1024)
CHECK_BATCH = (1, 3, 20)
CHECK_T = (1, 35)
# Variants of the kernel (lstm_layer.cu's macros): without its grid barrier or its
# recurrent product (wrong results: the step's time less theirs is that part's share),
# and with a barrier of release/acquire alone (no __threadfence; checked and timed).
VARIANTS = {
    "": {},
    "no-barrier": {"LSTM_LEAVE_OUT": 1},
    "no-product": {"LSTM_LEAVE_OUT": 2},
    "no-fences": {"LSTM_BARRIER_FENCES": 0},
}
HOST_WAIT_S = 30.0  # the longest the host waits for queued work before giving up


# ----------------------------------------------------------------------------------
# Compilation (no GPU needed)


@dataclass(frozen=True)
class Layout:
    """How a layer of ``hidden`` units spreads over CTAs: ``units`` per CTA (a multiple
    of 4, all four gates of each), ``ctas`` of them (one per SM at most)."""

    units: int
    ctas: int


def layout(hidden: int, sms: int) -> Layout:
    """The fewest units per CTA that a grid of at most ``sms`` CTAs covers ``hidden``
    with; ValueError where the kernel does not take ``hidden``."""
    if hidden <= 0 or hidden % 8:
        raise ValueError(f"hidden must be a positive multiple of 8, got {hidden}")
    units = 4 * math.ceil(math.ceil(hidden / sms) / 4)
    return Layout(units=units, ctas=math.ceil(hidden / units))


def compile_options(dtype: str, hidden: int, batch: int, units: int, arch: str,
                    variant: str = "") -> list[str]:  # fmt: skip
    """NVRTC options for one configuration of ``lstm_layer.cu`` (``variant``: a key of
    VARIANTS)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    return [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        "--ptxas-options=-v",  # registers and spills in the log
        f"-DLSTM_BF16={int(dtype == 'bf16')}",
        f"-DLSTM_HIDDEN={hidden}",
        f"-DLSTM_BATCH={batch}",
        f"-DLSTM_UNITS={units}",
        *(f"-D{macro}={value}" for macro, value in VARIANTS[variant].items()),
    ]


class CompileError(RuntimeError):
    """NVRTC rejected the source; the message holds its log."""


def _bindings():
    """cuda-python's (nvrtc, driver) modules: ``cuda.bindings`` (cuda-python 12.6 and
    later) or the older ``cuda`` names."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError:
        from cuda import cuda as driver
        from cuda import nvrtc
    return nvrtc, driver


def _nvrtc_check(nvrtc, result):
    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"NVRTC: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return rest[0] if len(rest) == 1 else rest


def compile_cubin(dtype: str, hidden: int, batch: int, units: int, arch: str = "sm_90",
                  variant: str = "") -> tuple[bytes, str]:  # fmt: skip
    """(cubin, NVRTC's log) of ``lstm_layer.cu`` for one configuration; CompileError
    with the log where it does not compile."""
    nvrtc, _ = _bindings()
    options = compile_options(dtype, hidden, batch, units, arch, variant)
    options = [o.encode() for o in options]
    program = _nvrtc_check(
        nvrtc, nvrtc.nvrtcCreateProgram(SOURCE.read_bytes(), SOURCE.name.encode(), 0, [], [])
    )
    try:
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetProgramLogSize(program))
        log = b" " * size
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetProgramLog(program, log))
        log = log.rstrip(b"\x00 ").decode()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"{SOURCE.name} ({dtype}, H={hidden}, B={batch}):\n{log}")
        size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBINSize(program))
        cubin = b" " * size
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(program, cubin))
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(program)


# ----------------------------------------------------------------------------------
# The reference


def reference_forward(x: Tensor, h0: Tensor, c0: Tensor, w_ih: Tensor, w_hh: Tensor,
                      b_ih: Tensor, b_hh: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(y [T,B,H], h_n [B,H], c_n [B,H]) of one LSTM layer in plain PyTorch, in the
    tensors' dtype: mirrorgrad's reference layer (ops/rnn/reference.py), torch.nn.LSTM's
    gate order and formula."""
    from mirrorgrad.ops.rnn import reference
    from mirrorgrad.ops.rnn.layer_call import LayerCall

    y, h_n, c_n, _ = reference.layer_forward(
        LayerCall("lstm", x, h0, c0, w_ih, w_hh, b_ih, b_hh, memory="recompute")
    )
    return y, h_n, c_n


# ----------------------------------------------------------------------------------
# The kernel on a GPU


def _driver_check(driver, result):
    err, *rest = result
    if err != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA driver: {name.decode() if name else err}")
    return rest[0] if len(rest) == 1 else rest


def wait(event: torch.cuda.Event, what: str, timeout_s: float = HOST_WAIT_S) -> None:
    """Wait for ``event`` at most ``timeout_s``: TimeoutError rather than a hang."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: GPU work not done after {timeout_s:.0f} s")
        time.sleep(1e-4)


class PersistentLstm:
    """``lstm_layer.cu`` compiled for one (dtype, hidden, batch) and loaded into torch's
    context; ``forward`` runs a layer, ``recurrence`` the kernel alone. Hidden sizes
    up to 1024 keep W_hh in registers without spills on 132 SMs (``spill_bytes``)."""

    def __init__(self, dtype: str, hidden: int, batch: int, device: torch.device,
                 variant: str = ""):  # fmt: skip
        _, driver = _bindings()
        self.driver, self.dtype, self.hidden, self.batch = driver, dtype, hidden, batch

        def call(function, *args):
            return _driver_check(driver, function(*args))

        props = torch.cuda.get_device_properties(device)
        arch = f"sm_{props.major}{props.minor}"
        if props.major < 8:
            raise RuntimeError(f"needs sm_80 or later (bf16 mma.sync), got {arch}")
        sms = props.multi_processor_count
        self.layout = layout(hidden, sms)
        torch.zeros(1, device=device)  # torch makes its (primary) context current
        call(driver.cuInit, 0)
        dev = call(driver.cuDeviceGet, device.index or 0)
        if not int(call(driver.cuCtxGetCurrent)):
            call(driver.cuCtxSetCurrent, call(driver.cuDevicePrimaryCtxRetain, dev))
        cooperative = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH
        if not call(driver.cuDeviceGetAttribute, cooperative, dev):
            raise RuntimeError("the device has no cooperative launch")
        start = time.perf_counter()
        cubin, self.log = compile_cubin(dtype, hidden, batch, self.layout.units, arch,
                                        variant)  # fmt: skip
        self.compile_s = time.perf_counter() - start
        self.module = call(driver.cuModuleLoadData, cubin)
        self.function = call(driver.cuModuleGetFunction, self.module, KERNEL.encode())
        attribute = driver.CUfunction_attribute
        self.registers = call(driver.cuFuncGetAttribute,
                              attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, self.function)  # fmt: skip
        self.spill_bytes = call(driver.cuFuncGetAttribute,
                                attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                                self.function)  # fmt: skip
        per_sm = call(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor, self.function,
                      THREADS, 0)  # fmt: skip
        if self.layout.ctas > per_sm * sms:
            raise RuntimeError(f"{self.layout.ctas} CTAs cannot all be resident "
                               f"({per_sm} per SM x {sms} SMs)")  # fmt: skip
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.status = torch.zeros(1, dtype=torch.int32, device=device)

    def recurrence(self, xw: Tensor, w_hh: Tensor, b_hh: Tensor, h0: Tensor, c0: Tensor,
                   y: Tensor, h_n: Tensor, c_n: Tensor) -> None:  # fmt: skip
        """Launch the kernel on torch's current stream: y, h_n, c_n from xw = x W_ih^T + b_ih
        [T,B,4H], W_hh [4H,H], b_hh (fp32) [4H], h0 and c0 [B,H]."""
        T = xw.shape[0]
        if xw.shape[1:] != (self.batch, 4 * self.hidden) or T == 0:
            raise ValueError(f"compiled for batch {self.batch}, hidden {self.hidden}; "
                             f"got xw {tuple(xw.shape)}")  # fmt: skip
        tensors = (xw, w_hh, b_hh, h0, c0, y, h_n, c_n)
        if any(not t.is_contiguous() for t in tensors):
            raise ValueError("the kernel takes contiguous tensors")
        self.counter.zero_()
        values = [ctypes.c_void_p(t.data_ptr()) for t in (*tensors, self.counter, self.status)]
        values.append(ctypes.c_int(T))
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        stream = self.driver.CUstream(torch.cuda.current_stream().cuda_stream)
        _driver_check(self.driver, self.driver.cuLaunchCooperativeKernel(
            self.function, self.layout.ctas, 1, 1, THREADS, 1, 1, 0, stream,
            ctypes.addressof(params)))  # fmt: skip

    def forward(self, x: Tensor, h0: Tensor, c0: Tensor, w_ih: Tensor, w_hh: Tensor,
                b_ih: Tensor, b_hh: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """(y, h_n, c_n) of the layer: the input GEMM (cuBLAS), then the kernel."""
        xw = F.linear(x, w_ih, b_ih)
        y = torch.empty(x.shape[0], x.shape[1], self.hidden, dtype=x.dtype, device=x.device)
        h_n, c_n = torch.empty_like(h0), torch.empty_like(c0)
        self.recurrence(xw, w_hh, b_hh.float(), h0, c0, y, h_n, c_n)
        return y, h_n, c_n

    def timed_out(self) -> bool:
        """Whether a barrier of an earlier launch gave up (its results are wrong)."""
        return bool(self.status.item())


# ----------------------------------------------------------------------------------
# Check and timing


def _layer(hidden: int, batch: int, T: int, dtype: torch.dtype, device, seed: int = 0):
    """torch.nn.LSTM(hidden, hidden) in ``dtype`` and an input, h0, c0 (not zero)."""
    torch.manual_seed(seed)
    lstm = torch.nn.LSTM(hidden, hidden).to(device=device, dtype=dtype)
    x = torch.randn(T, batch, hidden, device=device, dtype=dtype)
    h0 = (0.5 * torch.randn(batch, hidden, device=device)).to(dtype)
    c0 = (0.5 * torch.randn(batch, hidden, device=device)).to(dtype)
    return lstm, x, h0, c0


def _weights(lstm: torch.nn.LSTM) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0


def relative_error(ours: tuple[Tensor, ...], ref: tuple[Tensor, ...]) -> float:
    """max |ours - ref| / (1 + |ref|) over all tensors."""
    return max(((a.double() - b).abs() / (1 + b.abs())).max().item() for a, b in zip(ours, ref))


def check_case(dtype: str, hidden: int, batch: int, T: int, device) -> dict:
    """The kernel's and cuDNN's errors against the float64 reference on the same rounded
    weights and inputs."""
    lstm, x, h0, c0 = _layer(hidden, batch, T, DTYPES[dtype], device)
    weights = _weights(lstm)
    with torch.no_grad():
        exact = (t.double() for t in (x, h0, c0, *weights))
        ref = reference_forward(*exact)
        kernel = PersistentLstm(dtype, hidden, batch, device)
        ours = kernel.forward(x, h0, c0, *weights)
        unfenced = PersistentLstm(dtype, hidden, batch, device, variant="no-fences")
        ours_unfenced = unfenced.forward(x, h0, c0, *weights)
        y, (h_n, c_n) = lstm(x, (h0[None], c0[None]))
        cudnn = (y, h_n[0], c_n[0])
    done = torch.cuda.Event()
    done.record()
    wait(done, f"check {dtype} H={hidden} B={batch} T={T}")
    if kernel.timed_out() or unfenced.timed_out():
        raise RuntimeError(f"check {dtype} H={hidden} B={batch} T={T}: a grid barrier timed out")
    err = relative_error(ours, ref)
    return {"dtype": dtype, "hidden": hidden, "batch": batch, "T": T, "error": err,
            "cudnn_error": relative_error(cudnn, ref), "tolerance": TOLERANCE[dtype],
            "no_fences_error": relative_error(ours_unfenced, ref),
            "ok": err <= TOLERANCE[dtype], "registers": kernel.registers,
            "spill_bytes": kernel.spill_bytes, "ctas": kernel.layout.ctas,
            "units": kernel.layout.units}  # fmt: skip


def us_per_step(call, T: int, *, calls: int = 10, rounds: int = 5, warmup: int = 3) -> float:
    """Median over ``rounds`` of (GPU time of ``calls`` back-to-back calls) / (calls * T),
    in microseconds: the host queues ahead, so launch costs hide behind the GPU's work
    where that is longer."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        wait(end, "timing")
        samples.append(start.elapsed_time(end) * 1e3 / (calls * T))
    return statistics.median(samples)


def time_case(dtype: str, hidden: int, batch: int, T: int, device) -> dict:
    """Microseconds per step of each method at one shape (None where one fails: the
    reason is recorded)."""
    import mirrorgrad.nn

    lstm, x, h0, c0 = _layer(hidden, batch, T, DTYPES[dtype], device)
    weights = _weights(lstm)
    kernel = PersistentLstm(dtype, hidden, batch, device)
    variants = {name: PersistentLstm(dtype, hidden, batch, device, variant=name)
                for name in VARIANTS if name}  # fmt: skip
    ours = mirrorgrad.nn.LSTM(hidden, hidden, impl="persistent").to(device=device, dtype=x.dtype)
    ours.load_state_dict(lstm.state_dict())
    xw = F.linear(x, weights[0], weights[2])
    h_n, c_n = torch.empty_like(h0), torch.empty_like(c0)
    y = torch.empty(T, batch, hidden, device=device, dtype=x.dtype)
    b_hh = weights[3].float()
    state = (h0[None], c0[None])
    recurrence_args = (xw, weights[1], b_hh, h0, c0, y, h_n, c_n)
    methods = {"cuda-kernel": functools.partial(kernel.recurrence, *recurrence_args)}
    for name, variant in variants.items():
        methods[f"cuda-kernel-{name}"] = functools.partial(variant.recurrence, *recurrence_args)
    methods |= {
        "cuda-layer": lambda: kernel.forward(x, h0, c0, *weights),
        "triton-persistent": lambda: ours(x, state),
        "cudnn": lambda: lstm(x, state),
    }
    row = {"dtype": dtype, "hidden": hidden, "batch": batch, "T": T, "us_per_step": {},
           "errors": {}, "registers": kernel.registers, "spill_bytes": kernel.spill_bytes,
           "ctas": kernel.layout.ctas, "compile_s": round(kernel.compile_s, 2)}  # fmt: skip
    with torch.no_grad():
        for name, call in methods.items():
            try:
                row["us_per_step"][name] = round(us_per_step(call, T), 3)
            except Exception as e:  # one method failing leaves the others' numbers
                row["us_per_step"][name] = None
                row["errors"][name] = f"{type(e).__name__}: {e}"[:300]
    for name, launched in {"": kernel, **variants}.items():
        if launched.timed_out():
            method = f"cuda-kernel-{name}" if name else "cuda-kernel"
            row["errors"][method] = "a grid barrier timed out: its times are not valid"
    return row


def _table(rows: list[dict]) -> str:
    names = ("cuda-kernel", *(f"cuda-kernel-{v}" for v in VARIANTS if v), "cuda-layer",
             "triton-persistent", "cudnn")  # fmt: skip
    lines = ["us per step (forward, T steps; median):",
             "| dtype | H | B | " + " | ".join(names) + " | regs | spill B |",
             "|---" * (len(names) + 5) + "|"]  # fmt: skip
    for r in rows:
        cells = [("-" if r["us_per_step"].get(n) is None else f"{r['us_per_step'][n]:.2f}")
                 for n in names]  # fmt: skip
        lines.append(f"| {r['dtype']} | {r['hidden']} | {r['batch']} | " + " | ".join(cells)
                     + f" | {r['registers']} | {r['spill_bytes']} |")  # fmt: skip
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _failure(shape: dict, error: Exception) -> dict:
    """A row for a case that raised: its shape and the error (with the traceback printed,
    so that one run on a GPU tells what went wrong)."""
    traceback.print_exc()
    return {**shape, "ok": False, "exception": f"{type(error).__name__}: {error}"[:2000]}


def run_checks(dtypes: list[str], device: torch.device) -> list[dict]:
    """``check_case`` at every shape of CHECK_HIDDEN x CHECK_BATCH x CHECK_T."""
    cases = []
    for dtype in dtypes:
        for hidden in CHECK_HIDDEN:
            for batch in CHECK_BATCH:
                for T in CHECK_T:
                    shape = {"dtype": dtype, "hidden": hidden, "batch": batch, "T": T}
                    try:
                        case = check_case(dtype, hidden, batch, T, device)
                    except Exception as e:  # the other shapes still tell something
                        case = _failure(shape, e)
                    cases.append(case)
                    print(f"check {dtype} H={hidden} B={batch} T={T}: {_errors(case)} "
                          f"{'ok' if case['ok'] else 'FAILED'}", flush=True)  # fmt: skip
    return cases


def _errors(case: dict) -> str:
    if "exception" in case:
        return case["exception"]
    return (f"error {case['error']:.2e} (no fences {case['no_fences_error']:.2e}, "
            f"cuDNN {case['cudnn_error']:.2e}, tolerance {case['tolerance']:.0e})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for prototype.json")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--hidden", default="512,1024", help="hidden sizes timed")
    parser.add_argument("--batch", default="1,4,20", help="batch sizes timed")
    parser.add_argument("--T", type=int, default=100, help="steps timed")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="timed rows stop being started after this many seconds")  # fmt: skip
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if unknown := set(dtypes) - set(DTYPES):
        parser.error(f"unknown dtypes {sorted(unknown)}; choose from {sorted(DTYPES)}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.monotonic()
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "tolerance": TOLERANCE, "checks": [], "timings": [], "skipped": []}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "prototype.json"
    if not args.skip_check:
        result["checks"] = run_checks(dtypes, device)
        path.write_text(json.dumps(result, indent=2))
    if not args.skip_timing:
        for dtype in dtypes:
            for hidden in _ints(args.hidden):
                for batch in _ints(args.batch):
                    shape = {"dtype": dtype, "hidden": hidden, "batch": batch, "T": args.T}
                    if time.monotonic() - started > args.budget_s:
                        result["skipped"].append(shape)
                        continue
                    try:
                        row = time_case(dtype, hidden, batch, args.T, device)
                    except Exception as e:
                        row = _failure(shape, e)
                    result["timings"].append(row)
                    print(json.dumps(row), flush=True)
                    path.write_text(json.dumps(result, indent=2))
        print(_table([r for r in result["timings"] if "exception" not in r]))
    if result["skipped"]:
        print(f"not timed (past --budget-s): {result['skipped']}")
    result["seconds"] = round(time.monotonic() - started, 1)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} ({result['seconds']} s)")
    failed = [c for c in result["checks"] if not c["ok"]] + [
        r for r in result["timings"] if "exception" in r
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
