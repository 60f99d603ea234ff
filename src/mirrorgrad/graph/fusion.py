"""Which values a fusing compiler (Inductor) computes in registers, never in memory.

Inductor inlines a pointwise op into the kernels of its readers when every reader
can take it (pointwise ops, the reductions it fuses with their producers, views)
and there are at most a few of them (``realize_reads_threshold``). An extern kernel
(mm, convolution, attention) reads its inputs from memory, so a value it reads is
written there. This is a rule of thumb, not Inductor's scheduler: the liveness
simulation and the cost model both use it, so they agree with each other (the
simulation also writes out chains that read more than ``REALIZE_ACC_READS`` buffers,
as Inductor does; the cost model does not, as its scheduler may fuse them again).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch.fx import Node

from mirrorgrad import _compat
from mirrorgrad.graph.joint import is_view, op_name

# Reductions Inductor fuses with the pointwise ops that feed them.
FUSIBLE_REDUCTIONS = frozenset(
    ("sum", "mean", "amax", "amin", "var_mean", "var", "prod", "any", "all", "logsumexp")
)
# Inductor inlines a pointwise value into its readers unless it has more than this
# many (torch._inductor.config.realize_reads_threshold).
INLINE_READERS = 4
# Inductor writes an inlined chain out once its code reads more buffers than this
# (realize_acc_reads_threshold); the liveness simulation ends lifetimes there.
REALIZE_ACC_READS = 8


# Not tagged pointwise, but Inductor lowers them to pointwise kernels: constant fills,
# and loads through an index (gather, embedding, index): readers compute them inline.
CONSTANT_FILLS = frozenset(
    ("full", "zeros", "ones", "full_like", "zeros_like", "ones_like", "scalar_tensor")
)
# Inductor's seeded random numbers (dropout after its joint-graph passes) are computed
# in registers from the seed and the element index. constant_pad_nd (pad_mm's padding
# of a matmul operand) is a masked load: a producer it alone reads is computed inside it.
POINTWISE_LOWERINGS = CONSTANT_FILLS | frozenset(
    ("gather", "embedding", "index", "inductor_random", "inductor_randint", "constant_pad_nd")
)


def is_pointwise(node: Node) -> bool:
    """Inductor computes ``node`` as a pointwise kernel (and so may inline it)."""
    kind = _pointwise_kind(node.target)
    if kind is not _SCATTER_VALUE:
        return kind
    # Inductor's scatter_upon_const_tensor: a scalar scattered onto a constant fill (the
    # loss's nll_loss_backward) is a pointwise select, the fill never allocated.
    base = node.args[0] if node.args else None
    return isinstance(base, Node) and op_name(base).split("::")[-1] in CONSTANT_FILLS


_SCATTER_VALUE = "scatter.value"  # pointwise depending on its input (is_pointwise)


@functools.cache
def _pointwise_kind(target: object) -> bool | str:
    """By the op alone (asked per node of every graph planned: cached per op)."""
    if not isinstance(target, _compat.OpOverload):
        return False
    if torch.Tag.pointwise in target.tags:
        return True
    name = target.name().split(".")[0].split("::")[-1]
    if name in POINTWISE_LOWERINGS:
        return True
    return _SCATTER_VALUE if name == "scatter" and target._overloadname == "value" else False


# Inductor pads the strides of the buffers it lays out on a GPU (comprehensive_padding;
# not on the CPU): by default a stride longer than 1024 elements to a multiple of 128
# bytes (its settings are read through ``_compat.stride_padding``).
PADDED_STRIDE_DEVICES = frozenset(("cuda",))


@contextlib.contextmanager
def strides_as_on_a_gpu() -> Iterator[None]:
    """Values on the CPU get the padded strides a GPU's buffers would (``bench.frontier
    --gpu-layout``: a CPU capture estimated as the GPU lays it out)."""
    global PADDED_STRIDE_DEVICES
    saved = PADDED_STRIDE_DEVICES
    PADDED_STRIDE_DEVICES = saved | {"cpu"}
    try:
        yield
    finally:
        PADDED_STRIDE_DEVICES = saved


def padded_strides(
    val: torch.Tensor, padding: tuple[bool, int, int] | None = None
) -> tuple[int, ...]:
    """The strides Inductor gives a buffer it allocates for ``val`` (its own layout, not
    a graph input's or output's): a dense row-major value's strides padded as
    ``ir.Layout._pad_strides`` does on ``PADDED_STRIDE_DEVICES``, else ``val``'s.
    ``padding``: ``_compat.stride_padding()``, read once by a caller asking for many."""
    strides = tuple(int(s) for s in val.stride())
    if val.device.type not in PADDED_STRIDE_DEVICES or not val.is_contiguous():
        return strides
    padding_on, alignment_bytes, threshold = padding or _compat.stride_padding()
    if not padding_on:
        return strides
    align = max(alignment_bytes // val.element_size(), 1)
    padded, stride = [1] * val.dim(), 1
    for dim in range(val.dim() - 1, 0, -1):
        stride *= int(val.shape[dim])
        if stride > threshold and stride % align:
            stride += align - stride % align
        padded[dim - 1] = stride
    return tuple(padded)


def pads_in_place(node: Node) -> bool:
    """A ``constant_pad_nd`` that Inductor writes into its input's buffer
    (``inplace_padding``): pad_mm's padding of the last dimension of a matmul operand
    that an Inductor kernel computes, within the gap stride padding leaves after each
    row. Measured (H100, GPT-2): the logits gradient, (8192, 50257) at stride 50272,
    padded to 50260 columns for the dX matmul in its own buffer."""
    if op_name(node).split("::")[-1] != "constant_pad_nd" or len(node.users) != 1:
        return False
    reader = op_name(next(iter(node.users)))
    x, pad = node.args[0], list(node.args[1])
    if reader not in ("aten::mm", "aten::addmm") or not isinstance(x, Node):
        return False
    if len(pad) != 4 or pad[0] or pad[2] or pad[3] or pad[1] <= 0:
        return False
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or is_view(x):
        return False
    if not fusible_reader(x):  # not a buffer an Inductor kernel computes (extern, input)
        return False
    return padded_strides(val)[0] >= int(val.shape[1]) + pad[1]


def fusible_reader(node: Node) -> bool:
    """``node`` can compute a pointwise input inside its own kernel."""
    if is_view(node):
        return True
    return is_pointwise(node) or op_name(node).split("::")[-1] in FUSIBLE_REDUCTIONS


def inlined(node: Node, readers: list[Node]) -> bool:
    """A pointwise ``node`` whose (non-view) ``readers`` all compute it in registers."""
    if not is_pointwise(node) or is_view(node):
        return False
    direct = [r for r in readers if not is_view(r)]
    return len(direct) <= INLINE_READERS and all(fusible_reader(r) for r in direct)
