"""cuda_lstm.cu's kernels themselves, run on the CPU (run_on_cpu.cpp, built with g++):
their source as NVRTC compiles it, with ptx_on_cpu.h standing in for CUDA's built-ins
and the few PTX instructions (bf16 and TF32 rounding, the MMAs by PTX's fragment
layouts, the barrier's atomics). The forward's outputs and the backward's gradients
(the kernel's dgates, dh0 and dc0, then the harness's GEMMs) against the float64
reference, within the tolerances the GPU check uses. Skipped without g++."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from benchmarks.persistent_cuda import prototype

from mirrorgrad.ops.rnn import cuda_lstm_kernel

HERE = Path(__file__).parent

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _build(tmp_path: Path, dtype: str, hidden: int, batch: int, units: int) -> Path:
    exe = tmp_path / f"run_on_cpu_{dtype}_{hidden}_{batch}_{units}"
    macros = [f"-DLSTM_BF16={int(dtype == 'bf16')}", f"-DLSTM_HIDDEN={hidden}",
              f"-DLSTM_BATCH={batch}", f"-DLSTM_UNITS={units}",
              f'-DLSTM_SOURCE="{cuda_lstm_kernel.SOURCE.resolve()}"']  # fmt: skip
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-Wall", "-Werror",
                    "-Wno-unknown-pragmas", *macros, f"-I{HERE}", str(HERE / "run_on_cpu.cpp"),
                    "-o", str(exe)], check=True, capture_output=True, text=True)  # fmt: skip
    return exe


def _run(exe: Path, direction: str, T: int, inputs, outputs, tmp_path: Path):
    """The kernel's outputs: ``outputs`` is [(shape, dtype)] in the order it writes them."""
    data = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in inputs)
    (tmp_path / "in").write_bytes(data)
    done = subprocess.run([str(exe), direction, str(T), str(tmp_path / "in"),
                           str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    raw = torch.frombuffer(bytearray((tmp_path / "out").read_bytes()), dtype=torch.uint8)
    tensors, offset = [], 0
    for shape, dtype in outputs:
        size = torch.Size(shape).numel() * dtype.itemsize
        tensors.append(raw[offset : offset + size].view(dtype).reshape(shape))
        offset += size
    assert offset == raw.numel()
    return tensors


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(
    ("hidden", "batch", "units", "T"),
    # K padded (bf16 H = 40), units past H, 3 forward N tiles and 2 backward M tiles
    # (batch 17), 2 backward N tiles (units 12), T = 1 (the backward's product only for dh0)
    [(32, 3, 4, 3), (40, 17, 8, 2), (24, 2, 12, 1)],
)
def test_kernels_on_cpu_match_the_reference(tmp_path, dtype, hidden, batch, units, T):
    exe = _build(tmp_path, dtype, hidden, batch, units)
    torch.manual_seed(0)
    lstm, x, h0, c0 = prototype._layer(hidden, batch, T, cuda_lstm_kernel.DTYPES[dtype], "cpu")
    weights = [w.detach() for w in prototype._weights(lstm)]
    w_ih, w_hh, b_ih, b_hh = weights
    dy, dh_n, dc_n = prototype._output_gradients(x, hidden)
    dt, H, G = x.dtype, hidden, 4 * hidden

    xw = torch.nn.functional.linear(x, w_ih, b_ih)
    y, h_n, c_n, stash = _run(exe, "forward", T, [xw, w_hh, b_hh.float(), h0, c0],
                              [((T, batch, H), dt), ((batch, H), dt), ((batch, H), dt),
                               ((T, batch, 5 * H), torch.float32)], tmp_path)  # fmt: skip
    dgates, dh0, dc0 = _run(exe, "backward", T, [w_hh, stash, c0, dy, dh_n, dc_n],
                            [((T, batch, G), dt), ((batch, H), dt), ((batch, H), dt)],
                            tmp_path)  # fmt: skip
    dx, dw_ih, dw_hh, db = cuda_lstm_kernel.input_and_weight_gradients(x, h0, y, w_ih, dgates)

    exact = [t.double() for t in (x, h0, c0, *weights)]
    tolerance = prototype.TOLERANCE[dtype]
    with torch.no_grad():
        want = prototype.reference_forward(*exact)
    assert prototype.relative_error((y, h_n, c_n), want) < tolerance
    want_grads = prototype.reference_backward(*exact, dy.double(), dh_n.double(), dc_n.double())
    errors = prototype.gradient_errors((dx, dh0, dc0, dw_ih, dw_hh, db, db), want_grads)
    assert max(errors.values()) < tolerance, errors
    # the stash is what the backward reads: the activated gates and c_t
    assert torch.allclose(stash[-1, :, 4 * H :].to(dt), c_n)
