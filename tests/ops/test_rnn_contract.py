"""The custom ops' contract, checked by ``torch.library.opcheck`` for every implementation
that runs on the CPU (the Triton ones in the interpreter): schema (no output aliases an
input or another output), fake kernels, autograd registration and AOTAutograd's dynamic
shapes agree with the real kernels. LSTM, GRU and both RNN nonlinearities, with and
without dropout, lengths and projection; the captured (CUDA Graph) path too, through the
CPU stand-in graph, since that is where the kernels hand out workspace and state blocks.
"""

from __future__ import annotations

import pytest
import torch

from mirrorgrad.ops.rnn.cell_modes import MODES

from .test_rnn_op import forward_args, stack_inputs

pytest.importorskip("triton")

IMPLS = ("reference", "triton", "persistent")
# (name, layers, bidirectional, dropout, lengths, proj): every variant the op takes
VARIANTS = {
    "plain": (1, False, 0.0, None, 0),
    "dropout-lengths-bidir": (2, True, 0.5, [3, 1, 2], 0),
    "projection": (2, False, 0.0, [3, 2, 3], 2),
}
UTILS = (
    "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic",
)  # fmt: skip


def _cases():
    for impl in IMPLS:
        for mode in MODES:
            for variant, (_, _, _, _, proj) in VARIANTS.items():
                if proj and (mode != "lstm" or impl != "reference"):
                    continue  # only torch.nn's LSTM projects; only the reference layer does
                if mode == "rnn_relu" and variant != "plain":
                    continue  # rnn_tanh's schema, fake kernel and autograd; only the cell differs
                yield pytest.param(impl, mode, variant, id=f"{impl}-{mode}-{variant}")


def _args(impl, mode, variant, *, memory="stash"):
    """rnn_forward's arguments (float32: the Triton paths' dtype)."""
    layers, bidirectional, dropout, lengths, proj = VARIANTS[variant]
    shape = dict(layers=layers, bidirectional=bidirectional, proj=proj)
    inputs = stack_inputs(mode, **shape, T=3, B=3, n_in=4, H=5, dtype=torch.float32)
    lengths = None if lengths is None else torch.tensor(lengths)
    return forward_args(mode, *inputs, **shape, lengths=lengths, dropout=dropout, seed=7,
                        memory=memory, impl=impl)  # fmt: skip


def _backward_args(forward_args):
    """rnn_backward's arguments for the forward's call: its saved tensors, random output
    gradients, every input gradient asked for."""
    x, weights, hx, cx, lengths, seed, mode, *config, impl, _ = forward_args
    with torch.no_grad():
        y, h_n, c_n, saved = torch.ops.mirrorgrad.rnn_forward(*forward_args)
    grad_cn = torch.randn_like(c_n) if mode == "lstm" else None
    needs = [True, True, cx is not None, *([True] * len(weights))]
    detach = [t.detach() for t in weights]
    return (torch.randn_like(y), torch.randn_like(h_n), grad_cn, x.detach(), detach,
            hx.detach(), None if cx is None else cx.detach(), lengths, seed, y, saved, mode,
            *config, impl, needs)  # fmt: skip


def _opcheck(args):
    torch.library.opcheck(torch.ops.mirrorgrad.rnn_forward.default, args, test_utils=UTILS)
    torch.library.opcheck(torch.ops.mirrorgrad.rnn_backward.default, _backward_args(args),
                          test_utils=UTILS)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("impl", "mode", "variant"), list(_cases()))
def test_rnn_forward_and_backward_pass_opcheck(impl, mode, variant):
    _opcheck(_args(impl, mode, variant))


@pytest.mark.slow
@pytest.mark.parametrize(("impl", "mode"), [("persistent", "lstm"), ("triton", "gru")])
def test_captured_layers_pass_opcheck(impl, mode, cpu_graphs):
    """The CUDA Graph path (CPU stand-in): workspace, copied-in states, one state block."""
    _opcheck(_args(impl, mode, "plain"))
    assert cpu_graphs, "nothing was captured: the test checks the uncaptured path"


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_recompute_memory_passes_opcheck(impl, mode):
    """memory="recompute" saves other tensors (the cells alone) and recomputes in backward."""
    _opcheck(_args(impl, mode, "dropout-lengths-bidir", memory="recompute"))


def _no_shared_storage(tensors):
    storages = [t.untyped_storage().data_ptr() for t in tensors if t.numel()]
    return len(storages) == len(set(storages))


@pytest.mark.slow
def test_no_output_shares_storage_with_another_or_an_input(cpu_graphs):
    """The check torch.library makes, spelled out, for the outputs that once shared the
    persistent backward's state block (grad_c0, the biases') and the forward's final
    states (one buffer for h_n and c_n), over a call that captures and one that replays."""
    for _ in range(2):
        args = _args("persistent", "lstm", "plain")
        y, h_n, c_n, saved = torch.ops.mirrorgrad.rnn_forward(*args)
        inputs = [args[0], *args[1], args[2], args[3]]
        assert _no_shared_storage([*inputs, y, h_n, c_n, *saved])
        grads = torch.ops.mirrorgrad.rnn_backward(*_backward_args(args))
        assert _no_shared_storage([*inputs, grads[0], grads[1], grads[2], *grads[3]])


def test_every_op_we_register_is_opchecked():
    """The ops opchecked: the two here, the LM head's two in test_linear_cross_entropy.py,
    the planner's seed split in tests/mirror/test_seed_buffers.py. An op registered
    anywhere else fails this until it gets its opcheck."""
    import mirrorgrad.mirror.seed_buffers  # registers its op
    import mirrorgrad.ops.linear_cross_entropy  # noqa: F401  (registers its ops)

    ours = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("mirrorgrad::")}
    assert ours == {"mirrorgrad::rnn_forward", "mirrorgrad::rnn_backward",
                    "mirrorgrad::linear_cross_entropy_forward",
                    "mirrorgrad::linear_cross_entropy_backward",
                    "mirrorgrad::seed_scalars"}  # fmt: skip
