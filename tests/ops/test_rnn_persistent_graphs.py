"""The persistent layers captured in CUDA Graphs (persistent.py's bodies through
cuda_graphs.py): on CPU with the stand-in graphs of conftest (the captured path run by the
interpreter, replayed on the captured addresses), on the GPU for real, the module's
forward and backward with capture on against capture off."""

import contextlib

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import mirrorgrad.nn
from mirrorgrad.ops.rnn import cuda_graphs, persistent
from mirrorgrad.ops.rnn.layer_call import LayerCall
from mirrorgrad.ops.rnn.tuning import StepTuning

from .test_rnn_persistent import _inputs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
CASES = [("lstm", "stash"), ("lstm", "recompute"), ("gru", "stash"), ("gru", "recompute"),
         ("rnn_tanh", "stash")]  # fmt: skip
on_cpu = pytest.mark.skipif(CUDA, reason="the stand-in graphs run the interpreter on CPU")
pytestmark = pytest.mark.slow  # captured persistent loops, replayed in the interpreter
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _step(mode, memory, inp, grads, lengths, use_graph):
    """Forward and backward of one layer; every tensor either returns."""
    c0 = inp["c0"] if mode == "lstm" else None
    call = LayerCall(mode, inp["x"], inp["h0"], c0, inp["w_ih"], inp["w_hh"], inp["b_ih"],
                     inp["b_hh"], lengths=lengths, memory=memory)  # fmt: skip
    y, h_n, c_n, saved = persistent.layer_forward(call, use_graph=use_graph)
    gy, ghn, gcn = grads
    out = persistent.layer_backward(call, saved, y, gy, ghn, gcn if mode == "lstm" else None,
                                    use_graph=use_graph)  # fmt: skip
    return [t for t in (y, h_n, c_n, *saved, *out) if t is not None]


def _case(mode, T=5, B=3, n_in=4, H=6, lengths=(5, 2, 3)):
    inp = _inputs(mode, T, B, n_in, H)
    grads = (torch.randn(T, B, H, device=DEVICE), torch.randn(B, H, device=DEVICE),
             torch.randn(B, H, device=DEVICE))  # fmt: skip
    if lengths is not None:
        lengths = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
    return inp, grads, lengths


def _scale_inputs(inp, base, scale):
    """New values for the inputs in place: a training loop's batch in a static buffer
    (the inputs are read where they are, so a replay needs their addresses again)."""
    for k in ("x", "h0", "c0"):
        if inp[k] is not None:
            inp[k].copy_(base[k] * scale)
    return inp


@on_cpu
@pytest.mark.parametrize("chunk_rows", [None, 6], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize(("mode", "memory"), CASES)
def test_captured_layer_equals_the_plain_call_and_keeps_earlier_outputs(
    cpu_graphs, reused_blocks, monkeypatch, tuning, mode, memory, chunk_rows
):
    """Step 1's tensors are kept while steps 2-4 run (capturing, then replaying on the
    addresses the allocator repeats): they keep their values, and every step equals the
    plain call bit for bit. ``chunks``: the backward in chunks of 2, 2 and 1 steps, the
    state gradients carried between them inside one captured body."""
    if chunk_rows is not None:
        tuning(StepTuning(bwd_chunk_rows=chunk_rows))
    inp, grads, lengths = _case(mode)
    base = {k: v.clone() if v is not None else None for k, v in inp.items()}
    kept = _step(mode, memory, inp, grads, lengths, True)
    expected = [t.clone() for t in kept]
    for scale in (2.0, 3.0, 4.0):
        _scale_inputs(inp, base, scale)
        got = _step(mode, memory, inp, grads, lengths, True)
        want = _step(mode, memory, inp, grads, lengths, False)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        del got, want
    for held, value in zip(kept, expected):
        torch.testing.assert_close(held, value, rtol=0, atol=0)
    counts = cuda_graphs.counts()
    assert counts["replays"] > 0 and counts["captures"] > 0, counts
    assert cpu_graphs and all(g.replays >= 0 for g in cpu_graphs)


@on_cpu
def test_weights_are_read_in_place(cpu_graphs, reused_blocks):
    """An optimizer step changes W in place: the next replay reads the new values."""
    inp, grads, lengths = _case("lstm")
    for _ in range(2):
        _step("lstm", "stash", inp, grads, lengths, True)
    inp["w_hh"].mul_(0.5)
    inp["b_ih"].add_(0.1)
    before = cuda_graphs.counts()["replays"]
    got = _step("lstm", "stash", inp, grads, lengths, True)
    assert cuda_graphs.counts()["replays"] > before
    for a, b in zip(got, _step("lstm", "stash", inp, grads, lengths, False)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Allocations(TorchDispatchMode):
    """Records the ops whose outputs are new storage (not an input's, not a view)."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        given = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.fresh.append(str(func))
        return out


@on_cpu
@pytest.mark.parametrize("chunk_rows", [None, 6], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize(("mode", "memory"), CASES)
def test_bodies_allocate_nothing(monkeypatch, tuning, mode, memory, chunk_rows):
    """What a capture records allocates nothing: an allocation inside a capture would
    come from the graph's private pool and stay there as long as the entry. (The launch
    is left out: the interpreter copies its arguments; a GPU launch allocates nothing.)"""
    if chunk_rows is not None:
        tuning(StepTuning(bwd_chunk_rows=chunk_rows))
    monkeypatch.setattr(persistent, "_launch", lambda *args, **kwargs: None)
    bodies = []
    real_fwd, real_bwd = persistent._fwd_body, persistent._bwd_body

    def watched(real):
        def body(config, layout, buf):
            with _Allocations() as mode_:
                real(config, layout, buf)
            bodies.append(mode_.fresh)

        return body

    monkeypatch.setattr(persistent, "_fwd_body", watched(real_fwd))
    monkeypatch.setattr(persistent, "_bwd_body", watched(real_bwd))
    inp, grads, lengths = _case(mode)
    _step(mode, memory, inp, grads, lengths, False)
    assert bodies == [[], []]


def _merged(held: list[dict]) -> dict:
    out: dict = {}
    for buffers in held:
        for key, nbytes in buffers.items():
            out[key] = max(out.get(key, 0), nbytes)
    return out


@on_cpu
@pytest.mark.parametrize("lengths", [None, (5, 2, 3)], ids=["full", "lengths"])
@pytest.mark.parametrize(("mode", "memory"), CASES)
def test_held_arenas_are_the_arenas_the_cache_allocates(cpu_graphs, tuning, mode, memory,
                                                        lengths):  # fmt: skip
    tuning(StepTuning(bwd_chunk_rows=6))  # chunks: their lengths too
    inp, grads, lengths = _case(mode, lengths=lengths)
    _step(mode, memory, inp, grads, lengths, True)
    allocated = {name: a.numel() for (_, name), a in cuda_graphs._ARENAS.items()}
    T, B, _ = inp["x"].shape
    shape = (mode, memory, T, B, inp["h0"].shape[-1], inp["x"].dtype, torch.device("cuda"))
    declared = _merged([persistent.held_arenas(*shape, has_lengths=lengths is not None,
                                               has_bias=True, backward=phase)
                        for phase in (False, True)])  # fmt: skip
    assert cpu_graphs and allocated
    assert {key[2]: n for key, n in declared.items()} == allocated


@on_cpu
def test_the_op_declares_the_persistent_arenas_as_held():
    """impl="persistent" on CUDA: the op's held formula is the layers' arenas, and its
    per-call temporaries leave them out (cuda_graphs.py keeps them between calls)."""
    from mirrorgrad.formulas import held_formula, memory_formula

    from .test_rnn_held import BACKWARD, FORWARD, _op_args

    fwd, bwd = _op_args("lstm", 2, False, 35, 20, 650, "recompute")
    fwd = (*fwd[:-2], "persistent", fwd[-1])
    bwd = (*bwd[:-2], "persistent", bwd[-1])
    held = {key[2]: n for key, n in held_formula(FORWARD)(*fwd).items()}
    assert {"gates", "persistent.h", "persistent.count"} <= set(held)
    assert {key[2] for key in held_formula(BACKWARD)(*bwd)} >= {"gates", "bwd.pre"}
    cpu_fwd, cpu_bwd = _op_args("lstm", 2, False, 35, 20, 650, "recompute", device="cpu")
    cpu_fwd = (*cpu_fwd[:-2], "persistent", cpu_fwd[-1])
    cpu_bwd = (*cpu_bwd[:-2], "persistent", cpu_bwd[-1])
    assert held_formula(FORWARD)(*cpu_fwd) == {}
    per_call = memory_formula(FORWARD)(*cpu_fwd) - memory_formula(FORWARD)(*fwd)
    assert per_call >= held["persistent.h"] + held["gates"] // 2
    assert memory_formula(BACKWARD)(*cpu_bwd) > memory_formula(BACKWARD)(*bwd)


# ---- The module: capture on against capture off ------------------------------------


@contextlib.contextmanager
def _capture(on: bool):
    """The layers captured as cuda_graphs.py decides (on CUDA: by size) or never."""
    before = cuda_graphs.use_graph
    if not on:
        cuda_graphs.use_graph = lambda device, elements, requested: False
    try:
        yield
    finally:
        cuda_graphs.use_graph = before


def _train_steps(module, xs, lengths, seeds):
    """A training loop's steps on one static input buffer: every step's output, input
    gradient and parameter gradients (copied to the CPU, stacked per tensor: nothing the
    loop keeps moves the GPU allocations of the next steps), and cuda_graphs.py's counts after
    each step."""
    x = torch.zeros_like(xs[0]).requires_grad_()
    store, counts, weight = [], [], None
    for x_value, seed in zip(xs, seeds):
        module.zero_grad(set_to_none=True)
        x.grad = None
        with torch.no_grad():
            x.copy_(x_value)
        torch.manual_seed(seed)  # the dropout seed: same masks with capture on and off
        inp = x
        if lengths is not None:
            inp = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        y, _ = module(inp)
        y = y.data if lengths is not None else y
        if weight is None:  # a loss whose gradient differs element by element
            weight = torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)
        (y.float() * weight).sum().backward()
        grads = (x.grad, *(p.grad for p in module.parameters()))
        store.append([t.cpu() for t in (y.detach(), *grads)])
        counts.append(cuda_graphs.counts())
    return [torch.stack(per_tensor) for per_tensor in zip(*store)], counts


def _module_pair(mode, dtype, dropout, hidden=40):
    cls = {"lstm": mirrorgrad.nn.LSTM, "gru": mirrorgrad.nn.GRU}[mode]
    torch.manual_seed(0)
    a = cls(24, hidden, 2, dropout=dropout, impl="persistent").to(DEVICE, dtype)
    b = cls(24, hidden, 2, dropout=dropout, impl="persistent").to(DEVICE, dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def _compare_captured(mode, dtype, packed, dropout, *, steps, T, B, hidden=40):
    cuda_graphs.clear_graphs()
    captured, plain = _module_pair(mode, dtype, dropout, hidden)
    xs = [torch.randn(T, B, 24, device=DEVICE, dtype=dtype) for _ in range(steps)]
    lengths = torch.tensor([T - (b % T) for b in range(B)]) if packed else None
    seeds = list(range(100, 100 + steps))
    with _capture(True):
        got, counts = _train_steps(captured, xs, lengths, seeds)
    with _capture(False):
        want, _ = _train_steps(plain, xs, lengths, seeds)
    names = ["y", "dx", *(name for name, _ in captured.named_parameters())]
    for name, a, b in zip(names, got, want):
        for step in range(steps):
            same = torch.equal(a[step], b[step])
            assert same, f"step {step} {name}: max diff {(a[step] - b[step]).abs().max()}"
    return counts


@on_cpu
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_module_with_dropout_captured_equals_plain(cpu_graphs, packed):
    counts = _compare_captured("lstm", torch.float32, packed, 0.4, steps=2, T=4, B=3)
    assert counts[-1]["captures"] + counts[-1]["replays"] >= 8  # 2 layers x 2 phases x 2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("mode", "dtype", "packed"),
    [("lstm", torch.bfloat16, True), ("lstm", torch.float32, False),
     ("gru", torch.float32, True), ("gru", torch.bfloat16, False)],
    ids=["lstm-bf16-packed", "lstm-fp32", "gru-fp32-packed", "gru-bf16"],
)  # fmt: skip (each case compiles its own kernels: four, not eight)
def test_gpu_module_captured_equals_uncaptured_call_after_call(mode, dtype, packed):
    """Twelve training steps of a 2-layer module (the medium word LM's 650 wide, batch
    20, 35 steps) with dropout between its layers, captured and not: the same outputs
    and gradients bit for bit at every step, whether a layer captured, replayed or ran
    uncaptured (this loop's allocations drift: the H100 showed all three, the next
    test the loop that settles)."""
    counts = _compare_captured(mode, dtype, packed, 0.3, steps=12, T=35, B=20, hidden=650)
    print(f"{mode} {dtype} packed={packed}: cuda_graphs.counts() per step {counts}")
    assert counts[-1]["captures"] > 0, counts


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_gpu_training_loop_replays_every_layer_once_settled(mode):
    """A training loop (a static input buffer, the loss, backward, SGD, grads set to None)
    through a 2-layer module of the medium LM's shape with dropout: in its last three of
    12 steps every layer's forward and backward replays (on the H100 the LSTM's from its
    5th step, the allocator repeating its addresses with period 2; the GRU's from its
    9th, once cuda_graphs.py captured the address sets that came back). Not every loop
    settles: at 40 wide, batch 5 (the allocator's pool of blocks under 1 MiB) no address
    set came back in 16 steps on the H100, and such a loop runs its layers uncaptured
    (cuda_graphs.misses() names the buffers that moved)."""
    cuda_graphs.clear_graphs()
    module, _ = _module_pair(mode, torch.float32, 0.3, hidden=650)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    xs = [torch.randn(35, 20, 24, device=DEVICE) for _ in range(4)]
    x = torch.empty_like(xs[0])
    per_step = []
    for step in range(12):
        before = cuda_graphs.counts()
        x.copy_(xs[step % 4])
        y, _ = module(x)
        y.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_step.append({k: n - before[k] for k, n in cuda_graphs.counts().items()})
    print(f"{mode}: per step {per_step}; misses {cuda_graphs.misses()}")
    # 2 layers: 2 forward and 2 backward replays per step
    assert per_step[-3:] == [{"captures": 0, "replays": 4, "uncaptured": 0}] * 3, per_step


@pytest.mark.gpu
@needs_gpu
def test_gpu_layer_in_chunks_captured_equals_plain(monkeypatch, tuning):
    """The backward in chunks of 8 steps (5 launches and their GEMMs in one graph, the
    state gradients carried between them), recompute memory: captured against plain,
    bit for bit, call after call on the same inputs' addresses, replaying. At the medium
    LM's shape: at 40 wide, batch 5 the allocator's pool of blocks under 1 MiB gave
    every call new addresses on the H100 (no replay in 4 calls)."""
    tuning(StepTuning(bwd_chunk_rows=8 * 20))
    cuda_graphs.clear_graphs()
    inp, grads, lengths = _case("lstm", T=35, B=20, n_in=24, H=650, lengths=None)
    base = {k: v.clone() if v is not None else None for k, v in inp.items()}
    for scale in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        _scale_inputs(inp, base, scale)
        got = _step("lstm", "recompute", inp, grads, lengths, None)
        want = _step("lstm", "recompute", inp, grads, lengths, False)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"scale {scale}: max diff {(a - b).abs().max()}"
        del got, want
    assert cuda_graphs.counts()["replays"] >= 2, cuda_graphs.counts()
