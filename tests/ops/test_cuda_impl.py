"""impl="cuda" (the CUDA C++ persistent LSTM) on the CPU: what it takes (``supports``,
the layout's limits), its saved layout, its errors (no CUDA tensors, no cuda.bindings,
a shape it does not take), the dispatcher listing it and leaving it out where it cannot
run, and the layer's GEMMs, hidden sizes padded to a multiple of 8 and stacking around a
stand-in of the kernel, against torch.nn.LSTM, with its workspace against its memory
formula. The kernel's own source runs on the CPU in
tests/benchmarks_persistent_cuda/test_kernels_on_cpu.py; on a GPU in
test_cuda_impl_gpu.py."""

from __future__ import annotations

import functools
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch

import mirrorgrad.nn
from mirrorgrad.ops import aligned_mm
from mirrorgrad.ops.rnn import IMPLS, cuda_lstm_kernel, cuda_persistent, dispatch, op, time_model

from .memory_tracker import PeakTracker

CUDA = torch.device("cuda", 0)
H100 = SimpleNamespace(multi_processor_count=132, major=9, minor=0)


@pytest.fixture
def h100(monkeypatch):
    """torch.cuda answers as an H100 (132 SMs) would, for the shape checks."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H100)


@pytest.fixture
def no_bindings(monkeypatch):
    """cuda-python is not installed (an import of it fails)."""
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.bindings.nvrtc"):
        monkeypatch.setitem(sys.modules, name, None)


def test_supports_lstm_in_fp32_and_bf16_on_cuda_only():
    assert cuda_persistent.supports("lstm", proj=False, dtype=torch.float32, device=CUDA)
    assert cuda_persistent.supports("lstm", proj=False, dtype=torch.bfloat16, device=CUDA)
    assert not cuda_persistent.supports("gru", proj=False, dtype=torch.float32, device=CUDA)
    assert not cuda_persistent.supports("lstm", proj=True, dtype=torch.float32, device=CUDA)
    assert not cuda_persistent.supports("lstm", proj=False, dtype=torch.float16, device=CUDA)
    cpu = torch.device("cpu")
    assert not cuda_persistent.supports("lstm", proj=False, dtype=torch.float32, device=cpu)


def test_w_words_are_the_kernels_register_counts():
    # benchmarks/persistent_cuda/README.md: 64 registers of W a thread at bf16 H = 1024,
    # 128 at fp32 (8 units a CTA on 132 SMs), forward and backward alike; 4 units at
    # H = 512 halve the forward's tiles.
    assert cuda_lstm_kernel.layout(1024, 132).units == 8
    assert cuda_lstm_kernel.w_words("bf16", 1024, 8) == 64
    assert cuda_lstm_kernel.w_words("fp32", 1024, 8) == 128
    assert cuda_lstm_kernel.w_words("bf16", 512, 4) == 32
    # the word LM's 656 in 4 batch groups: 20 units a CTA; the backward's W^T is the larger
    assert cuda_lstm_kernel.forward_w_words("bf16", 656, 20) == 120
    assert cuda_lstm_kernel.w_words("bf16", 656, 20) == 126


def test_the_counter_stride_is_the_kernels():
    """The host allocates a barrier counter a batch group, COUNTER_STRIDE words apart, as
    cuda_lstm.cu indexes them."""
    import re

    source = cuda_lstm_kernel.SOURCE.read_text()
    (stride,) = re.findall(r"constexpr int COUNTER_STRIDE = (\d+);", source)
    assert int(stride) == cuda_lstm_kernel.COUNTER_STRIDE


@pytest.mark.parametrize(("hidden", "batch", "sms", "want"), [
    (656, 20, 132, (8, 82, 1, 20)),  # one group: the batch
    (656, 32, 132, (8, 82, 1, 32)),
    (656, 33, 132, (12, 55, 2, 17)),  # 66 SMs a group
    (656, 128, 132, (20, 33, 4, 32)),  # the word LM at batch 128: 132 CTAs in all
    (656, 97, 132, (20, 33, 4, 25)),  # 25, 25, 25 and 22 rows
    (64, 4224, 132, (64, 1, 132, 32)),  # a CTA a group
])  # fmt: skip
def test_batch_layout_takes_the_fewest_groups_of_at_most_32_rows(hidden, batch, sms, want):
    lay = cuda_lstm_kernel.batch_layout(hidden, batch, sms)
    assert (lay.units, lay.ctas, lay.groups, lay.group_batch) == want
    assert lay.grid == (lay.ctas, lay.groups) and lay.ctas * lay.groups <= sms
    assert lay.group_batch * (lay.groups - 1) < batch <= lay.group_batch * lay.groups
    assert lay.units * lay.ctas >= hidden
    with pytest.raises(ValueError, match="more than the 132 SMs"):
        cuda_lstm_kernel.batch_layout(hidden, 32 * 132 + 1, 132)


@pytest.mark.parametrize(("dtype", "hidden", "batch", "sms"), [
    ("bf16", 1024, 20, 132), ("fp32", 1024, 32, 132), ("fp32", 96, 1, 132),
    ("bf16", 520, 3, 132), ("bf16", 1032, 1, 132), ("fp32", 8, 1, 4),
    ("bf16", 656, 128, 132), ("bf16", 512, 33, 132), ("fp32", 512, 128, 132),
    ("bf16", 1024, 32, 108),  # 12 units: the forward's sums past 48 KiB, so dynamic
])  # fmt: skip
def test_layouts_the_kernels_take(dtype, hidden, batch, sms):
    assert cuda_lstm_kernel.unfit(dtype, hidden, batch, sms) is None


@pytest.mark.parametrize(("dtype", "hidden", "batch", "sms", "reason"), [
    ("fp32", 1032, 1, 132, "registers of W"),  # 9 units a CTA: past 128 words
    ("bf16", 2048, 1, 132, "registers of W"),
    ("fp32", 1024, 1, 114, "registers of W"),  # fewer SMs: 12 units a CTA
    ("bf16", 100, 1, 132, "multiple of 8"),
    ("bf16", 512, 0, 132, "batch 0"),
    ("fp16", 512, 1, 132, "dtype"),
    # 4 groups of 33 SMs: 20 units a CTA, past W's registers in fp32
    ("fp32", 656, 128, 132, "hidden 656 in fp32 in 4 batch groups of 32 rows on 132 SMs (20 "
                            "units a CTA) needs 246 registers of W a thread (at most 128)"),
    ("bf16", 512, 32 * 132 + 1, 132, "133 batch groups, more than the 132 SMs"),
    # 66 groups of 2 SMs: 64 units a CTA, 256 KiB of forward sums
    ("bf16", 128, 66 * 32, 132, "the forward's partial sums and the barrier's flag past"),
    # 44 groups of 3 SMs: 44 units a CTA, 172 KiB of forward sums but 48 KiB of backward's
    ("bf16", 128, 44 * 32, 132, "the backward's partial sums past 49148 bytes"),
])  # fmt: skip
def test_layouts_the_kernels_do_not_take_say_why(dtype, hidden, batch, sms, reason):
    assert reason in cuda_lstm_kernel.unfit(dtype, hidden, batch, sms)


def test_the_forward_sums_pass_the_shared_memory_a_gpu_opts_in_to():
    # bf16 656 at batch 128: 80 KiB of forward sums, past an sm_75's 64 KiB
    assert cuda_lstm_kernel.forward_dynamic_bytes(20, 32) == 80 * 1024
    assert cuda_lstm_kernel.unfit("bf16", 656, 128, 132, shared_optin=100 * 1024) is None
    assert "forward's partial sums" in cuda_lstm_kernel.unfit("bf16", 656, 128, 132,
                                                              shared_optin=64 * 1024)  # fmt: skip
    assert cuda_lstm_kernel.forward_dynamic_bytes(8, 32) == 0  # 32 KiB: static


@pytest.mark.parametrize(("hidden", "padded"), [(1, 8), (8, 8), (13, 16), (650, 656), (1024, 1024)])
def test_hidden_sizes_pad_to_the_next_multiple_of_8(hidden, padded):
    assert cuda_persistent.padded_hidden(hidden) == padded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 20, 32, 64, 128])
def test_the_word_lm_hidden_size_runs_padded(h100, dtype, batch):
    reason = cuda_persistent.unsupported_reason("lstm", proj=False, dtype=dtype, device=CUDA,
                                                hidden=650, batch=batch)  # fmt: skip
    if dtype == torch.float32 and batch > 32:  # 3 or 4 batch groups: W past the registers
        assert reason.startswith("hidden 650 runs padded to 656, and hidden 656 in fp32 in ")
        assert "registers of W" in reason
    else:
        assert reason is None


def test_the_shared_memory_a_gpu_opts_in_to_decides(monkeypatch):
    """unsupported_reason reads the device's opt-in shared memory a CTA: 64 KiB cannot
    hold the forward's 80 KiB of sums at the word LM's batch 128."""
    small = SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=64 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: small)
    reason = cuda_persistent.unsupported_reason("lstm", proj=False, dtype=torch.bfloat16,
                                                device=CUDA, hidden=650, batch=128)  # fmt: skip
    assert "forward's partial sums" in reason


def test_a_padded_size_the_layout_does_not_take_says_so(h100):
    reason = cuda_persistent.unsupported_reason("lstm", proj=False, dtype=torch.bfloat16,
                                                device=CUDA, hidden=1500, batch=20)  # fmt: skip
    assert reason.startswith("hidden 1500 runs padded to 1504, and hidden 1504 in bf16")


def test_unsupported_reason_names_what_the_kernel_lacks(h100):
    def reason(mode="lstm", **kw):
        args = dict(proj=False, dtype=torch.bfloat16, device=CUDA, hidden=512, batch=4) | kw
        return cuda_persistent.unsupported_reason(mode, **args)

    assert reason() is None
    assert "CUDA tensors" in reason(device=torch.device("cpu"))
    assert "lstm" in reason("gru")
    assert "projection" in reason(proj=True)
    assert "lengths" in reason(varlen=True)
    assert "state_clip" in reason(clip=True)
    assert "float32 and bfloat16" in reason(dtype=torch.float16)
    assert "registers of W" in reason(hidden=4096)


@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_saved_layout_is_the_stash_in_the_layers_dtype_in_both_memory_modes(memory, dtype):
    assert cuda_persistent.saved_layout("lstm", memory, 7, 3, 16, dtype) == [((7, 3, 80), dtype)]
    assert op._saved_per_layer("cuda", "lstm", memory) == 1
    size = dtype.itemsize
    assert op.layer_saved_bytes("cuda", "lstm", memory, 7, 3, 16, dtype) == 7 * 3 * 80 * size
    # hidden 13 runs padded to 16: the stash the kernel writes, as the planner must see it
    assert cuda_persistent.saved_layout("lstm", memory, 7, 3, 13, dtype) == [((7, 3, 80), dtype)]
    assert op.layer_saved_bytes("cuda", "lstm", memory, 7, 3, 13, dtype) == 7 * 3 * 80 * size


@pytest.mark.parametrize(("H", "Hp"), [(16, 16), (13, 16)])
def test_fake_kernel_saves_one_stash_per_layer_direction(H, Hp):
    from mirrorgrad import _compat

    T, B, layers, dt = 5, 3, 2, torch.bfloat16
    with _compat.fake_tensors():
        x = torch.empty(T, B, 8, dtype=dt)
        weights = []
        for layer in range(layers):
            for _ in range(2):
                n_in = 8 if layer == 0 else 2 * H
                weights += [torch.empty(4 * H, n_in, dtype=dt), torch.empty(4 * H, H, dtype=dt),
                            torch.empty(4 * H, dtype=dt), torch.empty(4 * H, dtype=dt)]  # fmt: skip
        hx = torch.empty(2 * layers, B, H, dtype=dt)
        _, _, _, saved = op.rnn_forward_fake(
            x, weights, hx, hx, None, torch.empty((), dtype=torch.int64), "lstm", layers, True,
            True, 0, 0.0, "recompute", None, "cuda", True,
        )  # fmt: skip
    # per layer: two stashes, then (but after the last) the layer's output
    assert [tuple(s.shape) for s in saved] == [(T, B, 5 * Hp)] * 2 + [(T, B, 2 * H)] + [
        (T, B, 5 * Hp)] * 2  # fmt: skip
    assert all(s.dtype == dt for s in saved)


def test_impl_cuda_refuses_gru_and_rnn_modules():
    with pytest.raises(ValueError, match="LSTMs only"):
        mirrorgrad.nn.GRU(8, 16, impl="cuda")
    with pytest.raises(ValueError, match="LSTMs only"):
        mirrorgrad.nn.RNN(8, 16, impl="cuda")


def test_impl_cuda_on_cpu_tensors_says_it_needs_cuda():
    lstm = mirrorgrad.nn.LSTM(8, 16, impl="cuda")
    with pytest.raises(ValueError, match=r"impl='cuda'.*needs CUDA tensors"):
        lstm(torch.randn(3, 2, 8))


def test_impl_cuda_without_cuda_bindings_says_what_to_install(no_bindings, h100):
    x = SimpleNamespace(dtype=torch.bfloat16, device=CUDA, shape=(5, 3, 16))
    weights = [None, SimpleNamespace(shape=(4 * 512, 512))]
    with pytest.raises(ImportError, match=r"pip install mirrorgrad\[cuda\]"):
        dispatch._check_cuda_impl(x, weights, None, "lstm", False, None)
    assert not cuda_lstm_kernel.available()


def test_impl_cuda_on_a_shape_it_does_not_take_says_why(h100):
    x = SimpleNamespace(dtype=torch.float32, device=CUDA, shape=(5, 3, 16))
    big = [None, SimpleNamespace(shape=(4 * 2048, 2048))]
    with pytest.raises(ValueError, match="impl='cuda' cannot run this call: hidden 2048"):
        dispatch._check_cuda_impl(x, big, None, "lstm", False, None)
    small = [None, SimpleNamespace(shape=(4 * 64, 64))]
    with pytest.raises(ValueError, match="sequence lengths"):
        dispatch._check_cuda_impl(x, small, torch.ones(3), "lstm", False, None)
    with pytest.raises(ValueError, match="state_clip"):
        dispatch._check_cuda_impl(x, small, None, "lstm", False, (-1.0, 1.0))


def test_dispatch_lists_cuda_and_asks_for_cuda_bindings(monkeypatch, h100):
    assert "cuda" in IMPLS
    ask = dispatch._cuda_supports
    monkeypatch.setattr(cuda_lstm_kernel, "bindings", lambda: (None, None))
    assert ask("lstm", False, torch.bfloat16, CUDA, 512, 4)
    assert ask("lstm", False, torch.float32, CUDA, 650, 20)  # padded to 656
    assert ask("lstm", False, torch.bfloat16, CUDA, 650, 128)  # in 4 batch groups
    assert not ask("lstm", False, torch.float32, CUDA, 650, 128)
    assert not ask("lstm", False, torch.bfloat16, CUDA, 4096, 4)
    assert not ask("gru", False, torch.bfloat16, CUDA, 512, 4)

    def missing():
        raise ImportError("no cuda.bindings")

    monkeypatch.setattr(cuda_lstm_kernel, "bindings", missing)
    assert not ask("lstm", False, torch.bfloat16, CUDA, 512, 4)


@pytest.mark.parametrize(("cuda_runs", "plain_lstm"), [(True, True), (False, True), (True, False)])
def test_auto_times_cuda_only_where_it_runs(monkeypatch, cuda_runs, plain_lstm):
    """The candidates impl="auto" times: cuda beside the others where it runs the shape
    and the call has no lengths and no state clip (``plain_lstm``)."""
    monkeypatch.setattr(dispatch, "_on_gpu", lambda x: True)
    monkeypatch.setattr(dispatch, "_persistent_supports", lambda *args: False)
    monkeypatch.setattr(dispatch, "_triton_supports", lambda *args: True)
    monkeypatch.setattr(dispatch, "_cuda_supports", lambda *args: cuda_runs)
    monkeypatch.setattr(dispatch, "_choose_auto", lambda key, candidates, rule: list(candidates))
    x = torch.randn(5, 3, 8)
    shape = time_model.Shape(mode="lstm", T=5, B=3, H=16, layers=1, directions=1)
    key = ("lstm", x.device, x.dtype, 5, 3, 8, 64, 16, 1, False, False, "stash", False, True)
    call = (8, 16, True, 0.0, None)
    chosen = dispatch._auto_impl(x, False, shape, key, lambda name: None, lambda: None, [],
                                 "stash", call, plain_lstm=plain_lstm)  # fmt: skip
    wanted = cuda_runs and plain_lstm
    assert chosen == (["cuda", "triton", "cudnn"] if wanted else ["triton", "cudnn"])


def test_auto_asks_for_cuda_only_without_lengths_state_clip_or_recompute(monkeypatch):
    """rnn() tells _auto_impl whether the call is a plain LSTM (the kernel's only kind)
    whose caller did not ask for recompute by name (the kernel always stashes)."""
    seen = []

    def auto_impl(*args, plain_lstm, **kw):
        seen.append(plain_lstm)
        return "reference"

    monkeypatch.setattr(dispatch, "_auto_impl", auto_impl)
    x, h, weights = torch.randn(3, 2, 4), torch.zeros(1, 2, 5), list(mirrorgrad.nn.LSTM(4, 5)
                                                                     .parameters())  # fmt: skip
    dispatch.rnn(x, weights, h, h, mode="lstm")
    dispatch.rnn(x, weights, h, h, mode="lstm", lengths=torch.tensor([3, 2]))
    dispatch.rnn(x, weights, h, h, mode="lstm", state_clip=(-1.0, 1.0))
    dispatch.rnn(x, weights, h, h, mode="lstm", memory="recompute")
    dispatch.rnn(x, weights, h, h, mode="lstm", memory="stash")
    assert seen == [True, False, False, False, True]


def _activated(pre, H):
    """The gates i, f, g, o from their pre-activations [B, 4H]."""
    i, f, g, o = pre.split(H, 1)
    return i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()


class _StandInKernel:
    """cuda_lstm.cu's two kernels in plain PyTorch (same arguments, same stash: the gates'
    pre-activations and c_t), so that the layer around them (the input GEMM, the gradient
    GEMMs, the biases, the stack) runs on the CPU."""

    def __init__(self, hidden: int):
        self.hidden = hidden
        self.launches = 0

    def _check(self, T, B, w_hh, b_hh=None, **states):
        """The shapes the real kernel is compiled for (it reads no others)."""
        H = self.hidden
        assert w_hh.shape == (4 * H, H) and w_hh.is_contiguous()
        assert b_hh is None or (b_hh.shape == (4 * H,) and b_hh.dtype == torch.float32)
        steps = {"xw": 4 * H, "y": H, "stash": 5 * H, "dy": H, "dgates": 4 * H}
        for name, t in states.items():
            shape = (T, B, steps[name]) if name in steps else (B, H)
            assert t.shape == shape and t.is_contiguous(), (name, tuple(t.shape), shape)
            assert t.dtype == w_hh.dtype, (name, t.dtype)  # the layer's, the stash's too

    def recurrence(self, xw, w_hh, b_hh, h0, c0, y, h_n, c_n, stash):
        T, B, H = *xw.shape[:2], self.hidden
        self._check(T, B, w_hh, b_hh, xw=xw, h0=h0, c0=c0, y=y, h_n=h_n, c_n=c_n, stash=stash)
        h, c = h0, c0
        for t in range(xw.shape[0]):
            pre = xw[t] + h @ w_hh.t() + b_hh
            i, f, g, o = _activated(pre, H)
            c = f * c + i * g
            h = o * c.tanh()
            y[t] = h
            stash[t] = torch.cat([pre, c], 1)
        h_n.copy_(h)
        c_n.copy_(c)
        self.launches += 1

    def backward_recurrence(self, w_hh, stash, c0, dy, dh_n, dc_n, dgates, dh0, dc0):
        T, H = dy.shape[0], self.hidden
        self._check(T, dy.shape[1], w_hh, stash=stash, c0=c0, dy=dy, dh_n=dh_n, dc_n=dc_n,
                    dgates=dgates, dh0=dh0, dc0=dc0)  # fmt: skip
        dh_next = dh_n
        dc = dc_n
        for t in reversed(range(T)):
            dh = dy[t] + (dh_next if t == T - 1 else dgates[t + 1] @ w_hh)
            i, f, g, o = _activated(stash[t][:, : 4 * H], H)
            c = stash[t][:, 4 * H :]
            c_prev = c0 if t == 0 else stash[t - 1][:, 4 * H :]
            dc = dc + dh * o * (1 - c.tanh() ** 2)
            parts = (dc * g * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - g * g),
                     dh * c.tanh() * o * (1 - o))  # fmt: skip
            dgates[t] = torch.cat(parts, 1)
            dc = dc * f
        dh0.copy_(dgates[0] @ w_hh)
        dc0.copy_(dc)
        self.launches += 1

    def poison(self, *outputs):
        pass

    def note_status(self):
        pass

    def raise_if_timed_out(self):
        pass


def stand_in_kernel(monkeypatch, kernel) -> None:
    """impl="cuda" runs ``kernel`` (a `_StandInKernel`) on the CPU, in float64 too."""
    monkeypatch.setattr(cuda_persistent, "unsupported_reason", lambda *args, **kw: None)
    monkeypatch.setattr(cuda_lstm_kernel, "bindings", lambda: (None, None))
    monkeypatch.setattr(cuda_lstm_kernel, "compiled", lambda *args: kernel)
    monkeypatch.setitem(cuda_persistent._DTYPE_NAMES, torch.float64, "fp64")


def outputs_against_torch_nn(n_in: int, H: int, layers: int, bidirectional: bool,
                             bias: bool = True) -> dict[str, list]:  # fmt: skip
    """{"ours": ..., "want": ...}: y, h_n, c_n and the gradients of x, h0, c0 and every
    parameter, of mirrorgrad.nn.LSTM(impl="cuda") and torch.nn.LSTM in float64 with the
    same weights and inputs (T 5, batch 3)."""
    torch.manual_seed(0)
    want = torch.nn.LSTM(n_in, H, layers, bias=bias, bidirectional=bidirectional).double()
    ours = mirrorgrad.nn.LSTM(n_in, H, layers, bias=bias, bidirectional=bidirectional,
                              impl="cuda").double()  # fmt: skip
    ours.load_state_dict(want.state_dict())
    D = 2 if bidirectional else 1
    x = torch.randn(5, 3, n_in, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(layers * D, 3, H, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(layers * D, 3, H, dtype=torch.float64, requires_grad=True)
    outputs = {}
    for name, module in (("ours", ours), ("want", want)):
        y, (h_n, c_n) = module(x, (h0, c0))
        loss = y.square().sum() + h_n.sin().sum() + c_n.cos().sum()
        outputs[name] = [y, h_n, c_n, *torch.autograd.grad(loss, [x, h0, c0, *module.parameters()])]
    return outputs


@pytest.mark.parametrize(("H", "Hp", "layers", "bidirectional", "bias"), [
    (16, 16, 1, False, True), (16, 16, 2, True, True), (16, 16, 1, False, False),
    (13, 16, 1, False, True), (13, 16, 2, True, True), (13, 16, 1, False, False),
    (20, 24, 2, True, True), (37, 40, 2, True, True),
])  # fmt: skip
def test_layer_around_the_kernel_matches_torch_nn(monkeypatch, H, Hp, layers, bidirectional,
                                                  bias):  # fmt: skip
    """Hp > H: the kernel runs the layer zero-padded to Hp units per gate."""
    kernel = _StandInKernel(Hp)
    stand_in_kernel(monkeypatch, kernel)
    D = 2 if bidirectional else 1
    outputs = outputs_against_torch_nn(8, H, layers, bidirectional, bias=bias)
    assert kernel.launches == 2 * layers * D  # forward and backward of each layer-direction
    for got, expected in zip(outputs["ours"], outputs["want"]):
        # b_hh reaches the kernel in float32, as cuda_lstm.cu takes it
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


class _AllocationTimeline(PeakTracker):
    """PeakTracker that also keeps the order: every storage an ATen call returns and
    when it is freed, so that ``temporary_peak`` is the peak of those freed by the end
    (the call's temporaries, its outputs still held). Storages of ``existing`` tensors
    are not counted."""

    def __init__(self, *existing):
        super().__init__(*existing)
        self.events: list[tuple[int, int]] = []  # (allocation, +bytes or -bytes)
        self._allocations: dict[int, int] = {}  # data_ptr -> allocation, while alive

    def _free_allocation(self, ptr, allocation, nbytes):
        self._allocations.pop(ptr, None)
        self.events.append((allocation, -nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self._allocations or ptr in self._existing:
                continue
            allocation = len(self.events)
            self._allocations[ptr] = allocation
            self.events.append((allocation, nbytes))
            weakref.finalize(storage, self._free_allocation, ptr, allocation, nbytes)
        return out

    def temporary_peak(self) -> int:
        freed = {a for a, nbytes in self.events if nbytes < 0}
        live = peak = 0
        for allocation, nbytes in self.events:
            if allocation in freed:
                live += nbytes
                peak = max(peak, live)
        return peak


class _QuietKernel(_StandInKernel):
    """Checks the shapes, writes nothing and allocates nothing: what the layer around it
    allocates is the layer's own."""

    def recurrence(self, xw, w_hh, b_hh, h0, c0, y, h_n, c_n, stash):
        self._check(xw.shape[0], xw.shape[1], w_hh, b_hh, xw=xw, y=y, stash=stash)

    def backward_recurrence(self, w_hh, stash, c0, dy, dh_n, dc_n, dgates, dh0, dc0):
        self._check(dy.shape[0], dy.shape[1], w_hh, stash=stash, dy=dy, dgates=dgates)


@pytest.mark.parametrize(("T", "B", "H", "Hp"), [
    (5, 3, 13, 16),  # the forward's peak at the launch
    (40, 6, 13, 16),  # at the input GEMM's padded copy
    (7, 2, 37, 40),
    (5, 3, 16, 16),  # unpadded: the formula is a bound (the zeros and the GEMMs apart)
])  # fmt: skip
@pytest.mark.parametrize("padded_products", [False, True], ids=["", "padded-products"])
def test_workspace_is_what_the_layer_allocates(monkeypatch, T, B, H, Hp, padded_products):
    """The formula against the layer's allocations; ``padded_products``: the input and
    weight GEMMs on padded operands (the rule forced; input 9 and hidden 13 pad to 10
    and 14 in float64, hidden 16 does not)."""
    if padded_products:
        monkeypatch.setattr(aligned_mm, "pays_to_pad", lambda *args: True)
    kernel = _QuietKernel(Hp)
    monkeypatch.setattr(cuda_lstm_kernel, "compiled", lambda *args: kernel)
    monkeypatch.setattr(cuda_persistent, "unsupported_reason", lambda *args, **kw: None)
    monkeypatch.setitem(cuda_persistent._DTYPE_NAMES, torch.float64, "fp64")
    from mirrorgrad.ops.rnn.layer_call import LayerCall

    dtype = torch.float64
    tensors = [torch.randn(T, B, 9, dtype=dtype), torch.randn(B, H, dtype=dtype),
               torch.randn(B, H, dtype=dtype), torch.randn(4 * H, 9, dtype=dtype),
               torch.randn(4 * H, H, dtype=dtype), torch.randn(4 * H, dtype=dtype),
               torch.randn(4 * H, dtype=dtype)]  # fmt: skip
    grad_y = torch.randn(T, B, H, dtype=dtype)
    call = LayerCall("lstm", *tensors)
    with _AllocationTimeline(*tensors) as timeline:
        y, _, _, saved = cuda_persistent.layer_forward(call)
    formula = functools.partial(cuda_persistent.workspace_bytes, "lstm", "stash", T, B, H, dtype,
                                n_in=9)  # fmt: skip
    forward = formula(backward=False)
    assert [(tuple(t.shape), t.dtype) for t in saved] == cuda_persistent.saved_layout(
        "lstm", "stash", T, B, H, dtype)  # fmt: skip
    with _AllocationTimeline(*tensors, y, grad_y, *saved) as back:
        grads = cuda_persistent.layer_backward(call, saved, y, grad_y, None, None)
    backward = formula(backward=True)
    assert [g.shape for g in grads[:7]] == [t.shape for t in tensors]
    if Hp == H:
        assert timeline.temporary_peak() <= forward
        assert back.temporary_peak() <= backward
        return
    assert timeline.temporary_peak() == forward
    # The formula counts dh0 and dc0 as held (the op keeps them to the stack's end); here
    # they are the call's outputs.
    assert backward - 2 * B * H * dtype.itemsize <= back.temporary_peak() <= backward


def test_layer_gives_no_gradient_it_is_not_asked_for(monkeypatch):
    H = 8
    monkeypatch.setattr(cuda_lstm_kernel, "compiled", lambda *args: _StandInKernel(H))
    monkeypatch.setattr(cuda_persistent, "unsupported_reason", lambda *args, **kw: None)
    from mirrorgrad.ops.rnn.layer_call import LayerCall

    x, h0, c0 = torch.randn(4, 2, 3), torch.randn(2, H), torch.randn(2, H)
    call = LayerCall("lstm", x, h0, c0, torch.randn(4 * H, 3), torch.randn(4 * H, H),
                     torch.randn(4 * H), torch.randn(4 * H))  # fmt: skip
    y, _, _, saved = cuda_persistent.layer_forward(call)
    only_h0 = (False, True) + (False,) * 6
    grads = cuda_persistent.layer_backward(call, saved, y, torch.randn_like(y), None, None,
                                           needs_input_grad=only_h0)  # fmt: skip
    assert grads[1] is not None and all(g is None for i, g in enumerate(grads) if i != 1)
    both = cuda_persistent.layer_backward(call, saved, y, torch.randn_like(y), None, None)
    # the two bias gradients are equal, and two tensors (a custom op's outputs share none)
    torch.testing.assert_close(both[5], both[6])
    assert both[5].data_ptr() != both[6].data_ptr()
    assert all(g is None for g in cuda_persistent.layer_backward(
        call, saved, y, None, None, None, needs_input_grad=(False,) * 8))  # fmt: skip
    with pytest.raises(ValueError, match="in the input's dtype"):
        cuda_persistent.layer_forward(call._replace(h0=h0.double()))


def _nvrtc_or_skip():
    try:
        nvrtc, _ = cuda_lstm_kernel.bindings()
        nvrtc.nvrtcVersion()  # loads libnvrtc
    except Exception as e:  # no cuda-python, or no libnvrtc for it to load
        pytest.skip(f"NVRTC through cuda-python is not available: {type(e).__name__}: {e}")


@pytest.mark.slow
@pytest.mark.parametrize(("sms", "arch"), [(132, "sm_90"), (108, "sm_80")])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_largest_layers_taken_compile(sms, arch, dtype):
    """What ``unfit`` takes, NVRTC compiles: for each units-per-CTA count, the largest
    hidden size it takes, at batch 1, 17 and the most it takes (ptxas refuses more shared
    memory than a CTA has; W past the registers would spill heavily, not fail)."""
    _nvrtc_or_skip()
    largest = {}
    for hidden in range(8, 2048, 8):
        if cuda_lstm_kernel.unfit(dtype, hidden, 1, sms) is None:
            largest[cuda_lstm_kernel.layout(hidden, sms).units] = hidden
    assert largest
    for units, hidden in largest.items():
        batches = [b for b in (1, 17, 32) if cuda_lstm_kernel.unfit(dtype, hidden, b, sms) is None]
        for batch in batches:
            cubin, _ = cuda_lstm_kernel.compile_cubin(dtype, hidden, batch, units, arch)
            assert cubin[:4] == b"\x7fELF"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("batch", [33, 64, 96, 97, 128])
def test_the_word_lm_in_batch_groups_compiles(dtype, batch):
    """The word LM's hidden size (656 padded) past batch 32, in batch groups on 132 SMs:
    where ``unfit`` takes it, it compiles, and at batch 33 and at whole groups of 32 rows
    ptxas spills nothing in either kernel (bf16 B 128: the forward's 255 registers, one N
    tile at a time). Rows a group checks at run time (batch 97: groups of 25 and 22)
    spill a few words in the forward (16-36 bytes at batch 97-127)."""
    import re

    _nvrtc_or_skip()
    if cuda_lstm_kernel.unfit(dtype, 656, batch, 132) is not None:
        assert dtype == "fp32"  # W past the registers
        return
    lay = cuda_lstm_kernel.batch_layout(656, batch, 132)
    cubin, log = cuda_lstm_kernel.compile_cubin(dtype, 656, batch, lay.units,
                                                group_batch=lay.group_batch)  # fmt: skip
    assert cubin[:4] == b"\x7fELF"
    if batch != 97:
        assert re.findall(r"(\d+) bytes spill stores", log) == ["0", "0"], log


class _StandInWavefront(_StandInKernel):
    """The wavefront kernel in plain PyTorch (same arguments, same outputs): layer by
    layer, layer l > 0's input product from layer l-1's y (times the mask)."""

    def __init__(self, hidden: int, layers: int):
        super().__init__(hidden)
        self.layers = layers

    def wavefront(self, xw, w_ih, w_hh, bias, h0, c0, mask, dropped, y, h_n, c_n, stash):
        L, H = self.layers, self.hidden
        assert (len(y), len(stash)) == (L, L) and bias.dtype == torch.float32
        assert (len(w_ih), len(w_hh)) == (L - 1, L)
        assert all(w.shape == (4 * H, H) and w.is_contiguous() for w in (*w_ih, *w_hh))
        w_ih = [None, *w_ih]
        for layer in range(L):
            xw_l = xw
            if layer > 0:
                layer_in = y[layer - 1]
                if mask is not None:
                    dropped[layer - 1] = y[layer - 1] * mask[layer - 1]
                    layer_in = dropped[layer - 1]
                xw_l = layer_in @ w_ih[layer].t()
            self.recurrence(xw_l, w_hh[layer], bias[layer], h0[layer], c0[layer], y[layer],
                            h_n[layer], c_n[layer], stash[layer])  # fmt: skip
        self.launches += 1 - L  # one launch


def _mask_on_cpu(x, p, seed, offset=0):
    """cuda_persistent.dropout's stand-in: a mask fixed by (offset, shape), 0 or 1/(1-p)."""
    g = torch.Generator().manual_seed(1000 + offset)
    return x * ((torch.rand(x.shape, generator=g) >= p).to(x.dtype) / (1 - p))


@pytest.mark.parametrize(("H", "layers", "dropout"), [
    (16, 2, 0.0), (16, 3, 0.4), (13, 2, 0.4), (13, 3, 0.0), (16, 2, 1.0),
])  # fmt: skip
def test_stack_through_the_wavefront_matches_torch_nn(monkeypatch, H, layers, dropout):
    """A unidirectional stack runs as one wavefront launch (then the layers' backward
    launches): outputs and every gradient against float64 torch.nn.LSTM, or with dropout
    the op's differentiable stack with the same masks."""
    Hp = cuda_persistent.padded_hidden(H)
    kernel = _StandInWavefront(Hp, layers)
    monkeypatch.setattr(cuda_persistent, "unsupported_reason", lambda *args, **kw: None)
    monkeypatch.setattr(cuda_persistent, "wavefront_reason", lambda *args, **kw: None)
    monkeypatch.setattr(cuda_persistent, "dropout", _mask_on_cpu)
    monkeypatch.setattr(cuda_lstm_kernel, "bindings", lambda: (None, None))
    monkeypatch.setattr(cuda_lstm_kernel, "compiled", lambda *args: kernel)
    monkeypatch.setattr(cuda_lstm_kernel, "compiled_wavefront", lambda *args: kernel)
    monkeypatch.setitem(cuda_persistent._DTYPE_NAMES, torch.float64, "fp64")
    torch.manual_seed(0)
    want = torch.nn.LSTM(8, H, layers).double()
    ours = mirrorgrad.nn.LSTM(8, H, layers, dropout=dropout, impl="cuda").double()
    ours.load_state_dict(want.state_dict())
    x = torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(layers, 3, H, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(layers, 3, H, dtype=torch.float64, requires_grad=True)
    weights = list(want.parameters())

    def reference(x, state):
        h0, c0 = state
        if dropout == 0:
            return want(x, (h0, c0))
        y, h_n, c_n = op.differentiable_stack(x, weights, h0, c0, None, torch.tensor(0),
                                              "lstm", layers, False, True, 0, dropout, None,
                                              "cuda")  # fmt: skip
        return y, (h_n, c_n)

    outputs = {}
    for name, module in (("ours", ours), ("want", reference)):
        y, (h_n, c_n) = module(x, (h0, c0))
        loss = y.square().sum() + h_n.sin().sum() + c_n.cos().sum()
        params = list(ours.parameters() if name == "ours" else weights)
        outputs[name] = [y, h_n, c_n, *torch.autograd.grad(loss, [x, h0, c0, *params])]
    assert kernel.launches == 1 + layers  # the wavefront, then each layer's backward
    for got, expected in zip(outputs["ours"], outputs["want"]):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_wavefront_leaves_other_stacks_to_the_layers(h100, monkeypatch):
    monkeypatch.setattr(cuda_lstm_kernel, "bindings", lambda: (None, None))
    x = SimpleNamespace(device=CUDA, dtype=torch.bfloat16, shape=(35, 20, 650))
    hx = SimpleNamespace(dtype=torch.bfloat16, shape=(2, 20, 650))
    w = [SimpleNamespace(dtype=torch.bfloat16)]

    def reason(**kw):
        args = dict(lengths=None, mode="lstm", num_layers=2, bidirectional=False, proj_size=0,
                    state_clip=None) | kw  # fmt: skip
        return cuda_persistent.wavefront_reason(x, w, hx, **args)

    assert reason() is None
    assert "unidirectional" in reason(bidirectional=True)
    assert "2 layers or more" in reason(num_layers=1)
    assert "lengths" in reason(lengths=torch.ones(20))
    assert "state clip" in reason(state_clip=(-1.0, 1.0))
    x.dtype = hx.dtype = w[0].dtype = torch.float32  # 12 units a CTA: 132 registers of W
    assert "registers of W" in reason()


@pytest.mark.parametrize(("dtype", "hidden", "batch", "layers"), [
    ("bf16", 656, 20, 2), ("bf16", 256, 20, 3), ("fp32", 256, 20, 3), ("fp32", 512, 32, 2),
    ("bf16", 896, 8, 2), ("bf16", 656, 8, 3), ("bf16", 512, 16, 4),
])  # fmt: skip
def test_wavefront_layouts_that_fit_on_132_sms(dtype, hidden, batch, layers):
    """Each compiled without spills (ptxas, sm_90): benchmarks/persistent_cuda/README.md."""
    assert cuda_lstm_kernel.wavefront_unfit(dtype, hidden, batch, layers, 132) is None
    lay = cuda_lstm_kernel.wavefront_layout(hidden, layers, 132)
    assert lay.ctas * layers <= 132 and lay.ctas * lay.units >= hidden


@pytest.mark.parametrize(("dtype", "hidden", "batch", "layers", "reason"), [
    ("fp32", 656, 20, 2, "registers of W"),  # 12 units: 132 words of W (ptxas spills)
    ("bf16", 1024, 8, 2, "registers of W"),  # 128 words of W: 208 bytes spilled
    ("bf16", 768, 8, 3, "registers of W"),  # 20 units: 24 bytes spilled
    ("fp32", 512, 20, 3, "registers of W"),  # 12 units, 3 batch tiles: 32 bytes spilled
    ("bf16", 1024, 20, 2, "registers of W"),
    ("bf16", 656, 20, 1, "2 to 132 layers"),
    ("bf16", 512, 20, 4, "partial sums"),  # 16 units a CTA
    ("bf16", 656, 128, 2, "the wavefront takes 1 to 32: one batch group"),  # layer by layer
])  # fmt: skip
def test_wavefront_layouts_that_do_not_fit_say_why(dtype, hidden, batch, layers, reason):
    assert reason in cuda_lstm_kernel.wavefront_unfit(dtype, hidden, batch, layers, 132)


class _QuietWavefront(_StandInWavefront):
    """Checks the counts, writes nothing and allocates nothing."""

    def wavefront(self, xw, w_ih, w_hh, bias, h0, c0, mask, dropped, y, h_n, c_n, stash):
        assert (len(w_ih), len(w_hh), len(y)) == (self.layers - 1, self.layers, self.layers)


@pytest.mark.parametrize(("T", "B", "H", "layers", "dropout", "need_saved"), [
    (5, 3, 13, 2, 0.5, True),  # padded: the launch's copies
    (40, 6, 13, 3, 0.5, False),
    (7, 2, 37, 2, 0.0, True),
    (5, 3, 16, 2, 0.5, True),  # unpadded
    (5, 3, 16, 3, 0.0, False),  # the intermediate y's are temporaries
    (5, 3, 16, 2, 1.0, True),
])  # fmt: skip
@pytest.mark.parametrize("padded_products", [False, True], ids=["", "padded-products"])
def test_wavefront_temporaries_are_the_memory_formula(monkeypatch, T, B, H, layers, dropout,
                                                      need_saved, padded_products):  # fmt: skip
    """``padded_products``: the input GEMM on padded operands (the rule forced: input 9
    pads to 10 in float64)."""
    if padded_products:
        monkeypatch.setattr(aligned_mm, "pays_to_pad", lambda *args: True)
    Hp = cuda_persistent.padded_hidden(H)
    kernel = _QuietWavefront(Hp, layers)
    monkeypatch.setattr(cuda_lstm_kernel, "compiled_wavefront", lambda *args: kernel)
    monkeypatch.setattr(cuda_persistent, "wavefront_reason", lambda *args, **kw: None)
    # kernels.py's dropout allocates its output alone
    monkeypatch.setattr(cuda_persistent, "dropout", lambda x, *args: torch.empty_like(x))
    monkeypatch.setitem(cuda_persistent._DTYPE_NAMES, torch.float64, "fp64")
    dtype = torch.float64
    x = torch.randn(T, B, 9, dtype=dtype)
    weights = []
    for layer in range(layers):
        weights += [torch.randn(4 * H, 9 if layer == 0 else H, dtype=dtype),
                    torch.randn(4 * H, H, dtype=dtype), torch.randn(4 * H, dtype=dtype),
                    torch.randn(4 * H, dtype=dtype)]  # fmt: skip
    hx, cx = torch.randn(layers, B, H, dtype=dtype), torch.randn(layers, B, H, dtype=dtype)
    seed = torch.zeros((), dtype=torch.int64)
    args = (x, weights, hx, cx, None, seed, "lstm", layers, False, True, 0, dropout, "stash",
            None, "cuda", need_saved)  # fmt: skip
    with _AllocationTimeline(x, *weights, hx, cx, seed) as timeline:
        outputs = cuda_persistent.stack_forward(*args[:14], need_saved)  # held: not counted
        assert [tuple(t.shape) for t in outputs[3]] == ([(T, B, 5 * Hp), (T, B, H)] * (layers - 1)
                                                   + [(T, B, 5 * Hp)] if need_saved else [])
    formula = op._rnn_forward_temporary_bytes(*args)
    assert timeline.temporary_peak() == formula


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("batch", [1, 20, 32])
def test_the_largest_wavefronts_taken_compile_without_spills(dtype, layers, batch):
    """The largest hidden size ``wavefront_unfit`` takes on 132 SMs compiles for sm_90
    with no register spilled (its registers rule is fit to ptxas)."""
    import re

    _nvrtc_or_skip()
    unfit = cuda_lstm_kernel.wavefront_unfit
    hidden = max(h for h in range(8, 2048, 8) if unfit(dtype, h, batch, layers, 132) is None)
    units = cuda_lstm_kernel.wavefront_layout(hidden, layers, 132).units
    _, log = cuda_lstm_kernel.compile_cubin(dtype, hidden, batch, units,
                                            defines={"LSTM_LAYERS": layers})  # fmt: skip
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], log
