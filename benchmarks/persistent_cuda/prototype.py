"""Measured prototype: one LSTM layer's recurrence as persistent CUDA C++ kernels,
forward and backward (the package's ``cuda_lstm.cu``), compiled at run time with NVRTC,
against the plain-PyTorch reference, our Triton persistent kernel and cuDNN.

    PYTHONPATH=src python benchmarks/persistent_cuda/prototype.py --out DIR
        [--dtypes bf16,fp32] [--hidden 512,1024] [--batch 1,4,20] [--T 100]
        [--skip-check] [--skip-timing | --check-only] [--budget-s 170]

On a GPU (sm_80 or later; written for sm_90): (1) checks the forward kernel's y, h_n
and c_n against ``reference_forward`` and the backward kernel's gradients (dx, dh0, dc0,
dW_ih, dW_hh, db_ih, db_hh: the kernel, then one GEMM each) against torch autograd
through it (``reference_backward``), in float64 on the same rounded inputs, fp32 (TF32
products) and bf16, at hidden 96/520/1024 x batch 1/3/20 x T 1/35, with the tolerances
of ``TOLERANCE`` or, for a gradient, cuDNN's own error on it where that is larger
(cuDNN's errors are printed beside ours; where a gradient fails,
every gradient's error is printed); (2) times the layer at T steps, reporting
microseconds per step (total / T, CUDA events around many back-to-back calls, median of
rounds), forward (no grad) and backward, for: the kernel alone (``cuda-kernel``), the
kernel less its grid barrier or less its recurrent product (``cuda-kernel-no-barrier`` /
``-no-product``: wrong results, their differences to ``cuda-kernel`` are those parts'
shares of a step), the kernel whose barrier runs no ``__threadfence``
(``cuda-kernel-no-fences``; the check reports its error too), the forward kernel
writing the backward's stash (``cuda-kernel-stash``), the layer with its GEMMs
(``cuda-layer``: the input GEMM before the forward kernel; the dx and weight GEMMs after
the backward kernel), ``mirrorgrad.nn.LSTM(impl="cuda")`` (``cuda-module``: this kernel
as users get it), ``mirrorgrad.nn.LSTM(impl="persistent")`` (``triton-persistent``)
and ``torch.nn.LSTM`` (``cudnn``), called and captured in CUDA Graphs (``-graphed``: no
host time), whose backward is (forward and backward) less the forward, both recording
autograd; (3) prints two tables and writes ``prototype.json``.
Neither TF32 switch is touched: cuDNN's fp32 runs TF32 (``cudnn.allow_tf32`` is on by
default), as this kernel's fp32 does.

The kernels, their compilation and their launch are the package's
(``mirrorgrad.ops.rnn.cuda_lstm_kernel``, what ``mirrorgrad.nn.LSTM(impl="cuda")`` runs);
this script adds the timing variants, the checks and the tables. It needs cuda-python
(``pip install mirrorgrad[cuda]``). The host waits with a timeout, so no mistake hangs.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from mirrorgrad.ops.rnn import cuda_lstm_kernel
from mirrorgrad.ops.rnn.cuda_lstm_kernel import (
    BACKWARD_KERNEL,
    DTYPES,
    FORWARD_KERNEL,
    CudaLstmKernel,
)

# Largest error allowed against the float64 reference, as |ours - ref| / (1 + |ref|):
# bf16 rounds h to 8 bits every step (2^-9 ~ 2e-3 relative), fp32 runs the products in
# TF32 (2^-11 ~ 5e-4 relative per operand). A misplaced fragment gives errors of 0.1-1.
TOLERANCE = {"fp32": 3e-3, "bf16": 3e-2}
CHECK_HIDDEN = (96, 520, 1024)
CHECK_BATCH = (1, 3, 20)
CHECK_T = (1, 35)
# Variants of the kernel (cuda_lstm.cu's macros): without its grid barrier or its
# recurrent product (wrong results: the step's time less theirs is that part's share),
# and with a barrier of release/acquire alone (no __threadfence; checked and timed).
VARIANTS = {
    "": {},
    "no-barrier": {"LSTM_LEAVE_OUT": 1},
    "no-product": {"LSTM_LEAVE_OUT": 2},
    "no-fences": {"LSTM_BARRIER_FENCES": 0},
}
HOST_WAIT_S = 30.0  # the longest the host waits for queued work before giving up
# mirrorgrad.nn.LSTM's implementations timed (column name -> impl), beside cuDNN
MODULE_IMPLS = {"cuda-module": "cuda", "triton-persistent": "persistent"}


# ----------------------------------------------------------------------------------
# Compilation (no GPU needed): the package's, with the timing variants by name


def _defines(variant: str) -> dict[str, int]:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    return VARIANTS[variant]


def compile_options(dtype: str, hidden: int, batch: int, units: int, arch: str,
                    variant: str = "") -> list[str]:  # fmt: skip
    """NVRTC options for one configuration of ``cuda_lstm.cu`` (``variant``: a key of
    VARIANTS)."""
    defines = _defines(variant)
    return cuda_lstm_kernel.compile_options(dtype, hidden, batch, units, arch, defines)


def compile_cubin(dtype: str, hidden: int, batch: int, units: int, arch: str = "sm_90",
                  variant: str = "") -> tuple[bytes, str]:  # fmt: skip
    """(cubin, NVRTC's log) of ``cuda_lstm.cu`` for one configuration and variant."""
    return cuda_lstm_kernel.compile_cubin(dtype, hidden, batch, units, arch, _defines(variant))


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


GRADIENTS = ("dx", "dh0", "dc0", "dW_ih", "dW_hh", "db_ih", "db_hh")


def reference_backward(x: Tensor, h0: Tensor, c0: Tensor, w_ih: Tensor, w_hh: Tensor,
                       b_ih: Tensor, b_hh: Tensor, dy: Tensor, dh_n: Tensor,
                       dc_n: Tensor) -> tuple[Tensor, ...]:  # fmt: skip
    """The gradients named by GRADIENTS of ``reference_forward`` (torch autograd, in the
    tensors' dtype) given dy [T,B,H], dh_n and dc_n [B,H]."""
    inputs = [t.detach().requires_grad_() for t in (x, h0, c0, w_ih, w_hh, b_ih, b_hh)]
    with torch.enable_grad():
        outputs = reference_forward(*inputs)
        return torch.autograd.grad(outputs, inputs, (dy, dh_n, dc_n))


# ----------------------------------------------------------------------------------
# The kernel on a GPU



def wait(event: torch.cuda.Event, what: str, timeout_s: float = HOST_WAIT_S) -> None:
    """Wait for ``event`` at most ``timeout_s``: TimeoutError rather than a hang."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: GPU work not done after {timeout_s:.0f} s")
        time.sleep(1e-4)


@functools.cache
def compiled(dtype: str, hidden: int, batch: int, device: torch.device,
             variant: str = "") -> CudaLstmKernel:  # fmt: skip
    """The package's kernel for one configuration and variant, built once a run (the
    checks at T 1 and 35 and the timed rows share them; each case clears its timeout
    flag)."""
    return CudaLstmKernel(dtype, hidden, batch, device, tuple(_defines(variant).items()))



# ----------------------------------------------------------------------------------
# Check and timing


def _layer(hidden: int, batch: int, T: int, dtype: torch.dtype, device, seed: int = 0):
    """torch.nn.LSTM(hidden, hidden) in ``dtype`` and an input, h0, c0 (not zero)."""
    # Drawn on the CPU: a failed capture can leave the CUDA generator unusable, and one
    # method's failure must not take the later shapes with it.
    torch.manual_seed(seed)
    lstm = torch.nn.LSTM(hidden, hidden).to(device=device, dtype=dtype)
    lstm.flatten_parameters()
    x = torch.randn(T, batch, hidden).to(device=device, dtype=dtype)
    h0 = (0.5 * torch.randn(batch, hidden)).to(device=device, dtype=dtype)
    c0 = (0.5 * torch.randn(batch, hidden)).to(device=device, dtype=dtype)
    return lstm, x, h0, c0


def _output_gradients(x: Tensor, hidden: int, seed: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """dy [T,B,H], dh_n and dc_n [B,H] (not zero) in x's dtype and device."""
    torch.manual_seed(seed)
    T, B = x.shape[:2]
    dy, dh_n, dc_n = (torch.randn(*shape).to(device=x.device, dtype=x.dtype)
                      for shape in ((T, B, hidden), (B, hidden), (B, hidden)))  # fmt: skip
    return dy, dh_n, dc_n


def _weights(lstm: torch.nn.LSTM) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0


def relative_error(ours: tuple[Tensor, ...], ref: tuple[Tensor, ...]) -> float:
    """max |ours - ref| / (1 + |ref|) over all tensors."""
    return max(((a.double() - b).abs() / (1 + b.abs())).max().item() for a, b in zip(ours, ref))


def gradient_errors(ours: tuple[Tensor, ...], ref: tuple[Tensor, ...]) -> dict[str, float]:
    """``relative_error`` of each gradient, by its name in GRADIENTS."""
    return {name: relative_error((a,), (b,)) for name, a, b in zip(GRADIENTS, ours, ref)}


def _cudnn_gradients(lstm: torch.nn.LSTM, x: Tensor, h0: Tensor, c0: Tensor, dy: Tensor,
                     dh_n: Tensor, dc_n: Tensor) -> tuple[Tensor, ...]:  # fmt: skip
    """torch.nn.LSTM's gradients, in the order of GRADIENTS."""
    leaves = [t.detach().requires_grad_() for t in (x, h0, c0)]
    with torch.enable_grad():
        y, (h_n, c_n) = lstm(leaves[0], (leaves[1][None], leaves[2][None]))
        return torch.autograd.grad((y, h_n[0], c_n[0]), [*leaves, *_weights(lstm)],
                                   (dy, dh_n, dc_n))  # fmt: skip


def _forward_and_backward(kernel: CudaLstmKernel, x: Tensor, h0: Tensor, c0: Tensor,
                          weights: tuple[Tensor, ...], dy: Tensor, dh_n: Tensor,
                          dc_n: Tensor) -> tuple[tuple[Tensor, ...], ...]:  # fmt: skip
    """((y, h_n, c_n), gradients in the order of GRADIENTS) from the kernels."""
    y, h_n, c_n, stash = kernel.forward(x, h0, c0, *weights, stash=True)
    grads = kernel.backward(x, h0, c0, weights[0], weights[1], y, stash, dy, dh_n, dc_n)
    return (y, h_n, c_n), grads


def check_case(dtype: str, hidden: int, batch: int, T: int, device) -> dict:
    """The kernels' and cuDNN's errors against the float64 reference (forward, and the
    gradients of GRADIENTS) on the same rounded weights, inputs and output gradients."""
    lstm, x, h0, c0 = _layer(hidden, batch, T, DTYPES[dtype], device)
    weights = _weights(lstm)
    outputs_grad = _output_gradients(x, hidden)
    exact = [t.detach().double() for t in (x, h0, c0, *weights)]
    with torch.no_grad():
        ref = reference_forward(*exact)
    ref_grads = reference_backward(*exact, *(t.double() for t in outputs_grad))
    kernel = compiled(dtype, hidden, batch, device)
    unfenced = compiled(dtype, hidden, batch, device, "no-fences")
    for launched in (kernel, unfenced):
        launched.clear_timed_out()
    with torch.no_grad():
        ours, ours_grads = _forward_and_backward(kernel, x, h0, c0, weights, *outputs_grad)
        ours_unfenced, unfenced_grads = _forward_and_backward(unfenced, x, h0, c0, weights,
                                                              *outputs_grad)  # fmt: skip
        y, (h_n, c_n) = lstm(x, (h0[None], c0[None]))
        cudnn = (y, h_n[0], c_n[0])
    try:  # cuDNN's errors are context for ours, not part of the check
        cudnn_grads = _cudnn_gradients(lstm, x, h0, c0, *outputs_grad)
        cudnn_backward_errors = gradient_errors(cudnn_grads, ref_grads)
    except Exception as e:
        print(f"cuDNN's backward raised {type(e).__name__}: {e}", flush=True)
        cudnn_backward_errors = dict.fromkeys(GRADIENTS, math.nan)
    done = torch.cuda.Event()
    done.record()
    wait(done, f"check {dtype} H={hidden} B={batch} T={T}")
    if kernel.timed_out() or unfenced.timed_out():
        raise RuntimeError(f"check {dtype} H={hidden} B={batch} T={T}: a grid barrier timed out")
    err = relative_error(ours, ref)
    backward_errors = gradient_errors(ours_grads, ref_grads)
    worst = max(backward_errors, key=backward_errors.get)
    tolerance = TOLERANCE[dtype]
    # A gradient passes within the tolerance or within cuDNN's own error on it: bf16
    # weight gradients sum T x B rounded products, and cuDNN's miss 3e-2 at B20 T35 too.
    backward_ok = all(error <= max(tolerance, case_cudnn) for error, case_cudnn in
                      zip(backward_errors.values(), cudnn_backward_errors.values()))  # fmt: skip
    return {"dtype": dtype, "hidden": hidden, "batch": batch, "T": T, "error": err,
            "cudnn_error": relative_error(cudnn, ref), "tolerance": tolerance,
            "no_fences_error": relative_error(ours_unfenced, ref),
            "backward_error": backward_errors[worst], "worst_gradient": worst,
            "backward_errors": backward_errors,
            "cudnn_backward_errors": cudnn_backward_errors,
            "no_fences_backward_error": relative_error(unfenced_grads, ref_grads),
            "forward_ok": err <= tolerance, "backward_ok": backward_ok,
            "ok": err <= tolerance and backward_ok,
            "registers": kernel.registers, "spill_bytes": kernel.spill_bytes,
            "ctas": kernel.layout.ctas, "units": kernel.layout.units}  # fmt: skip


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


def _autograd_calls(module: torch.nn.Module, x: Tensor, h0: Tensor, c0: Tensor, dy: Tensor,
                    dh_n: Tensor, dc_n: Tensor):  # fmt: skip
    """(forward, forward and backward) of an nn.LSTM-like module as calls: the forward
    with autograd recording (what the backward needs saved), then all of GRADIENTS."""
    leaves = [t.detach().requires_grad_() for t in (x, h0, c0)]
    inputs = [*leaves, *module.parameters()]

    def forward():
        y, (h_n, c_n) = module(leaves[0], (leaves[1][None], leaves[2][None]))
        return y, h_n[0], c_n[0]

    def forward_and_backward():
        torch.autograd.grad(forward(), inputs, (dy, dh_n, dc_n))

    return forward, forward_and_backward


def graphed(call):
    """``call`` captured in one CUDA Graph (warm-up calls on a side stream, then the
    capture: mirrorgrad._cuda_graphs.capture), as its replay: the GPU's time without the
    host's launches and autograd."""
    from mirrorgrad._cuda_graphs import capture

    graph, _ = capture(call)
    return graph.replay


def _time_methods(methods: dict, T: int, times: dict, errors: dict, prefix: str = "",
                  graph: bool = False) -> None:  # fmt: skip
    """``times[name] = us_per_step(call)`` for each method (each captured first where
    ``graph``), None (and the reason in ``errors``) where one raises: one failing leaves
    the others' numbers."""
    for name, call in methods.items():
        try:
            times[name] = round(us_per_step(graphed(call) if graph else call, T), 3)
        except Exception as e:
            times[name] = None
            errors[prefix + name] = f"{type(e).__name__}: {e}"[:300]


def time_case(dtype: str, hidden: int, batch: int, T: int, device) -> dict:
    """Microseconds per step of each method at one shape, forward and backward (None
    where one fails: the reason is recorded)."""
    import mirrorgrad.nn

    lstm, x, h0, c0 = _layer(hidden, batch, T, DTYPES[dtype], device)
    weights = _weights(lstm)
    kernel = compiled(dtype, hidden, batch, device)
    variants = {name: compiled(dtype, hidden, batch, device, name) for name in VARIANTS if name}
    for launched in (kernel, *variants.values()):
        launched.clear_timed_out()
    modules = {}  # what users call: mirrorgrad.nn.LSTM with each impl, and cuDNN
    for name, impl in MODULE_IMPLS.items():
        modules[name] = mirrorgrad.nn.LSTM(hidden, hidden, impl=impl).to(device, x.dtype)
        modules[name].load_state_dict(lstm.state_dict())
    modules["cudnn"] = lstm
    xw = F.linear(x, weights[0], weights[2])
    h_n, c_n = torch.empty_like(h0), torch.empty_like(c0)
    y = torch.empty(T, batch, hidden, device=device, dtype=x.dtype)
    stash = torch.empty(T, batch, 5 * hidden, device=device, dtype=x.dtype)
    b_hh = weights[3].float()
    state = (h0[None], c0[None])
    recurrence_args = (xw, weights[1], b_hh, h0, c0, y, h_n, c_n)
    forward = {"cuda-kernel": functools.partial(kernel.recurrence, *recurrence_args)}
    for name, variant in variants.items():
        forward[f"cuda-kernel-{name}"] = functools.partial(variant.recurrence, *recurrence_args)
    forward |= {
        "cuda-kernel-stash": functools.partial(kernel.recurrence, *recurrence_args, stash),
        "cuda-layer": lambda: kernel.forward(x, h0, c0, *weights),
    }
    called = {name: functools.partial(module, x, state) for name, module in modules.items()}
    forward |= called
    row = {"dtype": dtype, "hidden": hidden, "batch": batch, "T": T, "us_per_step": {},
           "backward_us_per_step": {}, "autograd_us_per_step": {},
           "graphed_autograd_us_per_step": {}, "errors": {},
           "registers": kernel.registers, "spill_bytes": kernel.spill_bytes,
           "ctas": kernel.layout.ctas, "compile_s": round(kernel.compile_s, 2)}  # fmt: skip
    with torch.no_grad():
        _time_methods(forward, T, row["us_per_step"], row["errors"])
        _time_methods({f"{name}-graphed": call for name, call in called.items()}, T,
                      row["us_per_step"], row["errors"], graph=True)  # fmt: skip

    # Backward: the kernel alone on the stash of a forward, its variants, and the layer's
    # backward (the kernel, then the GEMMs of dx and the weights).
    dy, dh_n, dc_n = _output_gradients(x, hidden)
    with torch.no_grad():
        kernel.recurrence(*recurrence_args, stash)
    dgates = torch.empty(T, batch, 4 * hidden, device=device, dtype=x.dtype)
    dh0, dc0 = torch.empty_like(h0), torch.empty_like(c0)
    backward_args = (weights[1], stash, c0, dy, dh_n, dc_n, dgates, dh0, dc0)
    backward = {"cuda-kernel": functools.partial(kernel.backward_recurrence, *backward_args)}
    for name, variant in variants.items():
        backward[f"cuda-kernel-{name}"] = functools.partial(variant.backward_recurrence,
                                                            *backward_args)  # fmt: skip
    backward["cuda-layer"] = lambda: kernel.backward(x, h0, c0, weights[0], weights[1], y,
                                                     stash, dy, dh_n, dc_n)  # fmt: skip
    with torch.no_grad():
        _time_methods(backward, T, row["backward_us_per_step"], row["errors"], "backward ")
    # The modules' backward: (forward and backward) less the forward, both with autograd
    # recording, timed alike: called back to back, and captured in CUDA Graphs.
    autograd = {}
    for name, module in modules.items():
        one, both = _autograd_calls(module, x, h0, c0, dy, dh_n, dc_n)
        autograd |= {f"{name}-forward": one, f"{name}-forward-backward": both}
    with torch.enable_grad():
        _time_methods(autograd, T, row["autograd_us_per_step"], row["errors"])
        _time_methods(autograd, T, row["graphed_autograd_us_per_step"], row["errors"],
                      "graphed ", graph=True)  # fmt: skip
    for key, suffix in (("autograd_us_per_step", ""), ("graphed_autograd_us_per_step", "-graphed")):
        for name in modules:
            one, both = (row[key][f"{name}-{part}"] for part in ("forward", "forward-backward"))
            row["backward_us_per_step"][name + suffix] = (None if one is None or both is None
                                                          else round(both - one, 3))  # fmt: skip
    for name, launched in {"": kernel, **variants}.items():
        if launched.timed_out():
            method = f"cuda-kernel-{name}" if name else "cuda-kernel"
            row["errors"][method] = "a grid barrier timed out: its times are not valid"
    return row


_MODULE_COLUMNS = (*MODULE_IMPLS, "cudnn",
                   *(f"{name}-graphed" for name in (*MODULE_IMPLS, "cudnn")))  # fmt: skip
FORWARD_COLUMNS = ("cuda-kernel", *(f"cuda-kernel-{v}" for v in VARIANTS if v),
                   "cuda-kernel-stash", "cuda-layer", *_MODULE_COLUMNS)  # fmt: skip
BACKWARD_COLUMNS = ("cuda-kernel", *(f"cuda-kernel-{v}" for v in VARIANTS if v),
                    "cuda-layer", *_MODULE_COLUMNS)  # fmt: skip


def _table(rows: list[dict], key: str = "us_per_step") -> str:
    """The µs-per-step table of the forward (``key`` "us_per_step") or the backward
    ("backward_us_per_step")."""
    forward = key == "us_per_step"
    names = FORWARD_COLUMNS if forward else BACKWARD_COLUMNS
    kernel = FORWARD_KERNEL if forward else BACKWARD_KERNEL
    title = ("us per step (forward, T steps; median; -graphed: captured in a CUDA Graph):"
             if forward else
             "us per step (backward, T steps; median; the modules and cudnn: "
             "forward+backward less forward, both recording autograd; -graphed: each "
             "captured in a CUDA Graph):")  # fmt: skip
    lines = [title, "| dtype | H | B | " + " | ".join(names) + " | regs | spill B |",
             "|---" * (len(names) + 5) + "|"]  # fmt: skip
    for r in rows:
        cells = [("-" if r[key].get(n) is None else f"{r[key][n]:.2f}") for n in names]
        lines.append(f"| {r['dtype']} | {r['hidden']} | {r['batch']} | " + " | ".join(cells)
                     + f" | {r['registers'][kernel]} | {r['spill_bytes'][kernel]} |")  # fmt: skip
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
    """One check's errors: the forward's and its worst gradient's, each with the
    no-fences kernel's and cuDNN's beside it; every gradient's where one failed."""
    if "exception" in case:
        return case["exception"]
    worst = case["worst_gradient"]
    text = (f"forward {case['error']:.2e} (no fences {case['no_fences_error']:.2e}, "
            f"cuDNN {case['cudnn_error']:.2e}); backward {case['backward_error']:.2e} "
            f"in {worst} (no fences {case['no_fences_backward_error']:.2e}, cuDNN's "
            f"{worst} {case['cudnn_backward_errors'][worst]:.2e}); "
            f"tolerance {case['tolerance']:.0e}")  # fmt: skip
    if not case["ok"]:
        text += "; by gradient (ours / cuDNN): " + ", ".join(
            f"{name} {error:.2e} / {case['cudnn_backward_errors'][name]:.2e}"
            for name, error in case["backward_errors"].items())  # fmt: skip
    return text


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
    parser.add_argument("--skip-timing", "--check-only", action="store_true",
                        help="the checks alone (about a third of the run)")  # fmt: skip
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
        timed = [r for r in result["timings"] if "exception" not in r]
        print(_table(timed))
        print(_table(timed, "backward_us_per_step"))
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
