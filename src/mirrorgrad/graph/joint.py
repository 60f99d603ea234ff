"""Node roles in an AOTAutograd joint graph: primal, tangent, forward, backward.

The joint graph holds the forward computation followed by the backward one. A
*forward* node is one the forward pass computes (tagged ``is_forward`` by
AOTAutograd, or, untagged, needed by a forward output); every other compute node is
*backward*. Multi-output ops (``native_layer_norm``, ``native_dropout``) are read
through ``getitem`` nodes; a getitem belongs to the pass of the op it reads.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from mirrorgrad import _compat


class JointGraphError(ValueError):
    """The joint graph has a shape the planner does not handle (callers fall back)."""


def is_getitem(node: Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def op_name(node: Node) -> str:
    """``namespace::packet`` of a call_function node's target (``aten::mm``)."""
    target = node.target
    if isinstance(target, _compat.OpOverload):
        return target.name().split(".")[0]
    if isinstance(target, _compat.OpOverloadPacket):
        return str(target).replace(".", "::", 1)
    return getattr(target, "__name__", str(target))


def is_view(node: Node) -> bool:
    """The op returns an alias of its input: it allocates no storage."""
    return node.op == "call_function" and _is_view_op(node.target)


@functools.cache
def _is_view_op(target: object) -> bool:
    if not isinstance(target, _compat.OpOverload):
        return False
    if target.overloadpacket in (torch.ops.aten._unsafe_view, torch.ops.aten.alias):
        return True
    return any(
        r.alias_info is not None and not r.alias_info.is_write
        for r in _compat.op_schema(target).returns
    )


def is_sym(node: Node) -> bool:
    """A symbolic int/float/bool value (a size), not a tensor."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _tensor_nbytes(t: torch.Tensor) -> int:
    return _compat.optimization_hint(t.numel(), fallback=4096) * t.element_size()


def value_nbytes(val: object) -> int:
    """Bytes of a fake-tensor value: tensors by numel x itemsize, tuples summed, else 0."""
    if isinstance(val, torch.Tensor):
        return _tensor_nbytes(val)
    if isinstance(val, (tuple, list)):
        return sum(value_nbytes(v) for v in val)
    return 0


def schema_arg(node: Node, name: str) -> object:
    """The argument ``name`` of an op node, positional, keyword or by its default
    (None where the op's schema has no such argument)."""
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) else arg.default_value
    return None


def fake_value(arg: object) -> object:
    """A node argument as its fake value: nodes by their meta "val", lists/tuples element-wise."""
    if isinstance(arg, Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(fake_value(x) for x in arg)
    return arg


def fake_args(node: Node) -> tuple[list[object], dict[str, object]]:
    """``node``'s (args, kwargs) as fake values, to call a formula of its op with."""
    return [fake_value(a) for a in node.args], {k: fake_value(v) for k, v in node.kwargs.items()}


@dataclass(kw_only=True, slots=True)
class JointGraph:
    gm: GraphModule
    num_fwd_outputs: int
    primals: list[Node]
    tangents: list[Node]
    forward: list[Node]
    backward: list[Node]
    fwd_outputs: list[Node]
    bwd_outputs: list[Node]
    forward_set: frozenset[Node] = field(repr=False)
    order: dict[Node, int] = field(repr=False)
    _nbytes: dict[Node, int] = field(init=False, repr=False, default_factory=dict)
    _inputs: dict[Node, tuple[Node, ...]] = field(init=False, repr=False, default_factory=dict)
    _storage: dict[Node, Node] = field(init=False, repr=False, default_factory=dict)

    @classmethod
    def from_fx(cls, gm: GraphModule, num_fwd_outputs: int) -> JointGraph:
        """Classify the nodes of ``gm`` (a joint graph as AOTAutograd hands it over)."""
        nodes = list(gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        primals, tangents = [], []
        for n in nodes:
            if n.op != "placeholder":
                continue
            if _compat.is_tangent(n):
                tangents.append(n)
            elif _compat.is_primal(n):
                primals.append(n)
            else:
                raise JointGraphError(f"unsupported joint-graph input {n.name} ({n.target})")
        outputs = [n for n in nodes if n.op == "output"]
        if len(outputs) != 1:
            raise JointGraphError(f"joint graph has {len(outputs)} output nodes, expected 1")
        out_args = list(outputs[0].args[0])
        if not 0 <= num_fwd_outputs <= len(out_args):
            raise JointGraphError(
                f"num_fwd_outputs={num_fwd_outputs} but the joint graph has {len(out_args)} outputs"
            )
        fwd_outputs = [a for a in out_args[:num_fwd_outputs] if isinstance(a, Node)]
        bwd_outputs = [a for a in out_args[num_fwd_outputs:] if isinstance(a, Node)]

        needs_tangent = _tangent_closure(nodes, tangents)
        compute = [n for n in nodes if n.op in ("call_function", "get_attr")]
        # What the forward outputs need is forward whatever its tag (a pass may have
        # added untagged nodes); so is what AOTAutograd tagged forward.
        forward_set = _ancestors(fwd_outputs, stop=set(primals) | set(tangents))
        forward_set |= {n for n in compute if n.meta.get("partitioner_tag") == "is_forward"}
        # A getitem follows its producer: the other outputs of a forward op (dropout's
        # mask) are forward values even where nothing in the forward reads them.
        forward_set |= {n for n in compute if is_getitem(n) and n.args[0] in forward_set}
        bad = sorted(forward_set & needs_tangent, key=order.__getitem__)
        if bad:
            raise JointGraphError(f"forward nodes read a tangent: {[n.name for n in bad]}")
        for n in forward_set:
            if _compat.must_be_in_backward(n):
                raise JointGraphError(f"forward node {n.name} is marked must-be-in-backward")
        forward = [n for n in compute if n in forward_set]
        backward = [n for n in compute if n not in forward_set]
        return cls(
            gm=gm,
            num_fwd_outputs=num_fwd_outputs,
            primals=primals,
            tangents=tangents,
            forward=forward,
            backward=backward,
            fwd_outputs=fwd_outputs,
            bwd_outputs=bwd_outputs,
            forward_set=frozenset(forward),
            order=order,
        )

    @property
    def device(self) -> torch.device:
        """The device of the graph's first tensor input (CPU if it has none)."""
        for p in self.primals:
            val = p.meta.get("val")
            if isinstance(val, torch.Tensor):
                return val.device
        return torch.device("cpu")

    def nbytes(self, node: Node) -> int:
        """Bytes of ``node``'s value (fake tensors; tuples summed; symbolic scalars 0)."""
        size = self._nbytes.get(node)
        if size is None:
            size = self._nbytes[node] = value_nbytes(node.meta.get("val"))
        return size

    def inputs(self, node: Node) -> tuple[Node, ...]:
        """``node.all_input_nodes``, cached (the planner asks for it very often)."""
        inputs = self._inputs.get(node)
        if inputs is None:
            inputs = self._inputs[node] = tuple(node.all_input_nodes)
        return inputs

    def storage(self, node: Node) -> Node:
        """The node whose allocation ``node`` lives in: itself, or a view's base."""
        base = self._storage.get(node)
        if base is None:
            base = node
            while is_view(base):
                tensors = [a for a in self.inputs(base) if a.meta.get("val") is not None]
                if not tensors:
                    break
                base = tensors[0]
            self._storage[node] = base
        return base

    def sorted(self, nodes) -> list[Node]:
        """``nodes`` in graph order (the deterministic order used everywhere)."""
        return sorted(nodes, key=self.order.__getitem__)


def _tangent_closure(nodes: list[Node], tangents: list[Node]) -> set[Node]:
    closure = set(tangents)
    for n in nodes:
        if n in closure or _compat.must_be_in_backward(n):
            closure.add(n)
            closure.update(n.users)
    return closure


def _ancestors(roots: list[Node], stop: set[Node]) -> set[Node]:
    seen: set[Node] = set()
    stack = [r for r in roots if r not in stop]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if a not in stop)
    return seen
