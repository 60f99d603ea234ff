"""``mirrorgrad.nn.LSTM(impl="cuda")`` on a GPU: outputs and every gradient against
torch.nn.LSTM in float64 on the CPU (odd hidden sizes, batch 1 and 3, T 1 and 35, fp32
with TF32 products and bf16, the prototype's tolerances), hidden sizes off the multiple
of 8 (run zero-padded: 13, and the word LM's 650 at batch 20), batches past 32 in batch
groups (the word LM's 650 at batch 128 in bf16, a partial last group), two layers with
dropout (the
masks of impl="triton", which shares them), bidirectional, a CUDA Graph capture and its
replays, the op's opcheck, unidirectional stacks as one wavefront launch (2x650 and
3x256, with and without dropout, captured), the op's temporaries against its memory
formulas, a barrier that gives up, and impl="auto" timing it beside the others (called
and captured).
Skipped without CUDA or cuda.bindings; about a minute on an H100:

    PYTHONPATH=src python -m pytest -q tests/ops/test_cuda_impl_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import mirrorgrad.nn
from mirrorgrad._cuda_graphs import capture
from mirrorgrad.ops.rnn import cuda_lstm_kernel, dispatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not cuda_lstm_kernel.available(), reason="needs cuda.bindings"),
]

DEVICE = "cuda"
# max |ours - ref| / (1 + |ref|) per tensor (benchmarks/persistent_cuda/prototype.py):
# bf16 rounds h and the gate gradients every step, fp32 runs the products in TF32.
TOLERANCE = {torch.float32: 3e-3, torch.bfloat16: 3e-2}


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double().cpu() - ref).abs() / (1 + ref.abs())).max().item()


def _pair(n_in, hidden, layers=1, bidirectional=False, dropout=0.0, dtype=torch.float32,
          impl="cuda"):  # fmt: skip
    """(ours on the GPU in ``dtype``, torch.nn.LSTM in float64 on the CPU with ours'
    rounded weights)."""
    ours = mirrorgrad.nn.LSTM(n_in, hidden, layers, bidirectional=bidirectional,
                              dropout=dropout, impl=impl).to(DEVICE, dtype)  # fmt: skip
    ref = torch.nn.LSTM(n_in, hidden, layers, bidirectional=bidirectional).double()
    ref.load_state_dict({k: v.double().cpu() for k, v in ours.state_dict().items()})
    return ours, ref


def _inputs(T, B, n_in, hidden, dtype, *, layers=1, D=1, seed=0):
    """x, h0, c0 (not zero) on the GPU in ``dtype``, and output gradients."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)

    states = (layers * D, B, hidden)
    inputs = rand(T, B, n_in), rand(*states, scale=0.5), rand(*states, scale=0.5)
    return inputs, (rand(T, B, D * hidden), rand(*states), rand(*states))


def _run(module, inputs, grads):
    """(y, h_n, c_n, dx, dh0, dc0, d(each parameter)) of ``module``."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    y, (h_n, c_n) = module(leaves[0], (leaves[1], leaves[2]))
    grad = torch.autograd.grad((y, h_n, c_n), [*leaves, *module.parameters()], grads)
    return [y, h_n, c_n, *grad]


def _check_against_float64(ours, ref, inputs, grads, tolerance, got=None):
    """Every output and gradient within ``tolerance`` of float64, or (bf16) within
    cuDNN's own error on it: bf16 weight gradients sum T x B rounded products, and
    cuDNN's miss 3e-2 at these shapes too. ``got``: ours' results (default: ``ours``
    run now)."""
    got = _run(ours, inputs, grads) if got is None else got
    want = _run(ref, [t.double().cpu() for t in inputs], [t.double().cpu() for t in grads])
    names = ["y", "h_n", "c_n", "dx", "dh0", "dc0", *(n for n, _ in ours.named_parameters())]
    errors = {n: relative_error(a, b) for n, a, b in zip(names, got, want)}
    bars = dict.fromkeys(names, tolerance)
    if inputs[0].dtype == torch.bfloat16:
        cudnn = torch.nn.LSTM(ref.input_size, ref.hidden_size, ref.num_layers,
                              bidirectional=ref.bidirectional)  # fmt: skip
        cudnn = cudnn.to(DEVICE, torch.bfloat16)
        cudnn.load_state_dict(ours.state_dict())
        cudnn_errors = [relative_error(a, b) for a, b in zip(_run(cudnn, inputs, grads), want)]
        bars = {n: max(tolerance, e) for n, e in zip(names, cudnn_errors)}
    assert all(errors[n] <= bars[n] for n in names), (errors, bars)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [96, 520])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("T", [1, 35])
def test_one_layer_matches_float64(dtype, hidden, batch, T):
    torch.manual_seed(0)
    ours, ref = _pair(40, hidden, dtype=dtype)
    inputs, grads = _inputs(T, batch, 40, hidden, dtype)
    _check_against_float64(ours, ref, inputs, grads, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_largest_layout_matches_float64(dtype):
    """Hidden 1024 at batch 32: the most registers of W and of h a thread holds."""
    torch.manual_seed(0)
    ours, ref = _pair(64, 1024, dtype=dtype)
    inputs, grads = _inputs(9, 32, 64, 1024, dtype)
    _check_against_float64(ours, ref, inputs, grads, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("hidden", "batch"), [(13, 3), (650, 20)])
def test_padded_hidden_sizes_match_float64(dtype, hidden, batch):
    """Run padded to 16 (one CTA, 3 zero units a gate) and 656 (the word LM's layer at
    its batch and BPTT length)."""
    torch.manual_seed(0)
    ours, ref = _pair(40, hidden, dtype=dtype)
    inputs, grads = _inputs(35, batch, 40, hidden, dtype)
    _check_against_float64(ours, ref, inputs, grads, TOLERANCE[dtype])


@pytest.mark.parametrize(("dtype", "hidden", "batch", "T"), [
    (torch.bfloat16, 650, 128, 35),  # the word LM's layer: 4 groups of 32 rows, 33 CTAs each
    (torch.bfloat16, 96, 33, 35),  # 2 groups: 17 and 16 rows
    (torch.float32, 96, 64, 35),
    (torch.bfloat16, 520, 97, 9),  # 4 groups: 25, 25, 25 and 22 rows
])  # fmt: skip
def test_batch_groups_match_float64(dtype, hidden, batch, T):
    """Past 32 rows the batch runs in groups, each its rows of every tensor and its own
    grid barrier; at the word LM's shape without a register spilled."""
    torch.manual_seed(0)
    ours, ref = _pair(40, hidden, dtype=dtype)
    inputs, grads = _inputs(T, batch, 40, hidden, dtype)
    _check_against_float64(ours, ref, inputs, grads, TOLERANCE[dtype])
    padded = -(-hidden // 8) * 8
    kernel = cuda_lstm_kernel.compiled({torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype],
                                       padded, batch, torch.device(DEVICE, 0))  # fmt: skip
    assert kernel.layout.groups == -(-batch // 32) and kernel.grid[1] == kernel.layout.groups
    if batch == 128:
        assert set(kernel.spill_bytes.values()) == {0}, kernel.spill_bytes


def test_a_batch_group_barrier_that_gives_up_gives_nan_then_raises():
    ours = mirrorgrad.nn.LSTM(40, 96, impl="cuda").to(DEVICE)
    x = torch.randn(35, 64, 40, device=DEVICE)
    ours(x)
    kernel = cuda_lstm_kernel.compiled("fp32", 96, 64, torch.device(DEVICE, 0))
    assert kernel.layout.groups == 2
    _gives_nan_then_raises(ours, x, kernel)


@pytest.mark.parametrize("hidden", [96, 13])
def test_bidirectional_two_layers_match_float64(hidden):
    torch.manual_seed(0)
    ours, ref = _pair(24, hidden, layers=2, bidirectional=True)
    inputs, grads = _inputs(35, 3, 24, hidden, torch.float32, layers=2, D=2)
    _check_against_float64(ours, ref, inputs, grads, 2 * TOLERANCE[torch.float32])


def test_dropout_between_layers_uses_the_triton_masks():
    """Dropout's masks are kernels.py's: impl="triton" with the same seed drops the same
    elements, so the two agree within the products' rounding; two calls with one seed
    agree exactly (the kernel sums in a fixed order)."""
    results = {}
    inputs, grads = _inputs(35, 3, 24, 96, torch.float32, layers=2)
    for impl in ("cuda", "cuda", "triton"):
        torch.manual_seed(0)
        module = mirrorgrad.nn.LSTM(24, 96, 2, dropout=0.5, impl=impl).to(DEVICE).train()
        torch.manual_seed(1)  # the dropout seed
        results.setdefault(impl, []).append(_run(module, inputs, grads))
    first, second = results["cuda"]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    for a, b in zip(first, results["triton"][0]):
        assert relative_error(a, b.double().cpu()) <= 2 * TOLERANCE[torch.float32]
    no_dropout = mirrorgrad.nn.LSTM(24, 96, 2, impl="cuda").to(DEVICE)
    no_dropout.load_state_dict(module.state_dict())
    assert relative_error(first[0], _run(no_dropout, inputs, grads)[0].double().cpu()) > 1e-2


@pytest.mark.parametrize(("hidden", "batch"), [(520, 3), (650, 3), (650, 128)])
def test_captured_step_replays_with_new_inputs(hidden, batch):
    """650: the padded copies are made inside the capture, and replays see new weights
    (nothing cached from the captured ones' values); batch 128 in 4 batch groups."""
    torch.manual_seed(0)
    ours, ref = _pair(40, hidden, dtype=torch.bfloat16)
    inputs, grads = _inputs(35, batch, 40, hidden, torch.bfloat16)
    static = [t.clone() for t in (*inputs, *grads)]
    graph, outputs = capture(lambda: _run(ours, static[:3], static[3:]))
    for seed in (1, 2):
        with torch.no_grad():  # an optimizer's in-place step, between replays
            for weight in ours.parameters():
                weight.mul_(1.01)
        ref.load_state_dict({k: v.double().cpu() for k, v in ours.state_dict().items()})
        new_inputs, new_grads = _inputs(35, batch, 40, hidden, torch.bfloat16, seed=seed)
        for slot, value in zip(static, (*new_inputs, *new_grads)):
            slot.copy_(value)
        graph.replay()
        eager = _run(ours, new_inputs, new_grads)
        # the same kernels on the same inputs (cuBLAS may pick other GEMM algorithms)
        for a, b in zip(outputs, eager):
            assert relative_error(a, b.double().cpu()) <= 1e-2 * TOLERANCE[torch.bfloat16]
    # At batch 128 cuDNN's own bf16 error passes 3e-2: the bar is the larger of the two.
    _check_against_float64(ours, ref, new_inputs, new_grads, TOLERANCE[torch.bfloat16],
                           got=outputs)  # fmt: skip


@pytest.mark.parametrize("H", [16, 13])
def test_op_passes_opcheck(H):
    """13: the fake kernel's stash is the padded one the layer saves."""
    from .test_rnn_contract import UTILS, _backward_args
    from .test_rnn_op import forward_args, stack_inputs

    def gpu(t):
        return t.detach().to(DEVICE).requires_grad_()

    x, weights, hx, cx = stack_inputs("lstm", layers=2, bidirectional=True, T=3, B=3, n_in=8,
                                      H=H, dtype=torch.float32)  # fmt: skip
    args = list(forward_args("lstm", gpu(x), [gpu(w) for w in weights], gpu(hx), gpu(cx),
                             layers=2, bidirectional=True, dropout=0.5, impl="cuda"))  # fmt: skip
    args[5] = args[5].to(DEVICE)  # the dropout seed lives on the GPU
    args = tuple(args)
    torch.library.opcheck(torch.ops.mirrorgrad.rnn_forward.default, args, test_utils=UTILS)
    torch.library.opcheck(torch.ops.mirrorgrad.rnn_backward.default, _backward_args(args),
                          test_utils=UTILS)  # fmt: skip


def _gives_nan_then_raises(ours, x, kernel) -> None:
    """The status flag set (as a timed-out barrier sets it): the launch stops at its
    barriers, the call's outputs are NaN, and the next call raises; cleared, it runs."""
    kernel.status.fill_(1)
    try:
        with torch.no_grad():
            y, (h_n, c_n) = ours(x)
        torch.cuda.synchronize()
        assert y.isnan().all() and h_n.isnan().all() and c_n.isnan().all()
        with pytest.raises(RuntimeError, match="timed out"):
            ours(x)
    finally:
        kernel.clear_timed_out()
    y, _ = ours(x)
    assert not y.isnan().any()


def test_a_barrier_that_gives_up_gives_nan_then_raises():
    ours = mirrorgrad.nn.LSTM(40, 96, impl="cuda").to(DEVICE)
    x = torch.randn(35, 3, 40, device=DEVICE)
    ours(x)
    kernel = cuda_lstm_kernel.compiled("fp32", 96, 3, torch.device(DEVICE, 0))
    _gives_nan_then_raises(ours, x, kernel)


@pytest.mark.parametrize("captured", [False, True], ids=["called", "captured"])
@pytest.mark.parametrize("batch", [4, 128])
def test_auto_times_cuda_beside_the_others(captured, batch):
    """Called, and inside dispatch_as_captured() (each candidate timed captured in a CUDA
    Graph, as `mirrorgrad train lm` with CUDA Graphs chooses); batch 128 in batch groups."""
    import contextlib

    dispatch._AUTO_CHOICE.clear()
    ours = mirrorgrad.nn.LSTM(64, 512, impl="auto").to(DEVICE, torch.bfloat16)
    x = torch.randn(50, batch, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    with dispatch.dispatch_as_captured() if captured else contextlib.nullcontext():
        y, _ = ours(x)
    y.float().sum().backward()
    (row,) = [r for r in dispatch.auto_choices() if r["state"] == 512 and r["B"] == batch]
    assert row["captured"] == captured
    assert "cuda" in row["times"] and row["choice"] in row["times"], row
    assert {"triton", "cudnn"} <= set(row["times"]), row


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_layer_on_the_second_gpu_while_the_first_is_current():
    """The kernel is loaded into, and launched in, its tensors' device's context."""
    torch.manual_seed(0)
    ref = torch.nn.LSTM(40, 96).double()
    ours = mirrorgrad.nn.LSTM(40, 96, impl="cuda").to("cuda:1")
    ours.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    ref.load_state_dict({k: v.double().cpu() for k, v in ours.state_dict().items()})
    x = torch.randn(35, 3, 40)
    with torch.cuda.device(0):
        y, _ = ours(x.to("cuda:1"))
    assert relative_error(y, ref(x.double())[0]) <= TOLERANCE[torch.float32]


def _requested() -> int:
    """Bytes requested from the caching allocator and not freed (exact sizes)."""
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


def _peak_beyond(call, *, outputs_of) -> tuple[int, object]:
    """(peak bytes ``call()`` requested beyond what it returned, its result)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = _requested()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.memory_stats()["requested_bytes.all.peak"] - before
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in outputs_of(result) if t is not None and t.numel()}  # fmt: skip
    return peak - sum(storages.values()), result


@pytest.mark.parametrize(("H", "layers"), [(512, 1), (650, 1), (512, 2), (650, 2)])
def test_op_temporaries_within_the_memory_formulas(H, layers):
    """The forward's and the backward's peak beyond their inputs and outputs (the saved
    stash included) is what op.py's memory formulas say, from the layer's
    workspace_bytes or (2 layers, dropout: the wavefront) the stack's: at most, and not
    far below (650: its padded copies counted)."""
    from mirrorgrad.ops.rnn import op

    T, B, n_in, dtype = 100, 20, 256, torch.bfloat16
    x = torch.randn(T, B, n_in, device=DEVICE, dtype=dtype)
    weights = []
    for layer in range(layers):
        weights += [torch.randn(4 * H, n_in if layer == 0 else H, device=DEVICE, dtype=dtype) / 16,
                    torch.randn(4 * H, H, device=DEVICE, dtype=dtype) / 16,
                    torch.randn(4 * H, device=DEVICE, dtype=dtype),
                    torch.randn(4 * H, device=DEVICE, dtype=dtype)]  # fmt: skip
    hx = torch.randn(layers, B, H, device=DEVICE, dtype=dtype)
    seed = torch.zeros((), dtype=torch.int64, device=DEVICE)
    dropout = 0.5 if layers > 1 else 0.0
    config = ("lstm", layers, False, True, 0, dropout, "stash", None, "cuda")
    assert _wavefront_runs(x, layers, H) == (layers > 1)
    forward_args = (x, weights, hx, hx, None, seed, *config, True)
    grads = [torch.randn(T, B, H, device=DEVICE, dtype=dtype), torch.randn_like(hx),
             torch.randn_like(hx)]  # fmt: skip

    def forward():
        return torch.ops.mirrorgrad.rnn_forward(*forward_args)

    def backward(y, saved):
        return torch.ops.mirrorgrad.rnn_backward(*grads, x, weights, hx, hx, None, seed, y,
                                                 saved, *config, needs)  # fmt: skip

    needs = [True] * (3 + len(weights))

    def flat(result):
        return [t for item in result for t in (item if isinstance(item, list) else [item])]

    y, _, _, saved = forward()
    backward(y, saved)  # first calls: NVRTC, cuBLAS's workspace
    forward_peak, (y, _, _, saved) = _peak_beyond(forward, outputs_of=flat)
    backward_peak, _ = _peak_beyond(lambda: backward(y, saved), outputs_of=flat)
    forward_formula = op._rnn_forward_temporary_bytes(*forward_args)
    backward_formula = op._rnn_backward_temporary_bytes(
        *grads, x, weights, hx, hx, None, seed, y, saved, *config, needs)  # fmt: skip
    slack = 64 * 1024  # small tensors: the barrier's flag as bool, a stacked state
    measured = {"forward": (forward_peak, forward_formula),
                "backward": (backward_peak, backward_formula)}  # fmt: skip
    assert forward_formula / 2 <= forward_peak <= forward_formula + slack, measured
    assert backward_formula / 2 <= backward_peak <= backward_formula + slack, measured


def _wavefront_runs(x, layers, hidden) -> bool:
    from mirrorgrad.ops.rnn import cuda_persistent

    hx = x.new_empty(layers, x.shape[1], hidden)
    return cuda_persistent.wavefront_reason(x, [x], hx, None, "lstm", layers, False, 0,
                                            None) is None  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("layers", "hidden", "batch", "T"), [
    (2, 650, 20, 35), (3, 256, 20, 35), (3, 256, 3, 1), (2, 96, 1, 5),
])  # fmt: skip
def test_wavefront_stack_matches_float64(dtype, layers, hidden, batch, T):
    """The stack as one wavefront launch (fp32 2x650 does not fit: 132 registers of W a
    thread at 12 units a CTA; it runs layer by layer), then the layers' backward."""
    torch.manual_seed(0)
    ours, ref = _pair(40, hidden, layers=layers, dtype=dtype)
    inputs, grads = _inputs(T, batch, 40, hidden, dtype, layers=layers)
    fits = (dtype, hidden) != (torch.float32, 650)
    assert _wavefront_runs(inputs[0], layers, hidden) == fits
    _check_against_float64(ours, ref, inputs, grads, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wavefront_with_dropout_agrees_with_layer_by_layer(dtype, monkeypatch):
    """The same masks (one seed): the wavefront and the layers agree within the products'
    rounding (the layers round x W_ih^T to the dtype before the kernel; the wavefront
    sums it in fp32)."""
    from mirrorgrad.ops.rnn import cuda_persistent

    inputs, grads = _inputs(35, 20, 64, 256, dtype, layers=3)
    results = []
    for wavefront in (True, False):
        monkeypatch.setattr(cuda_persistent, "WAVEFRONT", wavefront)
        torch.manual_seed(0)
        module = mirrorgrad.nn.LSTM(64, 256, 3, dropout=0.5, impl="cuda").to(DEVICE, dtype)
        torch.manual_seed(1)  # the dropout seed
        results.append(_run(module, inputs, grads))
    for a, b in zip(*results):
        assert relative_error(a, b.double().cpu()) <= TOLERANCE[dtype]


@pytest.mark.parametrize(("layers", "hidden"), [(2, 650), (3, 256)])
def test_wavefront_captured_replays_with_new_inputs(layers, hidden):
    """Forward and backward captured in one CUDA Graph: replays after new inputs and an
    in-place weight update give what eager calls give; with dropout each replay draws
    fresh masks (its seed is drawn on the GPU inside the graph)."""
    torch.manual_seed(0)
    ours, _ = _pair(40, hidden, layers=layers, dtype=torch.bfloat16)
    inputs, grads = _inputs(35, 20, 40, hidden, torch.bfloat16, layers=layers)
    assert _wavefront_runs(inputs[0], layers, hidden)
    static = [t.clone() for t in (*inputs, *grads)]
    graph, outputs = capture(lambda: _run(ours, static[:3], static[3:]))
    for seed in (1, 2):
        with torch.no_grad():  # an optimizer's in-place step, between replays
            for weight in ours.parameters():
                weight.mul_(1.01)
        new_inputs, new_grads = _inputs(35, 20, 40, hidden, torch.bfloat16, layers=layers,
                                        seed=seed)  # fmt: skip
        for slot, value in zip(static, (*new_inputs, *new_grads)):
            slot.copy_(value)
        graph.replay()
        eager = _run(ours, new_inputs, new_grads)
        for a, b in zip(outputs, eager):
            assert relative_error(a, b.double().cpu()) <= 1e-2 * TOLERANCE[torch.bfloat16]

    ours.dropout = 0.5
    graph, outputs = capture(lambda: _run(ours, static[:3], static[3:]))
    graph.replay()
    first = [t.clone() for t in outputs]
    graph.replay()
    assert all(torch.isfinite(t).all() for t in outputs)
    assert not torch.equal(first[0], outputs[0])  # fresh masks


def test_a_wavefront_barrier_that_gives_up_gives_nan_then_raises():
    ours = mirrorgrad.nn.LSTM(40, 96, 2, impl="cuda").to(DEVICE)
    x = torch.randn(35, 3, 40, device=DEVICE)
    assert _wavefront_runs(x, 2, 96)
    ours(x)
    kernel = cuda_lstm_kernel.compiled_wavefront("fp32", 96, 3, 2, torch.device(DEVICE, 0))
    _gives_nan_then_raises(ours, x, kernel)


def test_wavefront_op_passes_opcheck():
    """The stack's outputs and saved tensors as the fake kernel says, none sharing storage."""
    from .test_rnn_contract import UTILS, _backward_args
    from .test_rnn_op import forward_args, stack_inputs

    def gpu(t):
        return t.detach().to(DEVICE).requires_grad_()

    x, weights, hx, cx = stack_inputs("lstm", layers=3, bidirectional=False, T=3, B=3, n_in=8,
                                      H=13, dtype=torch.float32)  # fmt: skip
    args = list(forward_args("lstm", gpu(x), [gpu(w) for w in weights], gpu(hx), gpu(cx),
                             layers=3, bidirectional=False, dropout=0.5, impl="cuda"))  # fmt: skip
    args[5] = args[5].to(DEVICE)  # the dropout seed lives on the GPU
    args = tuple(args)
    assert _wavefront_runs(args[0], 3, 13)
    torch.library.opcheck(torch.ops.mirrorgrad.rnn_forward.default, args, test_utils=UTILS)
    torch.library.opcheck(torch.ops.mirrorgrad.rnn_backward.default, _backward_args(args),
                          test_utils=UTILS)  # fmt: skip
