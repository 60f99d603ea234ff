"""PyTorch's own RNN tests (test/test_nn.py, torch 2.11-2.13), ported to pytest and run
for both ``torch.nn`` and ``mirrorgrad.nn`` (ids "torch" / "mirrorgrad"), on the CPU and,
when present, on the GPU.

Each test keeps the name and the checks of its PyTorch original; ``nn`` below is the
flavour under test (its LSTM, GRU, RNN and cells), ``torch.nn`` stays the reference
where the original compares against the CPU. Sizes and loops are cut where the
original runs exhaustive products, so the CPU run stays short. test/nn/ of these
releases holds no RNN-module tests (test_packed_sequence.py tests only the
torch.nn.utils.rnn helpers, which take no module). TorchScript is out of scope.

Every case that cannot pass for a flavour is in SKIPS, with the reason.
"""

from __future__ import annotations

import copy
import io
import itertools
import re
import types
import warnings

import pytest
import torch
import torch.nn.utils.rnn as rnn_utils
from torch.autograd import gradcheck, gradgradcheck

import mirrorgrad.nn as mnn

# (test name, flavour) -> why that case cannot pass for that flavour.
SKIPS: dict[tuple[str, str], str] = {
    ("test_cudnn_weight_format", "mirrorgrad"): (
        "checks cuDNN's warning about weights outside its single flat buffer; mirrorgrad "
        "keeps no flat buffer, so there is nothing to warn about (outputs and gradients "
        "after weight.set_ are checked in tests/nn/test_rnn_modules.py)"
    ),
    ("test_rnn_double_backward_cudnn_error", "mirrorgrad"): (
        "checks that cuDNN refuses double backward; mirrorgrad's op supports it "
        "(tests/nn/test_rnn_modules.py::test_gradgradcheck)"
    ),
}

FLAVOURS = {
    "torch": types.SimpleNamespace(
        LSTM=torch.nn.LSTM, GRU=torch.nn.GRU, RNN=torch.nn.RNN,
        LSTMCell=torch.nn.LSTMCell, GRUCell=torch.nn.GRUCell, RNNCell=torch.nn.RNNCell,
    ),
    "mirrorgrad": types.SimpleNamespace(
        LSTM=mnn.LSTM, GRU=mnn.GRU, RNN=mnn.RNN,
        LSTMCell=mnn.LSTMCell, GRUCell=mnn.GRUCell, RNNCell=mnn.RNNCell,
    ),
}  # fmt: skip
HAS_CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu")]
if HAS_CUDA:
    DEVICES.append(pytest.param("cuda", id="cuda", marks=pytest.mark.gpu))
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
PARAM_DEVICE = "Input and parameter tensors are not at the same device"
HIDDEN_DEVICE = "Input and hidden tensors are not at the same device"
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (as PyTorch's original)"
)


@pytest.fixture(autouse=True)
def _tf32_off():
    """The TF32-off half of the originals' @tf32_on_and_off: GPU results are compared with
    float32/float64 CPU results at full-precision tolerances."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(params=list(FLAVOURS), ids=list(FLAVOURS))
def flavour(request) -> str:
    reason = SKIPS.get((request.node.originalname, request.param))
    if reason is not None:
        pytest.skip(reason)
    return request.param


@pytest.fixture
def nn(flavour):
    return FLAVOURS[flavour]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def assert_equal(a, b, atol=None, rtol=None):
    """PyTorch's assertEqual for what these tests compare: tensors, tuples, numbers."""
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal(x, y, atol, rtol)
        return
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        b = torch.as_tensor(b, dtype=a.dtype if isinstance(a, torch.Tensor) else None)
        a = torch.as_tensor(a)
        b = b.to(a.device)
        if atol is None and rtol is None:
            torch.testing.assert_close(a, b, check_dtype=False)
        else:
            torch.testing.assert_close(a, b, atol=atol or 0, rtol=rtol or 0, check_dtype=False)
        return
    assert a == b


def assert_not_equal(a, b):
    with pytest.raises(AssertionError):
        assert_equal(a, b)


# --- TestNN -------------------------------------------------------------------------------


def test_RNN_nonlinearity(nn):
    rnn = nn.RNN(1, 10)
    assert rnn.nonlinearity == "tanh"
    rnn = nn.RNN(1, 10, nonlinearity="relu")
    assert rnn.nonlinearity == "relu"
    with pytest.raises(ValueError, match="Unknown nonlinearity"):
        nn.RNN(1, 10, nonlinearity="garbage")


def test_RNN_nonlinearity_passed_as_arg(nn):
    rnn = nn.RNN(2, 3, 1, "relu")
    assert rnn.nonlinearity == "relu"


def test_rnn_weight_norm(nn):
    def check_weight_norm(layer, name, num_params):
        layer = torch.nn.utils.weight_norm(layer, name=name)
        assert sum(isinstance(p, torch.nn.Parameter) for p in layer._flat_weights) == (
            num_params - 1
        )
        layer = torch.nn.utils.remove_weight_norm(layer, name=name)
        assert sum(isinstance(p, torch.nn.Parameter) for p in layer._flat_weights) == num_params
        assert name in layer._parameters and layer._parameters[name] is not None
        assert name + "_v" not in layer._parameters and name + "_g" not in layer._parameters
        named = dict(layer.named_parameters())
        assert named.get(name) is not None
        assert name + "_v" not in named and name + "_g" not in named

    check_weight_norm(nn.LSTM(32, 32), "weight_ih_l0", 4)
    check_weight_norm(nn.LSTM(32, 32, proj_size=16), "weight_hr_l0", 5)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cell", ["RNNCell", "GRUCell"])
def test_RNN_cell(nn, device, cell, bias):
    input = torch.randn(3, 10, device=device)
    hx = torch.randn(3, 20, device=device)
    module = getattr(nn, cell)(10, 20, bias=bias, device=device)
    for _ in range(6):
        hx = module(input, hx)
    hx.sum().backward()


def test_RNN_cell_forward_zero_hidden_size(nn, device):
    input = torch.randn(3, 10, device=device)
    hx = torch.randn(3, 0, device=device)
    for cell in (
        nn.RNNCell(10, 0, nonlinearity="relu", device=device),
        nn.RNNCell(10, 0, nonlinearity="tanh", device=device),
        nn.GRUCell(10, 0, device=device),
    ):
        assert cell(input, hx).shape == torch.Size([3, 0])


def test_RNN_cell_no_broadcasting(nn, device):
    def check(cell_module, input, hx, input_size, hidden_size):
        cell = cell_module(input_size, hidden_size, device=device)
        with pytest.raises(RuntimeError):
            cell(input, hx)

    def check_all(hidden_size, bad_hx, good_hx, input_size, input):
        check(nn.RNNCell, input, bad_hx, input_size, hidden_size)
        check(nn.GRUCell, input, bad_hx, input_size, hidden_size)
        check(nn.LSTMCell, input, (bad_hx, good_hx), input_size, hidden_size)
        check(nn.LSTMCell, input, (good_hx, bad_hx), input_size, hidden_size)

    hidden_size, input_size = 20, 10
    input = torch.randn(3, input_size, device=device)
    good_hx = torch.randn(3, hidden_size, device=device)
    check_all(hidden_size, torch.randn(1, hidden_size, device=device), good_hx, input_size, input)
    check_all(hidden_size, torch.randn(3, 1, device=device), good_hx, input_size, input)
    check_all(hidden_size, good_hx, good_hx, input_size, torch.randn(3, 1, device=device))


@pytest.mark.parametrize("bias", [True, False])
def test_LSTM_cell(nn, device, bias):
    input = torch.randn(3, 10, device=device)
    hx = torch.randn(3, 20, device=device)
    cx = torch.randn(3, 20, device=device)
    lstm = nn.LSTMCell(10, 20, bias=bias, device=device)
    for _ in range(6):
        hx, cx = lstm(input, (hx, cx))
    (hx + cx).sum().backward()


def test_LSTM_cell_forward_input_size(nn, device):
    input = torch.randn(3, 11, device=device)
    hx = torch.randn(3, 20, device=device)
    cx = torch.randn(3, 20, device=device)
    lstm = nn.LSTMCell(10, 20, device=device)
    with pytest.raises(Exception):  # noqa: B017 (the original asserts Exception)
        lstm(input, (hx, cx))


def test_LSTM_cell_forward_hidden_size(nn, device):
    input = torch.randn(3, 10, device=device)
    hx = torch.randn(3, 21, device=device)
    cx = torch.randn(3, 20, device=device)
    lstm = nn.LSTMCell(10, 20, device=device)
    with pytest.raises(Exception):  # noqa: B017 (the original asserts Exception)
        lstm(input, (hx, cx))
    with pytest.raises(Exception):  # noqa: B017
        lstm(input, (cx, hx))


@needs_cuda
def test_pack_sequence_batch_sizes_throw(nn):
    with pytest.raises(ValueError, match=r"batch_sizes should always be on CPU"):
        nn.LSTM(3, 4, bidirectional=True, num_layers=2).to("cuda")
        a = torch.rand(5, 3, device="cuda")
        b = torch.tensor([1, 1, 1, 1, 1], device="cuda")
        rnn_utils.PackedSequence(a, b)


@needs_two_gpus
def test_cudnn_rnn_dropout_states_device(nn):
    rnn = nn.RNN(10, 20, num_layers=2, dropout=0.5)
    input = torch.randn(5, 4, 10).cuda(1)
    rnn.cuda(1)
    hx = torch.randn(2, 4, 20).cuda(1)
    rnn(input, hx)


def test_cudnn_forward_exception(nn, device):
    rnns = [
        (nn.LSTM(10, 20, batch_first=True), (torch.zeros(1, 2, 19), torch.zeros(1, 2, 19))),
        (nn.LSTM(10, 20, batch_first=True, proj_size=10),
         (torch.zeros(1, 2, 19), torch.zeros(1, 2, 19))),
        (nn.GRU(10, 20, batch_first=True), torch.zeros(1, 2, 19)),
        (nn.RNN(10, 20, batch_first=True), torch.zeros(1, 2, 19)),
    ]  # fmt: skip
    x_wrong = torch.randn(2, 3, 3, device=device)
    x_right = torch.randn(2, 3, 10, device=device)
    for rnn, hidden in rnns:
        rnn.to(device)
        if isinstance(hidden, tuple):
            hidden = tuple(h.to(device) for h in hidden)
        else:
            hidden = hidden.to(device)
        with pytest.raises(RuntimeError, match=r"Expected hidden.*size.*got"):
            rnn(x_right, hidden)
        with pytest.raises(
            RuntimeError, match=re.escape("input.size(-1) must be equal to input_size")
        ):
            rnn(x_wrong)


def _gpu_rnn_pass(rnn, proj_hx_size):
    """Forward and backward of the cuDNN weight tests; returns (output, all_vars)."""
    rnn.cuda()
    input = torch.randn(5, 4, 10, requires_grad=True, device="cuda")
    hx = torch.randn(rnn.num_layers * 2 if rnn.bidirectional else 1, 5, 20, device="cuda")
    hx.requires_grad_()
    all_vars = [input, hx, *rnn.parameters()]
    if isinstance(rnn, torch.nn.LSTM):
        if rnn.proj_size > 0:
            hx = torch.randn(hx.shape[0], 5, proj_hx_size, requires_grad=True, device="cuda")
            all_vars[1] = hx
        cx = torch.randn(hx.shape[0], 5, 20, requires_grad=True, device="cuda")
        all_vars[2:2] = [cx]
        hx = (hx, cx)
    return input, hx, all_vars


@needs_cuda
def test_cudnn_weight_format(nn):
    rnns = [
        nn.LSTM(10, 20, batch_first=True),
        nn.LSTM(10, 20, batch_first=True, proj_size=10),
        nn.GRU(10, 20, batch_first=True),
        nn.RNN(10, 20, batch_first=True),
    ]
    first_warn = True
    for rnn in rnns:
        input, hx, all_vars = _gpu_rnn_pass(rnn, 10)
        output = rnn(input, hx)
        output[0].sum().backward()
        grads = [v.grad.data.clone() for v in all_vars]
        for v in all_vars:
            v.grad.data.zero_()
        weight = all_vars[4]
        weight_data = weight.data.clone()
        with torch.no_grad():
            weight.set_(weight_data)
        for _ in range(2):
            with warnings.catch_warnings(record=True) as w:
                output_noncontig = rnn(input, hx)
            if first_warn:
                assert len(w) == 1
                assert "weights are not part of single contiguous chunk of memory" in str(
                    w[0].message
                )
                first_warn = False
                warnings.resetwarnings()
            output_noncontig[0].sum().backward()
            grads_noncontig = [v.grad.data.clone() for v in all_vars]
            for v in all_vars:
                v.grad.data.zero_()
            assert_equal(output, output_noncontig)
            assert_equal(grads_noncontig, grads)
        weight_data[:] = 4
        assert_equal(weight_data, all_vars[4].data)


@needs_cuda
def test_cudnn_weight_tying(nn):
    rnns = [
        nn.LSTM(10, 20, batch_first=True, bidirectional=True),
        nn.LSTM(10, 20, batch_first=True, bidirectional=True, proj_size=10),
        nn.GRU(10, 20, batch_first=True, bidirectional=True),
        nn.RNN(10, 20, batch_first=True, bidirectional=True),
    ]
    for rnn in rnns:
        rnn.bias_ih_l0_reverse = rnn.bias_ih_l0
        input, hx, _ = _gpu_rnn_pass(rnn, 10)
        opt = torch.optim.SGD(rnn.parameters(), lr=0.1)
        opt.zero_grad()
        with warnings.catch_warnings(record=True):
            output = rnn(input, hx)
        output[0].sum().backward()
        opt.step()
        with warnings.catch_warnings(record=True):
            output_cuda = rnn(input, hx)
        rnn.cpu()
        hx = (hx[0].cpu(), hx[1].cpu()) if isinstance(hx, tuple) else hx.cpu()
        output_cpu = rnn(input.cpu(), hx)
        assert_equal(output_cuda, output_cpu)


def _update_shape(shape, dim, size):
    shape = list(shape)
    shape[dim] = size
    return tuple(shape)


@pytest.mark.parametrize("mode", ["RNN", "GRU", "LSTM"])
def test_rnn_args_check(nn, device, mode):
    input_size, hidden_size, num_layers, batch_size, seq_len, bad_size = 3, 5, 2, 4, 6, 7
    good_input = (seq_len, batch_size, input_size)
    good_hidden = (num_layers, batch_size, hidden_size)

    def inputs(input_shape, hidden_shape):
        input = torch.randn(input_shape, device=device)
        hidden = torch.randn(hidden_shape, device=device)
        if mode != "LSTM":
            return [(input, hidden)]
        if hidden_shape == good_hidden:
            return [(input, (hidden, hidden))]
        good = torch.randn(good_hidden, device=device)
        return [(input, (hidden, good)), (input, (good, hidden))]

    cases = [
        (_update_shape(good_input, 1, bad_size), good_hidden),
        (good_input, _update_shape(good_hidden, 1, bad_size)),
        (_update_shape(good_input, 2, bad_size), good_hidden),
        (good_input, _update_shape(good_hidden, 2, bad_size)),
        (good_input, _update_shape(good_hidden, 0, bad_size)),
    ]
    for input_shape, hidden_shape in cases:
        for input, hidden in inputs(input_shape, hidden_shape):
            model = getattr(nn, mode)(input_size, hidden_size, num_layers, device=device)
            with pytest.raises(RuntimeError):
                model(input, hidden)


def test_projections_lstm_args_check(nn, device):
    input_size, hidden_size, proj_size, num_layers, batch_size, seq_len, bad = 3, 5, 2, 2, 4, 6, 7
    good_input = (seq_len, batch_size, input_size)
    good_h = (num_layers, batch_size, proj_size)
    good_c = (num_layers, batch_size, hidden_size)
    cases = [
        (_update_shape(good_input, 1, bad), good_h, good_c),
        (good_input, _update_shape(good_h, 1, bad), _update_shape(good_c, 1, bad)),
        (_update_shape(good_input, 2, bad), good_h, good_c),
        (good_input, _update_shape(good_h, 2, bad), _update_shape(good_c, 2, bad)),
        (good_input, _update_shape(good_h, 0, bad), _update_shape(good_c, 0, bad)),
        (good_input, _update_shape(good_h, 0, hidden_size), good_c),
        (good_input, _update_shape(good_h, 0, bad), good_c),
        (good_input, good_h, _update_shape(good_c, 0, bad)),
    ]
    for input_shape, h_shape, c_shape in cases:
        model = nn.LSTM(input_size, hidden_size, num_layers, proj_size=proj_size, device=device)
        hidden = (torch.randn(h_shape, device=device), torch.randn(c_shape, device=device))
        with pytest.raises(RuntimeError):
            model(torch.randn(input_shape, device=device), hidden)


@needs_two_gpus
@pytest.mark.parametrize("mode", ["RNN", "GRU", "LSTM"])
def test_rnn_check_device(nn, mode):
    model = getattr(nn, mode)(3, 5, 2)
    model_cuda = copy.deepcopy(model).to("cuda:0")
    input = torch.randn(6, 4, 3)
    hidden = torch.randn(2, 4, 5)
    with pytest.raises(RuntimeError, match=PARAM_DEVICE):
        model(input.to("cuda:0"))
    with pytest.raises(RuntimeError, match=PARAM_DEVICE):
        model_cuda(input)
    state = (hidden.to("cuda:0"), hidden.to("cuda:0")) if mode == "LSTM" else hidden.to("cuda:0")
    with pytest.raises(RuntimeError, match=HIDDEN_DEVICE):
        model(input, state)
    state = (hidden, hidden) if mode == "LSTM" else hidden
    with pytest.raises(RuntimeError, match=HIDDEN_DEVICE):
        model_cuda(input.to("cuda:0"), state)
    if mode == "LSTM":
        with pytest.raises(RuntimeError, match=HIDDEN_DEVICE):
            model(input.to("cuda:0"), (hidden.to("cuda:0"), hidden.to("cuda:1")))


@needs_two_gpus
def test_projections_lstm_check_device(nn):
    model = nn.LSTM(3, 5, 2, proj_size=2)
    input = torch.randn(6, 4, 3)
    hidden_h, hidden_c = torch.randn(2, 4, 2), torch.randn(2, 4, 5)
    with pytest.raises(RuntimeError, match=PARAM_DEVICE):
        model(input.to("cuda:0"))
    with pytest.raises(RuntimeError, match=HIDDEN_DEVICE):
        model(input, (hidden_h.to("cuda:0"), hidden_c.to("cuda:0")))
    with pytest.raises(RuntimeError, match=HIDDEN_DEVICE):
        model(input.to("cuda:0"), (hidden_h.to("cuda:0"), hidden_c.to("cuda:1")))


@pytest.mark.parametrize("mode", ["RNN", "GRU", "LSTM"])
def test_rnn_initial_hidden_state(nn, device, mode):
    rnn = getattr(nn, mode)(30, 20, 2, device=device)
    input = torch.randn(10, 32, 30, device=device)
    hidden = torch.zeros(2, 32, 20, device=device)
    if mode == "LSTM":
        hidden = (hidden, hidden)
    output1, hidden1 = rnn(input, hidden)
    output2, hidden2 = rnn(input)
    assert_equal(output1, output2)
    assert_equal(hidden1, hidden2)


@pytest.mark.parametrize("bidir", [False, True])
def test_projections_lstm_initial_hidden_state(nn, device, bidir):
    rnn = nn.LSTM(30, 20, 2, bidirectional=bidir, proj_size=10, device=device)
    num_dirs = 2 if bidir else 1
    input = torch.randn(10, 32, 30, device=device)
    hidden = (torch.zeros(2 * num_dirs, 32, 10, device=device),
              torch.zeros(2 * num_dirs, 32, 20, device=device))  # fmt: skip
    output1, hidden1 = rnn(input, hidden)
    output2, hidden2 = rnn(input)
    assert_equal(output1, output2)
    assert_equal(hidden1, hidden2)


@pytest.mark.parametrize("mode", ["RNN", "GRU"])
def test_projections_errors_on_gru_and_rnn(nn, mode):
    error_msg = "proj_size argument is only supported for LSTM, not RNN or GRU"
    with pytest.raises(ValueError, match=error_msg):
        getattr(nn, mode)(30, 20, 2, proj_size=10)


# _test_RNN_cpu_vs_cudnn: there, the CPU result against cuDNN's; here, the flavour on the
# device against torch.nn on the CPU, in float64. Four of the original's 64 combinations
# of (bias, bidirectional, batch_first, contiguous, variable length, lengths as tensor).
CPU_VS_DEVICE_COMBOS = [
    (True, False, False, True, False, False),
    (False, True, True, False, True, True),
    (True, True, False, False, True, False),
    (True, False, True, True, True, True),
]


def _forward_backward(rnn, input_val, grad_output, weights_val, hx_val, grad_hy, device,
                      cx_val=None, grad_cy=None):  # fmt: skip
    is_lstm = isinstance(rnn, torch.nn.LSTM)
    for x_layer, y_layer in zip(rnn.all_weights, weights_val):
        for x, y in zip(x_layer, y_layer):
            x.data.copy_(y.data)
    rnn.to(device)
    if isinstance(input_val, rnn_utils.PackedSequence):
        data = input_val.data.detach().to(device).requires_grad_(True)
        input = rnn_utils.PackedSequence(data, input_val.batch_sizes)
        input_var = data
    else:
        input = input_val.clone().to(device).requires_grad_(True)
        input_var = input
    c_init = hx_val if cx_val is None else cx_val
    if is_lstm:
        hx = (hx_val.clone().to(device).requires_grad_(True),
              c_init.add(1).to(device).requires_grad_(True))  # fmt: skip
    else:
        hx = hx_val.clone().to(device).requires_grad_(True)
    output, hy = rnn(input, hx)
    if isinstance(output, rnn_utils.PackedSequence):
        output = output.data
    grad_output, grad_hy = grad_output.to(device), grad_hy.to(device)
    if is_lstm:
        grad_c = grad_hy + 1 if grad_cy is None else grad_cy.to(device) + 1
        torch.autograd.backward([output, hy[0], hy[1]], [grad_output, grad_hy, grad_c])
    else:
        torch.autograd.backward([output, hy], [grad_output, grad_hy])
    return {
        "output": output.data.cpu(),
        "hy": (hy[0] if is_lstm else hy).data.cpu(),
        "weights": rnn.all_weights,
        "grad_input": input_var.grad.data.cpu(),
        "grad_hx": (hx[0] if is_lstm else hx).grad.data.cpu(),
        "cy": hy[1].data.cpu() if is_lstm else None,
        "grad_cx": hx[1].grad.data.cpu() if is_lstm else None,
    }


def _compare_outputs(expected, actual):
    for key in expected:
        if key != "weights":
            assert_equal(actual[key], expected[key], atol=5e-5, rtol=0)
    for ref_layer, layer in zip(expected["weights"], actual["weights"]):
        for ref_weight, weight in zip(ref_layer, layer):
            assert_equal(weight.grad.data.cpu(), ref_weight.grad.data, atol=5e-5, rtol=0)


def _noncontig(tensor):
    ndim = tensor.dim()
    return torch.stack([tensor.clone().zero_(), tensor], ndim).select(ndim, 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "combo", CPU_VS_DEVICE_COMBOS, ids=lambda c: "".join("TF"[not b] for b in c)
)
@pytest.mark.parametrize("module", ["RNN", "RNN_relu", "LSTM", "GRU", "LSTM_proj"])
@pytest.mark.parametrize("dropout", [0, 1], ids=["no_dropout", "with_dropout"])
def test_RNN_cpu_vs_device(nn, device, dropout, module, combo):
    bias, bidirectional, batch_first, contig, variable_len, lens_as_tensor = combo
    dtype = torch.double
    input_size, hidden_size, proj_size, num_layers, seq_length, batch = 10, 6, 3, 2, 7, 6
    num_dirs = 2 if bidirectional else 1
    out_size = proj_size if module == "LSTM_proj" else hidden_size
    kwargs = dict(bias=bias, dropout=dropout, bidirectional=bidirectional,
                  batch_first=batch_first)  # fmt: skip
    name = module.split("_")[0]
    if module == "RNN_relu":
        kwargs["nonlinearity"] = "relu"
    if module == "LSTM_proj":
        kwargs["proj_size"] = proj_size
    shape = (batch, seq_length) if batch_first else (seq_length, batch)
    input_val = torch.randn(*shape, input_size, dtype=dtype)
    grad_output = torch.randn(*shape, out_size * num_dirs, dtype=dtype)
    hx_val = torch.randn(num_layers * num_dirs, batch, out_size, dtype=dtype)
    grad_hy = torch.randn(num_layers * num_dirs, batch, out_size, dtype=dtype)
    cx_val = grad_cy = None
    if module == "LSTM_proj":
        cx_val = torch.randn(num_layers * num_dirs, batch, hidden_size, dtype=dtype)
        grad_cy = torch.randn(num_layers * num_dirs, batch, hidden_size, dtype=dtype)
    if not contig:
        grad_output, grad_hy, hx_val = map(_noncontig, (grad_output, grad_hy, hx_val))
        if cx_val is not None:
            cx_val, grad_cy = _noncontig(cx_val), _noncontig(grad_cy)
    if variable_len:
        lengths = [7, 5, 5, 2, 1, 1]
        if lens_as_tensor:
            lengths = torch.tensor(lengths, dtype=torch.long)
        input_val = rnn_utils.pack_padded_sequence(input_val, lengths, batch_first=batch_first)
        grad_output = rnn_utils.pack_padded_sequence(
            grad_output, lengths, batch_first=batch_first
        ).data
    reference = getattr(torch.nn, name)(input_size, hidden_size, num_layers, **kwargs).to(dtype)
    expected = _forward_backward(reference, input_val, grad_output, reference.all_weights,
                                 hx_val, grad_hy, "cpu", cx_val, grad_cy)  # fmt: skip
    rnn = getattr(nn, name)(input_size, hidden_size, num_layers, **kwargs).to(dtype)
    actual = _forward_backward(rnn, input_val, grad_output, reference.all_weights, hx_val,
                               grad_hy, device, cx_val, grad_cy)  # fmt: skip
    _compare_outputs(expected, actual)


@needs_cuda
@pytest.mark.parametrize("name", ["weight_hh_l0", "weight_hr_l0"])
def test_RNN_cudnn_weight_norm(nn, name):
    kwargs = {"proj_size": 3} if name == "weight_hr_l0" else {}
    m = nn.LSTM(10, 6, 2, **kwargs)
    input = torch.randn(7, 6, 10)
    expected_output = m(input)
    m = torch.nn.utils.weight_norm(m, name=name).cuda()
    input = input.cuda()
    warnings.simplefilter("always")
    assert_equal(m(input), expected_output)
    m = torch.nn.utils.remove_weight_norm(m, name=name)
    assert_equal(m(input), expected_output)


@needs_cuda
def test_partial_flat_weights(nn):
    m = nn.LSTM(10, 6, 2)
    inp = torch.randn(3, 2, 10)
    out_expected = m(inp)
    weight_orig = m.weight_hh_l0
    del m.weight_hh_l0
    assert not hasattr(m, "weight_hh_l0")
    m.cuda()
    m.weight_hh_l0 = weight_orig.cuda()
    inp = inp.cuda()
    warnings.simplefilter("always")
    assert_equal(m(inp)[0].cpu(), out_expected[0])


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("p", [0, 0.276, 0.731, 1])
def test_RNN_dropout(nn, device, p, train):
    # checks that dropout sits between the layers (the original: cuDNN's placement)
    rnn = nn.RNN(10, 1000, 2, bias=False, dropout=p, nonlinearity="relu",
                 device=device, dtype=torch.double)  # fmt: skip
    rnn.train(train)
    for weight in (rnn.weight_ih_l0, rnn.weight_hh_l0, rnn.weight_ih_l1, rnn.weight_hh_l1):
        weight.data.fill_(1)
    input = torch.ones(1, 1, 10, device=device, dtype=torch.double)
    hx = torch.zeros(2, 1, 1000, device=device, dtype=torch.double)
    output, hy = rnn(input, hx)
    assert_equal(output.data.min(), output.data.max())
    output_val = output.data[0][0][0]
    if p == 0 or not train:
        assert_equal(output_val, 10000)
    elif p == 1:
        assert_equal(output_val, 0)
    else:
        assert 8000 < output_val < 12000
        denorm_mod = (output_val * (1 - p)) % 10
        assert min(denorm_mod, 10 - denorm_mod) < 1e-2
    assert_equal(hy[0].data.min(), hy[0].data.max())
    assert_equal(hy[1].data.min(), hy[1].data.max())
    assert_equal(hy.data[0][0][0], 10)
    assert_equal(hy.data[1][0][0], output_val)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("mode", ["RNN", "LSTM", "GRU"])
def test_error_RNN_seq_len_zero(nn, device, mode, bidirectional):
    input = torch.ones(0, 10, 5, device=device)
    rnn = getattr(nn, mode)(5, 6, bidirectional=bidirectional, device=device)
    with pytest.raises(RuntimeError, match="Expected sequence length to be larger than 0 in RNN"):
        rnn(input)


@pytest.mark.parametrize("mode", ["RNN", "LSTM", "GRU"])
def test_RNN_input_size_zero(nn, device, mode):
    input = torch.zeros((5, 0, 3), device=device)
    rnn = getattr(nn, mode)(input_size=3, hidden_size=4, device=device)
    outs = rnn(input)
    assert outs[0].shape == torch.Size([5, 0, 4])
    outs[0].sum().backward()


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("p", [0, 0.1234])
def test_RNN_dropout_state(nn, device, p, train):
    rnn = nn.RNN(100, 100, 2, bias=False, dropout=p, nonlinearity="relu", device=device)
    rnn.train(train)
    input = torch.rand(1, 1, 100, device=device)
    hx = torch.rand(2, 1, 100, device=device)
    output1, hy1 = rnn(input, hx)
    output2, hy2 = rnn(input, hx)
    buf = io.BytesIO()
    torch.save(rnn, buf)
    buf.seek(0)
    rnn2 = torch.load(buf, weights_only=False)
    rnn2.flatten_parameters()
    output3, hy3 = rnn2(input, hx)
    if p == 0 or not train:
        assert_equal(output1, output2)
        assert_equal(output1, output3)
        assert_equal(hy1, hy2)
        assert_equal(hy1, hy3)
    else:
        assert_not_equal(output1, output2)
        assert_not_equal(output1, output3)
        assert_not_equal(hy1, hy2)
        assert_not_equal(hy1, hy3)


@pytest.mark.slow
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_RNN_change_dropout(nn, device, train):
    rnn = nn.RNN(100, 100, 2, dropout=0, nonlinearity="relu", device=device, dtype=torch.double)
    input = torch.rand(3, 2, 100, device=device, dtype=torch.double)
    rnn.train(train)
    prev_output = None
    for p in (0, 0.5, 0, 0.7, 0.2, 1, 0.2, 0):
        rnn.dropout = p
        output1, hy1 = rnn(input)
        output2, hy2 = rnn(input)
        if p == 0 or p == 1 or not train:
            assert_equal(output1, output2)
            assert_equal(hy1, hy2)
        else:
            assert_not_equal(output1, output2)
            assert_not_equal(hy1, hy2)
        if prev_output is not None:
            if not train:
                assert_equal(output1.data, prev_output)
                assert_equal(output2.data, prev_output)
            else:
                assert_not_equal(output1.data, prev_output)
                assert_not_equal(output2.data, prev_output)
        prev_output = output1.data


# --- TestNNDeviceType ---------------------------------------------------------------------


@pytest.mark.slow
def test_rnn_retain_variables(nn, device):
    dtype = torch.double
    rnns = [nn.LSTM(10, 20, num_layers=2), nn.GRU(10, 20, num_layers=2),
            nn.RNN(10, 20, num_layers=2)]  # fmt: skip
    for rnn in rnns:
        rnn.to(device, dtype)
        input = torch.randn(5, 6, 10, device=device, dtype=dtype, requires_grad=True)
        output = rnn(input)
        output[0].sum().backward(retain_graph=True)
        grads = [input.grad.data.clone()] + [p.grad.data.clone() for p in rnn.parameters()]
        for _ in range(4):
            rnn.zero_grad()
            input.grad.data.zero_()
            output[0].sum().backward(retain_graph=True)
            grads2 = [input.grad.data] + [p.grad.data for p in rnn.parameters()]
            assert_equal(grads, grads2)


def test_lstmcell_backward_only_one_output_grad(nn, device):
    # the original runs on CUDA only; the property holds on every device
    cell = nn.LSTMCell(2, 3).to(device).to(dtype=torch.double)
    s = torch.randn(1, 2, device=device, dtype=torch.double, requires_grad=True)
    for i in range(2):
        out = cell(s)[i]
        out.sum().backward()
        assert not (s.grad is None or s.grad.abs().sum().item() == 0)


def _flatten_out(mod, inp):
    out = mod(inp)
    return tuple(t if isinstance(t, torch.Tensor) else tt for t in out for tt in t)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_rnn_grad_and_gradgrad(nn, device, mode, bias):
    # test_LSTM_grad_and_gradgrad, test_GRU_grad_and_gradgrad
    hsize = 4
    inp = torch.rand(1, 3, hsize, device=device, dtype=torch.double, requires_grad=True)
    mod = getattr(nn, mode)(hsize, hsize, bias=bias).to(device).to(torch.double)
    with torch.backends.cudnn.flags(enabled=False):
        gradcheck(lambda x: _flatten_out(mod, x), inp, check_batched_grad=False)
        gradgradcheck(lambda x: _flatten_out(mod, x), inp, check_batched_grad=False)


@needs_cuda
@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_rnn_double_backward_cudnn_error(nn, mode):
    # the CUDA half of _test_rnn_mod: cuDNN's message for double backward
    inp = torch.rand(1, 3, 4, device="cuda", dtype=torch.double, requires_grad=True)
    mod = getattr(nn, mode)(4, 4).to("cuda", torch.double)
    with torch.backends.cudnn.flags(enabled=True):
        result = _flatten_out(mod, inp)
        result[0].sum().backward(create_graph=True)
        grad0 = next(mod.parameters()).grad
        with pytest.raises(RuntimeError, match="please disable the CuDNN backend temporarily"):
            grad0.sum().backward()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_LSTM_differentiable_backward_using_oneDNN(nn, dtype):
    net = nn.LSTM(3, 3, 20, batch_first=True)
    net_clone = copy.deepcopy(net)
    x = torch.rand(10, 12, 3)
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    enabled = torch._C._get_mkldnn_enabled()
    try:
        torch._C._set_mkldnn_enabled(False)
        out1, _ = net(x1)
        der_out1 = torch.autograd.grad(out1, x1, grad_outputs=torch.ones_like(out1),
                                       retain_graph=True, create_graph=True)[0]  # fmt: skip
        der_out1.sum().backward(retain_graph=True)
        torch._C._set_mkldnn_enabled(True)
        out2, _ = net_clone(x2)
        der_out2 = torch.autograd.grad(out2, x2, grad_outputs=torch.ones_like(out2),
                                       retain_graph=True, create_graph=True)[0]  # fmt: skip
        der_out2.sum().backward(retain_graph=True)
    finally:
        torch._C._set_mkldnn_enabled(enabled)
    assert torch.allclose(der_out1, der_out2)
    assert torch.allclose(x1.grad, x2.grad)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float, torch.double], ids=["float32", "float64"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", ["GRU", "LSTM"])
def test_rnn_fused(nn, mode, bias, dtype):
    # torch.nn on the CPU against the flavour on the GPU (cuDNN off, as the original)
    input_val = torch.randn(7, 6, 10, dtype=dtype)
    grad_output = torch.randn(7, 6, 6, dtype=dtype)
    hx_val = torch.randn(2, 6, 6, dtype=dtype)
    grad_hy = torch.randn(2, 6, 6, dtype=dtype)
    with torch.backends.cudnn.flags(enabled=False):
        rnn = getattr(torch.nn, mode)(10, 6, 2, bias=bias).to(dtype)
        rnn_device = getattr(nn, mode)(10, 6, 2, bias=bias).to("cuda", dtype)
        rnn_device.load_state_dict(rnn.state_dict())
        if mode == "LSTM":
            hx = (hx_val.clone().requires_grad_(True), hx_val.clone().add(1).requires_grad_(True))
            hx_device = (hx_val.clone().cuda().requires_grad_(True),
                         hx_val.clone().cuda().add(1).requires_grad_(True))  # fmt: skip
        else:
            hx = hx_val.clone().requires_grad_(True)
            hx_device = hx_val.clone().cuda().requires_grad_(True)
        inp = input_val.clone().requires_grad_(True)
        inp_cu = input_val.clone().cuda().requires_grad_(True)
        output1, hy1 = rnn(inp, hx)
        output2, hy2 = rnn_device(inp_cu, hx_device)
        if mode == "LSTM":
            torch.autograd.backward([output1, hy1[0], hy1[1]], [grad_output, grad_hy, grad_hy + 1])
            grads = [grad_output.cuda(), grad_hy.cuda(), (grad_hy + 1).cuda()]
            torch.autograd.backward([output2, hy2[0], hy2[1]], grads)
        else:
            torch.autograd.backward([output1, hy1], [grad_output, grad_hy])
            torch.autograd.backward([output2, hy2], [grad_output.cuda(), grad_hy.cuda()])
    tol = {"atol": 5e-3, "rtol": 0} if dtype == torch.float else {}
    assert_equal(output2, output1, **tol)
    assert_equal(hy2, hy1, **tol)
    for p, p_device in zip(rnn.parameters(), rnn_device.parameters()):
        assert_equal(p_device.grad, p.grad, atol=5e-5 if dtype == torch.double else 5e-3, rtol=0)
    assert_equal(inp_cu.grad, inp.grad, **tol)
    hx_list = list(hx) if mode == "LSTM" else [hx]
    hx_device_list = list(hx_device) if mode == "LSTM" else [hx_device]
    for a, b in zip(hx_device_list, hx_list):
        assert_equal(a.grad, b.grad, **tol)


VARIABLE_SEQUENCE_CASES = [
    (True, [5]),
    (False, [5]),
    (True, [10, 10, 6, 2, 2, 1, 1]),
    (False, [10, 10, 6, 2, 2, 1, 1]),
    (False, [2, 1, 3, 2, 10, 5, 3]),
]


@pytest.mark.slow
@pytest.mark.parametrize("proj_size", [0, 2])
@pytest.mark.parametrize("use_default_hiddens", [True, False], ids=["zero_h0", "given_h0"])
@pytest.mark.parametrize(
    ("enforce_sorted", "lengths"),
    VARIABLE_SEQUENCE_CASES,
    ids=[f"{'sorted' if s else 'any'}-{len(x)}" for s, x in VARIABLE_SEQUENCE_CASES],
)
def test_variable_sequence(nn, device, enforce_sorted, lengths, use_default_hiddens, proj_size):
    dtype = torch.float
    input_size, hidden_size, num_layers, num_dirs = 3, 4, 2, 2

    def pad(var, length):
        if var.size(0) == length:
            return var
        return torch.cat([var, var.new_zeros(length - var.size(0), *var.size()[1:])])

    max_length = max(lengths)
    x_leaf = torch.randn(max_length, len(lengths), input_size, device=device, dtype=dtype,
                         requires_grad=True)  # fmt: skip
    lstm = nn.LSTM(input_size, hidden_size, bidirectional=True, num_layers=num_layers,
                   proj_size=proj_size).to(device, dtype)  # fmt: skip
    lstm2 = copy.deepcopy(lstm).to(device, dtype)
    hidden0 = None
    if not use_default_hiddens:
        real_hidden = hidden_size if proj_size == 0 else proj_size
        states = num_dirs * num_layers, len(lengths)
        hidden0 = (torch.randn(*states, real_hidden, device=device),
                   torch.randn(*states, hidden_size, device=device))  # fmt: skip
    seq_outs, seq_hiddens = [], []
    for i, length in enumerate(lengths):
        hidden_i = None if hidden0 is None else tuple(h[:, i : i + 1].contiguous() for h in hidden0)
        out, hid = lstm2(x_leaf[:length, i : i + 1], hidden_i)
        seq_outs.append(pad(out, max_length))
        seq_hiddens.append(hid)
    seq_out = torch.cat(seq_outs, 1)
    seq_hidden = tuple(torch.cat(hids, 1) for hids in zip(*seq_hiddens))
    packed = rnn_utils.pack_padded_sequence(x_leaf, lengths, enforce_sorted=enforce_sorted)
    packed_out, packed_hidden = lstm(packed, hidden0)
    unpacked, unpacked_len = rnn_utils.pad_packed_sequence(packed_out)
    prec = 1e-5
    assert_equal(packed_hidden, seq_hidden, atol=prec, rtol=0)
    assert_equal(unpacked, seq_out, atol=prec, rtol=0)
    assert_equal(unpacked_len, lengths)
    seq_out.sum().backward()
    grad_x = x_leaf.grad.data.clone()
    x_leaf.grad.data.zero_()
    unpacked.sum().backward()
    assert_equal(x_leaf.grad, grad_x, atol=prec, rtol=0)
    for p1, p2 in zip(lstm.parameters(), lstm2.parameters()):
        assert_equal(p1.grad, p2.grad, atol=2e-4, rtol=0)


def test_save_lstm_compatibility(nn, device):
    # an LSTM pickled by PyTorch <= 1.7 (no proj_size) still loads
    model = nn.LSTM(2, 3, device=device)
    x = torch.randn(32, 5, 2, device=device)
    expected = model(x)
    assert model.proj_size == 0
    state_dict = model.__dict__
    del state_dict["proj_size"]
    loaded_model = nn.LSTM(2, 3, device=device)
    loaded_model.__setstate__(state_dict)
    assert_equal(loaded_model(x), expected)


# --- test/test_modules.py: test_grad_nn_{LSTM,GRU,RNN}_{train,eval}_mode --------------------
def _module_inputs(name):
    """common_modules.module_inputs_torch_nn_{LSTM,RNN_GRU}'s samples (no-batch-dim
    input [3, 2], with and without an initial state): (constructor kwargs, state shapes)."""
    products = {
        "LSTM": itertools.product([False, True], [False, True], [False, True], [0, 2], [None]),
        "GRU": itertools.product([False, True], [False, True], [False, True], [0], [None]),
        "RNN": itertools.product([False, True], [False, True], [False, True], [0],
                                 ["relu", "tanh"]),
    }  # fmt: skip
    for bias, batch_first, bidir, proj, nonlinearity in products[name]:
        kwargs = dict(input_size=2, hidden_size=3, num_layers=2, bias=bias,
                      batch_first=batch_first, bidirectional=bidir)  # fmt: skip
        kwargs.update({"proj_size": proj} if proj else {})
        kwargs.update({"nonlinearity": nonlinearity} if nonlinearity else {})
        D = 2 if bidir else 1
        yield kwargs, None
        h0 = (2 * D, proj or 3)
        yield kwargs, (h0, (2 * D, 3)) if name == "LSTM" else h0


@pytest.mark.slow
@pytest.mark.parametrize("training", [True, False], ids=["train_mode", "eval_mode"])
@pytest.mark.parametrize("name", ["LSTM", "GRU", "RNN"])
def test_grad_nn(nn, name, training):
    # gradcheck as test_modules.py runs it (common_utils.gradcheck's defaults: fast mode,
    # batched gradients checked) over every sample, parameters among the inputs
    for kwargs, state in _module_inputs(name):
        module = getattr(nn, name)(**kwargs).double().train(training)
        params = tuple(module.parameters())
        x = torch.randn(3, 2, dtype=torch.double, requires_grad=True)
        if state is None:
            states = ()
        elif name == "LSTM":
            states = tuple(torch.randn(s, dtype=torch.double, requires_grad=True) for s in state)
        else:
            states = (torch.randn(state, dtype=torch.double, requires_grad=True),)

        n, lstm = len(states), name == "LSTM"

        def fn(x, *rest, module=module, n=n, lstm=lstm):
            hx = None if not n else (tuple(rest[:n]) if lstm else rest[0])
            out, h = module(x) if hx is None else module(x, hx)
            return (out, *(h if lstm else (h,)))

        assert gradcheck(fn, (x, *states, *params), check_batched_grad=True, fast_mode=True), kwargs


def test_ported_cases_cover_both_flavours():
    """Every skip names a test of this file and a known flavour (no stale entries)."""
    names = {name for name in globals() if name.startswith("test_")}
    for test_name, flavour_name in SKIPS:
        assert test_name in names and flavour_name in FLAVOURS


assert set(itertools.chain(FLAVOURS)) == {"torch", "mirrorgrad"}
