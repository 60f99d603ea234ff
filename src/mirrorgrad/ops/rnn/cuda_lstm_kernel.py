"""The persistent CUDA C++ LSTM kernels (``cuda_lstm.cu``): compiled at run time with
NVRTC and launched cooperatively through ``cuda.bindings`` (cuda-python), on torch's
current stream.

``cuda_lstm.cu`` runs one layer's recurrence, all T steps in one launch, forward
(writing the backward's stash where asked) and backward, or (compiled with
LSTM_LAYERS) a stack's forward as one wavefront launch; its comments are the design.
This module builds it for one (dtype, hidden, batch) on one GPU (``compiled``: once a
process), launches it (``CudaLstmKernel``) and runs a layer with the GEMMs around the
launches (``forward``, ``backward``); cuda_persistent.py plugs it into the RNN op and
benchmarks/persistent_cuda/ measures it.

Why ``cuda.bindings``: ``cuLaunchCooperativeKernel`` refuses a grid whose CTAs cannot all
be resident, so the kernel's spin barrier cannot wait on a CTA that never started; the
barrier also gives up after 1 s (a status flag, ``timed_out``). torch's own NVRTC entry
(``torch.cuda._compile_kernel``) has no cooperative launch and is private. Nothing here
imports ``cuda.bindings`` until a kernel is built: without it ``bindings()`` raises
ImportError naming ``pip install mirrorgrad[cuda]``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

SOURCE = Path(__file__).with_name("cuda_lstm.cu")
FORWARD_KERNEL = "lstm_persistent_forward"
BACKWARD_KERNEL = "lstm_persistent_backward"
WAVEFRONT_KERNEL = "lstm_wavefront_forward"
THREADS = 256  # cuda_lstm.cu's WARPS * 32
WARPS = 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The most 32-bit words of W_hh (forward) or W_hh^T (backward) a thread holds as MMA
# fragments: 128 is fp32 at H = 1024 on 132 SMs, the largest layer measured without
# spilling W (ptxas, sm_90). Larger slices would need W in shared memory: not built.
MAX_W_WORDS = 128
# The most batch rows one CTA takes (a batch group's): each batch tile of 8 rows adds a
# step's h fragments to the forward's registers. At 32, fp32 H = 1024 uses 246 (forward)
# and 250 (backward) of 255 registers without spills (NVRTC 13.5, sm_90). A larger batch
# runs in batch groups of at most this many rows (``batch_layout``).
MAX_BATCH = 32
# Static shared memory a CTA may declare: 48 KiB, less the grid barrier's flag (an int,
# beside the partial sums: ptxas refused 49,152 bytes of sums at bf16 H = 1024, batch 32,
# 12 units a CTA on 108 SMs). The forward's sums past it go to dynamic shared memory
# (LSTM_DYNAMIC_SUMS); the backward's stay static.
SHARED_BYTES = 48 * 1024 - 4
# cuda_lstm.cu's COUNTER_STRIDE: a batch group's barrier counter every 32 words.
COUNTER_STRIDE = 32
# The wavefront's registers, in 32-bit words a thread: W_hh's fragments counted twice
# plus a step's two inputs' fragments (h_{t-1} and the layer's input, K_PER_WARP x
# N_TILES x 2 each). Fit to ptxas (NVRTC 13.5, sm_90) over H 256-1024, batch 8-32, 2 and
# 3 layers: every layout at or under 256 spilled nothing, every one over spilled.
MAX_WAVEFRONT_WORDS = 256
# The wavefront's W_ih fragments are dynamic shared memory beside the static sums: at
# most what a CTA may opt in to on sm_90 (227 KiB; the driver's attribute decides at load).
SHARED_OPTIN_BYTES = 227 * 1024
INSTALL_HINT = "pip install mirrorgrad[cuda]"


class CompileError(RuntimeError):
    """NVRTC rejected the source; the message holds its log."""


@dataclass(frozen=True)
class Layout:
    """How a layer of ``hidden`` units spreads over CTAs: ``units`` per CTA (a multiple
    of 4, all four gates of each), ``ctas`` of them (one per SM at most)."""

    units: int
    ctas: int


@dataclass(frozen=True)
class BatchLayout(Layout):
    """A layer at one batch: ``groups`` batch groups (blockIdx.y) of ``group_batch`` rows
    (the last one may have fewer), each ``ctas`` CTAs of ``units`` units; one group is
    the whole batch."""

    groups: int
    group_batch: int

    @property
    def grid(self) -> tuple[int, int]:
        """The launch's (x, y) grid: a group's CTAs by the groups."""
        return self.ctas, self.groups


def layout(hidden: int, sms: int) -> Layout:
    """The fewest units per CTA that a grid of at most ``sms`` CTAs covers ``hidden``
    with; ValueError where the kernel does not take ``hidden``."""
    if hidden <= 0 or hidden % 8:
        raise ValueError(f"hidden must be a positive multiple of 8, got {hidden}")
    units = 4 * math.ceil(math.ceil(hidden / sms) / 4)
    return Layout(units=units, ctas=math.ceil(hidden / units))


def batch_layout(hidden: int, batch: int, sms: int) -> BatchLayout:
    """The fewest batch groups of at most MAX_BATCH rows (the rows split evenly: every
    group but the last has ``ceil(batch / groups)``), each group ``layout`` on the SMs it
    gets (``sms // groups``), so that all groups' CTAs are resident at once. More groups
    would only take more units a CTA (W's registers) for fewer rows. ValueError where
    the kernel does not take ``hidden`` or the groups outnumber the SMs."""
    if batch < 1:
        raise ValueError(f"batch {batch} (the kernels take 1 or more)")
    group_batch = math.ceil(batch / math.ceil(batch / MAX_BATCH))
    groups = math.ceil(batch / group_batch)
    if groups > sms:
        raise ValueError(f"batch {batch} needs {groups} batch groups, more than the {sms} SMs")
    one = layout(hidden, sms // groups)
    return BatchLayout(units=one.units, ctas=one.ctas, groups=groups, group_batch=group_batch)


def wavefront_layout(hidden: int, layers: int, sms: int) -> Layout:
    """The wavefront's layout of each layer: ``layout`` on the SMs one layer gets, so
    that all ``layers`` x ``ctas`` CTAs are resident at once."""
    if layers < 2 or sms < layers:
        raise ValueError(f"a wavefront takes 2 to {sms} layers, got {layers}")
    return layout(hidden, sms // layers)


def forward_w_words(dtype: str, hidden: int, units: int) -> int:
    """32-bit words of W_hh a thread of the forward keeps in registers (cuda_lstm.cu's
    w_frag: M_TILES x K_PER_WARP x 4); the wavefront's W_ih slice takes as many words
    of shared memory a thread."""
    k_step = 16 if dtype == "bf16" else 8
    return (units // 4) * math.ceil(math.ceil(hidden / k_step) / WARPS) * 4


def _partial_sums_bytes(units: int, batch: int) -> int:
    """The forward's shared memory for its warps' partial sums (``batch``: a group's)."""
    return 4 * WARPS * 4 * units * 8 * math.ceil(batch / 8)


def _backward_sums_bytes(units: int, batch: int) -> int:
    """The backward's static shared memory for its warps' partial sums."""
    return 4 * WARPS * 16 * math.ceil(batch / 16) * 8 * math.ceil(units / 8)


def forward_dynamic_bytes(units: int, group_batch: int) -> int:
    """The forward's dynamic shared memory: its partial sums where they pass SHARED_BYTES
    (static shared memory), else none."""
    sums = _partial_sums_bytes(units, group_batch)
    return sums if sums > SHARED_BYTES else 0


def wavefront_shared_bytes(dtype: str, hidden: int, units: int) -> int:
    """The wavefront's dynamic shared memory: a thread's W_ih fragments, 256 threads."""
    return forward_w_words(dtype, hidden, units) * 4 * THREADS


def wavefront_unfit(dtype: str, hidden: int, batch: int, layers: int, sms: int,
                    shared_optin: int = SHARED_OPTIN_BYTES) -> str | None:  # fmt: skip
    """Why the wavefront does not take this stack of ``layers`` layers of ``hidden``
    units on a GPU of ``sms`` SMs, or None where it does: ``unfit``'s rules on the
    wavefront's layout, its registers (MAX_WAVEFRONT_WORDS), and W_ih's slice in shared
    memory."""
    if dtype not in DTYPES:
        return f"dtype {dtype!r} (the kernels take {sorted(DTYPES)})"
    try:
        units = wavefront_layout(hidden, layers, sms).units
        layout(hidden, sms)  # the hidden size's own rule
    except ValueError as e:
        return str(e)
    if not 1 <= batch <= MAX_BATCH:
        return f"batch {batch} (the wavefront takes 1 to {MAX_BATCH}: one batch group)"
    k_step = 16 if dtype == "bf16" else 8
    inputs = 2 * math.ceil(math.ceil(hidden / k_step) / WARPS) * math.ceil(batch / 8) * 2
    words = 2 * forward_w_words(dtype, hidden, units) + inputs
    if words > MAX_WAVEFRONT_WORDS:
        return (f"{layers} layers of {hidden} at batch {batch} in {dtype} on {sms} SMs need "
                f"{words} registers of W (twice) and inputs a thread (at most "
                f"{MAX_WAVEFRONT_WORDS})")  # fmt: skip
    sums = _partial_sums_bytes(units, batch)
    if sums > SHARED_BYTES:
        return f"batch {batch} at hidden {hidden}: partial sums past {SHARED_BYTES} bytes"
    if sums + 4 + wavefront_shared_bytes(dtype, hidden, units) > shared_optin:
        return (f"{layers} layers of {hidden} in {dtype}: W_ih's slice and the sums past "
                f"{shared_optin} bytes of shared memory")  # fmt: skip
    return None


def w_words(dtype: str, hidden: int, units: int) -> int:
    """32-bit words of W a thread keeps in registers, the larger of the two kernels'
    (cuda_lstm.cu's w_frag arrays): forward M_TILES x K_PER_WARP x 4, backward
    BWD_K_PER_WARP x BWD_N_TILES x 2."""
    k_step = 16 if dtype == "bf16" else 8
    forward = forward_w_words(dtype, hidden, units)
    backward = math.ceil(4 * hidden // k_step / WARPS) * math.ceil(units / 8) * 2
    return max(forward, backward)


def unfit(dtype: str, hidden: int, batch: int, sms: int,
          shared_optin: int = SHARED_OPTIN_BYTES) -> str | None:  # fmt: skip
    """Why the kernels do not take this layer on a GPU of ``sms`` SMs, or None where they
    do: H a multiple of 8, batch 1 or more in batch groups no more than the SMs
    (``batch_layout``), W's slice within MAX_W_WORDS registers a thread, the backward's
    partial sums within static shared memory (SHARED_BYTES) and the forward's within what
    a CTA may opt in to (``shared_optin``: past SHARED_BYTES they are dynamic)."""
    if dtype not in DTYPES:
        return f"dtype {dtype!r} (the kernels take {sorted(DTYPES)})"
    try:
        lay = batch_layout(hidden, batch, sms)
    except ValueError as e:
        return str(e)
    where = f"on {sms} SMs"
    if lay.groups > 1:
        where = (f"in {lay.groups} batch groups of {lay.group_batch} rows on {sms} SMs "
                 f"({lay.units} units a CTA)")  # fmt: skip
    if (words := w_words(dtype, hidden, lay.units)) > MAX_W_WORDS:
        return (f"hidden {hidden} in {dtype} {where} needs {words} registers of W a thread "
                f"(at most {MAX_W_WORDS})")  # fmt: skip
    if _partial_sums_bytes(lay.units, lay.group_batch) + 4 > shared_optin:
        return (f"batch {batch} at hidden {hidden} {where}: the forward's partial sums and "
                f"the barrier's flag past {shared_optin} bytes of shared memory")  # fmt: skip
    if _backward_sums_bytes(lay.units, lay.group_batch) > SHARED_BYTES:
        return (f"batch {batch} at hidden {hidden} {where}: the backward's partial sums past "
                f"{SHARED_BYTES} bytes")  # fmt: skip
    return None


def compile_options(dtype: str, hidden: int, batch: int, units: int, arch: str,
                    defines: dict[str, int] | None = None,
                    group_batch: int | None = None) -> list[str]:  # fmt: skip
    """NVRTC options for one configuration of ``cuda_lstm.cu``: ``group_batch`` the rows
    of a batch group (None: the whole batch; with its forward's partial sums in dynamic
    shared memory where they pass SHARED_BYTES); ``defines``: more of its macros
    (benchmarks' timing variants)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    defines = dict(defines or {})
    if group_batch is not None and group_batch != batch:
        defines["LSTM_GROUP_BATCH"] = group_batch
    if forward_dynamic_bytes(units, batch if group_batch is None else group_batch):
        defines["LSTM_DYNAMIC_SUMS"] = 1
    return [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        "--ptxas-options=-v",  # registers and spills in the log
        f"-DLSTM_BF16={int(dtype == 'bf16')}",
        f"-DLSTM_HIDDEN={hidden}",
        f"-DLSTM_BATCH={batch}",
        f"-DLSTM_UNITS={units}",
        *(f"-D{macro}={value}" for macro, value in defines.items()),
    ]


def bindings():
    """cuda-python's (nvrtc, driver) modules: ``cuda.bindings`` (cuda-python 12.6 and
    later) or the older ``cuda`` names; ImportError naming the extra to install."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError:
        try:
            from cuda import cuda as driver
            from cuda import nvrtc
        except ImportError as e:
            raise ImportError(f"the CUDA C++ LSTM kernel needs cuda-python's bindings: "
                              f"{INSTALL_HINT}") from e  # fmt: skip
    return nvrtc, driver


def available() -> bool:
    """Whether ``cuda.bindings`` imports (the kernels can be built)."""
    try:
        bindings()
    except ImportError:
        return False
    return True


def _nvrtc_check(nvrtc, result):
    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"NVRTC: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return rest[0] if len(rest) == 1 else rest


def compile_cubin(dtype: str, hidden: int, batch: int, units: int, arch: str = "sm_90",
                  defines: dict[str, int] | None = None,
                  group_batch: int | None = None) -> tuple[bytes, str]:  # fmt: skip
    """(cubin, NVRTC's log) of ``cuda_lstm.cu`` for one configuration (``compile_options``);
    CompileError with the log where it does not compile."""
    nvrtc, _ = bindings()
    options = [o.encode() for o in compile_options(dtype, hidden, batch, units, arch, defines,
                                                   group_batch)]  # fmt: skip
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


def _driver_check(driver, result):
    err, *rest = result
    if err != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA driver: {name.decode() if name else err}")
    return rest[0] if len(rest) == 1 else rest


def input_and_weight_gradients(x: Tensor, h0: Tensor, y: Tensor, w_ih: Tensor,
                               dgates: Tensor) -> tuple[Tensor, ...]:  # fmt: skip
    """(dx, dW_ih, dW_hh, db) from the gradients of every step's gates [T,B,4H]: one GEMM
    each (db is both biases' gradient), as the backward kernel leaves them."""
    T, B, G = dgates.shape
    flat = dgates.reshape(T * B, G)
    h_prev = torch.cat([h0[None], y[:-1]]).reshape(T * B, -1)  # h_{t-1} of every step
    dx = (flat @ w_ih).reshape(T, B, -1)
    return dx, flat.t() @ x.reshape(T * B, -1), flat.t() @ h_prev, flat.sum(0)


class CudaLstmKernel:
    """``cuda_lstm.cu`` compiled for one (dtype, hidden, batch) and loaded into torch's
    context; ``forward`` and ``backward`` run a layer, ``recurrence`` and
    ``backward_recurrence`` the kernels alone. With ``layers`` > 1, the wavefront of a
    stack of that many layers instead (``wavefront``: its forward alone). Launches share
    one barrier counter and status flag, so they must follow each other on one stream (as
    a layer stack's do)."""

    def __init__(self, dtype: str, hidden: int, batch: int, device: torch.device,
                 defines: tuple[tuple[str, int], ...] = (), layers: int = 1):  # fmt: skip
        device = torch.device(device)
        self.device_index = device.index if device.index is not None else 0
        self.layers = layers
        if layers > 1:
            defines = (*defines, ("LSTM_LAYERS", layers))
        # The driver loads the module into the current context: the device's own.
        with torch.cuda.device(self.device_index):
            self._load(dtype, hidden, batch, torch.device("cuda", self.device_index), defines)

    def _load(self, dtype: str, hidden: int, batch: int, device: torch.device,
              defines: tuple[tuple[str, int], ...]) -> None:  # fmt: skip
        _, driver = bindings()
        self.driver, self.dtype, self.hidden, self.batch = driver, dtype, hidden, batch

        def call(function, *args):
            return _driver_check(driver, function(*args))

        props = torch.cuda.get_device_properties(device)
        arch = f"sm_{props.major}{props.minor}"
        if props.major < 8:
            raise RuntimeError(f"needs sm_80 or later (bf16 mma.sync), got {arch}")
        sms = props.multi_processor_count
        wavefront = self.layers > 1
        # Each kernel's dynamic shared memory: W_ih's fragments (the wavefront), the
        # forward's partial sums where they pass static shared memory.
        if wavefront:
            self.layout = wavefront_layout(hidden, self.layers, sms)
            self.grid = (self.layout.ctas * self.layers, 1)
            group_batch = None
            units = self.layout.units
            self.shared_bytes = {WAVEFRONT_KERNEL: wavefront_shared_bytes(dtype, hidden, units)}
        else:
            self.layout = batch_layout(hidden, batch, sms)
            self.grid, group_batch = self.layout.grid, self.layout.group_batch
            self.shared_bytes = {
                FORWARD_KERNEL: forward_dynamic_bytes(self.layout.units, group_batch),
                BACKWARD_KERNEL: 0}  # fmt: skip
        ctas = self.grid[0] * self.grid[1]
        torch.zeros(1, device=device)  # torch makes its (primary) context current
        call(driver.cuInit, 0)
        dev = call(driver.cuDeviceGet, device.index)
        if not int(call(driver.cuCtxGetCurrent)):
            call(driver.cuCtxSetCurrent, call(driver.cuDevicePrimaryCtxRetain, dev))
        cooperative = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH
        if not call(driver.cuDeviceGetAttribute, cooperative, dev):
            raise RuntimeError("the device has no cooperative launch")
        start = time.perf_counter()
        cubin, self.log = compile_cubin(dtype, hidden, batch, self.layout.units, arch,
                                        dict(defines), group_batch)  # fmt: skip
        self.compile_s = time.perf_counter() - start
        self.module = call(driver.cuModuleLoadData, cubin)
        attribute = driver.CUfunction_attribute
        self.functions, self.registers, self.spill_bytes = {}, {}, {}
        for name, shared in self.shared_bytes.items():
            function = call(driver.cuModuleGetFunction, self.module, name.encode())
            self.functions[name] = function
            if shared:  # past 48 KiB a CTA's dynamic shared memory is opt-in
                call(driver.cuFuncSetAttribute, function,
                     attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                     shared)  # fmt: skip
            self.registers[name] = call(driver.cuFuncGetAttribute,
                                        attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, function)  # fmt: skip
            self.spill_bytes[name] = call(driver.cuFuncGetAttribute,
                                          attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                                          function)  # fmt: skip
            per_sm = call(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor, function,
                          THREADS, shared)  # fmt: skip
            if ctas > per_sm * sms:
                raise RuntimeError(f"{name}: {ctas} CTAs cannot all be resident "
                                   f"({per_sm} per SM x {sms} SMs)")  # fmt: skip
        # one barrier counter a batch group, COUNTER_STRIDE words apart
        self.counter = torch.zeros(self.grid[1] * COUNTER_STRIDE, dtype=torch.int32,
                                   device=device)  # fmt: skip
        self.status = torch.zeros(1, dtype=torch.int32, device=device)
        # The status as the host last saw it (``note_status``): read without a sync.
        self.status_seen = torch.zeros(1, dtype=torch.int32, pin_memory=True)

    def _launch(self, name: str, pointers: list[Tensor | list[Tensor | None] | None],
                T: int) -> None:  # fmt: skip
        """Launch kernel ``name`` cooperatively on torch's current stream with the
        tensors' addresses (None: a null pointer; a list: a struct of addresses, by
        value), the barrier's counter and status, T."""
        if torch.cuda.current_device() != self.device_index:  # the module's context current
            with torch.cuda.device(self.device_index):
                return self._launch(name, pointers, T)
        tensors = [t for p in pointers for t in (p if isinstance(p, list) else [p])]
        if any(t is not None and not t.is_contiguous() for t in tensors):
            raise ValueError("the kernel takes contiguous tensors")
        self.counter.zero_()

        def address(t: Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        values = [(ctypes.c_void_p * len(p))(*map(address, p)) if isinstance(p, list)
                  else ctypes.c_void_p(address(p))
                  for p in (*pointers, self.counter, self.status)]  # fmt: skip
        values.append(ctypes.c_int(T))
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        stream = self.driver.CUstream(torch.cuda.current_stream().cuda_stream)
        _driver_check(self.driver, self.driver.cuLaunchCooperativeKernel(
            self.functions[name], *self.grid, 1, THREADS, 1, 1, self.shared_bytes[name], stream,
            ctypes.addressof(params)))  # fmt: skip

    def _check_steps(self, steps: Tensor, width: int, what: str) -> int:
        T = steps.shape[0]
        if steps.shape[1:] != (self.batch, width) or T == 0:
            raise ValueError(f"compiled for batch {self.batch}, hidden {self.hidden}; "
                             f"got {what} {tuple(steps.shape)}")  # fmt: skip
        return T

    def recurrence(self, xw: Tensor, w_hh: Tensor, b_hh: Tensor, h0: Tensor, c0: Tensor,
                   y: Tensor, h_n: Tensor, c_n: Tensor,
                   stash: Tensor | None = None) -> None:  # fmt: skip
        """Launch the forward kernel on torch's current stream: y, h_n, c_n (and the
        backward's stash [T,B,5H] in the layer's dtype where given: the gates'
        pre-activations and c_t) from xw = x W_ih^T + b_ih [T,B,4H], W_hh [4H,H], b_hh
        (fp32) [4H], h0 and c0 [B,H]."""
        T = self._check_steps(xw, 4 * self.hidden, "xw")
        self._launch(FORWARD_KERNEL, [xw, w_hh, b_hh, h0, c0, y, h_n, c_n, stash], T)

    def backward_recurrence(self, w_hh: Tensor, stash: Tensor, c0: Tensor, dy: Tensor,
                            dh_n: Tensor, dc_n: Tensor, dgates: Tensor, dh0: Tensor,
                            dc0: Tensor) -> None:  # fmt: skip
        """Launch the backward kernel on torch's current stream: dgates [T,B,4H] and dh0,
        dc0 [B,H] from W_hh, the forward's stash [T,B,5H] (the layer's dtype), c0, dy
        [T,B,H], and dh_n, dc_n [B,H]."""
        T = self._check_steps(dy, self.hidden, "dy")
        shape, dtype = (T, self.batch, 5 * self.hidden), DTYPES[self.dtype]
        if stash.shape != shape or stash.dtype != dtype:
            raise ValueError(f"stash must be {dtype} {shape}, "
                             f"got {stash.dtype} {tuple(stash.shape)}")  # fmt: skip
        self._launch(BACKWARD_KERNEL, [w_hh, stash, c0, dy, dh_n, dc_n, dgates, dh0, dc0], T)

    def wavefront(self, xw: Tensor, w_ih: list[Tensor], w_hh: list[Tensor], bias: Tensor,
                  h0: Tensor, c0: Tensor, mask: Tensor | None, dropped: Tensor | None,
                  y: list[Tensor], h_n: Tensor, c_n: Tensor,
                  stash: list[Tensor] | None) -> None:  # fmt: skip
        """Launch the wavefront on torch's current stream: each layer's y [T,B,H] (and the
        backward's stash [T,B,5H] in the layer's dtype where given), h_n and c_n [L,B,H]
        from layer 0's xw = x W_ih^T + b_ih [T,B,4H], W_ih of layers 1.. and W_hh of every
        layer [4H,H] each, the biases (fp32) [L,4H] (b_hh, plus b_ih past layer 0), h0 and
        c0 [L,B,H], and where dropout runs between the layers its mask (0 or 1/(1-p))
        [L-1,T,B,H] and scratch ``dropped`` of that shape."""
        T = self._check_steps(xw, 4 * self.hidden, "xw")
        L, H = self.layers, self.hidden
        if (len(w_ih), len(w_hh), len(y), len(stash or y)) != (L - 1, L, L, L) or (
                mask is None) != (dropped is None):  # fmt: skip
            raise ValueError(f"compiled for {L} layers: W_ih past layer 0, W_hh, y and stash "
                             f"of each, and a mask with its scratch or neither")  # fmt: skip
        if any(w.shape != (4 * H, H) for w in (*w_ih, *w_hh)):
            raise ValueError(f"W_ih past layer 0 and W_hh must be {(4 * H, H)}")
        for name, t, shape in (("bias", bias, (L, 4 * H)), ("h0", h0, (L, self.batch, H)),
                               ("c0", c0, (L, self.batch, H)), ("h_n", h_n, (L, self.batch, H)),
                               ("c_n", c_n, (L, self.batch, H)),
                               ("mask", mask, (L - 1, T, self.batch, H)),
                               ("dropped", dropped, (L - 1, T, self.batch, H))):  # fmt: skip
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")
        stash = stash or [None] * L
        self._launch(WAVEFRONT_KERNEL, [xw, [None, *w_ih, *w_hh], bias, h0, c0, mask, dropped,
                                        [*y, *stash], h_n, c_n], T)  # fmt: skip

    def forward(self, x: Tensor, h0: Tensor, c0: Tensor, w_ih: Tensor, w_hh: Tensor,
                b_ih: Tensor, b_hh: Tensor, *,
                stash: bool = False) -> tuple[Tensor, ...]:  # fmt: skip
        """(y, h_n, c_n) of the layer, and the stash for ``backward`` where ``stash``:
        the input GEMM (cuBLAS), then the kernel."""
        xw = F.linear(x, w_ih, b_ih)
        y = torch.empty(x.shape[0], x.shape[1], self.hidden, dtype=x.dtype, device=x.device)
        h_n, c_n = torch.empty_like(h0), torch.empty_like(c0)
        saved = None
        if stash:
            saved = x.new_empty(x.shape[0], x.shape[1], 5 * self.hidden)
        self.recurrence(xw, w_hh, b_hh.float(), h0, c0, y, h_n, c_n, saved)
        return (y, h_n, c_n, saved) if stash else (y, h_n, c_n)

    def backward(self, x: Tensor, h0: Tensor, c0: Tensor, w_ih: Tensor, w_hh: Tensor,
                 y: Tensor, stash: Tensor, dy: Tensor, dh_n: Tensor,
                 dc_n: Tensor) -> tuple[Tensor, ...]:  # fmt: skip
        """(dx, dh0, dc0, dW_ih, dW_hh, db_ih, db_hh) of the layer whose ``forward(...,
        stash=True)`` gave y and stash: the kernel, then ``input_and_weight_gradients``."""
        dgates = torch.empty(*dy.shape[:2], 4 * self.hidden, dtype=dy.dtype, device=dy.device)
        dh0, dc0 = torch.empty_like(h0), torch.empty_like(c0)
        self.backward_recurrence(w_hh, stash, c0, dy, dh_n, dc_n, dgates, dh0, dc0)
        dx, dw_ih, dw_hh, db = input_and_weight_gradients(x, h0, y, w_ih, dgates)
        return dx, dh0, dc0, dw_ih, dw_hh, db, db

    def timed_out(self) -> bool:
        """Whether a barrier of a launch since ``clear_timed_out`` (or the first) gave up
        (its results are wrong; waits for the GPU). Sticky: every later launch's barriers
        give up at their next poll of the flag."""
        return bool(self.status.item())

    def clear_timed_out(self) -> None:
        self.status.zero_()
        self.status_seen.zero_()

    def note_status(self) -> None:
        """Queue a copy of the status flag to the host after the launches queued so far
        (no sync; not while a CUDA Graph is captured, whose replays the flag's NaNs
        cover), for ``raise_if_timed_out`` to read later."""
        if not torch.cuda.is_current_stream_capturing():
            self.status_seen.copy_(self.status, non_blocking=True)

    def raise_if_timed_out(self) -> None:
        """RuntimeError where an earlier launch's barrier gave up, as far as the host has
        seen (``note_status``): that launch's outputs were NaN (``poison``)."""
        if self.status_seen.item():
            raise RuntimeError(
                f"the CUDA LSTM kernel ({self.dtype}, hidden {self.hidden}, batch "
                f"{self.batch}) timed out at a grid barrier in an earlier call: its CTAs "
                f"did not all run at once (another kernel held SMs?). That call's outputs "
                f"were NaN; use impl='persistent' or impl='auto'."
            )

    def poison(self, *outputs: Tensor) -> None:
        """NaN over ``outputs`` where a barrier gave up (the status flag is set): on the
        GPU, without a sync, so a timed-out launch never hands on finite garbage."""
        failed = self.status.bool()
        for tensor in outputs:
            tensor.masked_fill_(failed, float("nan"))


@functools.cache
def compiled_wavefront(dtype: str, hidden: int, batch: int, layers: int,
                       device: torch.device) -> CudaLstmKernel:  # fmt: skip
    """The wavefront of ``layers`` layers as a CudaLstmKernel, built once a process for
    each configuration."""
    return CudaLstmKernel(dtype, hidden, batch, device, layers=layers)


@functools.cache
def compiled(dtype: str, hidden: int, batch: int, device: torch.device,
             defines: tuple[tuple[str, int], ...] = ()) -> CudaLstmKernel:  # fmt: skip
    """CudaLstmKernel, built once a process for each configuration (NVRTC takes ~0.3-1.5
    s for the two kernels)."""
    return CudaLstmKernel(dtype, hidden, batch, device, defines)
