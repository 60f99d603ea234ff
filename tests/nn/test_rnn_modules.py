"""mirrorgrad.nn.LSTM / GRU / RNN against torch.nn in float64 on CPU (reference path)."""

import pytest
import torch
from torch.autograd import gradgradcheck
from torch.nn.utils.rnn import pack_padded_sequence

import mirrorgrad.nn as mnn

DT = torch.float64

# (name, mirrorgrad class, torch class, fixed constructor kwargs)
KINDS = [
    ("lstm", mnn.LSTM, torch.nn.LSTM, {}),
    ("gru", mnn.GRU, torch.nn.GRU, {}),
    ("rnn_tanh", mnn.RNN, torch.nn.RNN, {"nonlinearity": "tanh"}),
    ("rnn_relu", mnn.RNN, torch.nn.RNN, {"nonlinearity": "relu"}),
]

# (id, constructor kwargs, T, B, input_size, hidden_size)
CONFIGS = [
    ("1layer", {}, 5, 3, 4, 6),
    ("3layers", {"num_layers": 3}, 4, 2, 3, 5),
    ("bidir-2layers", {"num_layers": 2, "bidirectional": True}, 5, 3, 4, 6),
    ("batch_first", {"batch_first": True, "num_layers": 2}, 4, 3, 4, 5),
    ("no-bias", {"bias": False}, 4, 2, 3, 5),
    ("T1", {"num_layers": 2}, 1, 3, 4, 5),
    ("T63", {}, 63, 2, 3, 4),
    ("hidden1", {"num_layers": 2, "bidirectional": True}, 4, 2, 3, 1),
    ("hidden500", {}, 3, 2, 4, 500),
]
LSTM_ONLY_CONFIGS = [
    ("proj", {"proj_size": 3, "num_layers": 2}, 4, 3, 4, 6),
    ("proj-bidir", {"proj_size": 2, "bidirectional": True}, 4, 2, 3, 5),
]


def make_pair(kind, kwargs, input_size, hidden_size, **ours):
    _, ours_cls, torch_cls, fixed = kind
    ref = torch_cls(input_size, hidden_size, dtype=DT, **fixed, **kwargs)
    mod = ours_cls(input_size, hidden_size, dtype=DT, **fixed, **kwargs, **ours)
    mod.load_state_dict(ref.state_dict())
    return ref, mod


def states(h):
    return list(h) if isinstance(h, tuple) else [h]


def weighted_loss(y, h, weights):
    """A loss that weighs every output element differently (not just .sum())."""
    outs = [y, *states(h)]
    return sum((o * w).sum() for o, w in zip(outs, weights))


def random_weights(y, h):
    return [torch.randn_like(o) for o in [y, *states(h)]]


def check_against_torch(ref, mod, x, hx=None, y_of=lambda y: y, atol=1e-10, x_leaf=None):
    """Outputs, final states and the gradient of every input and parameter agree.

    x_leaf: the tensor x was made from (the padded batch of a PackedSequence)."""
    y_ref, h_ref = ref(x, hx)
    y_mod, h_mod = mod(x, hx)
    y_ref, y_mod = y_of(y_ref), y_of(y_mod)
    torch.testing.assert_close(y_mod, y_ref, atol=atol, rtol=0)
    for a, b in zip(states(h_mod), states(h_ref)):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)
    weights = random_weights(y_ref, h_ref)
    x_leaf = x if x_leaf is None else x_leaf
    leaves = [t for t in [x_leaf, *(states(hx) if hx is not None else [])] if t.requires_grad]
    trained = [n for n, p in ref.named_parameters() if p.requires_grad]
    ref_params = [getattr(ref, n) for n in trained]
    mod_params = [getattr(mod, n) for n in trained]
    # retain_graph: a PackedSequence's pack step is shared by both calls.
    loss_ref = weighted_loss(y_ref, h_ref, weights)
    g_ref = torch.autograd.grad(loss_ref, [*leaves, *ref_params], retain_graph=True)
    g_mod = torch.autograd.grad(weighted_loss(y_mod, h_mod, weights), [*leaves, *mod_params])
    names = [f"input{i}" for i in range(len(leaves))] + trained
    for name, a, b in zip(names, g_mod, g_ref):
        torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def initial_states(kind_name, mod, batch, *, unbatched=False):
    num = mod.num_layers * (2 if mod.bidirectional else 1)
    hidden = mod.proj_size or mod.hidden_size
    shape_h = (num, hidden) if unbatched else (num, batch, hidden)
    h0 = torch.randn(shape_h, dtype=DT, requires_grad=True)
    if kind_name != "lstm":
        return h0
    shape_c = (num, mod.hidden_size) if unbatched else (num, batch, mod.hidden_size)
    return h0, torch.randn(shape_c, dtype=DT, requires_grad=True)


def all_cases():
    for kind in KINDS:
        configs = CONFIGS + (LSTM_ONLY_CONFIGS if kind[0] == "lstm" else [])
        for config in configs:
            for memory in ("stash", "recompute"):
                yield pytest.param(kind, config, memory, id=f"{kind[0]}-{config[0]}-{memory}")


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "config", "memory"), list(all_cases()))
def test_matches_torch_nn(kind, config, memory):
    _, kwargs, T, B, input_size, hidden_size = config
    ref, mod = make_pair(kind, kwargs, input_size, hidden_size, memory=memory)
    shape = (B, T, input_size) if kwargs.get("batch_first") else (T, B, input_size)
    x = torch.randn(shape, dtype=DT, requires_grad=True)
    check_against_torch(ref, mod, x, initial_states(kind[0], mod, B))


@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_default_zero_initial_state(kind):
    ref, mod = make_pair(kind, {"num_layers": 2}, 3, 4)
    check_against_torch(ref, mod, torch.randn(5, 2, 3, dtype=DT, requires_grad=True))


@pytest.mark.parametrize("batch_first", [False, True], ids=["time_major", "batch_first"])
@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_unbatched_input(kind, batch_first):
    kwargs = {"num_layers": 2, "bidirectional": True, "batch_first": batch_first}
    ref, mod = make_pair(kind, kwargs, 3, 4)
    x = torch.randn(5, 3, dtype=DT, requires_grad=True)
    check_against_torch(ref, mod, x, initial_states(kind[0], mod, 1, unbatched=True))


PACKED = [(kind, bidir) for kind in KINDS for bidir in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "bidirectional"),
    PACKED,
    ids=[f"{k[0]}-{'bidir' if b else 'unidir'}" for k, b in PACKED],
)
def test_packed_unsorted_lengths(kind, bidirectional):
    extra = {"proj_size": 2} if kind[0] == "lstm" and bidirectional else {}
    ref, mod = make_pair(kind, {"num_layers": 2, "bidirectional": bidirectional, **extra}, 3, 4)
    lengths = torch.tensor([3, 6, 1, 6, 4])
    padded = torch.randn(6, 5, 3, dtype=DT, requires_grad=True)
    packed = pack_padded_sequence(padded, lengths, enforce_sorted=False)
    h0 = initial_states(kind[0], mod, 5)
    y_ref, _ = ref(packed, h0)
    y_mod, _ = mod(packed, h0)
    assert torch.equal(y_mod.batch_sizes, y_ref.batch_sizes)
    assert torch.equal(y_mod.sorted_indices, y_ref.sorted_indices)
    assert torch.equal(y_mod.unsorted_indices, y_ref.unsorted_indices)
    check_against_torch(ref, mod, packed, h0, y_of=lambda y: y.data, x_leaf=padded)


def test_packed_sorted_input():
    ref, mod = make_pair(KINDS[0], {"bidirectional": True}, 3, 4)
    padded = torch.randn(4, 3, 3, dtype=DT, requires_grad=True)
    packed = pack_padded_sequence(padded, torch.tensor([4, 2, 1]))
    check_against_torch(ref, mod, packed, y_of=lambda y: y.data, x_leaf=padded)


def plain_clipped_lstm(x, h0, c0, layers, clip):
    """Unidirectional multi-layer LSTM as a plain loop with torch.clamp on the cell."""
    hs, cs = [], []
    for layer, (w_ih, w_hh, b_ih, b_hh) in enumerate(layers):
        h, c, ys = h0[layer], c0[layer], []
        for t in range(x.shape[0]):
            i, f, g, o = (x[t] @ w_ih.T + b_ih + h @ w_hh.T + b_hh).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            c = c.clamp(*clip)
            h = torch.sigmoid(o) * torch.tanh(c)
            ys.append(h)
        x = torch.stack(ys)
        hs.append(h)
        cs.append(c)
    return x, (torch.stack(hs), torch.stack(cs))


@pytest.mark.slow
@pytest.mark.parametrize("memory", ["stash", "recompute"])
def test_state_clip_matches_plain_loop(memory):
    clip = (-0.4, 0.5)
    mod = mnn.LSTM(3, 5, num_layers=2, dtype=DT, memory=memory, state_clip=clip)
    with torch.no_grad():  # large weights so that the clamp is active often
        for p in mod.parameters():
            p.mul_(4)
    x = torch.randn(6, 2, 3, dtype=DT, requires_grad=True)
    h0, c0 = initial_states("lstm", mod, 2)
    layers = [[getattr(mod, f"{n}_l{k}") for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
              for k in range(2)]  # fmt: skip
    y_ref, h_ref = plain_clipped_lstm(x, h0, c0, layers, clip)
    y_mod, h_mod = mod(x, (h0, c0))
    cells = h_mod[1]
    assert ((cells == clip[0]) | (cells == clip[1])).any(), "clip never active: weak test"
    torch.testing.assert_close(y_mod, y_ref, atol=1e-10, rtol=0)
    weights = random_weights(y_ref, h_ref)
    leaves = [x, h0, c0, *mod.parameters()]
    g_ref = torch.autograd.grad(weighted_loss(y_ref, h_ref, weights), leaves)
    g_mod = torch.autograd.grad(weighted_loss(y_mod, h_mod, weights), leaves)
    for a, b in zip(g_mod, g_ref):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def dropout_run(seed, kind=KINDS[0]):
    torch.manual_seed(123)
    mod = kind[1](3, 4, num_layers=3, dropout=0.5, dtype=DT, **kind[3])
    x = torch.randn(5, 2, 3, dtype=DT, requires_grad=True)
    torch.manual_seed(seed)
    y, _ = mod(x)
    weights = torch.randn_like(y)
    grads = torch.autograd.grad((y * weights).sum(), [x, *mod.parameters()])
    return y, grads


@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_dropout_same_seed_same_outputs_and_grads(kind):
    y1, g1 = dropout_run(7, kind)
    y2, g2 = dropout_run(7, kind)
    y3, _ = dropout_run(8, kind)
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    assert not torch.equal(y1, y3), "another seed must give another mask"


def test_dropout_off_in_eval_mode():
    ref, mod = make_pair(KINDS[0], {"num_layers": 2, "dropout": 0.5}, 3, 4)
    ref.eval()
    mod.eval()
    check_against_torch(ref, mod, torch.randn(4, 2, 3, dtype=DT, requires_grad=True))


def test_frozen_weights_and_input_without_grad_get_no_gradient():
    ref, mod = make_pair(KINDS[0], {"num_layers": 2, "bidirectional": True}, 3, 4)
    for m in (ref, mod):
        m.weight_ih_l0.requires_grad_(False)
        m.bias_hh_l1_reverse.requires_grad_(False)
    x = torch.randn(5, 2, 3, dtype=DT)  # no gradient wanted
    check_against_torch(ref, mod, x)
    y, _ = mod(x)
    y.sum().backward()
    assert mod.weight_ih_l0.grad is None
    assert mod.bias_hh_l1_reverse.grad is None
    assert mod.weight_hh_l0.grad is not None


def test_no_grad_forward_returns_plain_tensors():
    mod = mnn.LSTM(3, 4, num_layers=2, dtype=DT)
    with torch.no_grad():
        y, (h, c) = mod(torch.randn(5, 2, 3, dtype=DT))
    assert not y.requires_grad and y.shape == (5, 2, 4)
    assert h.shape == c.shape == (2, 2, 4)


@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_state_dict_round_trip_both_ways(kind):
    ref, mod = make_pair(kind, {"num_layers": 2, "bidirectional": True}, 3, 4)
    assert mod.state_dict().keys() == ref.state_dict().keys()
    fresh_torch = kind[2](3, 4, num_layers=2, bidirectional=True, dtype=DT, **kind[3])
    fresh_torch.load_state_dict(mod.state_dict())
    for (name, a), b in zip(fresh_torch.state_dict().items(), mod.state_dict().values()):
        assert torch.equal(a, b), name


def test_same_initialisation_as_torch_nn():
    torch.manual_seed(3)
    ref = torch.nn.LSTM(3, 4, num_layers=2, proj_size=2)
    torch.manual_seed(3)
    mod = mnn.LSTM(3, 4, num_layers=2, proj_size=2)
    for a, b in zip(ref.state_dict().values(), mod.state_dict().values()):
        assert torch.equal(a, b)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 3)
        self.lstm = torch.nn.LSTM(3, 4, num_layers=2)
        self.head = torch.nn.Sequential(torch.nn.GRU(4, 5), torch.nn.RNN(5, 2, nonlinearity="relu"))

    def forward(self, tokens):
        y, _ = self.lstm(self.embed(tokens))
        y, _ = self.head[0](y)
        return self.head[1](y)[0]


def test_convert_swaps_every_rnn_in_place():
    model = _Model().double()
    tokens = torch.randint(0, 10, (5, 2))
    expected = model(tokens)
    converted = mnn.convert(model, memory="stash")
    assert converted is model
    assert type(model.lstm) is mnn.LSTM and model.lstm.memory == "stash"
    assert type(model.head[0]) is mnn.GRU
    assert type(model.head[1]) is mnn.RNN and model.head[1].nonlinearity == "relu"
    torch.testing.assert_close(model(tokens), expected, atol=1e-12, rtol=0)


def test_convert_of_a_bare_module_returns_the_replacement():
    lstm = torch.nn.LSTM(3, 4, proj_size=2).double().eval()
    new = mnn.convert(lstm, state_clip=(-1.0, 1.0))
    assert type(new) is mnn.LSTM and new.state_clip == (-1.0, 1.0) and not new.training
    x = torch.randn(3, 2, 3, dtype=DT)
    torch.testing.assert_close(new(x)[0], lstm(x)[0])


def test_autocast_runs_in_the_autocast_dtype_like_torch_nn():
    ref, mod = make_pair(KINDS[0], {}, 3, 4)
    ref.float()
    mod.float()
    x = torch.randn(5, 2, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, (h_ref, _) = ref(x)
        y_mod, (h_mod, _) = mod(x)
    assert y_mod.dtype == y_ref.dtype == torch.bfloat16
    assert h_mod.dtype == h_ref.dtype
    torch.testing.assert_close(y_mod.float(), y_ref.float(), atol=3e-2, rtol=0)


# Each bad call goes to torch.nn.LSTM and to ours: same exception type, ours names a fix.
BAD_CALLS = [
    ("4d-input", lambda: (torch.randn(3, 2, 4, 1), None), "2D or 3D"),
    ("wrong-input-size", lambda: (torch.randn(3, 2, 3), None), "input_size"),
    ("wrong-dtype", lambda: (torch.randn(3, 2, 4, dtype=torch.float64), None), "input.to"),
    ("wrong-device", lambda: (torch.randn(3, 2, 4, device="meta"), None), ".to("),
    ("hx-batch", lambda: (torch.randn(3, 2, 4), (torch.zeros(1, 3, 5), torch.zeros(1, 2, 5))),
     "Expected hidden[0] size"),
    ("cx-size", lambda: (torch.randn(3, 2, 4), (torch.zeros(1, 2, 5), torch.zeros(1, 2, 4))),
     "Expected hidden[1] size"),
    ("hx-dims", lambda: (torch.randn(3, 2, 4), (torch.zeros(2, 5), torch.zeros(2, 5))), "3-D"),
    ("unbatched-hx-dims", lambda: (torch.randn(3, 4), (torch.zeros(1, 1, 5),) * 2), "2-D"),
    ("hx-device", lambda: (torch.randn(3, 2, 4), (torch.zeros(1, 2, 5, device="meta"),) * 2),
     "hx.to"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "hint"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_raises_like_torch_nn(call, hint):
    ref, mod = torch.nn.LSTM(4, 5), mnn.LSTM(4, 5)
    x, hx = call()
    with pytest.raises(Exception) as torch_error:
        ref(x, hx)
    with pytest.raises(torch_error.type, match=hint.replace("[", r"\[").replace("(", r"\(")):
        mod(x, hx)


def test_hx_dtype_mismatch_raises_runtime_error_with_fix():
    mod = mnn.GRU(4, 5)
    with pytest.raises(RuntimeError, match=r"hx.to\(torch.float32\)"):
        mod(torch.randn(3, 2, 4), torch.zeros(1, 2, 5, dtype=torch.float64))


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: mnn.LSTM(3, 4, memory="none"), ValueError),
        (lambda: mnn.GRU(3, 4, impl="cuda"), ValueError),
        (lambda: mnn.RNN(3, 4, nonlinearity="gelu"), ValueError),
        (lambda: mnn.LSTM(3, 4, state_clip=(1.0, -1.0)), ValueError),
        (lambda: mnn.LSTM(3, 4, proj_size=4), ValueError),
    ],
    ids=["memory", "impl", "nonlinearity", "state_clip-order", "proj-too-large"],
)
def test_bad_constructor_arguments(make, error):
    with pytest.raises(error):
        make()


@pytest.mark.parametrize("impl", ["triton", "persistent"])
def test_kernel_impl_with_projection_names_the_fix(impl):
    """The split and persistent kernels have no projection: a ValueError at the call
    that names impl='auto', not a failure inside a kernel."""
    mod = mnn.LSTM(3, 4, proj_size=2, impl=impl)
    with pytest.raises(ValueError, match=rf"impl='{impl}' does not support.*impl='auto'"):
        mod(torch.randn(5, 2, 3))


@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_chunked_run_with_carried_state_equals_whole_run(kind):
    mod = kind[1](3, 4, num_layers=2, dtype=DT, **kind[3])
    x = torch.randn(7, 2, 3, dtype=DT)
    y_whole, h_whole = mod(x)
    y_first, h_first = mod(x[:3])
    y_second, h_second = mod(x[3:], h_first)
    torch.testing.assert_close(torch.cat([y_first, y_second]), y_whole)
    for a, b in zip(states(h_second), states(h_whole)):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS[:2], ids=[k[0] for k in KINDS[:2]])
def test_inductor_with_permuted_input_matches_eager_and_torch_nn(kind):
    """DeepSpeech2 feeds its GRUs conv features .permute(2, 0, 1): a non-contiguous x.
    Inductor checks the backward op's grad_x against the fake kernel's strides."""
    ref, mod = make_pair(kind, {"bidirectional": True}, 3, 2)
    x = torch.randn(2, 3, 4, dtype=DT, requires_grad=True)  # [B, I, T]

    def loss(rnn, x):
        y, h = rnn(x.permute(2, 0, 1))  # [T, B, I] with strides (1, I*T, T)
        return weighted_loss(y, h, probes)

    probes = random_weights(*ref(x.detach().permute(2, 0, 1)))
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="inductor")
    results = []
    for fn, rnn in ((compiled, mod), (loss, mod), (loss, ref)):
        value = fn(rnn, x)
        results.append((value, *torch.autograd.grad(value, [x, *rnn.parameters()])))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


# --- Drop-in parity ----------------------------------------------------------------------

CELLS = [
    ("lstm_cell", mnn.LSTMCell, torch.nn.LSTMCell, {}),
    ("gru_cell", mnn.GRUCell, torch.nn.GRUCell, {}),
    ("rnn_cell_tanh", mnn.RNNCell, torch.nn.RNNCell, {"nonlinearity": "tanh"}),
    ("rnn_cell_relu", mnn.RNNCell, torch.nn.RNNCell, {"nonlinearity": "relu"}),
]


def flat_outputs(out):
    """(y, h) or (y, (h, c)) or a cell's h or (h, c) -> a flat tuple of tensors."""
    if isinstance(out, torch.Tensor):
        return (out,)
    return tuple(
        t for o in out for t in (flat_outputs(o) if not isinstance(o, torch.Tensor) else (o,))
    )


def test_modules_and_cells_are_torch_nn_instances():
    for _, ours, theirs, fixed in KINDS + CELLS:
        module = ours(3, 4, **fixed)
        assert isinstance(module, theirs), ours


@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_repr_is_torch_nn_repr_plus_non_default_options(kind):
    _, ours, theirs, fixed = kind
    kwargs = dict(num_layers=2, bidirectional=True, **fixed)
    assert repr(ours(3, 4, **kwargs)) == repr(theirs(3, 4, **kwargs))
    assert repr(ours(3, 4, memory="stash", **kwargs)).endswith("memory='stash')")


def test_pickle_deepcopy_and_torch_save_keep_class_and_options():
    import copy
    import io
    import pickle

    mod = mnn.LSTM(3, 4, num_layers=2, memory="stash", state_clip=(-2.0, 2.0), dtype=DT)
    buf = io.BytesIO()
    torch.save(mod, buf)
    buf.seek(0)
    x = torch.randn(5, 2, 3, dtype=DT)
    for clone in (pickle.loads(pickle.dumps(mod)), copy.deepcopy(mod),
                  torch.load(buf, weights_only=False)):  # fmt: skip
        assert type(clone) is mnn.LSTM
        assert (clone.memory, clone.state_clip) == ("stash", (-2.0, 2.0))
        torch.testing.assert_close(clone(x)[0], mod(x)[0])


@pytest.mark.parametrize("impl", ["op", "torch", "auto"])
@pytest.mark.parametrize("cell", CELLS, ids=[c[0] for c in CELLS])
def test_cells_match_torch_cells_with_gradients(cell, impl):
    _, ours, theirs, fixed = cell
    ref = theirs(3, 5, dtype=DT, **fixed)
    mod = ours(3, 5, dtype=DT, impl=impl, **fixed)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    h = torch.randn(4, 5, dtype=DT, requires_grad=True)
    c = torch.randn(4, 5, dtype=DT, requires_grad=True)
    hx = (h, c) if theirs is torch.nn.LSTMCell else h
    leaves = [x, h, c] if theirs is torch.nn.LSTMCell else [x, h]
    results = []
    for module in (ref, mod):
        outs = flat_outputs(module(x, hx))
        loss = sum((o * (i + 1.5) * o).sum() for i, o in enumerate(outs))
        results.append((*outs, *torch.autograd.grad(loss, [*leaves, *module.parameters()])))
    for a, b in zip(results[1], results[0]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("cell", CELLS[:2], ids=[c[0] for c in CELLS[:2]])
def test_cell_op_path_unbatched_and_default_state_match_torch(cell):
    _, ours, theirs, fixed = cell
    ref = theirs(3, 5, dtype=DT, **fixed)
    mod = ours(3, 5, dtype=DT, impl="op", **fixed)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, dtype=DT)
    for a, b in zip(flat_outputs(mod(x)), flat_outputs(ref(x))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("cell", CELLS, ids=[c[0] for c in CELLS])
def test_cell_op_path_raises_like_torch_cells(cell):
    _, ours, theirs, fixed = cell
    lstm = theirs is torch.nn.LSTMCell
    bad = [
        (torch.randn(2, 3, 3), None),  # 3-D input
        (torch.randn(2, 4), None),  # wrong input size
        (torch.randn(2, 3), (torch.randn(1, 5),) * 2 if lstm else torch.randn(1, 5)),  # batch
        (torch.randn(2, 3), (torch.randn(2, 4),) * 2 if lstm else torch.randn(2, 4)),  # hidden
    ]
    for x, hx in bad:
        with pytest.raises(Exception) as torch_error:
            theirs(3, 5, **fixed)(x, hx)
        with pytest.raises(torch_error.type):
            ours(3, 5, impl="op", **fixed)(x, hx)


def test_convert_swaps_cells_too():
    model = torch.nn.ModuleDict(
        {"a": torch.nn.LSTMCell(3, 4), "b": torch.nn.GRUCell(4, 4),
         "c": torch.nn.RNNCell(4, 2, nonlinearity="relu", bias=False)}
    ).double()  # fmt: skip
    x = torch.randn(2, 3, dtype=DT)
    h, _ = model["a"](x)
    expected = model["c"](model["b"](h))
    mnn.convert(model)
    assert [type(m) for m in model.values()] == [mnn.LSTMCell, mnn.GRUCell, mnn.RNNCell]
    assert model["c"].nonlinearity == "relu" and model["c"].bias is False
    h, _ = model["a"](x)
    torch.testing.assert_close(model["c"](model["b"](h)), expected, atol=1e-12, rtol=0)


PARITY_CONFIGS = [
    ("1layer", {}),
    ("2layers-bidir", {"num_layers": 2, "bidirectional": True}),
]


@pytest.mark.slow
@pytest.mark.parametrize("config", PARITY_CONFIGS, ids=[c[0] for c in PARITY_CONFIGS])
@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_gradgradcheck(kind, config):
    """Double backward: the op's backward under create_graph recomputes through the
    differentiable reference stack. Checked w.r.t. input, states and every weight."""
    num = (2 if config[1].get("bidirectional") else 1) * config[1].get("num_layers", 1)
    T, B, H = (3, 2, 3) if num == 1 else (2, 1, 2)  # every weight is an input: keep it small
    _, mod = make_pair(kind, config[1], 2, H)
    x = torch.randn(T, B, 2, dtype=DT, requires_grad=True)
    h0 = torch.randn(num, B, H, dtype=DT, requires_grad=True)
    params = list(mod.parameters())
    lstm = kind[0] == "lstm"

    def run(x, h0, *weights):
        return torch.func.functional_call(
            mod,
            dict(zip(mod._flat_weights_names, weights)),
            (x, (h0, torch.tanh(h0)) if lstm else h0),
        )

    inputs = (x, h0, *[p.detach().requires_grad_() for p in params])
    assert gradgradcheck(lambda *a: flat_outputs(run(*a)), inputs)


@pytest.mark.slow
def test_gradgradcheck_of_packed_lstm_with_projection():
    _, mod = make_pair(KINDS[0], {"proj_size": 2, "bidirectional": True}, 2, 3)
    x = torch.randn(4, 3, 2, dtype=DT, requires_grad=True)
    lengths = torch.tensor([4, 2, 3])

    def f(x):
        y, (h, c) = mod(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return y.data, h, c

    assert gradgradcheck(f, (x,))


def test_create_graph_gradient_penalty_matches_torch_nn():
    """A gradient penalty (create_graph=True, then backward of the gradient's norm)."""
    ref, mod = make_pair(KINDS[0], {"num_layers": 2}, 3, 4)
    x = torch.randn(5, 2, 3, dtype=DT, requires_grad=True)
    results = []
    for module in (ref, mod):
        (gx,) = torch.autograd.grad(module(x)[0].square().sum(), x, create_graph=True)
        penalty = gx.square().sum()
        results.append(torch.autograd.grad(penalty, [x, *module.parameters()]))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=0)


@pytest.mark.parametrize("config", PARITY_CONFIGS, ids=[c[0] for c in PARITY_CONFIGS])
@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_forward_mode_ad_matches_torch_nn(kind, config):
    """torch.func.jvp and torch.autograd.forward_ad take the differentiable stack."""
    import torch.autograd.forward_ad as fwad

    ref, mod = make_pair(kind, config[1], 3, 4)
    x = torch.randn(5, 2, 3, dtype=DT)
    v = torch.randn_like(x)
    _, expected = torch.func.jvp(lambda x: flat_outputs(ref(x)), (x,), (v,))
    _, tangents = torch.func.jvp(lambda x: flat_outputs(mod(x)), (x,), (v,))
    with fwad.dual_level():
        dual_tangents = [
            fwad.unpack_dual(o).tangent for o in flat_outputs(mod(fwad.make_dual(x, v)))
        ]
    for a, b, c in zip(tangents, dual_tangents, expected):
        torch.testing.assert_close(a, c, atol=1e-12, rtol=0)
        torch.testing.assert_close(b, c, atol=1e-12, rtol=0)


def test_vmap_over_a_batch_of_sequences_matches_a_loop():
    mod = mnn.GRU(3, 4, dtype=DT)
    xs = torch.randn(6, 5, 2, 3, dtype=DT)
    out = torch.func.vmap(lambda x: mod(x)[0])(xs)
    torch.testing.assert_close(out, torch.stack([mod(x)[0] for x in xs]))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", "triton", "persistent"])
def test_batched_gradients_equal_a_loop_of_gradients(impl):
    """``torch.autograd.grad(..., is_grads_batched=True)`` (what jacobians and gradcheck's
    batched check run) through every implementation's backward, dropout and lengths
    included: the same as one backward per cotangent."""
    pytest.importorskip("triton")
    mod = mnn.LSTM(3, 4, 2, dropout=0.5, impl=impl)
    x = torch.randn(5, 2, 3, requires_grad=True)
    torch.manual_seed(2)
    y, (h_n, c_n) = mod(x)
    inputs = [x, *mod.parameters()]
    cotangents = [torch.randn(3, *t.shape) for t in (y, h_n, c_n)]
    batched = torch.autograd.grad((y, h_n, c_n), inputs, cotangents, is_grads_batched=True,
                                  retain_graph=True)  # fmt: skip
    for i in range(3):
        one = torch.autograd.grad((y, h_n, c_n), inputs, [v[i] for v in cotangents],
                                  retain_graph=True)  # fmt: skip
        for a, b in zip(batched, one):
            torch.testing.assert_close(a[i], b, rtol=1e-4, atol=1e-5)


def test_jacrev_matches_the_jacobian_of_torch_nn():
    ref, mod = make_pair(KINDS[0], {"num_layers": 2}, 3, 4)
    x = torch.randn(4, 2, 3, dtype=DT)
    jac = torch.func.jacrev(lambda x: mod(x)[0])(x)
    torch.testing.assert_close(jac, torch.func.jacrev(lambda x: ref(x)[0])(x))


@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_dropout_one_in_training_gives_torch_nn_zeros(kind):
    ref, mod = make_pair(kind, {"num_layers": 3, "dropout": 1.0}, 3, 4)
    x = torch.randn(5, 2, 3, dtype=DT, requires_grad=True)
    probes = random_weights(*ref(x))
    results = []
    for module in (ref, mod):
        y, h = module(x)
        results.append((y, *states(h), *torch.autograd.grad(weighted_loss(y, h, probes), x)))
    assert not any(t.isnan().any() for t in results[1])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_length_zero_rejected_like_torch_nn(kind, batched):
    _, ours, theirs, fixed = kind
    x = torch.randn(0, 2, 3) if batched else torch.randn(0, 3)
    with pytest.raises(RuntimeError, match="Expected sequence length to be larger than 0"):
        theirs(3, 4, **fixed)(x)
    with pytest.raises(RuntimeError, match="Expected sequence length to be larger than 0"):
        ours(3, 4, **fixed)(x)


@pytest.mark.parametrize("kind", KINDS[1:3], ids=[k[0] for k in KINDS[1:3]])
def test_proj_size_on_gru_and_rnn_raises_value_error_like_torch_nn(kind):
    _, ours, theirs, fixed = kind
    message = "proj_size argument is only supported for LSTM, not RNN or GRU"
    for cls in (theirs, ours):
        with pytest.raises(ValueError, match=message):
            cls(3, 4, proj_size=2, **fixed)


def test_cell_state_of_another_dtype_is_accepted_like_torch_nn():
    ref, mod = make_pair(KINDS[0], {}, 3, 4)
    x = torch.randn(5, 2, 3, dtype=DT)
    hx = (torch.randn(1, 2, 4, dtype=DT), torch.randn(1, 2, 4, dtype=torch.float32))
    y_ref, (_, c_ref) = ref(x, hx)
    y_mod, (_, c_mod) = mod(x, hx)
    assert c_mod.dtype == c_ref.dtype == DT
    torch.testing.assert_close(y_mod, y_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(c_mod, c_ref, atol=1e-12, rtol=0)


def test_hidden_state_of_another_dtype_raises_runtime_error_like_torch_nn():
    ref, mod = make_pair(KINDS[0], {}, 3, 4)
    x = torch.randn(5, 2, 3, dtype=DT)
    hx = (torch.randn(1, 2, 4, dtype=torch.float32), torch.randn(1, 2, 4, dtype=DT))
    for module in (ref, mod):
        with pytest.raises(RuntimeError):
            module(x, hx)


@pytest.mark.slow
@pytest.mark.parametrize("enforce_sorted", [False, True], ids=["unsorted", "sorted"])
def test_packed_sequence_under_fullgraph_compile(enforce_sorted):
    """PackedSequence in, our LSTM, PackedSequence out, in one Dynamo graph (the module
    unpacks and repacks with index arithmetic: torch.nn.utils.rnn's functions, which
    Dynamo refuses to trace, stay outside). Values and gradients equal torch.nn's."""
    ref, mod = make_pair(KINDS[0], {"bidirectional": True, "num_layers": 2}, 3, 4)
    lengths = [5, 3, 2] if enforce_sorted else [2, 5, 3]
    x = torch.randn(5, 3, 3, dtype=DT, requires_grad=True)

    def step(module, packed):
        y, (h, c) = module(packed)
        return y.data, h, c

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn, module in ((compiled, mod), (step, ref)):
        outs = fn(module, pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted))
        loss = sum((o * o * (i + 1)).sum() for i, o in enumerate(outs))
        grads = torch.autograd.grad(loss, [x, *module.parameters()])
        results.append((*outs, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def tf32_off():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cell", CELLS, ids=[c[0] for c in CELLS])
def test_cells_op_path_on_the_gpu_matches_torch_cells(cell, tf32_off):
    _, ours, theirs, fixed = cell
    ref = theirs(64, 128, device="cuda", **fixed)
    mod = ours(64, 128, device="cuda", impl="op", **fixed)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    results = []
    for module in (ref, mod):
        outs = flat_outputs(module(x))
        loss = sum((o * o * (i + 1)).sum() for i, o in enumerate(outs))
        results.append((*outs, *torch.autograd.grad(loss, [x, *module.parameters()])))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


DEVICES = [
    "cpu",  # the Triton kernels under TRITON_INTERPRET=1
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda]),
]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_create_graph_backward_with_fused_dropout_equals_the_plain_backward(mode, device, tf32_off):
    """The create_graph backward recomputes through the reference stack with the fused
    kernels' own dropout masks: its first-order gradients equal the fused backward's."""
    size = 4 if device == "cpu" else 32
    mod = getattr(mnn, mode)(size, size, num_layers=3, dropout=0.5, impl="triton", device=device)
    x = torch.randn(3, 2, size, device=device, requires_grad=True)
    grads = []
    for create_graph in (False, True):
        # The same dropout seed for both calls: drawn from the device's generator, which
        # torch.set_rng_state (the CPU's alone) does not restore on CUDA.
        torch.manual_seed(7)
        y = mod(x)[0]
        grads.append(torch.autograd.grad(y.square().sum(), [x, *mod.parameters()],
                                         create_graph=create_graph))  # fmt: skip
    for plain, graph in zip(*grads):
        torch.testing.assert_close(graph, plain, atol=1e-4, rtol=1e-4)
    assert grads[1][0].requires_grad


# (id, kind index, input, hx): calls torch.nn rejects; ours must say the same words.
MESSAGE_CALLS = [
    ("lstm-4d", 0, lambda: torch.randn(3, 2, 4, 1), lambda: None),
    ("gru-4d", 1, lambda: torch.randn(3, 2, 4, 1), lambda: None),
    ("rnn-4d", 2, lambda: torch.randn(3, 2, 4, 1), lambda: None),
    ("lstm-unbatched-hx-dims", 0, lambda: torch.randn(3, 4),
     lambda: (torch.zeros(1, 1, 5), torch.zeros(1, 5))),
    ("lstm-batched-hx-dims", 0, lambda: torch.randn(3, 1, 4),
     lambda: (torch.zeros(1, 5), torch.zeros(1, 5))),
    ("gru-batched-hx-dims", 1, lambda: torch.randn(3, 1, 4), lambda: torch.zeros(1, 5)),
    ("gru-hidden-size", 1, lambda: torch.randn(3, 2, 4), lambda: torch.zeros(1, 3, 5)),
    ("rnn-hidden-size", 2, lambda: torch.randn(3, 2, 4), lambda: torch.zeros(2, 2, 5)),
    ("lstm-cell-size", 0, lambda: torch.randn(3, 2, 4),
     lambda: (torch.zeros(1, 2, 5), torch.zeros(1, 2, 6))),
    ("input-size", 0, lambda: torch.randn(3, 2, 3), lambda: None),
    ("input-dtype", 1, lambda: torch.randn(3, 2, 4, dtype=DT), lambda: None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "x", "hx"), [c[1:] for c in MESSAGE_CALLS], ids=[c[0] for c in MESSAGE_CALLS]
)
def test_error_messages_start_with_torch_nn_words(kind, x, hx):
    """Same type, and ours begins with torch.nn's message (it may add the fix after)."""
    _, ours, theirs, fixed = KINDS[kind]
    x, hx = x(), hx()
    with pytest.raises(Exception) as torch_error:
        theirs(4, 5, **fixed)(x, hx)
    with pytest.raises(torch_error.type) as our_error:
        ours(4, 5, **fixed)(x, hx)
    assert str(our_error.value).startswith(str(torch_error.value))


@pytest.mark.parametrize("impl", ["auto", "op"])
def test_cell_compiles_in_one_graph(impl):
    cell = mnn.LSTMCell(3, 4, impl=impl, dtype=DT)
    x = torch.randn(2, 3, dtype=DT)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: cell(x), fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(x), cell(x)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_parametrized_weight_norm_matches_torch_nn():
    from torch.nn.utils.parametrizations import weight_norm

    ref, mod = make_pair(KINDS[0], {"num_layers": 2}, 3, 4)
    for module in (ref, mod):
        weight_norm(module, "weight_hh_l1")
        with torch.no_grad():
            module.parametrizations.weight_hh_l1.original0.mul_(2)  # the norm g: doubles W
    assert isinstance(mod, torch.nn.LSTM)
    x = torch.randn(5, 2, 3, dtype=DT)
    probes = random_weights(*ref(x))
    results = []
    for module in (ref, mod):
        y, h = module(x)
        grads = torch.autograd.grad(weighted_loss(y, h, probes), list(module.parameters()))
        results.append((y, *states(h), *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
