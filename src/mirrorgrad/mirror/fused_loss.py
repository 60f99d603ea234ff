"""The LM head's loss through the fused op: ``F.cross_entropy(F.linear(h, w, b), t)`` in
the graph Dynamo captures becomes ``linear_cross_entropy(h, w, b, t)``.

A language model's ``[tokens, vocab]`` logits and their gradient are often the largest
values of the step (GPT-2 small, 8192 tokens: 1.6 GB each in float32), and they are
matmul outputs, which the planner does not recompute. The fused op
(``ops.linear_cross_entropy``) never holds them whole: it keeps one log-sum-exp per row
and recomputes the logits chunk by chunk in the backward (one more GEMM).

The rewrite runs on the torch-level graph, before AOTAutograd. It matches a linear
(``F.linear``, an ``nn.Linear`` call, ``x @ w.t()``) whose output reaches
``F.cross_entropy`` only through row-wise steps: views and reshapes that keep the
vocabulary as the last dim, ``.float()`` / ``.to(torch.float32)``, ``.contiguous()``
and slices of the leading dims (``logits[..., :-1, :]``, a shift). Those steps are
replayed on the hidden states instead: the linear acts row by row, so slicing its
input slices its output. Anything else (a second user of the logits, such as a model
that also returns them; class weights; label smoothing; probability targets; dynamic
shapes) leaves the graph as it is.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from mirrorgrad import _compat
from mirrorgrad._units import format_bytes
from mirrorgrad.ops.linear_cross_entropy import op as fused_op

_LINEARS = set(_compat.DYNAMO_LINEAR_TARGETS)
_MATMULS = {operator.matmul, torch.matmul}
_CROSS_ENTROPY = {F.cross_entropy}
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
# Elementwise steps that keep the shape: the fused op computes in (at least) float32.
_CASTS = {"float", "to", "contiguous"}
_RESHAPES = {"view", "reshape", "flatten"}


@dataclass(frozen=True, slots=True)
class FusedLoss:
    """One LM head + cross-entropy found in a graph, and whether it was fused."""

    rows: int
    vocab: int
    fused: bool
    reason: str = ""  # why not, when not fused

    @property
    def logits_bytes(self) -> int:
        """The float32 logits (and as much again for their gradient) the fusion avoids."""
        return self.rows * self.vocab * 4

    def __str__(self) -> str:
        shape = f"[{self.rows:,}, {self.vocab:,}]"
        if self.fused:
            return (
                f"LM head + cross-entropy fused: logits {shape} and their gradient never "
                f"stored ({format_bytes(self.logits_bytes)} each)"
            )
        return f"LM head + cross-entropy not fused ({self.reason}): logits {shape}"


@dataclass(slots=True)
class _Match:
    loss: Node
    linear: Node
    hidden: Node
    weight: Node | None  # None: the transpose of the matmul's right operand
    right: Node | None  # the matmul's [H, V] operand
    bias: Node | None
    steps: list[Node]  # from the linear's output to the loss's input, in order
    target: Node
    reduction: str
    ignore_index: int
    rows: int
    vocab: int


def fuse_lm_head_losses(
    gm: GraphModule, enabled: bool, disabled_because: str = "fuse_loss=False"
) -> list[FusedLoss]:
    """Rewrite each LM head + cross-entropy of ``gm`` in place; what was found.

    ``enabled``: True fuses every match, False none (the plan says ``disabled_because``)."""
    found: list[FusedLoss] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CROSS_ENTROPY:
            continue
        match, reason, shape = _match(node)
        if match is None:
            if shape is not None:  # the logits of a linear, but a pattern we leave alone
                found.append(FusedLoss(rows=shape[0], vocab=shape[1], fused=False, reason=reason))
            continue
        reason = "" if enabled else disabled_because
        if not reason:
            _rewrite(gm.graph, match)
        found.append(FusedLoss(rows=match.rows, vocab=match.vocab, fused=not reason, reason=reason))
    if any(f.fused for f in found):
        gm.graph.lint()
        gm.recompile()
    return found


def _value(node: object) -> torch.Tensor | None:
    """The example value Dynamo recorded for a node (a fake tensor), if a tensor."""
    if not isinstance(node, Node):
        return None
    value = node.meta.get(_compat.DYNAMO_EXAMPLE_VALUE)
    return value if isinstance(value, torch.Tensor) else None


def _static(shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def _match(loss: Node) -> tuple[_Match | None, str, tuple[int, int] | None]:
    """(match, "", shape) or (None, why not, the logits' shape if they come from a linear)."""
    try:
        bound = _CE_SIGNATURE.bind(*loss.args, **loss.kwargs)
    except TypeError:
        return None, "unrecognised call", None
    bound.apply_defaults()
    ce = bound.arguments
    logits, target = ce["input"], ce["target"]
    value, target_value = _value(logits), _value(target)
    if value is None or value.dim() != 2 or not _static(value.shape):
        return None, "not [rows, classes] logits of static shape", None
    shape = (int(value.shape[0]), int(value.shape[1]))
    # Walk back to the linear through row-wise steps, each the only user of the one before.
    steps: list[Node] = []
    node = logits
    while isinstance(node, Node) and not _is_linear(node):
        if not _row_wise(node, shape[1]):
            return None, "", None  # not an LM head's logits: nothing to report
        steps.append(node)
        node = node.args[0]
    if not isinstance(node, Node):
        return None, "", None
    steps.reverse()
    chain = [node, *steps]
    if any(len(n.users) != 1 for n in chain):
        return None, "the logits have another user (returned or reused)", shape
    if ce["weight"] is not None or ce["size_average"] is not None or ce["reduce"] is not None:
        return None, "class weights or legacy reduction arguments", shape
    if ce["label_smoothing"] != 0.0:
        return None, "label smoothing", shape
    if ce["reduction"] not in ("mean", "sum") or not isinstance(ce["ignore_index"], int):
        return None, f"reduction={ce['reduction']!r}", shape
    if target_value is None or target_value.dtype != torch.int64 or target_value.dim() != 1:
        return None, "targets are not class indices", shape
    if _value(loss) is None or _value(node) is None:
        return None, "no example values", shape
    hidden, weight, right, bias = _linear_operands(node)
    if hidden is None:
        return None, "unrecognised linear", shape
    match = _Match(
        loss=loss, linear=node, hidden=hidden, weight=weight, right=right, bias=bias,
        steps=steps, target=target, reduction=ce["reduction"], ignore_index=ce["ignore_index"],
        rows=shape[0], vocab=shape[1],
    )  # fmt: skip
    return match, "", shape


def _is_linear(node: Node) -> bool:
    return node.op == "call_function" and (node.target in _LINEARS or node.target in _MATMULS)


def _linear_operands(node: Node) -> tuple[Node | None, Node | None, Node | None, Node | None]:
    """(hidden, weight [V, H] or None, the matmul's right operand [H, V] or None, bias)."""
    args = list(node.args) + [None] * 3
    if node.target in _LINEARS:
        hidden = args[0]
        weight = node.kwargs.get("weight", args[1])
        bias = node.kwargs.get("bias", args[2])
        weight_value = _value(weight)
        if weight_value is None or weight_value.dim() != 2:
            return None, None, None, None
        if node.kwargs.keys() - {"weight", "bias"} or (bias is not None and _value(bias) is None):
            return None, None, None, None
        return hidden, weight, None, bias
    hidden, right = args[0], args[1]
    right_value = _value(right)
    if node.kwargs or right_value is None or right_value.dim() != 2:
        return None, None, None, None
    return hidden, None, right, None


def _row_wise(node: Node, vocab: int) -> bool:
    """A step that maps the logits' rows to rows in order, the vocabulary dim untouched."""
    if node.op not in ("call_method", "call_function") or not node.args:
        return False
    before, after = _value(node.args[0]), _value(node)
    if before is None or after is None or before.device != after.device:
        return False
    if before.shape[-1:] != (vocab,) or after.shape[-1:] != (vocab,):
        return False
    if not (_static(before.shape) and _static(after.shape)):
        return False
    name = node.target if node.op == "call_method" else None
    if name in _CASTS:
        # .float(), .to(float32), .contiguous(): same shape, the dtype kept or float32.
        return before.shape == after.shape and after.dtype in (before.dtype, torch.float32)
    if name in _RESHAPES or node.target in (torch.reshape, torch.flatten):
        # Row-major order is kept by any reshape, so with the last dim unchanged the
        # rows stay in order.
        return before.dtype == after.dtype
    if node.op == "call_function" and node.target is operator.getitem:
        return _index_keeps_last_dim(node.args[1], before.dim())
    return False


def _index_keeps_last_dim(index: object, ndim: int) -> bool:
    """``logits[index]`` with basic indexing that leaves the last (vocabulary) dim whole."""
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if item is Ellipsis or isinstance(item, slice):
            continue
        if isinstance(item, bool) or not isinstance(item, int):
            return False  # None (a new dim), tensors, bools: not a plain row selection
    if any(item is Ellipsis for item in items):
        after = items[[item is Ellipsis for item in items].index(True) + 1 :]
        last = after[-1] if after else None
    else:
        last = items[ndim - 1] if len(items) == ndim else None
    return last is None or (isinstance(last, slice) and last == slice(None))


def _rewrite(graph: torch.fx.Graph, m: _Match) -> None:
    """Replay the row-wise steps on the hidden states and call the fused op there."""
    hidden_size = int(_value(m.hidden).shape[-1])
    with graph.inserting_before(m.loss):
        hidden = m.hidden
        for step in m.steps:
            if step.op == "call_function" and step.target is operator.getitem:
                hidden = graph.call_function(operator.getitem, (hidden, step.args[1]))
            elif step.target not in _CASTS:  # a reshape: the same rows of hidden_size
                rows = tuple(int(d) for d in _value(step).shape[:-1])
                hidden = graph.call_method("reshape", (hidden, (*rows, hidden_size)))
        weight = m.weight
        if weight is None:  # x @ right: right is weight.T
            weight = graph.call_method("t", (m.right,))
        fused = graph.call_function(
            fused_op.linear_cross_entropy,
            (hidden, weight, m.bias, m.target),
            {
                "reduction": m.reduction,
                "ignore_index": m.ignore_index,
                "dtype": _value(m.loss).dtype,
            },
        )
    fused.meta.update(m.loss.meta)
    m.loss.replace_all_uses_with(fused)
    for dead in (m.loss, *reversed(m.steps), m.linear):
        graph.erase_node(dead)
