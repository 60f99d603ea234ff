"""The CUDA Graph cache of the RNN step loops (graphs.py), run on CPU with a stand-in
graph that replays the captured loop on its captured buffers (graph_stand_in.py)."""

import gc

import pytest
import torch

from mirrorgrad.ops.rnn import graphs, kernels

from .test_rnn_kernels import B, H, T, _check_layer, _inputs

pytestmark = pytest.mark.skipif(
    not kernels.supports("lstm", proj=False, dtype=torch.float32, device=torch.device("cpu")),
    reason="Triton kernels need TRITON_INTERPRET=1 on CPU",
)

CASES = [("lstm", "stash"), ("lstm", "recompute"), ("gru", "stash"), ("gru", "recompute"),
         ("rnn_tanh", "stash")]  # fmt: skip


@pytest.mark.parametrize(("mode", "memory"), CASES)
def test_replays_match_the_oracle_call_after_call(cpu_graphs, mode, memory):
    for _ in range(3):  # capture, then replays with new values
        _check_layer(mode, memory=memory, lengths=[2, 4, 1], use_graph=True)
    assert cpu_graphs and all(g.replays >= 1 for g in cpu_graphs)


def _forward(inp, memory="stash"):
    return kernels.layer_forward("lstm", *inp.values(), None, memory=memory, use_graph=True)


def test_outputs_are_the_graph_buffers_and_are_never_overwritten_while_held(cpu_graphs):
    inp = _inputs("lstm")
    y1, _, _, saved1 = _forward(inp)
    expected = [t.clone() for t in (y1, *saved1)]
    (entry,) = graphs._ENTRIES[next(iter(graphs._ENTRIES))]
    # Handed out, not copied: views of the entry's own buffers.
    assert y1.data_ptr() == entry.buffers.y.data_ptr()
    assert saved1[0].data_ptr() == entry.buffers.pre.data_ptr()
    inp2 = {k: (v + 1 if v is not None else None) for k, v in inp.items()}
    y2 = _forward(inp2)[0]  # y1 is held: a second entry captures
    assert y2.data_ptr() != y1.data_ptr()
    for held, value in zip((y1, *saved1), expected):
        torch.testing.assert_close(held, value, rtol=0, atol=0)
    ptr1 = y1.data_ptr()
    del y1, saved1, expected, held
    y3 = _forward(inp)[0]  # entry 1 is idle again: replayed, not recaptured
    assert y3.data_ptr() == ptr1
    assert len(cpu_graphs) == 2


def test_busy_entries_beyond_the_limit_run_uncaptured(cpu_graphs, monkeypatch):
    monkeypatch.setattr(graphs, "ENTRIES_PER_KEY", 1)
    inp = _inputs("lstm")
    first = _forward(inp)
    second = _forward(inp)
    assert len(cpu_graphs) == 1 and second[0].data_ptr() != first[0].data_ptr()
    torch.testing.assert_close(second[0], first[0])


def test_weights_are_read_in_place_not_copied(cpu_graphs):
    inp = _inputs("lstm")
    _forward(inp)
    (entry,) = graphs._ENTRIES[next(iter(graphs._ENTRIES))]
    assert entry.buffers.w.data_ptr() == inp["w_hh"].data_ptr()
    inp["w_hh"].mul_(0.5)  # an optimizer step: same address, new values
    y = _forward(inp)[0]
    reference = kernels.layer_forward("lstm", *inp.values(), None, use_graph=False)[0]
    torch.testing.assert_close(y, reference)
    assert len(cpu_graphs) == 1


@pytest.mark.parametrize("memory", ["stash", "recompute"])
def test_backward_reads_the_forward_outputs_in_place(cpu_graphs, memory):
    inp = _inputs("lstm")
    y, _, _, saved = _forward(inp, memory)
    fields = dict(pre=saved[0][:T] if memory == "stash" else torch.randn(T, B, 4 * H),
                  cells=saved[-1], h0=None, y=None, dy=torch.randn_like(y),
                  w_hh=inp["w_hh"], lengths=None)  # fmt: skip
    config = kernels._loop_config("lstm", inp["x"], inp["w_hh"], inp["b_ih"], inp["b_hh"], None,
                                  memory, None, False)  # fmt: skip
    _, copied = kernels._backward_entry(config, fields)
    assert copied == (["dy"] if memory == "stash" else ["pre", "dy"])


def test_the_cache_holds_one_set_of_outputs_per_layer_and_shared_workspace(cpu_graphs):
    """LSTM stash, forward+backward twice: what the cache holds afterwards is each entry's
    handed-out y, stash and cells, and one workspace per config: no clone of an output
    and no copy of W_hh or of the stash."""
    inp = _inputs("lstm")
    for _ in range(2):
        y, _, _, saved = _forward(inp)
        kernels.layer_backward("lstm", saved, *inp.values(), None, y, torch.randn_like(y),
                               None, None, use_graph=True)  # fmt: skip
        del y, saved
    f32 = 4
    handed_out = T * B * H * f32 + T * B * 4 * H * f32 + (T + 1) * B * H * f32
    forward_workspace = 2 * B * H * f32  # h ping-pong
    backward_workspace = T * B * H * f32 + B * H * f32 * 2 + T * B * 4 * H * f32  # dy dh dc dg
    assert graphs.held_bytes() == handed_out + forward_workspace + backward_workspace
    assert len(cpu_graphs) == 2  # one forward entry, one backward entry


def _step(inp, memory):
    y, _, _, saved = _forward(inp, memory)
    kernels.layer_backward("lstm", saved, *inp.values(), None, y, torch.randn_like(y), None,
                           None, memory=memory, use_graph=True)  # fmt: skip


def test_forward_pre_activations_and_gate_gradients_share_one_arena(cpu_graphs):
    """Recompute: the forward's pre-activations (workspace: not saved), the backward's
    recomputed ones and its gate gradients, written over them, are never live at once
    with the forward's: one buffer holds all three (before, the recomputed ones had an
    arena of their own, [T, B, 4H] held for the whole run)."""
    inp = _inputs("lstm")
    for _ in range(2):
        _step(inp, "recompute")
    f32 = 4
    handed_out = T * B * H * f32 + (T + 1) * B * H * f32  # y, cells
    gates = T * B * 4 * H * f32  # forward pre = backward pre = backward dG
    forward_workspace = 2 * B * H * f32  # h ping-pong
    backward_workspace = T * B * H * f32 + 2 * B * H * f32  # dy dh dc
    assert graphs.held_bytes() == handed_out + gates + forward_workspace + backward_workspace
    names = {name for _, name in graphs._WORKSPACE}
    assert {"pre", "bwd.pre_dg"} <= names and "bwd.dg" not in names
    pre, dg = (next(v for (_, n), v in graphs._WORKSPACE.items() if n == name)
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
    names = {name for _, name in graphs._WORKSPACE}
    assert {"pre", "bwd.pre_dg", "bwd.dgh"} <= names and not {"bwd.dg", "bwd.pre"} & names
    assert {name for _, name in graphs._ARENAS} >= {"gates"}


@pytest.mark.parametrize(("mode", "memory"), CASES)
def test_every_workspace_view_lies_in_a_live_arena(cpu_graphs, mode, memory):
    """The forward reserves "gates" for what its backward will ask too (a GRU's recomputed
    rows are 4H wide, its forward's 3H): an arena that grew later stayed allocated beside
    its successor in the views taken of it, for the whole run."""
    for _ in range(2):
        _check_layer(mode, memory=memory, use_graph=True)
    arenas = {a.untyped_storage().data_ptr() for a in graphs._ARENAS.values()}
    views = {v.untyped_storage().data_ptr() for v in graphs._WORKSPACE.values()}
    assert views <= arenas


def test_configs_of_several_lengths_share_the_workspace_of_the_longest(cpu_graphs):
    """A shorter sequence (another loop config) adds its own entries' outputs but no
    workspace: its buffers are views of the arenas the longer one made."""
    long, short = _inputs("lstm"), _inputs("lstm", t=T - 2)
    short.update({k: long[k] for k in ("w_ih", "w_hh", "b_ih", "b_hh")})
    _step(long, "stash")
    arenas = graphs.held_bytes()
    workspace = sum(a.untyped_storage().nbytes() for a in graphs._ARENAS.values())
    _step(short, "stash")
    f32 = 4
    t = T - 2
    short_outputs = t * B * H * f32 + t * B * 4 * H * f32 + (t + 1) * B * H * f32
    assert graphs.held_bytes() == arenas + short_outputs
    assert sum(a.untyped_storage().nbytes() for a in graphs._ARENAS.values()) == workspace


def test_past_the_byte_bound_idle_entries_of_other_shapes_are_dropped(cpu_graphs, monkeypatch):
    long, short = _inputs("lstm"), _inputs("lstm", t=T - 2)
    _step(long, "stash")
    one_shape = graphs.held_bytes()
    monkeypatch.setattr(graphs, "GRAPH_CACHE_BYTES", one_shape)
    held = _forward(short)  # a new shape past the bound: the long one's idle entries go
    assert all(key[0].T == T - 2 for key in graphs._ENTRIES)
    assert all(config.T == T - 2 for config, _ in graphs._WORKSPACE)
    assert graphs.held_bytes() <= one_shape
    _forward(long)  # while `held` is referenced its entry stays
    assert any(key[0].T == T - 2 for key in graphs._ENTRIES)
    del held


def test_released_keys_leave_nothing_held(cpu_graphs):
    """What impl="auto" does with the loops of an implementation it timed and dropped."""
    inp = _inputs("lstm")
    with graphs.recording() as keys:
        _step(inp, "recompute")
    assert {key[1] for key in keys} == {"fwd", "bwd"} and graphs.held_bytes() > 0
    cpu_graphs.clear()  # the stand-in graphs hold their buffers (a CUDA Graph does not)
    gc.collect()
    graphs.release(keys)
    assert graphs.held_bytes() == 0 and not graphs._WORKSPACE and not graphs._ARENAS


def test_nested_recording_blocks_each_keep_their_own_keys(cpu_graphs):
    """impl="auto" can time a candidate whose call picks again inside; an inner block
    ending first (its set equal to the outer's then) must not end the outer one."""
    inp = _inputs("lstm")
    with graphs.recording() as outer:
        with graphs.recording() as inner:
            _step(inp, "recompute")
        assert inner == outer
        _step(_inputs("lstm", t=T + 1), "recompute")
    assert inner < outer and graphs._RECORDING == []


def test_every_capture_runs_on_one_thread_whichever_thread_asks(cpu_graphs, monkeypatch):
    """The forward is captured from the caller's thread, the backward from autograd's
    device thread: recorded there, each would get a cuBLAS workspace of its own on the
    side stream (32 MiB on an H100, held for the process). One capturing thread: one."""
    import threading

    threads = []
    stand_in = graphs._record

    def record(device, buffers, loop):
        threads.append(threading.get_ident())
        assert not torch.is_grad_enabled()  # the loops write into buffers in place
        return stand_in(device, buffers, loop)

    monkeypatch.setattr(graphs, "_record", record)
    inp = _inputs("lstm")
    y, _, _, saved = _forward(inp)
    backward = threading.Thread(target=kernels.layer_backward, args=(
        "lstm", saved, *inp.values(), None, y, torch.randn_like(y), None, None),
        kwargs={"use_graph": True})  # fmt: skip
    backward.start()
    backward.join()
    assert len(threads) == 2 and len(set(threads)) == 1
    assert threads[0] not in (threading.get_ident(), backward.ident)
