"""The persistent CUDA LSTM prototype (benchmarks/persistent_cuda/): its plain-PyTorch
reference (forward and gradients) against torch.nn.LSTM in float64, its launch layout,
the kernel source compiled by NVRTC for sm_90 (skipped where cuda-python's NVRTC is not
installed), and the harness's checks and timing rows with the GPU parts replaced."""

import ctypes
import functools
import re

import pytest
import torch
from benchmarks.persistent_cuda import prototype

import mirrorgrad.nn
from mirrorgrad.ops.rnn import cuda_lstm_kernel


@pytest.mark.parametrize(("hidden", "batch", "T"), [(8, 1, 1), (16, 3, 7), (24, 20, 5)])
def test_reference_matches_torch_lstm_in_float64(hidden, batch, T):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(hidden, hidden).double()
    x = torch.randn(T, batch, hidden, dtype=torch.float64)
    h0 = torch.randn(batch, hidden, dtype=torch.float64)
    c0 = torch.randn(batch, hidden, dtype=torch.float64)
    with torch.no_grad():
        y, (h_n, c_n) = lstm(x, (h0[None], c0[None]))
        ours = prototype.reference_forward(x, h0, c0, *prototype._weights(lstm))
    for got, want in zip(ours, (y, h_n[0], c_n[0])):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert prototype.relative_error(ours, (y, h_n[0], c_n[0])) < 1e-12


@pytest.mark.parametrize(("hidden", "batch", "T"), [(8, 1, 1), (16, 3, 7)])
def test_reference_gradients_match_torch_lstm_in_float64(hidden, batch, T):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(hidden, hidden).double()
    x, dy = (torch.randn(T, batch, hidden, dtype=torch.float64) for _ in range(2))
    h0, c0, dh_n, dc_n = (torch.randn(batch, hidden, dtype=torch.float64) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (x, h0, c0)]
    y, (h_n, c_n) = lstm(leaves[0], (leaves[1][None], leaves[2][None]))
    want = torch.autograd.grad((y, h_n[0], c_n[0]), [*leaves, *prototype._weights(lstm)],
                               (dy, dh_n, dc_n))  # fmt: skip
    weights = [w.detach() for w in prototype._weights(lstm)]
    got = prototype.reference_backward(x, h0, c0, *weights, dy, dh_n, dc_n)
    assert len(got) == len(prototype.GRADIENTS)
    for name, a, b in zip(prototype.GRADIENTS, got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    # the GEMMs after the backward kernel give the same from the gates' gradients
    gates = [t.detach().requires_grad_() for t in (x, h0, c0, *weights)]
    outputs = prototype.reference_forward(*gates)
    dgates = _gate_gradients(gates, outputs, (dy, dh_n, dc_n))
    dx, dw_ih, dw_hh, db = cuda_lstm_kernel.input_and_weight_gradients(
        x, h0, outputs[0].detach(), weights[0], dgates)  # fmt: skip
    for a, b in zip((dx, dw_ih, dw_hh, db, db), (want[0], *want[3:])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _gate_gradients(inputs, outputs, output_grads):
    """The gradient of every step's gate pre-activations [T,B,4H], by autograd: the gates
    are x W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh, so this is the gradient of b_hh's use in
    each step, read through a per-step copy of b_hh."""
    x, h0, c0, w_ih, w_hh, b_ih, b_hh = inputs
    T, B = x.shape[:2]
    per_step = b_hh.detach().expand(T, B, -1).clone().requires_grad_()
    h, c = h0, c0
    ys = []
    for t in range(T):
        pre = x[t] @ w_ih.t() + b_ih + h @ w_hh.t() + per_step[t]
        i, f, g, o = pre.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        ys.append(h)
    (dgates,) = torch.autograd.grad((torch.stack(ys), h, c), [per_step], output_grads)
    return dgates


@pytest.mark.parametrize(("hidden", "sms"), [(96, 132), (512, 132), (520, 132), (1024, 132),
                                             (1024, 114), (8, 4), (4096, 132)])  # fmt: skip
def test_layout_covers_hidden_with_one_cta_per_sm_at_most(hidden, sms):
    layout = cuda_lstm_kernel.layout(hidden, sms)
    assert layout.units % 4 == 0 and layout.ctas <= sms
    assert layout.ctas * layout.units >= hidden > (layout.ctas - 1) * layout.units
    # the fewest units per CTA: four fewer would need more CTAs than SMs
    assert layout.units == 4 or -(-hidden // (layout.units - 4)) > sms


def test_layout_and_options_reject_what_the_kernel_does_not_take():
    with pytest.raises(ValueError, match="multiple of 8"):
        cuda_lstm_kernel.layout(100, 132)
    with pytest.raises(ValueError, match="dtype"):
        prototype.compile_options("fp16", 512, 4, 4, "sm_90")
    with pytest.raises(ValueError, match="variant"):
        prototype.compile_options("bf16", 512, 4, 4, "sm_90", "no-cell")


def _nvrtc_or_skip():
    try:
        nvrtc, _ = cuda_lstm_kernel.bindings()
        err, *_ = nvrtc.nvrtcVersion()  # loads libnvrtc
    except Exception as e:  # no cuda-python, or no libnvrtc for it to load
        pytest.skip(f"NVRTC through cuda-python is not available: {type(e).__name__}: {e}")
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS


def _spill_bytes(log: str) -> dict[str, int]:
    """Spill stores of each kernel in ptxas's log, by kernel name."""
    found = re.findall(r"entry function '(\w+)'.*?(\d+) bytes spill stores", log, re.DOTALL)
    return {kernel: int(bytes_) for kernel, bytes_ in found}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("hidden", "batch"), [(96, 1), (520, 3), (512, 4), (1024, 20)])
def test_kernels_compile_for_sm90_without_warnings_or_spills(dtype, hidden, batch):
    _nvrtc_or_skip()
    layout = cuda_lstm_kernel.layout(hidden, 132)  # an H100's SMs
    for variant in prototype.VARIANTS:
        cubin, log = prototype.compile_cubin(dtype, hidden, batch, layout.units, "sm_90",
                                             variant)  # fmt: skip
        assert cubin[:4] == b"\x7fELF"
        assert "warning" not in log.lower(), (variant, log)
        spills = _spill_bytes(log)
        kernels = {cuda_lstm_kernel.FORWARD_KERNEL, cuda_lstm_kernel.BACKWARD_KERNEL}
        assert set(spills) == kernels, log
        assert spills[cuda_lstm_kernel.FORWARD_KERNEL] == 0, (variant, log)
        # The backward at fp32 H = 1024, batch 20 spills a few words of the cell's state
        # around the product (nvdisasm: 36 bytes, none inside the MMA loop); W's
        # fragments alone are 512 bytes a thread there, so they stay in registers.
        assert spills[cuda_lstm_kernel.BACKWARD_KERNEL] <= 64, (variant, log)


def test_compile_error_carries_nvrtc_log(monkeypatch, tmp_path):
    _nvrtc_or_skip()
    broken = tmp_path / "broken.cu"
    broken.write_text('extern "C" __global__ void lstm_persistent_forward() { undeclared; }\n')
    monkeypatch.setattr(cuda_lstm_kernel, "SOURCE", broken)
    with pytest.raises(cuda_lstm_kernel.CompileError, match="undeclared"):
        prototype.compile_cubin("bf16", 512, 1, 4)


class _ReferenceKernel:
    """Stands in for CudaLstmKernel on the CPU: the reference's results (the backward's
    rounded to the tensors' dtype), no launch."""

    def __init__(self, dtype, hidden, batch, device, defines=()):
        self.layout = cuda_lstm_kernel.layout(hidden, 132)
        kernels = (cuda_lstm_kernel.FORWARD_KERNEL, cuda_lstm_kernel.BACKWARD_KERNEL)
        self.registers, self.spill_bytes = dict.fromkeys(kernels, 128), dict.fromkeys(kernels, 0)
        self.compile_s = 0.0

    def forward(self, *args, stash=False):
        self.args = args
        outputs = prototype.reference_forward(*args)
        return (*outputs, None) if stash else outputs

    def backward(self, x, h0, c0, w_ih, w_hh, y, stash, dy, dh_n, dc_n):
        exact = [t.detach().double() for t in (*self.args, dy, dh_n, dc_n)]
        return [g.to(x.dtype) for g in prototype.reference_backward(*exact)]

    def recurrence(self, *args):
        pass

    def backward_recurrence(self, *args):
        pass

    def timed_out(self):
        return False

    def clear_timed_out(self):
        pass


class _PlainLstm(torch.nn.LSTM):
    """Stands in for mirrorgrad.nn.LSTM (whose persistent kernel the CPU would interpret)."""

    def __init__(self, *args, impl, **kwargs):
        super().__init__(*args, **kwargs)


class _Event:
    """Stands in for torch.cuda.Event: every span 1 ms."""

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1.0


@pytest.mark.slow
def test_check_and_timing_rows_from_the_harness_on_cpu(monkeypatch, capsys):
    # The harness's own code (shapes, records, table) runs with the GPU parts replaced.
    monkeypatch.setattr(prototype, "CudaLstmKernel", _ReferenceKernel)
    # a cache of this test's own, so that no stand-in outlives it
    monkeypatch.setattr(prototype, "compiled", functools.cache(prototype.compiled.__wrapped__))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(prototype, "graphed", lambda call: call)  # no CUDA Graphs here
    monkeypatch.setattr(mirrorgrad.nn, "LSTM", _PlainLstm)
    monkeypatch.setattr(prototype, "CHECK_HIDDEN", (16,))
    monkeypatch.setattr(prototype, "CHECK_BATCH", (3,))
    monkeypatch.setattr(prototype, "CHECK_T", (4,))
    cpu = torch.device("cpu")
    (case,) = prototype.run_checks(["bf16"], cpu)
    assert case["ok"] and 0 < case["error"] < case["tolerance"] and case["cudnn_error"] > 0
    assert 0 < case["backward_error"] < case["tolerance"]
    assert set(case["backward_errors"]) == set(case["cudnn_backward_errors"]) == set(
        prototype.GRADIENTS)  # fmt: skip
    assert "backward" in capsys.readouterr().out
    row = prototype.time_case("fp32", 16, 2, 10, cpu)
    # 10 calls in 1 ms over 10 steps each: 10 us a step
    assert set(row["us_per_step"].values()) == {10.0} and not row["errors"]
    assert set(row["us_per_step"]) == set(prototype.FORWARD_COLUMNS) == {
        "cuda-kernel", "cuda-kernel-no-barrier", "cuda-kernel-no-product",
        "cuda-kernel-no-fences", "cuda-kernel-stash", "cuda-layer", "cuda-module",
        "triton-persistent", "cudnn", "cuda-module-graphed", "triton-persistent-graphed",
        "cudnn-graphed"}  # fmt: skip
    # The modules' backward: (forward and backward) less forward, 10 - 10
    assert row["backward_us_per_step"] == {**dict.fromkeys(
        ("cuda-kernel", "cuda-kernel-no-barrier", "cuda-kernel-no-product",
         "cuda-kernel-no-fences", "cuda-layer"), 10.0), "cuda-module": 0.0,
        "triton-persistent": 0.0, "cudnn": 0.0, "cuda-module-graphed": 0.0,
        "triton-persistent-graphed": 0.0, "cudnn-graphed": 0.0}  # fmt: skip
    assert set(row["graphed_autograd_us_per_step"].values()) == {10.0}
    assert set(row["backward_us_per_step"]) == set(prototype.BACKWARD_COLUMNS)
    assert "| fp32 | 16 | 2 | 10.00 |" in prototype._table([row])
    backward = prototype._table([row], "backward_us_per_step")
    assert "backward" in backward and "| fp32 | 16 | 2 | 10.00 |" in backward


def test_a_failing_case_is_recorded_and_the_others_still_run(monkeypatch, capsys):
    monkeypatch.setattr(prototype, "CHECK_HIDDEN", (16, 24))
    monkeypatch.setattr(prototype, "CHECK_BATCH", (1,))
    monkeypatch.setattr(prototype, "CHECK_T", (1,))

    def check_case(dtype, hidden, batch, T, device):
        if hidden == 16:
            raise RuntimeError("CUDA driver: CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE")
        return {"ok": True, "error": 0.0, "no_fences_error": 0.0, "cudnn_error": 0.0,
                "tolerance": 1.0, "backward_error": 0.0, "worst_gradient": "dx",
                "no_fences_backward_error": 0.0, "cudnn_backward_errors": {"dx": 0.0}}  # fmt: skip

    monkeypatch.setattr(prototype, "check_case", check_case)
    failed, passed = prototype.run_checks(["fp32"], torch.device("cpu"))
    assert not failed["ok"] and "TOO_LARGE" in failed["exception"] and passed["ok"]
    assert "check fp32 H=16 B=1 T=1: RuntimeError" in capsys.readouterr().out


def _kernel_parameters(name: str) -> list[str]:
    """The parameter names of kernel ``name`` in cuda_lstm.cu, in order."""
    source = cuda_lstm_kernel.SOURCE.read_text()
    start = source.index("(", source.index(f"{name}(")) + 1
    signature = re.sub(r"//[^\n]*", "", source[start : source.index(")", start)])
    return [re.findall(r"\w+", parameter)[-1] for parameter in signature.split(",")]


class _RecordingDriver:
    """Stands in for cuda.bindings' driver: records each launch's argument values (the
    addresses the kernel would get, and T; a struct of ``struct_words`` addresses where
    the parameter is one of ``structs``)."""

    structs = ("weights", "outputs")

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, struct_words: int = 0):
        self.launches = []
        self.struct_words = struct_words

    def CUstream(self, handle):
        return handle

    def cuLaunchCooperativeKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, params):
        assert (gz, by, bz) == (1, 1, 1)
        names = _kernel_parameters(function)
        slots = (ctypes.c_void_p * len(names)).from_address(params)
        values = []
        for name, slot in zip(names[:-1], slots[:-1]):
            if name in self.structs:
                words = (ctypes.c_void_p * self.struct_words).from_address(slot)
                values.append([w or 0 for w in words])
            else:
                values.append(ctypes.c_void_p.from_address(slot).value or 0)
        values.append(ctypes.c_int.from_address(slots[-1]).value)
        self.launches.append((function, (gx, gy), bx, smem, values))
        return (self.CUresult.CUDA_SUCCESS,)


@pytest.mark.parametrize(("batch", "forward_shared"), [(3, 0), (40, 81920)])
def test_launches_pass_the_kernels_parameters_in_their_order(monkeypatch, batch, forward_shared):
    """Each tensor is named as the kernel's parameter it must arrive as; the grid is a
    group's CTAs by the batch groups (batch 40: 2 groups of 20 rows), the forward's
    dynamic shared memory its own."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7}))
    hidden, T = 16, 5
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = object.__new__(cuda_lstm_kernel.CudaLstmKernel)
    kernel.device_index = 0
    kernel.driver, kernel.hidden, kernel.batch = _RecordingDriver(), hidden, batch
    kernel.dtype = "fp32"  # the tensors' (the stash's too)
    kernel.layout = cuda_lstm_kernel.batch_layout(hidden, batch, 132)
    kernel.grid = kernel.layout.grid
    kernel.shared_bytes = {cuda_lstm_kernel.FORWARD_KERNEL: forward_shared,
                           cuda_lstm_kernel.BACKWARD_KERNEL: 0}  # fmt: skip
    kernel.functions = {name: name for name in (cuda_lstm_kernel.FORWARD_KERNEL,
                                                cuda_lstm_kernel.BACKWARD_KERNEL)}  # fmt: skip
    kernel.counter, kernel.status = (torch.zeros(1, dtype=torch.int32) for _ in range(2))
    shapes = {"xw": (T, batch, 4 * hidden), "w_hh": (4 * hidden, hidden), "b_hh": (4 * hidden,),
              "y": (T, batch, hidden), "dy": (T, batch, hidden), "stash": (T, batch, 5 * hidden),
              "dgates": (T, batch, 4 * hidden)}  # fmt: skip
    tensors = {name: torch.zeros(shapes.get(name, (batch, hidden))) for name in
               ("xw", "w_hh", "b_hh", "h0", "c0", "y", "h_n", "c_n", "stash", "dy", "dh_n",
                "dc_n", "dgates", "dh0", "dc0")}  # fmt: skip
    tensors |= {"counter": kernel.counter, "status": kernel.status}
    forward = ("xw", "w_hh", "b_hh", "h0", "c0", "y", "h_n", "c_n", "stash")
    kernel.recurrence(**{name: tensors[name] for name in forward})
    kernel.recurrence(**{name: tensors[name] for name in forward[:-1]})  # no stash: null
    backward = ("w_hh", "stash", "c0", "dy", "dh_n", "dc_n", "dgates", "dh0", "dc0")
    kernel.backward_recurrence(**{name: tensors[name] for name in backward})

    launches = kernel.driver.launches
    assert [launch[0] for launch in launches] == [cuda_lstm_kernel.FORWARD_KERNEL] * 2 + [
        cuda_lstm_kernel.BACKWARD_KERNEL]  # fmt: skip
    for i, (function, ctas, threads, shared, values) in enumerate(launches):
        assert ctas == (kernel.layout.ctas, 1 if batch <= 32 else 2)
        assert (threads, shared) == (cuda_lstm_kernel.THREADS, forward_shared if i < 2 else 0)
        names = _kernel_parameters(function)
        assert names[-1] == "T" and values[-1] == T
        want = [0 if (i, name) == (1, "stash") else tensors[name].data_ptr()
                for name in names[:-1]]  # fmt: skip
        assert values[:-1] == want, (function, names)


def test_the_wavefront_launch_passes_its_parameters_in_their_order(monkeypatch):
    """Each layer's weights and outputs as the structs the kernel takes by value, its grid
    (every layer's CTAs) and its dynamic shared memory."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7}))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    hidden, batch, T, L = 16, 3, 5, 3
    kernel = object.__new__(cuda_lstm_kernel.CudaLstmKernel)
    kernel.device_index, kernel.layers = 0, L
    kernel.driver, kernel.hidden, kernel.batch = _RecordingDriver(2 * L), hidden, batch
    kernel.layout = cuda_lstm_kernel.wavefront_layout(hidden, L, 132)
    kernel.grid = (kernel.layout.ctas * L, 1)
    kernel.shared_bytes = {cuda_lstm_kernel.WAVEFRONT_KERNEL:
                           cuda_lstm_kernel.wavefront_shared_bytes("bf16", hidden, 4)}  # fmt: skip
    kernel.functions = {cuda_lstm_kernel.WAVEFRONT_KERNEL: cuda_lstm_kernel.WAVEFRONT_KERNEL}
    kernel.counter, kernel.status = (torch.zeros(1, dtype=torch.int32) for _ in range(2))

    def zeros(*shape):
        return torch.zeros(shape)

    w_ih = [zeros(4 * hidden, hidden) for _ in range(L - 1)]
    w_hh = [zeros(4 * hidden, hidden) for _ in range(L)]
    ys = [zeros(T, batch, hidden) for _ in range(L)]
    stash = [zeros(T, batch, 5 * hidden) for _ in range(L)]
    tensors = {"xw": zeros(T, batch, 4 * hidden), "bias": zeros(L, 4 * hidden),
               "h0": zeros(L, batch, hidden), "c0": zeros(L, batch, hidden),
               "mask": zeros(L - 1, T, batch, hidden), "dropped": zeros(L - 1, T, batch, hidden),
               "h_n": zeros(L, batch, hidden), "c_n": zeros(L, batch, hidden),
               "counter": kernel.counter, "status": kernel.status}  # fmt: skip
    args = {name: tensors[name] for name in ("xw", "bias", "h0", "c0", "mask", "dropped",
                                              "h_n", "c_n")}  # fmt: skip
    kernel.wavefront(w_ih=w_ih, w_hh=w_hh, y=ys, stash=stash, **args)
    unmasked = args | {"mask": None, "dropped": None}
    kernel.wavefront(w_ih=w_ih, w_hh=w_hh, y=ys, stash=None, **unmasked)

    tensors["weights"] = [0] + [t.data_ptr() for t in (*w_ih, *w_hh)]  # W_ih of layer 0: null
    for i, (function, ctas, threads, shared, values) in enumerate(kernel.driver.launches):
        assert (ctas, threads, shared) == (kernel.grid, cuda_lstm_kernel.THREADS,
                                           kernel.shared_bytes[function])  # fmt: skip
        tensors["outputs"] = [t.data_ptr() for t in ys] + (
            [t.data_ptr() for t in stash] if i == 0 else [0] * L)  # fmt: skip
        names = _kernel_parameters(function)
        assert names[-1] == "T" and values[-1] == T

        want = [0 if i == 1 and name in ("mask", "dropped") else
                tensors[name] if isinstance(tensors[name], list) else tensors[name].data_ptr()
                for name in names[:-1]]  # fmt: skip
        assert values[:-1] == want, names
