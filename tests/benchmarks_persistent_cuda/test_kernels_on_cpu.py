"""cuda_lstm.cu's kernels themselves, run on the CPU (run_on_cpu.cpp, built with g++):
their source as NVRTC compiles it, with ptx_on_cpu.h standing in for CUDA's built-ins
and the few PTX instructions (bf16 and TF32 rounding, the MMAs by PTX's fragment
layouts, the barrier's atomics). The forward's outputs and stash (in the layer's dtype)
and the backward's gradients (the kernel's dgates, dh0 and dc0, then the harness's
GEMMs) against the float64 reference, within the tolerances the GPU check uses. Skipped
without g++."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from benchmarks.persistent_cuda import prototype

from mirrorgrad.ops.rnn import cuda_lstm_kernel

HERE = Path(__file__).parent

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _build(tmp_path: Path, dtype: str, hidden: int, batch: int, units: int, layers: int = 1,
           group_batch: int | None = None,
           defines: dict[str, int] | None = None) -> Path:  # fmt: skip
    """run_on_cpu for one configuration, with the macros the library compiles it with
    (``cuda_lstm_kernel.compile_options``); ``layers`` > 1: the wavefront's."""
    exe = tmp_path / f"run_on_cpu_{dtype}_{hidden}_{batch}_{units}_{layers}_{group_batch}"
    defines = dict(defines or {})
    if layers > 1:
        defines["LSTM_LAYERS"] = layers
    options = cuda_lstm_kernel.compile_options(dtype, hidden, batch, units, "sm_90", defines,
                                               group_batch)  # fmt: skip
    macros = [o for o in options if o.startswith("-D")]
    macros.append(f'-DLSTM_SOURCE="{cuda_lstm_kernel.SOURCE.resolve()}"')
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
    _check_layer(_build(tmp_path, dtype, hidden, batch, units), tmp_path, dtype, hidden, batch,
                 T)  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(
    ("hidden", "batch", "group_batch", "units", "T", "defines"),
    [
        (32, 9, 4, 8, 3, {}),  # 3 groups: 4, 4 and 1 row (a partial tile each)
        (40, 13, 8, 12, 2, {}),  # 2 groups: 8 and 5 rows; units past H, K padded in bf16
        # 2 groups of 19 and 18 rows: 3 forward N tiles and 2 backward M tiles each, the
        # forward one N tile at a time (the third's loads behind the first's MMAs) and its
        # partial sums in dynamic shared memory
        (24, 37, 19, 12, 2, {"LSTM_FORWARD_BY_N_TILE": 1, "LSTM_DYNAMIC_SUMS": 1}),
    ],
)
def test_batch_groups_on_cpu_match_the_reference(tmp_path, dtype, hidden, batch, group_batch,
                                                 units, T, defines):  # fmt: skip
    """A grid of batch groups (blockIdx.y), each its rows of the [T, batch, ...] tensors
    and its own barrier counter, forward and backward against the float64 reference."""
    exe = _build(tmp_path, dtype, hidden, batch, units, group_batch=group_batch,
                 defines=defines)  # fmt: skip
    _check_layer(exe, tmp_path, dtype, hidden, batch, T)


def test_the_chosen_batch_groups_on_cpu_match_the_reference(tmp_path):
    """The LM's layout in miniature: ``batch_layout`` on 4 SMs splits batch 53 into 2
    groups of 27 and 26 rows at 20 units a CTA, whose forward runs one N tile at a time
    with its sums in dynamic shared memory by default (as bf16 H 656 B 128 on 132 SMs)."""
    lay = cuda_lstm_kernel.batch_layout(40, 53, 4)
    assert (lay.groups, lay.group_batch, lay.units, lay.ctas) == (2, 27, 20, 2)
    options = cuda_lstm_kernel.compile_options("bf16", 40, 53, lay.units, "sm_90",
                                               group_batch=lay.group_batch)  # fmt: skip
    assert "-DLSTM_DYNAMIC_SUMS=1" in options and "-DLSTM_GROUP_BATCH=27" in options
    exe = _build(tmp_path, "bf16", 40, 53, lay.units, group_batch=lay.group_batch)
    _check_layer(exe, tmp_path, "bf16", 40, 53, 2)


def _check_layer(exe: Path, tmp_path: Path, dtype: str, hidden: int, batch: int, T: int):
    """The forward's outputs and stash, and the gradients from the backward's, of the
    kernels ``exe`` runs against the float64 reference."""
    torch.manual_seed(0)
    lstm, x, h0, c0 = prototype._layer(hidden, batch, T, cuda_lstm_kernel.DTYPES[dtype], "cpu")
    weights = [w.detach() for w in prototype._weights(lstm)]
    w_ih, w_hh, b_ih, b_hh = weights
    dy, dh_n, dc_n = prototype._output_gradients(x, hidden)
    dt, H, G = x.dtype, hidden, 4 * hidden

    xw = torch.nn.functional.linear(x, w_ih, b_ih)
    y, h_n, c_n, stash = _run(exe, "forward", T, [xw, w_hh, b_hh.float(), h0, c0],
                              [((T, batch, H), dt), ((batch, H), dt), ((batch, H), dt),
                               ((T, batch, 5 * H), dt)], tmp_path)  # fmt: skip
    dgates, dh0, dc0 = _run(exe, "backward", T, [w_hh, stash, c0, dy, dh_n, dc_n],
                            [((T, batch, G), dt), ((batch, H), dt), ((batch, H), dt)],
                            tmp_path)  # fmt: skip
    dx, dw_ih, dw_hh, db = cuda_lstm_kernel.input_and_weight_gradients(x, h0, y, w_ih, dgates)

    exact = [t.double() for t in (x, h0, c0, *weights)]
    tolerance = prototype.TOLERANCE[dtype]
    (want,) = _stack_reference(exact[0], exact[1][None], exact[2][None], [exact[3:]], None)
    assert prototype.relative_error((y, h_n, c_n, stash), want) < tolerance
    want_grads = prototype.reference_backward(*exact, dy.double(), dh_n.double(), dc_n.double())
    errors = prototype.gradient_errors((dx, dh0, dc0, dw_ih, dw_hh, db, db), want_grads)
    assert max(errors.values()) < tolerance, errors
    # the stash's c_t is the c the forward carries: the last step's is c_n, as rounded
    assert torch.equal(stash[-1, :, 4 * H :], c_n)


def _stack_reference(x, h0, c0, weights, masks):
    """Per layer (float64): y, h_n, c_n and the stash the backward reads (the gates'
    pre-activations and c_t of every step), layer l > 0 reading layer l-1's y times
    masks[l-1]."""
    layer_in, out = x, []
    for layer, (w_ih, w_hh, b_ih, b_hh) in enumerate(weights):
        if layer > 0:
            layer_in = out[-1][0] * masks[layer - 1]
        y, h_n, c_n = prototype.reference_forward(layer_in, h0[layer], c0[layer], w_ih, w_hh,
                                                  b_ih, b_hh)  # fmt: skip
        h_prev = torch.cat([h0[layer][None], y[:-1]])
        pre = layer_in @ w_ih.t() + b_ih + h_prev @ w_hh.t() + b_hh
        i, f, g, o = pre.chunk(4, -1)
        c = torch.cat([c0[layer][None], torch.zeros_like(y)])
        for t in range(y.shape[0]):
            c[t + 1] = f[t].sigmoid() * c[t] + i[t].sigmoid() * g[t].tanh()
        stash = torch.cat([i, f, g, o, c[1:]], -1)
        out.append((y, h_n, c_n, stash))
    return out


@pytest.mark.parametrize(("dtype", "hidden", "batch", "units", "layers", "T", "dropout"), [
    ("bf16", 32, 3, 8, 2, 5, True),
    ("fp32", 32, 1, 16, 3, 5, False),
    ("bf16", 40, 3, 12, 3, 1, True),  # K padded, units past H, 3 M tiles
    ("fp32", 24, 3, 12, 2, 1, False),
    ("fp32", 16, 1, 4, 2, 5, True),
    ("bf16", 16, 1, 8, 3, 5, False),
])  # fmt: skip
def test_wavefront_on_cpu_matches_the_reference(tmp_path, dtype, hidden, batch, units, layers,
                                                T, dropout):  # fmt: skip
    """The wavefront forward of a stack (its every layer's y, h_n, c_n and stash) against
    the float64 layers, with dropout's mask between them where ``dropout``."""
    exe = _build(tmp_path, dtype, hidden, batch, units, layers)
    dt, H, L = cuda_lstm_kernel.DTYPES[dtype], hidden, layers
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(7, H, L).to(dt)
    x = torch.randn(T, batch, 7).to(dt)
    h0, c0 = (0.5 * torch.randn(L, batch, H)).to(dt), (0.5 * torch.randn(L, batch, H)).to(dt)
    names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    weights = [[getattr(lstm, f"{name}_l{layer}").detach() for name in names]
               for layer in range(L)]  # fmt: skip
    masks = torch.ones(L - 1, T, batch, H, dtype=dt)
    if dropout:  # as dropout(ones): 0 or 1/(1 - p), p = 0.4
        masks = (torch.rand(L - 1, T, batch, H) >= 0.4).to(dt) / 0.6
    xw = torch.nn.functional.linear(x, weights[0][0], weights[0][2])
    w_ih = torch.stack([w[0] for w in weights[1:]])
    w_hh = torch.stack([w[1] for w in weights])
    bias = torch.stack([w[3].float() + (w[2].float() if layer else 0)
                        for layer, w in enumerate(weights)])  # fmt: skip
    given_mask = masks if dropout else torch.zeros_like(masks)  # all zero: none
    y, h_n, c_n, stash = _run(exe, "wavefront", T, [xw, w_ih, w_hh, bias, h0, c0, given_mask],
                              [((L, T, batch, H), dt), ((L, batch, H), dt), ((L, batch, H), dt),
                               ((L, T, batch, 5 * H), dt)], tmp_path)  # fmt: skip

    exact = [[t.double() for t in w] for w in weights]
    want = _stack_reference(x.double(), h0.double(), c0.double(), exact, masks.double())
    tolerance = prototype.TOLERANCE[dtype]
    for layer, (want_y, want_h, want_c, want_stash) in enumerate(want):
        got = (y[layer], h_n[layer], c_n[layer], stash[layer])
        error = prototype.relative_error(got, (want_y, want_h, want_c, want_stash))
        assert error < tolerance, (layer, error)


def test_saturated_gates_keep_their_gradients_in_bf16(tmp_path):
    """Forget gates near 1 (pre-activations 4-8: f = 0.986-0.9997) in a bf16 layer: their
    gradients dc c_{t-1} f(1-f), the kernel's dgates of one step, stay within 2% of
    float64's: the stash keeps the pre-activations. (Activated gates in bf16 are 2^-8
    apart near 1, so f rounds to 0.9961 or 1 and f(1-f) is off by up to all of it.)"""
    H, batch, T = 32, 3, 1
    exe = _build(tmp_path, "bf16", H, batch, 8)
    lstm, x, h0, c0 = prototype._layer(H, batch, T, torch.bfloat16, "cpu")
    with torch.no_grad():
        lstm.bias_hh_l0[H : 2 * H] += 6
    w_ih, w_hh, b_ih, b_hh = (w.detach() for w in prototype._weights(lstm))
    dy, dh_n, dc_n = prototype._output_gradients(x, H)
    xw = torch.nn.functional.linear(x, w_ih, b_ih)
    dt = x.dtype
    *_, stash = _run(exe, "forward", T, [xw, w_hh, b_hh.float(), h0, c0],
                     [((T, batch, H), dt), ((batch, H), dt), ((batch, H), dt),
                      ((T, batch, 5 * H), dt)], tmp_path)  # fmt: skip
    dgates, _, _ = _run(exe, "backward", T, [w_hh, stash, c0, dy, dh_n, dc_n],
                        [((T, batch, 4 * H), dt), ((batch, H), dt), ((batch, H), dt)],
                        tmp_path)  # fmt: skip

    exact = [t.double() for t in (x, h0, c0, w_ih, w_hh, b_ih, b_hh, dy, dh_n, dc_n)]
    x, h0, c0, w_ih, w_hh, b_ih, b_hh, dy, dh_n, dc_n = exact
    pre = (x[0] @ w_ih.t() + b_ih + h0 @ w_hh.t() + b_hh).requires_grad_()
    i, f, g, o = pre.chunk(4, -1)
    c = f.sigmoid() * c0 + i.sigmoid() * g.tanh()
    h = o.sigmoid() * c.tanh()
    (want,) = torch.autograd.grad((h * (dy[0] + dh_n)).sum() + (c * dc_n).sum(), pre)
    assert f.detach().sigmoid().min() > 0.98  # saturated
    got_f, want_f = dgates[0, :, H : 2 * H].double(), want[:, H : 2 * H]
    # 0.0096 (an activated-gate stash in bf16: 0.29)
    assert (got_f - want_f).norm() / want_f.norm() < 0.02
