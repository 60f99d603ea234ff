"""The mirrorgrad::rnn_forward / rnn_backward ops: registration, gradients, compile capture."""

import warnings

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils.flop_counter import FlopCounterMode

import mirrorgrad.nn as mnn
from mirrorgrad.ops.rnn import dispatch, op, reference, reverse_within_lengths, rnn
from mirrorgrad.ops.rnn.cell_modes import GATES, MODES

DT = torch.float64


def stack_inputs(mode, *, layers=2, bidirectional=True, T=4, B=3, n_in=2, H=2, proj=0, bias=True,
                 dtype=DT):  # fmt: skip
    """Random inputs of rnn_forward in torch.nn's weight order (requiring grad)."""
    G = GATES[mode]
    D = 2 if bidirectional else 1
    Hr = proj or H
    weights = []
    for layer in range(layers):
        for _ in range(D):
            layer_in = n_in if layer == 0 else D * Hr
            shapes = [(G * H, layer_in), (G * H, Hr)] + ([(G * H,), (G * H,)] if bias else [])
            shapes += [(Hr, H)] if proj else []
            weights += [torch.randn(s, dtype=dtype).mul_(0.5).requires_grad_() for s in shapes]
    x = torch.randn(T, B, n_in, dtype=dtype, requires_grad=True)
    hx = torch.randn(layers * D, B, Hr, dtype=dtype, requires_grad=True)
    cx = torch.randn(layers * D, B, H, dtype=dtype, requires_grad=True) if mode == "lstm" else None
    return x, weights, hx, cx


def forward_args(mode, x, weights, hx, cx, *, layers=2, bidirectional=True, proj=0, lengths=None,
                 dropout=0.0, seed=5, memory="stash", clip=None, need_saved=True,
                 impl="reference"):  # fmt: skip
    return (
        x, weights, hx, cx, lengths, torch.tensor(seed), mode, layers, bidirectional, True, proj,
        dropout, memory, clip, impl, need_saved,
    )  # fmt: skip


GRADCHECK = [
    pytest.param(mode, memory, id=f"{mode}-{memory}")
    for mode in MODES
    for memory in ("stash", "recompute")
]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "memory"), GRADCHECK)
def test_gradcheck_bidir_varlen_dropout(mode, memory):
    """Finite differences through the whole op: 2 layers, both directions, unsorted
    lengths, dropout between layers (mask regenerated from the seed in backward)."""
    x, weights, hx, cx = stack_inputs(mode, T=3, B=3)
    lengths = torch.tensor([2, 3, 1])
    clip = [-0.5, 0.6] if mode == "lstm" else None

    def f(x, hx, cx, *weights):
        args = forward_args(mode, x, list(weights), hx, cx, lengths=lengths, dropout=0.4,
                            memory=memory, clip=clip)  # fmt: skip
        y, h_n, c_n, _ = torch.ops.mirrorgrad.rnn_forward(*args)
        return y, h_n, c_n

    if cx is None:
        assert torch.autograd.gradcheck(lambda x, hx, *w: f(x, hx, None, *w)[:2], (x, hx, *weights))
    else:
        assert torch.autograd.gradcheck(f, (x, hx, cx, *weights))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_opcheck_forward(mode):
    """torch.library.opcheck: schema, fake kernel, autograd registration agree with eager."""
    proj = 1 if mode == "lstm" else 0
    x, weights, hx, cx = stack_inputs(mode, proj=proj)
    args = forward_args(mode, x, weights, hx, cx, proj=proj, lengths=torch.tensor([4, 2, 3]),
                        dropout=0.3)  # fmt: skip
    torch.library.opcheck(torch.ops.mirrorgrad.rnn_forward.default, args)


def test_fake_kernel_matches_real_shapes_for_every_memory_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for mode in MODES:
        for memory in ("stash", "recompute"):
            x, weights, hx, cx = (
                t.detach() if isinstance(t, torch.Tensor) else t for t in stack_inputs(mode)
            )
            weights = [w.detach() for w in weights]
            args = forward_args(mode, x, weights, hx, cx, memory=memory)
            real = torch.ops.mirrorgrad.rnn_forward(*args)
            with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
                fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                             for a in args]  # fmt: skip
                fake_args[1] = [fake_mode.from_tensor(w) for w in weights]
                fake = torch.ops.mirrorgrad.rnn_forward(*fake_args)
            flat_real = [*real[:3], *real[3]]
            flat_fake = [*fake[:3], *fake[3]]
            assert [(t.shape, t.dtype) for t in flat_real] == [
                (t.shape, t.dtype) for t in flat_fake
            ]


def test_eager_function_agrees_with_the_registered_autograd():
    """rnn() in eager mode runs autograd through op.EagerStack, the op called directly
    through its torch.library registration: same outputs and the same gradients of x,
    states and weights (dropout, unsorted lengths, both directions, h_n/c_n used)."""
    x, weights, hx, cx = stack_inputs("lstm", T=4, B=3)
    lengths = torch.tensor([4, 2, 3])
    inputs = [x, hx, cx, *weights]
    torch.manual_seed(3)
    eager = rnn(x, weights, hx, cx, mode="lstm", num_layers=2, bidirectional=True, dropout=0.4,
                training=True, lengths=lengths, memory="recompute", impl="reference")  # fmt: skip
    assert type(eager[0].grad_fn).__name__ == "EagerStackBackward"
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))  # what rnn() drew
    args = forward_args("lstm", x, weights, hx, cx, lengths=lengths, dropout=0.4, seed=seed,
                        memory="recompute")  # fmt: skip
    registered = torch.ops.mirrorgrad.rnn_forward(*args)[:3]
    probes = [torch.randn_like(t) for t in eager]
    grads = [
        torch.autograd.grad(sum((t * w).sum() for t, w in zip(out, probes)), inputs)
        for out in (eager, registered)
    ]
    for a, b in zip(eager, registered):
        torch.testing.assert_close(a, b)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_eager_calls_skip_the_dispatcher_unless_something_would_see_the_op(monkeypatch):
    """In plain eager mode EagerStack calls the op's Python implementations directly
    (no torch.library wrappers); under a dispatch mode it goes through the dispatcher,
    which is what the mode sees. Both give the same gradients."""
    direct = {"forward": 0, "backward": 0}

    def counting(name, impl):
        def call(*args):
            direct[name] += 1
            return impl(*args)

        return call

    monkeypatch.setattr(op, "_forward_impl", counting("forward", op._forward_impl))
    monkeypatch.setattr(op, "_backward_impl", counting("backward", op._backward_impl))
    mod = mnn.LSTM(4, 5, 2, dtype=DT, memory="recompute")
    x = torch.randn(3, 2, 4, dtype=DT, requires_grad=True)
    inputs = [x, *mod.parameters()]

    def grads():
        mod(x)[0].square().sum().backward()
        out = [t.grad for t in inputs]
        for t in inputs:
            t.grad = None
        return out

    plain = grads()
    assert direct == {"forward": 1, "backward": 1}
    with FlopCounterMode(display=False) as counter:
        seen = grads()
    assert direct == {"forward": 1, "backward": 1}
    assert torch.ops.mirrorgrad.rnn_backward in counter.get_flop_counts()["Global"]
    for a, b in zip(plain, seen):
        torch.testing.assert_close(a, b)


def test_flop_formulas():
    T, B, n_in, H = 2, 3, 4, 5
    mod = mnn.LSTM(n_in, H, dtype=DT, memory="recompute")
    x = torch.randn(T, B, n_in, dtype=DT, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        mod(x)[0].sum().backward()
    forward = 2 * T * B * 4 * H * (n_in + H)
    flops = counter.get_flop_counts()["Global"]
    assert flops[torch.ops.mirrorgrad.rnn_forward] == forward
    assert flops[torch.ops.mirrorgrad.rnn_backward] == 3 * forward  # 2x + recomputed gates


def test_reverse_within_lengths_flips_each_sequence_and_is_an_involution():
    x = torch.arange(12.0).view(4, 3, 1)
    lengths = torch.tensor([4, 1, 3])
    r = reverse_within_lengths(x, lengths)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(r[:n, b], x[:n, b].flip(0))
        assert torch.equal(r[n:, b], x[n:, b])
    assert torch.equal(reverse_within_lengths(r, lengths), x)


@pytest.mark.parametrize("mode", MODES)
def test_variable_lengths_equal_per_sequence_runs(mode):
    """A padded batch with lengths gives, row by row, what each sequence gives alone."""
    x, weights, hx, cx = stack_inputs(mode, T=5, B=3)
    lengths = torch.tensor([5, 2, 4])
    kw = {"mode": mode, "num_layers": 2, "bidirectional": True}
    with torch.no_grad():
        y, h_n, c_n = rnn(x, weights, hx, cx, lengths=lengths, **kw)
        for b, n in enumerate(lengths.tolist()):
            cx_b = None if cx is None else cx[:, b : b + 1]
            y_b, h_b, c_b = rnn(x[:n, b : b + 1], weights, hx[:, b : b + 1], cx_b, **kw)
            torch.testing.assert_close(y[:n, b : b + 1], y_b)
            assert torch.all(y[n:, b] == 0)
            torch.testing.assert_close(h_n[:, b : b + 1], h_b)
            if c_n is not None:
                torch.testing.assert_close(c_n[:, b : b + 1], c_b)


def test_backward_skips_gradients_nobody_needs(monkeypatch):
    """Frozen weights and an input without grad reach layer_backward as 'not needed'."""
    seen = []
    original = reference.layer_backward

    def spy(*args, **kwargs):
        seen.append(kwargs["needs_input_grad"])
        return original(*args, **kwargs)

    monkeypatch.setattr(op.reference, "layer_backward", spy)
    mod = mnn.LSTM(3, 4, num_layers=2, dtype=DT)
    for name in ("weight_ih_l0", "bias_ih_l0", "bias_hh_l0"):
        getattr(mod, name).requires_grad_(False)
    mod(torch.randn(3, 2, 3, dtype=DT))[0].sum().backward()
    top, bottom = seen  # layers run top-down in backward
    # order: x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr
    assert top == (True, False, False, True, True, True, True, False)
    assert bottom == (False, False, False, False, True, False, False, False)


def test_memory_auto_recomputes_lstm_only_when_training(monkeypatch):
    memories = []
    original = reference.layer_forward

    def spy(*args, **kwargs):
        memories.append(args[0].memory)
        return original(*args, **kwargs)

    monkeypatch.setattr(op.reference, "layer_forward", spy)
    lstm, gru = mnn.LSTM(3, 4), mnn.GRU(3, 4)
    x = torch.randn(2, 1, 3)
    lstm(x)
    gru(x)
    with torch.no_grad():
        lstm(x)
    assert memories == ["recompute", "stash", "stash"]


def test_dropout_mask_is_deterministic_with_mean_near_keep_probability():
    x = torch.ones(200, 500, dtype=DT)
    a = reference.dropout(x, 0.3, seed=11, offset=1)
    assert torch.equal(a, reference.dropout(x, 0.3, seed=11, offset=1))
    assert not torch.equal(a, reference.dropout(x, 0.3, seed=11, offset=2))
    assert not torch.equal(a, reference.dropout(x, 0.3, seed=12, offset=1))
    kept = (a != 0).double().mean().item()
    assert abs(kept - 0.7) < 0.01
    torch.testing.assert_close(a.mean().item(), 1.0, atol=0.02, rtol=0)  # inverted scaling


class _Tagger(torch.nn.Module):
    def __init__(self, mode_cls, **kw):
        super().__init__()
        self.rnn = mode_cls(3, 4, num_layers=2, dropout=0.2, **kw)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0]).square().mean()


@pytest.mark.slow
@pytest.mark.parametrize("mode_cls", [mnn.LSTM, mnn.GRU, mnn.RNN], ids=["lstm", "gru", "rnn"])
def test_compile_fullgraph_captures_one_node(mode_cls):
    """No graph break and no per-step ops: one rnn_forward, one rnn_backward node."""
    graphs = {}

    def keep(name):
        def compiler(gm, _example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))
    torch._dynamo.reset()
    model = _Tagger(mode_cls).double()
    x = torch.randn(6, 2, 3, dtype=DT)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    torch.manual_seed(0)
    loss = compiled(x)
    loss.backward()

    def targets(gm):
        return [n.target for n in gm.graph.nodes if n.op == "call_function"]

    fw, bw = targets(graphs["fw"]), targets(graphs["bw"])
    assert fw.count(torch.ops.mirrorgrad.rnn_forward.default) == 1
    assert bw.count(torch.ops.mirrorgrad.rnn_backward.default) == 1
    per_step = {torch.ops.aten.sigmoid.default, torch.ops.aten.tanh.default,
                torch.ops.aten.relu.default}  # fmt: skip
    assert not per_step & set(fw + bw)
    # Only the Linear head adds GEMMs: the recurrence has none outside the op.
    gemms = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    assert sum(t in gemms for t in fw) == 1
    # Same numbers as eager with the same dropout seed.
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(0)
    eager = model(x)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for a, p in zip(grads, model.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_bad_functional_arguments():
    x, weights, hx, _ = stack_inputs("gru", layers=1, bidirectional=False)
    with pytest.raises(ValueError, match="mode"):
        rnn(x, weights, hx, mode="lstmm")
    with pytest.raises(ValueError, match="LSTM only"):
        rnn(x, weights, hx, mode="gru", state_clip=(-1.0, 1.0))
    with pytest.raises(ValueError, match="memory"):
        rnn(x, weights, hx, mode="gru", memory="some")


def test_cudnn_impl_is_torch_own_rnn():
    """impl="cudnn" runs torch._VF (cuDNN on CUDA, aten here) with torch's autograd."""
    ref = torch.nn.GRU(3, 4, num_layers=2, bidirectional=True).double()
    mod = mnn.GRU(3, 4, num_layers=2, bidirectional=True, dtype=DT, impl="cudnn")
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(5, 2, 3, dtype=DT)
    torch.testing.assert_close(mod(x)[0], ref(x)[0])


@pytest.mark.slow
@pytest.mark.skipif(op.triton_module() is None, reason="triton not installed")
@pytest.mark.parametrize("mode", MODES)
def test_triton_impl_through_the_op_matches_reference(mode):
    """The op composes R2's Triton layer (interpreted on CPU) like the reference layer."""
    if not op.triton_module().supports(mode, proj=False, dtype=torch.float32,
                                        device=torch.device("cpu")):  # fmt: skip
        pytest.skip("Triton path needs TRITON_INTERPRET=1 on CPU")
    torch.manual_seed(0)
    ref = mnn.LSTM if mode == "lstm" else mnn.GRU if mode == "gru" else mnn.RNN
    kw = {} if mode in ("lstm", "gru") else {"nonlinearity": mode.split("_")[1]}
    a = ref(3, 4, num_layers=2, bidirectional=True, impl="reference", **kw)
    b = ref(3, 4, num_layers=2, bidirectional=True, impl="triton", **kw)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 2, 3, requires_grad=True)
    ya, yb = a(x)[0], b(x)[0]
    torch.testing.assert_close(yb, ya, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(ya)
    ga = torch.autograd.grad((ya * w).sum(), [x, *a.parameters()])
    gb = torch.autograd.grad((yb * w).sum(), [x, *b.parameters()])
    for u, v in zip(gb, ga):
        torch.testing.assert_close(u, v, atol=1e-4, rtol=1e-4)


def test_auto_choice_is_timed_once_per_shape_and_cached(monkeypatch):
    monkeypatch.setattr(dispatch, "_AUTO_CHOICE", {})
    timings = {"triton": 2.0, "cudnn": 3.0}
    timed = []

    def timer(fn):
        timed.append(fn())
        return timings[timed[-1]]

    candidates = {"triton": lambda: "triton", "cudnn": lambda: "cudnn"}
    assert dispatch._choose_auto(("k", 1), candidates, timer) == "triton"
    timings["triton"] = 9.0
    assert dispatch._choose_auto(("k", 1), candidates, timer) == "triton"  # cached
    assert dispatch._choose_auto(("k", 2), candidates, timer) == "cudnn"  # new shape: timed again
    assert timed == ["triton", "cudnn", "triton", "cudnn"]


def test_timing_auto_candidates_keeps_the_rng_state(monkeypatch):
    """The timed calls draw dropout seeds; the call timed first still gets the masks
    torch.manual_seed gives (the draw after the choice is the one without timing)."""
    monkeypatch.setattr(dispatch, "_AUTO_CHOICE", {})
    monkeypatch.setattr(dispatch, "AUTO_TIMES", {})
    candidates = {"triton": lambda: torch.rand(3), "cudnn": lambda: torch.rand(3)}
    torch.manual_seed(4)
    expected = torch.rand(2)
    torch.manual_seed(4)
    dispatch._choose_auto((torch.device("cpu"), 1), candidates, lambda fn: float(fn()[0]))
    torch.testing.assert_close(torch.rand(2), expected)


def test_auto_keeps_only_the_graphs_of_the_implementation_it_picked(monkeypatch):
    """Timing captures step loops for every candidate; those only the losers used are
    released (a shape cuDNN wins keeps no CUDA Graph buffers)."""
    monkeypatch.setattr(dispatch, "_AUTO_CHOICE", {})
    released = []
    monkeypatch.setattr(dispatch.cuda_graphs, "release", released.append)

    def step(name, keys):
        def run():
            for recording in dispatch.cuda_graphs._RECORDING:
                recording.update(keys)
            return name

        return run

    candidates = {
        "persistent": step("persistent", {"p", "shared"}),
        "triton": step("triton", {"t", "shared"}),
        "cudnn": step("cudnn", set()),
    }
    times = {"persistent": 3.0, "triton": 2.0, "cudnn": 4.0}
    assert dispatch._choose_auto(("k",), candidates, lambda fn: times[fn()]) == "triton"
    assert released == [{"p"}]
    assert dispatch.AUTO_TIMES[("k",)] == times


def test_auto_follows_the_cost_rule_without_timing_while_compiling(monkeypatch):
    monkeypatch.setattr(dispatch, "_AUTO_CHOICE", {("k",): "cudnn"})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    def timer(fn):
        raise AssertionError("nothing is timed while tracing")

    candidates = {"triton": None, "cudnn": None}
    assert dispatch._choose_auto(("k",), candidates, timer, rule=lambda: "triton") == "triton"


def test_auto_offers_the_persistent_kernel_where_it_covers_the_shape(monkeypatch):
    """On CUDA the candidates are the persistent kernel (where it runs the shape), the
    split kernels and cuDNN; the rule ranks only the first two."""
    seen = {}

    def choose(key, candidates, timer=None, rule=None):
        seen["candidates"], seen["rule"] = list(candidates), rule()
        return "cudnn"

    class CudaInput:  # what _auto_impl reads of x
        device = torch.device("cuda")
        dtype = torch.float32
        shape = (35, 20, 650)

    monkeypatch.setattr(dispatch, "_choose_auto", choose)
    monkeypatch.setattr(dispatch, "_triton_supports", lambda *args: True)
    shape = dispatch.time_model.Shape(mode="lstm", T=35, B=20, H=650, layers=2, directions=1)
    for covered in (True, False):
        monkeypatch.setattr(dispatch, "_persistent_supports", lambda *args, c=covered: c)
        impl = dispatch._auto_impl(CudaInput(), False, shape, ("k",), lambda name: None,
                                   lambda: None, [], "auto")  # fmt: skip
        assert impl == "cudnn"
        fused = ["persistent", "triton"] if covered else ["triton"]
        assert seen["candidates"] == [*fused, "cudnn"]
        assert seen["rule"] == "triton"  # no constants for the persistent kernel yet


def test_choose_by_rule_takes_the_rule_untimed_and_never_cudnn(monkeypatch):
    """Inside choose_by_rule() (train's evaluation) auto times nothing and caches nothing:
    the cost rule's pick among the custom op's implementations."""

    def choose(*args, **kwargs):
        raise AssertionError("timed inside choose_by_rule()")

    class CudaInput:
        device = torch.device("cuda")
        dtype = torch.float32
        shape = (35, 10, 650)

    monkeypatch.setattr(dispatch, "_choose_auto", choose)
    monkeypatch.setattr(dispatch, "_triton_supports", lambda *args: True)
    monkeypatch.setattr(dispatch, "_persistent_supports", lambda *args: True)
    monkeypatch.setattr(dispatch.time_model, "pick", lambda candidates, *args: candidates[-1])
    shape = dispatch.time_model.Shape(mode="lstm", T=35, B=10, H=650, layers=2, directions=1)
    with dispatch.choose_by_rule():
        impl = dispatch._auto_impl(CudaInput(), False, shape, ("k",), lambda name: None,
                                   lambda: None, [], "auto")  # fmt: skip
        assert not dispatch.cuda_graphs.use_graph(torch.device("cuda"), 1, True)  # plain loops
    assert impl == "triton"  # the rule's last candidate: cuDNN was not among them
    with pytest.raises(AssertionError, match="timed"):
        dispatch._auto_impl(CudaInput(), False, shape, ("k",), lambda name: None,
                            lambda: None, [], "auto")  # fmt: skip


def test_triton_impl_refuses_what_it_does_not_support():
    mod = mnn.LSTM(3, 4, proj_size=2, impl="triton")
    with pytest.raises(ValueError, match="impl='auto'"):
        mod(torch.randn(2, 1, 3))


def test_expanded_and_transposed_inputs_reach_layers_contiguous(monkeypatch):
    """h_n.sum() gives a stride-0 gradient and users may pass transposed states: the
    per-layer implementations (Triton kernels) get contiguous tensors all the same."""
    original_fw, original_bw = reference.layer_forward, reference.layer_backward
    seen = []

    def record(fn):
        def wrapped(*args, **kwargs):
            seen.extend(a.is_contiguous() for a in args if isinstance(a, torch.Tensor))
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(op.reference, "layer_forward", record(original_fw))
    monkeypatch.setattr(op.reference, "layer_backward", record(original_bw))
    mod = mnn.LSTM(3, 4, num_layers=2, bidirectional=True, dtype=DT)
    h0 = torch.randn(2, 4, 4, dtype=DT).transpose(0, 1).requires_grad_()  # [4,2,4], strided
    c0 = torch.randn(4, 2, 4, dtype=DT, requires_grad=True)
    y, (h_n, c_n) = mod(torch.randn(5, 2, 3, dtype=DT), (h0, c0))
    (h_n.sum() + c_n.sum() + y.sum()).backward()
    assert seen and all(seen)


def _strided(t):
    """The same values with reversed memory order (a permuted, non-contiguous view)."""
    dims = tuple(reversed(range(t.dim())))
    return t.permute(dims).contiguous().permute(dims).requires_grad_(t.requires_grad)


def _strides(outputs):
    y, h, c, rest = outputs
    return [(tuple(t.shape), t.stride()) for t in (y, h, c, *rest)]


def _fake_call(fn, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:

        def fake(a):
            if isinstance(a, torch.Tensor):
                return mode.from_tensor(a)
            if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
                return [mode.from_tensor(t) for t in a]
            return a

        return fn(*[fake(a) for a in args])


@pytest.mark.parametrize("mode", MODES)
def test_fake_kernels_promise_the_real_strides_for_strided_inputs(mode):
    """Inductor asserts that a custom op's outputs have the strides its fake kernel gave:
    with a permuted x (DeepSpeech2 feeds conv features .permute(2, 0, 1)) the backward's
    fake kernel used empty_like(x), i.e. x's strides, for a contiguous real grad_x."""
    x, weights, hx, cx = stack_inputs(mode, n_in=3)
    x, hx = _strided(x.detach()), _strided(hx.detach())
    cx = None if cx is None else _strided(cx.detach())
    weights = [_strided(w.detach()) for w in weights]
    assert not x.is_contiguous() and not hx.is_contiguous()
    for memory in ("stash", "recompute"):
        args = forward_args(mode, x, weights, hx, cx, lengths=torch.tensor([4, 2, 3]),
                            memory=memory)  # fmt: skip
        real = torch.ops.mirrorgrad.rnn_forward(*args)
        fake = _fake_call(torch.ops.mirrorgrad.rnn_forward, args)
        assert _strides(real) == _strides(fake)
        y, h_n, c_n, saved = real
        grad_cn = _strided(torch.randn_like(c_n)) if mode == "lstm" else None
        needs = [True, True, mode == "lstm", *([True] * len(weights))]
        back = (
            _strided(torch.randn_like(y)), _strided(torch.randn_like(h_n)), grad_cn, *args[:6],
            y, saved, *args[6:15], needs,
        )  # fmt: skip
        real = torch.ops.mirrorgrad.rnn_backward(*back)
        fake = _fake_call(torch.ops.mirrorgrad.rnn_backward, back)
        assert _strides(real) == _strides(fake)


def test_triton_support_check_is_a_constant_under_compile():
    # On a GPU, impl="auto" asks this while Dynamo traces the module: it must not trace
    # into the cached import (Dynamo warned about the functools.cache on every compile).
    def f(x):
        supported = dispatch._triton_supports("lstm", False, x.dtype, torch.device("cuda"))
        return x * 2 if supported else x

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(f, fullgraph=True, backend="eager")(torch.ones(3))
    assert not [w for w in caught if "lru_cache" in str(w.message)]


def _storage_bytes(tensors):
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor) and t.numel()}  # fmt: skip
    return sum(storages.values())


def _declared_and_seen(mode, impl, memory, layers, bidirectional, dropout, *, n_in=12, H=16):
    """(declared, seen) temporaries of rnn_forward and of rnn_backward, float32."""
    from mirrorgrad import formulas

    from .memory_tracker import PeakTracker

    x, weights, hx, cx = stack_inputs(mode, layers=layers, bidirectional=bidirectional, T=10,
                                      B=8, n_in=n_in, H=H)  # fmt: skip
    x, hx, weights = x.detach().float(), hx.detach().float(), [w.detach().float() for w in weights]
    cx = None if cx is None else cx.detach().float()
    args = (x, weights, hx, cx, None, torch.tensor(3), mode, layers, bidirectional, True, 0,
            dropout, memory, None, impl, True)  # fmt: skip
    inputs = [t for t in (x, hx, cx, *weights) if t is not None]
    with PeakTracker(*inputs) as tracker:
        y, h_n, c_n, saved = op.rnn_forward._init_fn(*args)
    forward = (formulas.memory_formula(torch.ops.mirrorgrad.rnn_forward)(*args),
               tracker.peak - _storage_bytes([y, h_n, c_n, *saved]))  # fmt: skip
    grads = [torch.randn_like(y), torch.randn_like(h_n), torch.randn_like(c_n) if cx is not None
             else None]  # fmt: skip
    needs = [True, True, cx is not None, *([True] * len(weights))]
    back = (*grads, *args[:6], y, saved, *args[6:15], needs)
    with PeakTracker(*inputs, y, h_n, c_n, *saved, *[g for g in grads if g is not None]) as tracker:
        gx, ghx, gcx, gw = op.rnn_backward._init_fn(*back)
    backward = (formulas.memory_formula(torch.ops.mirrorgrad.rnn_backward)(*back),
                tracker.peak - _storage_bytes([gx, ghx, gcx, *gw]))  # fmt: skip
    return forward, backward


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize(("layers", "bidirectional", "dropout"), [(1, False, 0.0), (2, False, 0.5),
                                                                  (2, True, 0.0)])  # fmt: skip
def test_memory_formulas_match_what_the_op_allocates(monkeypatch, impl, mode, memory, layers,
                                                      bidirectional, dropout):  # fmt: skip
    """The declared temporaries (what the planner's simulation adds while the op runs)
    against the bytes the op allocates through ATen beyond its inputs and outputs:
    within 10% for the Triton path's unidirectional stacks (the GPU path the planner
    plans for), an overestimate of at most 1.5x for bidirectional ones (copies of
    reversed directions counted at their worst) and for the reference path (estimated
    per-step temporaries)."""
    if impl == "triton":
        if op.triton_module() is None or not op.triton_module().supports(
            mode, proj=False, dtype=torch.float32, device=torch.device("cpu")
        ):
            pytest.skip("Triton path needs TRITON_INTERPRET=1 on CPU")
        # The interpreter's reference cycles keep kernel arguments alive until the next
        # GC; what the loops compute does not change what is allocated.
        monkeypatch.setattr(op.triton_module(), "_fwd_loop", lambda config, buf: None)
        monkeypatch.setattr(op.triton_module(), "_bwd_loop", lambda config, buf: None)
    for declared, seen in _declared_and_seen(mode, impl, memory, layers, bidirectional, dropout):
        low, high = (0.9, 1.5) if bidirectional or impl == "reference" else (0.9, 1.1)
        assert low * seen <= declared <= high * seen, (declared, seen)


def _same_grads_with_the_same_seed(compiled, model, ref, x) -> None:
    """``compiled`` (of ``model``) and ``ref`` give the same gradients from one seed
    (dropout masks included)."""
    for m in (model, ref):
        m.zero_grad()
    torch.manual_seed(1)
    compiled(x)[0].square().sum().backward()
    torch.manual_seed(1)
    ref(x)[0].square().sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.slow
@pytest.mark.skipif(op.triton_module() is None, reason="triton not installed")
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_auto_under_compile_traces_the_gpu_choice_in_one_graph(monkeypatch, persistent, dynamic):
    """The choice impl="auto" makes on a GPU while torch.compile traces (persistent
    support, the timed pick or the cost rule) is traced without a graph break, with
    static or symbolic shapes, and the op it picks gets the same memory in forward and
    backward: run here with the interpreted kernels."""
    if not op.triton_module().supports("lstm", proj=False, dtype=torch.float32,
                                        device=torch.device("cpu")):  # fmt: skip
        pytest.skip("Triton path needs TRITON_INTERPRET=1 on CPU")
    monkeypatch.setattr(dispatch, "_on_gpu", lambda x: True)
    monkeypatch.setattr(dispatch, "_persistent_supports", lambda *args: persistent)
    picked = []
    real_pick = dispatch.time_model.pick
    monkeypatch.setattr(dispatch.time_model, "pick",
                        lambda *a: picked.append(real_pick(*a)) or picked[0])  # fmt: skip

    # With static shapes and two candidates the choice is timed (the test below): here a
    # stand-in that picks the split kernels, traced as a constant as the real one is.
    @torch.compiler.assume_constant_result
    def timed(key, candidates, call):
        picked.append("triton")
        return "triton"

    monkeypatch.setattr(dispatch, "_timed_while_tracing", timed)
    torch.manual_seed(0)
    # Dropout: its seed is drawn by torch.randint, not the poisoned torch.empty (whose
    # frame inspection Dynamo cannot trace).
    model = mnn.LSTM(4, 5, 2, dropout=0.3)
    ref = mnn.LSTM(4, 5, 2, dropout=0.3, impl="triton")
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for T, B in ((3, 2), (2, 3)):
        x = torch.randn(T, B, 4)
        _same_grads_with_the_same_seed(compiled, model, ref, x)
    assert picked and set(picked) == {"triton"}


@pytest.fixture
def gpu_auto_dispatch(monkeypatch):
    """impl="auto" as on a GPU with the persistent kernel supported (the interpreted
    kernels stand in), with no cached picks."""
    if op.triton_module() is None or not op.triton_module().supports(
        "lstm", proj=False, dtype=torch.float32, device=torch.device("cpu")
    ):
        pytest.skip("Triton path needs TRITON_INTERPRET=1 on CPU")
    monkeypatch.setattr(dispatch, "_on_gpu", lambda x: True)
    monkeypatch.setattr(dispatch, "_persistent_supports", lambda *args: True)
    monkeypatch.setattr(dispatch, "_AUTO_CHOICE", {})


@pytest.mark.slow
def test_auto_under_compile_times_the_op_implementations_as_eager_does(
    monkeypatch, gpu_auto_dispatch
):
    """While torch.compile traces impl="auto" on a GPU, the custom op's implementations
    (here the persistent kernel and the split kernels) are timed once, on tensors of the
    call's shapes, cached beside eager's picks: the compiled graph runs the pick, an
    eager call still times its own candidates, and the RNG state is as if nothing had been timed
    (the gradients with dropout match a model that never timed). Run here with the
    interpreted kernels and a stand-in timer (the persistent kernel is not run)."""
    monkeypatch.setattr(dispatch, "AUTO_TIMES", {})
    times, timed = {"persistent": 2.0, "triton": 1.0}, []
    real_steps = dispatch._synthetic_steps

    def named_steps(key, candidates, call):
        steps = real_steps(key, candidates, call)
        return {name: (lambda n=name, s=steps[name]: (n, s)) for name in steps}

    def timer(step):
        name, run = step()
        if name == "triton":
            run()  # the synthetic step runs (on real tensors)
        timed.append(name)
        return times[name]

    monkeypatch.setattr(dispatch, "_synthetic_steps", named_steps)
    monkeypatch.setattr(dispatch, "_time_ms", timer)
    torch._dynamo.reset()  # an earlier test's graph of the same module class would serve
    torch.manual_seed(0)
    model = mnn.LSTM(4, 5, 2, dropout=0.3)
    ref = mnn.LSTM(4, 5, 2, dropout=0.3, impl="triton")
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 2, 4)
    for _ in range(2):
        _same_grads_with_the_same_seed(compiled, model, ref, x)
    assert timed == ["persistent", "triton"]  # once, at the first trace
    ((key, choice),) = dispatch._AUTO_CHOICE.items()
    assert key[-1] == "compiled" and choice == "triton"
    # Eager, same shape: eager times its own candidates (cuDNN among them): the compiled
    # pick is not eager's.
    asked = []

    def choose(key, candidates, timer=None, rule=None):
        asked.append((key, list(candidates)))
        return "triton"

    monkeypatch.setattr(dispatch, "_choose_auto", choose)
    model(x)[0].sum().backward()
    assert asked == [(key[:-1], ["persistent", "triton", "cudnn"])]


@pytest.mark.slow
def test_auto_under_compile_falls_back_to_the_rule_with_a_warning_where_timing_fails(
    monkeypatch, gpu_auto_dispatch
):

    def timer(step):
        raise RuntimeError("no timing here")

    monkeypatch.setattr(dispatch, "_time_ms", timer)
    torch._dynamo.reset()
    model = mnn.LSTM(4, 5, 2, dropout=0.3)  # a seed by torch.randint: see the test above
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.warns(RuntimeWarning, match="could not time persistent, triton.*'triton'"):
        compiled(torch.randn(3, 2, 4))[0].sum().backward()
    assert dispatch._AUTO_CHOICE == {}


def test_captured_and_uncaptured_choices_are_timed_and_cached_apart(monkeypatch):
    """dispatch_as_captured(): the candidates are timed again (captured, on a GPU) and
    that choice is kept beside the uncaptured one, not instead of it."""
    monkeypatch.setattr(dispatch, "_AUTO_CHOICE", {})
    monkeypatch.setattr(dispatch, "AUTO_TIMES", {})
    uncaptured, captured = {"triton": 1.0, "cudnn": 2.0}, {"triton": 2.0, "cudnn": 1.0}

    def timer(fn):
        return (captured if dispatch._captured_depth else uncaptured)[fn()]

    candidates = {"triton": lambda: "triton", "cudnn": lambda: "cudnn"}
    key = (torch.device("cpu"), 1)
    assert dispatch._choose_auto(key, candidates, timer) == "triton"
    with dispatch.dispatch_as_captured():
        assert dispatch._choose_auto(key, candidates, timer) == "cudnn"
    assert dispatch._choose_auto(key, candidates, timer) == "triton"
    assert {key: uncaptured, (*key, "captured"): captured} == dispatch.AUTO_TIMES


def test_auto_choices_names_each_key_and_its_timings(monkeypatch):
    key = ("lstm", torch.device("cuda", 0), torch.bfloat16, 35, 20, 650, 2600, 650, 2, False,
           False, "recompute", True, True, False, False)  # fmt: skip
    choices = {key: "cudnn", (*key, "captured", "compiled"): "persistent"}
    monkeypatch.setattr(dispatch, "_AUTO_CHOICE", choices)
    monkeypatch.setattr(dispatch, "AUTO_TIMES", {key: {"cudnn": 1.0, "triton": 2.0}})
    plain, captured = dispatch.auto_choices()
    assert plain["mode"] == "lstm" and plain["dtype"] == "torch.bfloat16" and plain["B"] == 20
    assert plain["device"] == "cuda:0" and plain["memory"] == "recompute" and plain["grads"]
    assert (plain["captured"], plain["compiled"], plain["choice"]) == (False, False, "cudnn")
    assert plain["times"] == {"cudnn": 1.0, "triton": 2.0}
    assert (captured["captured"], captured["compiled"]) == (True, True)
    assert captured["choice"] == "persistent"
    assert captured["times"] == {}


def test_auto_key_tells_clipped_and_recompute_asked_calls_apart():
    """A choice made for a plain call (cuDNN, or the CUDA C++ kernel) must not serve a
    call with a state clip (cuDNN has none) or one asking for recompute by name (the
    CUDA C++ kernel always stashes)."""
    x, hx = torch.randn(5, 2, 3), torch.zeros(1, 2, 4)
    weights = list(mnn.LSTM(3, 4).parameters())

    def key(**kw):
        return dispatch._auto_key(x, weights, hx, None, "lstm", 1, False, "auto", 0.0, True, **kw)

    plain = key()
    assert key(clipped=True) != plain
    assert key(recompute_asked=True) != plain
    assert len(plain) == len(dispatch._KEY_FIELDS)  # auto_choices() names every field
