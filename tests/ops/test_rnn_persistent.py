"""Persistent RNN kernels (ops/rnn/persistent.py) against float64: interpreted on CPU at
small shapes (one program), natively on the GPU (many programs, a real grid barrier)."""

import itertools
from dataclasses import replace

import pytest
import torch

import mirrorgrad.nn
from mirrorgrad.ops.rnn import (
    persistent,
    persistent_buffers,
    persistent_kernels,
    persistent_plan,
    step_loop,
)
from mirrorgrad.ops.rnn.cell_modes import GATES
from mirrorgrad.ops.rnn.layer_call import LayerCall
from mirrorgrad.ops.rnn.tuning import PersistentTuning, StepTuning

from .test_rnn_kernels import _oracle

pytestmark = pytest.mark.slow  # the persistent kernel runs in Triton's interpreter on CPU

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NAMES = ("x", "h0", "c0", "w_ih", "w_hh", "b_ih", "b_hh")
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture
def no_tf32():
    """Full fp32 GEMMs on both sides of a comparison (cuBLAS and tl.dot)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _inputs(mode, T, B, n_in, H, *, bias=True, dtype=torch.float32, scale=None):
    g = GATES[mode]
    s = scale if scale is not None else min(0.6, 1.5 / H**0.5)
    tensors = {
        "x": torch.randn(T, B, n_in),
        "h0": torch.randn(B, H) * 0.5,
        "c0": torch.randn(B, H) if mode == "lstm" else None,
        "w_ih": torch.randn(g * H, n_in) * s,
        "w_hh": torch.randn(g * H, H) * s,
        "b_ih": torch.randn(g * H) * s if bias else None,
        "b_hh": torch.randn(g * H) * s if bias else None,
    }
    return {k: (v.to(DEVICE, dtype) if v is not None else None) for k, v in tensors.items()}


def _reference(mode, inp, lengths, clip, seed_grads=True):
    """float64 outputs, output gradients and input gradients of the oracle loop."""
    ref_in = {k: (v.double().requires_grad_() if v is not None else None) for k, v in inp.items()}
    y, hn, cn = _oracle(mode, *ref_in.values(), lengths, clip)
    gy = torch.randn_like(y) if seed_grads else None
    ghn, gcn = torch.randn_like(hn), (torch.randn_like(cn) if cn is not None else None)
    loss = (hn * ghn).sum() + ((y * gy).sum() if gy is not None else 0)
    loss = loss + ((cn * gcn).sum() if gcn is not None else 0)
    present = [k for k, v in ref_in.items() if v is not None]
    grads = torch.autograd.grad(loss, [ref_in[k] for k in present])
    return (y, hn, cn), (gy, ghn, gcn), dict(zip(present, grads))


def _close(actual, expected, tol, what):
    """Max error relative to the reference's largest magnitude (bf16/TF32 friendly)."""
    err = (actual.double() - expected).abs().max().item()
    scale = max(expected.abs().max().item(), 1e-3)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def _check(mode, *, memory="stash", T=4, B=3, n_in=5, H=6, lengths=None, clip=None, bias=True,
           layout=None, dtype=torch.float32, tol=1e-5, grad_y=True):  # fmt: skip
    inp = _inputs(mode, T, B, n_in, H, bias=bias, dtype=dtype)
    if lengths is not None:
        lengths = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
    (y_ref, hn_ref, cn_ref), (gy, ghn, gcn), ref_grads = _reference(
        mode, inp, lengths, clip, grad_y
    )
    call = LayerCall(mode, *inp.values(), lengths=lengths, memory=memory, state_clip=clip)
    y, hn, cn, saved = persistent.layer_forward(call, layout=layout)
    assert [(tuple(s.shape), s.dtype) for s in saved] == persistent.saved_layout(
        mode, memory, T, B, H, dtype
    )
    _close(y, y_ref, tol, "y")
    _close(hn, hn_ref, tol, "h_n")
    if mode == "lstm":
        _close(cn, cn_ref, tol, "c_n")
    cast = lambda t: t.to(dtype) if t is not None else None  # noqa: E731
    grads = persistent.layer_backward(call, saved, y, cast(gy), cast(ghn), cast(gcn),
                                      layout=layout)  # fmt: skip
    assert grads[7] is None
    for name, grad in zip(NAMES, grads[:7]):
        if name not in ref_grads:
            assert grad is None, name
        else:
            _close(grad, ref_grads[name], 10 * tol, f"grad {name}")


def _streamed(mode, B, H, dtype=torch.float32, bk=16, split=1):
    layout = persistent.plan(mode, B, H, dtype, torch.device(DEVICE))
    return replace(layout, resident=False, bk=bk, split=split, bwd_bk=bk,
                              bwd_split=split)  # fmt: skip


# ---- CPU (interpreter) and GPU alike: small shapes --------------------------------


@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_layer_matches_float64(mode, memory):
    _check(mode, memory=memory, lengths=None)


@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_unsorted_lengths(mode, memory):
    _check(mode, memory=memory, lengths=[2, 4, 1])


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_streamed_weights_and_hidden_not_a_multiple_of_16(mode):
    # H=20: resident W in two K pieces (16 + 16); streamed in chunks of 16 with a tail.
    _check(mode, H=20, lengths=[3, 1, 4])
    _check(mode, H=20, layout=_streamed(mode, 3, 20), lengths=[3, 1, 4])


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_window2_layout(mode):
    # The defaults before the 15:41 UTC window (bench's "old"): the barrier polled with
    # loads, the resident backward one MMA chain per gate, its inputs loaded tile by tile.
    layout = persistent.plan(mode, 3, 20, torch.float32, torch.device(DEVICE))
    layout = replace(layout, spin_load=True, rsplit=1, bwd_rsplit=1, gather=False)
    _check(mode, H=20, lengths=[2, 4, 1], layout=layout)


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "streamed"])
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_forward_gates_in_one_dot(mode, resident):
    layout = persistent.plan(mode, 3, 20, torch.float32, torch.device(DEVICE))
    layout = replace(layout, fuse_gates=True, resident=resident)
    _check(mode, H=20, lengths=[2, 4, 1], layout=layout)


@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_bf16_matches_float64(mode, memory):
    _check(mode, memory=memory, H=20, lengths=[3, 4, 1], dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_streamed_k_in_slices(mode):
    # Chunks of 64 in 4 slices of 16 (H 40: one chunk with a masked tail; backward G*H).
    _check(mode, H=40, lengths=[3, 1, 4], layout=_streamed(mode, 3, 40, bk=64, split=4))


@pytest.mark.parametrize("rsplit", [2, 4])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_resident_k_in_slices(mode, rsplit):
    # H 40 as 2 slices of 16 + 16 rows (both pieces) or 4 of 16 (one piece, zero tails);
    # the forward's gates in one dot (lstm, gru), the backward a gate at a time.
    layout = persistent.plan(mode, 3, 40, torch.float32, torch.device(DEVICE))
    layout = replace(layout, resident=True, rsplit=rsplit, bwd_rsplit=rsplit)
    _check(mode, H=40, lengths=[3, 1, 4], layout=layout)


@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_inputs_gathered_in_one_load(mode, memory):
    # The backward's other inputs in one load per dtype, with K slices (bench's "new").
    layout = persistent.plan(mode, 3, 20, torch.float32, torch.device(DEVICE))
    layout = replace(layout, gather=True, rsplit=2, bwd_rsplit=2)
    _check(mode, memory=memory, H=20, lengths=[2, 4, 1], layout=layout)
    _check(mode, memory=memory, H=20, layout=layout, dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_batch_one_and_one_step(mode):
    _check(mode, T=1, B=1)
    _check(mode, memory="recompute", T=1, B=1, grad_y=False)


def test_batch_in_several_tiles():
    # 20 rows: two batch tiles of 16 per program, lengths ending in both.
    _check("lstm", T=3, B=20, lengths=[3, 1, 2, 3] * 5)
    _check("gru", T=3, B=20, memory="recompute")


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_batch_groups_with_their_own_barriers(mode):
    # 40 rows, tiles of 16 over 2 groups: group 0 runs tiles 0 and 2, group 1 tile 1.
    layout = persistent.plan(mode, 40, 6, torch.float32, torch.device(DEVICE))
    layout = replace(layout, groups=2)
    if CUDA:
        layout = replace(layout, programs=1, bn=16)
    _check(mode, T=3, B=40, lengths=[3, 1, 2, 3] * 10, layout=layout)


def test_lstm_state_clip_and_no_bias():
    _check("lstm", clip=(-0.3, 0.4), lengths=[4, 3, 2])
    _check("lstm", bias=False, grad_y=False)
    _check("gru", bias=False, grad_y=False)


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_backward_in_chunks(mode, monkeypatch, tuning):
    # Chunks of 2, 2 and 1 steps: one launch each, state gradients carried between them.
    tuning(StepTuning(bwd_chunk_rows=2 * 3))
    _check(mode, T=5, lengths=[5, 2, 3], memory="recompute")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_state_and_counters_are_views_of_one_buffer(dtype):
    # dh, dc, a counter row per launch and the small gradients asked for (grad_c0, the
    # biases'): apart, each 16-byte aligned (the JIT specializes pointers on it), in one
    # allocation that the backward zeroes in one fill.
    B, H = 3, 5
    config = step_loop.make_config("lstm", 4, B, H, dtype, torch.device(DEVICE), False, None,
                                   "stash", True, False, "ieee")  # fmt: skip
    layout = replace(persistent.plan("lstm", B, H, dtype, torch.device(DEVICE)),
                     groups=3, streamed_groups=5)  # fmt: skip
    needs = (True,) * 6  # the gradients of x, c0, w_ih, w_hh, b_ih, b_hh all asked
    block = persistent_buffers.state_block(config, layout, launches=3, needs=needs)
    dh, dc, counts = block["dh"], block["dc"], block["count"]
    assert (dh.shape, dh.dtype, dc.shape, dc.dtype) == ((B, H), dtype, (B, H), torch.float32)
    assert counts.shape[0] == 3 and counts.shape[1] >= 5 and counts.dtype == torch.int32
    small = [block["grad_c0"], block["grad_bih"], block["grad_bhh"]]
    assert [t.shape for t in small] == [(B, H), (4 * H,), (4 * H,)]
    assert all(t.dtype == dtype for t in small)
    views = [dh, dc, *counts, *small]
    state = block["state"].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == state for v in views)
    assert all(v.data_ptr() % 16 == 0 for v in views)
    spans = sorted((v.data_ptr(), v.data_ptr() + v.nbytes) for v in views)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # apart
    block["state"].zero_()
    assert all(not v.any() for v in views)


def test_empty_batch_runs_kernels_py():
    assert persistent.plan("lstm", 0, 6, torch.float32, torch.device(DEVICE)) is None
    inp = _inputs("lstm", 2, 0, 5, 6)
    y, hn, cn, _ = persistent.layer_forward(LayerCall("lstm", *inp.values()))
    assert y.shape == (2, 0, 6) and hn.shape == (0, 6) and cn.shape == (0, 6)


def test_plan_caps_the_grid_at_the_sm_count(monkeypatch):
    monkeypatch.setattr(step_loop, "interpreting", lambda: False)
    monkeypatch.setattr(persistent_plan, "_programs_at_once", lambda device: 132)
    cuda = torch.device("cuda")
    small = persistent.plan("lstm", 20, 650, torch.float32, cuda)
    assert (small.programs, small.bn, small.ka, small.kb) == (41, 16, 512, 256)
    resident_bytes = PersistentTuning().resident_bytes
    assert small.resident == (small.w_bytes("lstm", torch.float32) <= resident_bytes)
    # 41 unit blocks leave room for 3 groups: 20 rows in two tiles of 16, one per group.
    assert (small.bb, small.groups) == (16, 2)
    big = persistent.plan("lstm", 256, 512, torch.float32, cuda)  # 32 blocks x 4 groups
    assert (big.programs, big.groups) == (32, 4)
    assert big.streamed().bb * big.streamed().groups >= 256
    assert big.programs * big.groups <= 132 and big.streamed().groups * big.programs <= 132
    wide = persistent.plan("lstm", 4, 8448, torch.bfloat16, cuda)
    assert (wide.programs, wide.groups, wide.bn, wide.resident) == (132, 1, 64, False)
    assert persistent.plan("lstm", 4, 8449, torch.bfloat16, cuda) is None
    assert not persistent.supports_persistent(
        "lstm", proj=False, dtype=torch.float32, device="cuda", hidden=9000, batch=4
    )
    assert not persistent.supports_persistent(
        "lstm", proj=True, dtype=torch.float32, device="cuda", hidden=64, batch=4
    )


def _module_pair(mode, impl_a, impl_b, dropout):
    cls = {"lstm": mirrorgrad.nn.LSTM, "gru": mirrorgrad.nn.GRU}[mode]
    a = cls(5, 6, 2, dropout=dropout, impl=impl_a).to(DEVICE)
    b = cls(5, 6, 2, dropout=dropout, impl=impl_b).to(DEVICE)
    b.load_state_dict(a.state_dict())
    return a, b


def _run(module, x, seed):
    torch.manual_seed(seed)
    x = x.detach().requires_grad_()
    y, _ = module(x)
    y.square().sum().backward()
    return y.detach(), x.grad, [p.grad for p in module.parameters()]


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_module_with_dropout_equals_kernels_py(mode):
    # Same seed, same Philox masks between layers: the same numbers as impl="triton".
    a, b = _module_pair(mode, "persistent", "triton", dropout=0.4)
    x = torch.randn(4, 3, 5, device=DEVICE)
    ya, gxa, gwa = _run(a, x, seed=7)
    yb, gxb, gwb = _run(b, x, seed=7)
    torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gxa, gxb, atol=1e-5, rtol=1e-5)
    for ga, gb in zip(gwa, gwb):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)


def test_module_bidirectional_packed_matches_torch_in_float64():
    torch.manual_seed(0)
    ours = mirrorgrad.nn.LSTM(5, 6, 2, bidirectional=True, impl="persistent").to(DEVICE)
    ref = torch.nn.LSTM(5, 6, 2, bidirectional=True).to(DEVICE).double()
    ref.load_state_dict({k: v.double() for k, v in ours.state_dict().items()})
    x = torch.randn(4, 3, 5, device=DEVICE)
    lengths = torch.tensor([4, 2, 3])
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    packed64 = torch.nn.utils.rnn.pack_padded_sequence(x.double(), lengths, enforce_sorted=False)
    y, _ = ours(packed)
    y_ref, _ = ref(packed64)
    _close(y.data, y_ref.data, 1e-5, "y")
    y.data.square().sum().backward()
    y_ref.data.square().sum().backward()
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
        _close(p.grad, p_ref.grad, 1e-4, name)


# ---- GPU: many programs and a real barrier -----------------------------------------

GPU_SHAPES = [  # (T, B, I, H): one program-slice, a partial slice, several batch tiles
    (7, 1, 24, 16),
    (9, 5, 40, 100),
    (5, 33, 64, 650),
    (3, 4, 128, 1024),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("resident", [True, False], ids=["resident", "streamed"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "T{}-B{}-I{}-H{}".format(*s))
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize(
    "dtype, tf32, tol",
    [(torch.float32, False, 2e-3), (torch.float32, True, 1e-2), (torch.bfloat16, False, 3e-2)],
    ids=["fp32", "tf32", "bf16"],
)
def test_gpu_many_programs_match_float64(mode, shape, resident, dtype, tf32, tol, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
    T, B, n_in, H = shape
    layout = persistent.plan(mode, B, H, dtype, torch.device("cuda"))
    layout = replace(layout, resident=resident)
    lengths = [T - (b % T) for b in range(B)]
    _check(mode, T=T, B=B, n_in=n_in, H=H, lengths=lengths, layout=layout, dtype=dtype, tol=tol,
           memory="recompute" if mode == "lstm" else "stash")  # fmt: skip


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("resident", [True, False], ids=["resident", "streamed"])
@pytest.mark.parametrize("shape", GPU_SHAPES[2:], ids=lambda s: "T{}-B{}-I{}-H{}".format(*s))
@pytest.mark.parametrize("mode", ["lstm", "gru"])
@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-2), (torch.bfloat16, 3e-2)], ids=["tf32", "bf16"]
)
def test_gpu_k_slices_match_float64(mode, shape, resident, dtype, tol, monkeypatch, tuning):
    # The "new" variant of bench.persistent_rnn: K in slices, the backward's loads gathered.
    from benchmarks.persistent_rnn import VARIANTS

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    tuning(PersistentTuning(**VARIANTS["new"]))
    T, B, n_in, H = shape
    layout = persistent.plan(mode, B, H, dtype, torch.device("cuda"))
    layout = replace(layout, resident=resident)
    assert layout.gather and layout.bwd_rsplit > 1 and layout.bwd_split > 1
    lengths = [T - (b % T) for b in range(B)]
    _check(mode, T=T, B=B, n_in=n_in, H=H, lengths=lengths, layout=layout, dtype=dtype, tol=tol,
           memory="recompute" if mode == "lstm" else "stash")  # fmt: skip


@pytest.mark.gpu
@needs_gpu
def test_gpu_op_captured_in_a_cuda_graph_replays():
    torch.manual_seed(0)
    model = mirrorgrad.nn.LSTM(64, 128, 2, impl="persistent").cuda()
    static_x = torch.randn(6, 4, 64, device="cuda", requires_grad=True)

    def step():
        y, _ = model(static_x)
        y.square().sum().backward()
        return y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compile the kernels outside the capture
            model.zero_grad(set_to_none=False)
            static_x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(stream)
    model.zero_grad(set_to_none=False)
    static_x.grad = torch.zeros_like(static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    fresh = torch.randn_like(static_x)
    static_x.data.copy_(fresh)
    for p in model.parameters():
        p.grad.zero_()
    static_x.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    eager = mirrorgrad.nn.LSTM(64, 128, 2, impl="triton").cuda()
    eager.load_state_dict(model.state_dict())
    x = fresh.clone().requires_grad_()
    y, _ = eager(x)
    y.square().sum().backward()
    torch.testing.assert_close(static_y, y, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(static_x.grad, x.grad, atol=2e-3, rtol=2e-3)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=5e-3, rtol=5e-3)


BENCHMARK_SHAPES = [  # the module table's (layers, input, hidden, batch, T, bidirectional)
    (2, 650, 650, 20, 35, False),
    (2, 1500, 1500, 20, 35, False),
    (2, 1024, 1024, 64, 50, False),
    (4, 1024, 1024, 128, 50, False),
    (1, 512, 512, 16, 100, False),
    (2, 512, 512, 256, 35, False),
    (2, 1024, 1024, 64, 50, True),
    (1, 2048, 2048, 4, 100, False),
    (2, 1152, 1152, 4, 100, False),
    (2, 1024, 1024, 1, 100, False),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["lstm", "gru"])
@pytest.mark.parametrize("cfg", BENCHMARK_SHAPES, ids=lambda c: "L{}-I{}-H{}-B{}-T{}{}".format(*c))
def test_gpu_benchmark_shapes_match_kernels_py(cfg, mode, no_tf32):
    layers, n_in, hidden, batch, T, bi = cfg
    T = min(T, 12)  # the layouts depend on (layers, sizes, batch), not on T: fewer steps
    cls = {"lstm": mirrorgrad.nn.LSTM, "gru": mirrorgrad.nn.GRU}[mode]
    torch.manual_seed(0)
    ours = cls(n_in, hidden, layers, bidirectional=bi, impl="persistent").cuda()
    ref = cls(n_in, hidden, layers, bidirectional=bi, impl="triton").cuda()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(T, batch, n_in, device="cuda")
    y, gx, gw = _run(ours, x, 0)
    y_ref, gx_ref, gw_ref = _run(ref, x, 0)
    # Same fp32 arithmetic but for summation order: tight bounds.
    _close(y, y_ref.double(), 1e-4, "y")
    _close(gx, gx_ref.double(), 1e-3, "grad x")
    for (name, _), g, g_ref in zip(ours.named_parameters(), gw, gw_ref):
        _close(g, g_ref.double(), 1e-3, name)


# ---- CPU: the kernels compile for an H100 (sm_90), what the interpreter cannot show ----

_COMPILE_FOR_SM90 = """
import sys, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from dataclasses import replace
from mirrorgrad.ops.rnn import (persistent, persistent_buffers, persistent_kernels,
                                persistent_plan, persistent_probes, step_loop)

mode, resident, probe, split = sys.argv[1], sys.argv[2] == "resident", *map(int, sys.argv[3:])
persistent_plan._programs_at_once = lambda device: 132
layout = persistent_plan.plan(mode, 20, 650, torch.bfloat16, torch.device("cuda"))
layout = layout if resident else layout.streamed()
assert layout.resident == resident
# split: the resident K slices, or the streamed chunks' slices (SPLIT_K, BWD_SPLIT_K).
layout = replace(layout, rsplit=split, bwd_rsplit=split, split=split, bwd_bk=128,
                 bwd_split=split, gather=split > 1)
persistent_probes.PROBES, persistent_probes.PROBE_LEVEL = ({}, probe) if probe else (None, 1)
step_loop.interpreting = lambda: False
config = step_loop.make_config(mode, 35, 20, 650, torch.bfloat16, torch.device("cuda"), True,
                               None, "stash", True, False, "ieee")
special = {"cells_ptr": "*fp32", "dc_ptr": "*fp32", "len_ptr": "*i64", "count_ptr": "*i32",
           "probe_ptr": "*i64"}
for kind, kernel, extra in (
    ("fwd", persistent_kernels.persistent_fwd_kernel,
     {"WRITE_STASH": True, "HAS_HB": mode == "gru",
      "HS": persistent_buffers.padded(650, torch.bfloat16)}),
    ("bwd", persistent_kernels.persistent_bwd_kernel,
     {"HAS_DY": True, "DS": persistent_buffers.padded(config.gh, torch.bfloat16)}),
):
    constants = {**extra, **persistent._tile_constants(kind, config, layout)}
    options = {k: constants.pop(k) for k in ("num_warps", "num_stages")}
    signature = {
        name: "constexpr" if name in constants
        else special.get(name, "*bf16") if name.endswith("_ptr")
        else "fp32" if name.startswith("clip") else "i32"
        for name in kernel.arg_names
    }
    assert set(constants) >= {p.name for p in kernel.params if p.is_constexpr}, kind
    assert constants["PROBE"] == probe and constants["RS"] == (split if resident else 1), kind
    constexprs = {(kernel.arg_names.index(k),): v for k, v in constants.items()}
    # Pointers 16-byte aligned, as the JIT specializes them (else no vector loads).
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name].startswith("*")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"], kind
"""


@pytest.mark.parametrize(
    "mode, resident, probe, split",
    [("lstm", "resident", 0, 1), ("gru", "streamed", 0, 1), ("lstm", "resident", 3, 8),
     ("gru", "streamed", 3, 4)],
)  # fmt: skip
def test_kernels_compile_for_sm90(mode, resident, probe, split):
    # Compiled, not interpreted: a fresh process without TRITON_INTERPRET (ptxas ships
    # with triton; no GPU needed). Catches what only the compiler rejects.
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(persistent.__file__).parents[3])
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": src}
    args = [sys.executable, "-c", _COMPILE_FOR_SM90, mode, resident, str(probe), str(split)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_bench_new_variant_is_the_default():
    # benchmarks/persistent_rnn.py's "new" knob set is PersistentTuning's defaults, so the
    # measured "new" is what users get.
    from benchmarks.persistent_rnn import VARIANTS

    assert VARIANTS["old"].keys() == VARIANTS["new"].keys()
    for name, value in VARIANTS["new"].items():
        assert getattr(PersistentTuning(), name) == value, name


def test_phase_split_reads_the_probe_stamps():
    # Two programs, 6 steps of 2 us at 1.5 GHz: dot 1, gates 0.2, arrive 0.3, wait 0.5 us;
    # program 1 starts 0.1 us later and waits 0.1 us less.
    from benchmarks.persistent_rnn import phase_split

    ns = torch.zeros(1, 2, 6, persistent_kernels.STAMPS.value, dtype=torch.float64)
    start = 1000.0 + torch.arange(6) * 2000.0
    for p, lag in enumerate([0.0, 100.0]):
        for i, end in enumerate([1000.0, 1200.0, 1500.0]):
            ns[0, p, :, 3 + i] = start + lag + end
        ns[0, p, :, 1] = start + lag
    stamps = (ns * 1.5).long()
    stamps[..., 0] = (start + torch.tensor([[0.0], [100.0]])).long()
    got = phase_split(stamps, level=2)
    assert got["ghz"] == pytest.approx(1.5)
    for name, us in [("step", 2.0), ("dot", 1.0), ("gates", 0.2), ("arrive", 0.3),
                     ("wait", 0.5), ("work", 1.5), ("slowest", 1.5)]:  # fmt: skip
        assert got[name] == pytest.approx(us, abs=1e-3), name
    assert "error" in phase_split(torch.zeros(1, 2, 6, 6, dtype=torch.int64), level=2)


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("layers", [1, 2])
def test_memory_formulas_cover_what_the_op_allocates(monkeypatch, mode, memory, layers):
    # The op's declared temporaries with impl="persistent" against the bytes it
    # allocates (tests/ops/test_rnn_op.py's harness; launches skipped: the interpreter's
    # reference cycles keep kernel arguments alive, and they allocate nothing).
    from .test_rnn_op import _declared_and_seen

    monkeypatch.setattr(persistent, "_launch", lambda *args, **kwargs: None)
    # Up to 1.25x over: the op's per-layer [B, H] state term (the stack's, not the layer's)
    # weighs more next to this layer's small workspace than next to kernels.py's.
    for declared, seen in _declared_and_seen(mode, "persistent", memory, layers, False, 0.0):
        assert 0.9 * seen <= declared <= 1.25 * seen, (declared, seen)
