"""The CUDA Graph cache of the RNN step loops (cuda_graphs.py), run on CPU with a stand-in
graph that replays the captured loop on its captured buffers (graph_stand_in.py)."""

import dataclasses

import pytest
import torch

from mirrorgrad import _compat
from mirrorgrad.ops.rnn import cuda_graphs, kernels, step_loop
from mirrorgrad.ops.rnn.layer_call import LayerCall

from .test_rnn_kernels import B, H, T, _check_layer, _inputs

pytestmark = [
    pytest.mark.skipif(
        not kernels.supports("lstm", proj=False, dtype=torch.float32, device=torch.device("cpu")),
        reason="Triton kernels need TRITON_INTERPRET=1 on CPU",
    ),
    pytest.mark.slow,  # every test runs the loops in Triton's interpreter, several times
]

CASES = [("lstm", "stash"), ("lstm", "recompute"), ("gru", "stash"), ("gru", "recompute"),
         ("rnn_tanh", "stash")]  # fmt: skip


@pytest.mark.parametrize(("mode", "memory"), CASES)
def test_replays_match_the_oracle_call_after_call(cpu_graphs, mode, memory):
    for _ in range(3):  # capture, then replays with new values
        _check_layer(mode, memory=memory, lengths=[2, 4, 1], use_graph=True)
    assert cpu_graphs and all(g.replays >= 1 for g in cpu_graphs)


def _forward(inp, memory="stash"):
    return kernels.layer_forward(LayerCall("lstm", *inp.values(), memory=memory), use_graph=True)


def _step_with_outputs(inp, memory="stash", mode="lstm", use_graph=True):
    """Forward and backward of one layer; every tensor either returns."""
    c0 = inp["c0"] if mode == "lstm" else None
    call = LayerCall(mode, inp["x"], inp["h0"], c0, inp["w_ih"], inp["w_hh"], inp["b_ih"],
                     inp["b_hh"], memory=memory)  # fmt: skip
    y, h_n, c_n, saved = kernels.layer_forward(call, use_graph=use_graph)
    grads = kernels.layer_backward(call, saved, y, torch.ones_like(y), None, None,
                                   use_graph=use_graph)  # fmt: skip
    return [t for t in (y, h_n, c_n, *saved, *grads) if t is not None]


def _uncaptured(inp, memory="stash", mode="lstm"):
    return _step_with_outputs(inp, memory, mode, use_graph=False)


def _scaled(inp, scale):
    return {k: (v * scale if v is not None and k in ("x", "h0", "c0") else v)
            for k, v in inp.items()}  # fmt: skip


@pytest.mark.parametrize(("mode", "memory"), [("lstm", "stash"), ("gru", "recompute")])
def test_a_replay_never_writes_into_an_earlier_calls_outputs(
    cpu_graphs, reused_blocks, mode, memory
):
    """Step 1's outputs and gradients are kept while steps 2 and 3 run (replaying or
    capturing, as their fresh tensors' addresses decide): they keep their values, and
    every step equals the uncaptured loop."""
    inp = _inputs(mode)
    _step_with_outputs(inp, memory, mode)  # its tensors dropped: their addresses free again
    kept = _step_with_outputs(_scaled(inp, 2.0), memory, mode)
    expected = [t.clone() for t in kept]
    for scale in (3.0, 4.0):
        got = _step_with_outputs(_scaled(inp, scale), memory, mode)
        for a, b in zip(got, _uncaptured(_scaled(inp, scale), memory, mode)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for held, value in zip(kept, expected):
            torch.testing.assert_close(held, value, rtol=0, atol=0)
    counts = cuda_graphs.counts()
    assert counts["replays"] > 0 and counts["captures"] > 0, counts


def test_outputs_are_fresh_tensors_the_cache_does_not_hold(cpu_graphs):
    """What a captured forward returns is referenced by its caller alone: the entries
    hold addresses, the cache only its workspace."""
    inp = _inputs("lstm")
    for _ in range(2):
        y, h_n, c_n, saved = _forward(inp)
        alone = _compat.storage_use_count(torch.empty(0))
        for t in (y, h_n, c_n, *saved):
            assert _compat.storage_use_count(t) == alone
        workspace = {t.untyped_storage().data_ptr() for t in cuda_graphs.held()}
        assert not workspace & {t.untyped_storage().data_ptr() for t in (y, *saved)}
        del y, h_n, c_n, saved
    entries = [e for k in cuda_graphs._ENTRIES.values() for e in k.entries]
    assert cpu_graphs and all(isinstance(e, cuda_graphs.Entry) for e in entries)


def test_a_key_keeps_its_most_recent_entries_and_backs_off_when_it_keeps_missing(
    cpu_graphs, monkeypatch
):
    """Outputs all held, so no call finds its addresses again: one entry per key
    (ENTRIES_PER_KEY = 1), captured at the 1st, 2nd, 4th and 8th miss in a row; the
    calls between run uncaptured, on the same shared workspace. Forward and backward
    (which reads each call's stash in place, so misses too) equal the uncaptured loop."""
    monkeypatch.setattr(cuda_graphs, "ENTRIES_PER_KEY", 1)
    inp = _inputs("lstm")
    expected = _uncaptured(inp)
    held = [_step_with_outputs(inp) for _ in range(9)]
    assert len(cpu_graphs) == 8  # 4 forward, 4 backward
    assert cuda_graphs.counts() == {"captures": 8, "replays": 0, "uncaptured": 10}
    assert all(len(k.entries) == 1 for k in cuda_graphs._ENTRIES.values())
    for outputs in held:
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@dataclasses.dataclass
class _OneBuffer:
    out: torch.Tensor


def test_an_address_set_that_comes_back_is_captured_between_one_off_misses(cpu_graphs):
    """Past its first ENTRIES_PER_KEY misses a key backs off (captures only at the 8th,
    16th, ... miss in a row), but an address set that one of its last uncaptured calls
    had is captured at once: here a recurring buffer whose calls fall between one-off
    buffers, always on an odd miss, where back-off alone would never capture it."""
    key, device = ("test", 1), torch.device("cpu")
    outcome = []

    def call(buffer):
        before = cuda_graphs.counts()
        entry = cuda_graphs.acquire(key, device, _OneBuffer(buffer), lambda b: b.out.add_(1))
        outcome.append(next(k for k, n in cuda_graphs.counts().items() if n > before[k]))
        if entry is not None:
            entry.replay(_OneBuffer(buffer))

    warm_ups = [torch.zeros(4) for _ in range(cuda_graphs.ENTRIES_PER_KEY)]
    recurring, one_offs = torch.zeros(4), [torch.zeros(4) for _ in range(6)]
    for buffer in warm_ups:
        call(buffer)
    for one_off in one_offs:
        call(recurring)
        call(one_off)
    recurring_outcomes = outcome[len(warm_ups)::2]
    assert outcome[: len(warm_ups)] == ["captures"] * len(warm_ups)
    assert recurring_outcomes == ["uncaptured", "captures", *["replays"] * 4], outcome
    assert "replays" not in outcome[len(warm_ups) + 1 :: 2]  # one-offs never replay


def test_weights_are_read_in_place_not_copied(cpu_graphs):
    inp = _inputs("lstm")
    _forward(inp)
    (key,) = cuda_graphs._ENTRIES
    assert inp["w_hh"].data_ptr() in key
    inp["w_hh"].mul_(0.5)  # an optimizer step: same address, new values
    y = _forward(inp)[0]
    reference = kernels.layer_forward(LayerCall("lstm", *inp.values()), use_graph=False)[0]
    torch.testing.assert_close(y, reference)
    assert list(cuda_graphs._ENTRIES) == [key]


def test_backward_reads_its_large_inputs_in_place_and_copies_the_small_ones(cpu_graphs):
    """Stash, cells, y and dy are read where they are (a replay finds them by address),
    h0 and lengths are copied into workspace, and so is a large input that is not
    contiguous."""
    T_, B_, H_ = 3, 2, 4
    config = step_loop.make_config("gru", T_, B_, H_, torch.float32, torch.device("cpu"), True,
                                   None, "stash", True, False, "ieee")  # fmt: skip
    lengths = torch.ones(B_, dtype=torch.int64)
    fields = dict(pre=torch.randn(T_, B_, 4 * H_), cells=None, h0=torch.randn(B_, H_),
                  y=torch.randn(T_, B_, H_), dy=torch.randn(B_, T_, H_).transpose(0, 1),
                  w_hh=torch.randn(3 * H_, H_), lengths=lengths)  # fmt: skip
    buf, copied = kernels._bwd_entry_buffers(config, fields, cuda_graphs.workspace)
    assert copied == ["h0", "dy", "lengths"]
    assert buf.pre is fields["pre"] and buf.y is fields["y"] and buf.w_hh is fields["w_hh"]
    assert buf.dy.is_contiguous() and buf.dy.data_ptr() != fields["dy"].data_ptr()


def test_the_cache_holds_only_workspace(cpu_graphs):
    """LSTM stash, forward+backward twice: what the cache holds afterwards is one
    workspace per config (the h ping-pong, the state gradients and the "gates" arena of
    the backward's gate gradients): no output, no stash, no copy of dy or of W_hh."""
    inp = _inputs("lstm")
    for _ in range(2):
        y, _, _, saved = _forward(inp)
        kernels.layer_backward(LayerCall("lstm", *inp.values()), saved, y, torch.randn_like(y),
                               None, None, use_graph=True)  # fmt: skip
        del y, saved
    f32 = 4
    forward_workspace = 2 * B * H * f32  # h ping-pong
    backward_workspace = B * H * f32 * 2 + T * B * 4 * H * f32  # dh dc dg
    assert cuda_graphs.held_bytes() == forward_workspace + backward_workspace
    assert 2 <= len(cpu_graphs) <= 4  # a forward and a backward entry (the second step's
    # addresses may differ from the first's: the first allocated the workspace between)


def _step(inp, memory):
    y, _, _, saved = _forward(inp, memory)
    kernels.layer_backward(LayerCall("lstm", *inp.values(), memory=memory), saved, y,
                           torch.randn_like(y), None, None, use_graph=True)  # fmt: skip


def test_forward_pre_activations_and_gate_gradients_share_one_arena(cpu_graphs):
    """Recompute: the forward's pre-activations (workspace: not saved), the backward's
    recomputed ones and its gate gradients, written over them, are never live at once
    with the forward's: one buffer holds all three (before, the recomputed ones had an
    arena of their own, [T, B, 4H] held for the whole run)."""
    inp = _inputs("lstm")
    for _ in range(2):
        _step(inp, "recompute")
    f32 = 4
    gates = T * B * 4 * H * f32  # forward pre = backward pre = backward dG
    forward_workspace = 2 * B * H * f32  # h ping-pong
    backward_workspace = 2 * B * H * f32  # dh dc
    assert cuda_graphs.held_bytes() == gates + forward_workspace + backward_workspace
    names = {name for _, name in cuda_graphs._WORKSPACE}
    assert {"pre", "bwd.pre_dg"} <= names and "bwd.dg" not in names
    pre, dg = (next(v for (_, n), v in cuda_graphs._WORKSPACE.items() if n == name)
               for name in ("pre", "bwd.pre_dg"))  # fmt: skip
    assert pre.untyped_storage().data_ptr() == dg.untyped_storage().data_ptr()


def test_a_grus_recomputing_backward_writes_its_gate_gradients_over_the_pre_activations(
    cpu_graphs,
):
    """GRU, recompute: dG (3H wide) is written into the first 3H of each recomputed 4H-wide
    row, so the backward asks for no gate-gradient buffer of its own (only the hidden
    side's), and the recomputed rows live in the forward's "gates" arena."""
    for _ in range(2):  # each call checks the gradients against the oracle
        _check_layer("gru", memory="recompute", use_graph=True)
    names = {name for _, name in cuda_graphs._WORKSPACE}
    assert {"pre", "bwd.pre_dg", "bwd.dgh"} <= names and not {"bwd.dg", "bwd.pre"} & names
    assert {name for _, name in cuda_graphs._ARENAS} >= {"gates"}


@pytest.mark.parametrize(("mode", "memory"), CASES)
def test_every_workspace_view_lies_in_a_live_arena(cpu_graphs, mode, memory):
    """The forward reserves "gates" for what its backward will ask too (a GRU's recomputed
    rows are 4H wide, its forward's 3H): an arena that grew later stayed allocated beside
    its successor in the views taken of it, for the whole run."""
    for _ in range(2):
        _check_layer(mode, memory=memory, use_graph=True)
    arenas = {a.untyped_storage().data_ptr() for a in cuda_graphs._ARENAS.values()}
    views = {v.untyped_storage().data_ptr() for v in cuda_graphs._WORKSPACE.values()}
    assert views <= arenas


def test_configs_of_several_lengths_share_the_workspace_of_the_longest(cpu_graphs):
    """A shorter sequence (another loop config) adds nothing held: its buffers are views
    of the arenas the longer one made, its outputs its callers'."""
    long, short = _inputs("lstm"), _inputs("lstm", t=T - 2)
    short.update({k: long[k] for k in ("w_ih", "w_hh", "b_ih", "b_hh")})
    _step(long, "stash")
    arenas = cuda_graphs.held_bytes()
    _step(short, "stash")
    assert cuda_graphs.held_bytes() == arenas
    assert {config.T for config, _ in cuda_graphs._WORKSPACE} == {T, T - 2}


def test_past_the_byte_bound_outgrown_arenas_go_with_the_keys_that_used_them(
    cpu_graphs, monkeypatch
):
    """A longer sequence after a shorter one replaces the arenas by larger ones; the
    shorter config's views keep the old ones. Past the bound, the least recently used
    keys (the shorter's) are dropped, and the old arenas with them."""
    long, short = _inputs("lstm"), _inputs("lstm", t=T - 2)
    _step(long, "stash")
    one_shape = cuda_graphs.held_bytes()
    cuda_graphs.clear_graphs()
    _step(short, "stash")
    monkeypatch.setattr(cuda_graphs, "GRAPH_CACHE_BYTES", one_shape)
    _step(long, "stash")
    assert cuda_graphs.held_bytes() <= one_shape
    assert all(key[0].T == T for key in cuda_graphs._ENTRIES)
    assert all(config.T == T for config, _ in cuda_graphs._WORKSPACE)


def test_released_keys_leave_nothing_held(cpu_graphs):
    """What impl="auto" does with the loops of an implementation it timed and dropped."""
    inp = _inputs("lstm")
    with cuda_graphs.recording() as keys:
        _step(inp, "recompute")
    assert {key[1] for key in keys} == {"fwd", "bwd"} and cuda_graphs.held_bytes() > 0
    cuda_graphs.release(keys)
    assert cuda_graphs.held_bytes() == 0 and not cuda_graphs._WORKSPACE and not cuda_graphs._ARENAS


def test_nested_recording_blocks_each_keep_their_own_keys(cpu_graphs):
    """impl="auto" can time a candidate whose call picks again inside; an inner block
    ending first (its set equal to the outer's then) must not end the outer one."""
    inp = _inputs("lstm")
    with cuda_graphs.recording() as outer:
        with cuda_graphs.recording() as inner:
            _step(inp, "recompute")
        assert inner == outer
        _step(_inputs("lstm", t=T + 1), "recompute")
    assert inner < outer and cuda_graphs._RECORDING == []


def test_every_capture_runs_on_one_thread_whichever_thread_asks(cpu_graphs, monkeypatch):
    """The forward is captured from the caller's thread, the backward from autograd's
    device thread: recorded there, each would get a cuBLAS workspace of its own on the
    side stream (32 MiB on an H100, held for the process). One capturing thread: one."""
    import threading

    threads = []
    stand_in = cuda_graphs._record

    def record(device, buffers, loop):
        threads.append(threading.get_ident())
        assert not torch.is_grad_enabled()  # the loops write into buffers in place
        return stand_in(device, buffers, loop)

    monkeypatch.setattr(cuda_graphs, "_record", record)
    inp = _inputs("lstm")
    y, _, _, saved = _forward(inp)
    backward = threading.Thread(target=kernels.layer_backward, args=(
        LayerCall("lstm", *inp.values()), saved, y, torch.randn_like(y), None, None),
        kwargs={"use_graph": True})  # fmt: skip
    backward.start()
    backward.join()
    assert len(threads) == 2 and len(set(threads)) == 1
    assert threads[0] not in (threading.get_ident(), backward.ident)
