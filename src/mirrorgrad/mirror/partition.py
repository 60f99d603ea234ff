"""A plan -> (forward module, backward module): AOTAutograd's ``partition_fn`` and
Inductor's partitioner hook.

The planner decides which forward values the backward pass reads from the stash
(``Plan.saved``); everything else the backward needs is recomputed there. Planning
must never stop training: any exception becomes one ``MirrorgradFallbackWarning``
(naming the cause and the file the joint graph was dumped to) and PyTorch's own
partition.
"""

from __future__ import annotations

import dataclasses
import tempfile
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from mirrorgrad import _compat
from mirrorgrad.graph.joint import is_getitem, is_view
from mirrorgrad.mirror.late_gemm import PLANNED_BACKWARD, split_late_addmms
from mirrorgrad.mirror.op_memory import plan_joint
from mirrorgrad.mirror.plan import Plan, PlanOptions
from mirrorgrad.mirror.policy import is_random, policy_for
from mirrorgrad.mirror.seed_buffers import give_seeds_their_own_buffers

Partitioner = Callable[..., tuple[GraphModule, GraphModule]]
PlanCallback = Callable[[Plan], None]

# The planner's sources: a change to any of them must invalidate Inductor's cache.
_PLANNER_SOURCES = tuple(
    sorted(
        str(p)
        for package in ("graph", "mirror")
        for p in (Path(__file__).parents[1] / package).glob("*.py")
    )
)


# Output-node meta key: indices of the forward's outputs that it also reads through views.
VIEW_READ_OUTPUTS = "mirrorgrad_view_read_outputs"


class MirrorgradFallbackWarning(UserWarning):
    """A plan failed on a graph (planning, compiling, or its first run): PyTorch's own
    partition is used for that graph from then on; a backward whose first compiled call
    failed ran the plan's own graph eagerly once."""


def partition(
    joint_gm: GraphModule,
    joint_inputs: Sequence[object],
    *,
    num_fwd_outputs: int,
    options: PlanOptions,
    root_module: nn.Module | None = None,
    on_plan: PlanCallback | None = None,
    fallback: Partitioner = _compat.default_partition,
    strict: bool = False,
    static_lifetime_input_indices: list[int] | None = None,
    **unused: Any,
) -> tuple[GraphModule, GraphModule]:
    """Split ``joint_gm`` into forward and backward modules by the mirror planner.

    ``root_module``, when given, supplies the policy (its ``mirrorgrad.mark``s).
    ``on_plan`` receives each plan that was applied. With ``strict=True`` a planning
    error is raised instead of falling back to ``fallback``. Other keyword arguments
    that AOTAutograd or Inductor pass (``compiler=``) are accepted and ignored.
    """
    if root_module is not None:
        options = dataclasses.replace(options, policy=policy_for(root_module))
    try:
        remove_detaches(joint_gm)
        # Our RNN ops' memory modes are decided with the plan (and the graph rewritten).
        joint, the_plan = plan_joint(joint_gm, num_fwd_outputs, options)
        fw_gm, bw_gm = _split(
            joint_gm, the_plan, num_fwd_outputs, static_lifetime_input_indices or []
        )
        _check_no_random_recompute(bw_gm, {n.name for n in joint.forward})
    except Exception as exc:
        if strict:
            raise
        dump = _dump_joint_graph(joint_gm, exc)
        warnings.warn(
            f"mirrorgrad: planning failed ({type(exc).__name__}: {exc}); using PyTorch's "
            f"{fallback.__name__} for this graph instead. Joint graph and traceback: {dump}",
            MirrorgradFallbackWarning,
            stacklevel=2,
        )
        return fallback(
            joint_gm,
            joint_inputs,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )
    if on_plan is not None:
        on_plan(the_plan)
    return fw_gm, bw_gm


def remove_detaches(joint_gm: GraphModule) -> None:
    """Drop ``aten.detach`` nodes: in a joint graph they are identities at run time.

    torch 2.11's AOTAutograd reads the saved outputs of tanh, sigmoid, ... in backward
    through a ``detach`` of them; left in, those aliases hide from the planner that the
    output itself is what backward needs (no chain was ever mirrored there).
    """
    graph = joint_gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    joint_gm.recompile()


def _split(
    joint_gm: GraphModule, the_plan: Plan, num_fwd_outputs: int, static_indices: list[int]
) -> tuple[GraphModule, GraphModule]:
    primals = [n for n in joint_gm.graph.nodes if n.op == "placeholder" and _compat.is_primal(n)]
    fw_gm, bw_gm = _compat.extract_fwd_bwd_modules(
        joint_gm,
        one_per_storage(the_plan.saved),
        list(the_plan.saved_sym),
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes={primals[i] for i in static_indices},
    )
    # Recomputed values are placed just before their first backward reader (as the
    # autograd engine would run them), not all at the start of the backward.
    bw_gm = _compat.reordering_to_mimic_autograd_engine(bw_gm)
    fw_gm = _compat.raise_getitems(fw_gm)
    give_seeds_their_own_buffers(fw_gm)
    _mark_view_read_outputs(fw_gm)
    bw_gm = _compat.raise_getitems(bw_gm)
    bw_gm.graph.find_nodes(op="output")[0].meta[PLANNED_BACKWARD] = True
    return fw_gm, bw_gm


def _mark_view_read_outputs(fw_gm: GraphModule) -> None:
    """Record which forward outputs the forward itself also reads through a view.

    Inductor may lay out a saved output as it likes (channels-last where a convolution
    is near), but views of it inside the forward then carry strides nobody traced, and
    an op whose lowering takes such a view as it is fails at run time (a conv-augmented
    attention encoder: an attention query whose head dim ended up strided by T. ``PlannedGraphPass``
    makes Inductor keep these outputs' traced strides. Min-cut rarely saves such a
    base (it saves the views, which Inductor copies).
    """
    output = fw_gm.graph.find_nodes(op="output")[0]
    output.meta[VIEW_READ_OUTPUTS] = [
        i
        for i, node in enumerate(output.args[0])
        if isinstance(node, Node)
        and isinstance(node.meta.get("val"), torch.Tensor)
        and any(is_view(user) for user in node.users)
    ]


def one_per_storage(saved: list[Node]) -> list[Node]:
    """``saved`` with views of one saved storage replaced by their base.

    AOTAutograd donates saved tensors that alias no input or output to the backward,
    where Inductor may reuse their memory; it does not check saved tensors against
    each other, so a saved view next to its saved base can be overwritten (wrong
    gradients, seen on a Transformer block). Saving the base instead costs nothing
    (the view kept its storage alive) and the backward recomputes the view for free.
    """
    roots = {n: _view_root(n) for n in saved}
    sharers = Counter(roots.values())
    result: list[Node] = []
    for n in saved:
        root = roots[n]
        # Views of inputs alias a forward input: never donated, safe to keep.
        keep = n if sharers[root] == 1 or root.op == "placeholder" else root
        if keep not in result:
            result.append(keep)
    return result


def _view_root(node: Node) -> Node:
    """The node whose storage ``node`` aliases, through views and their getitems."""
    while True:
        if is_view(node):
            node = node.args[0]
        elif is_getitem(node) and is_view(node.args[0]):
            node = node.args[0].args[0]
        else:
            return node


def _check_no_random_recompute(bw_gm: GraphModule, forward_names: set[str]) -> None:
    """A recomputed random op would draw a new mask: wrong gradients, silently.

    Only forward nodes count (extraction keeps their names): a backward op of its own,
    such as the efficient-attention backward with its philox seed, is no recompute."""
    for node in bw_gm.graph.nodes:
        if node.op == "call_function" and node.name in forward_names and is_random(node):
            raise RuntimeError(f"the plan recomputes random op {node.name} ({node.target})")


def _dump_joint_graph(joint_gm: GraphModule, exc: BaseException) -> str:
    try:
        with tempfile.NamedTemporaryFile(
            "w", prefix="mirrorgrad-joint-", suffix=".txt", delete=False
        ) as f:
            f.write("".join(traceback.format_exception(exc)))
            f.write("\n")
            f.write(joint_gm.print_readable(print_output=False))
        return f.name
    except Exception as dump_exc:
        return f"(not dumped: {dump_exc})"


class MirrorPartitioner(_compat.CustomPartitionerFn):
    """The planner as Inductor's ``custom_partitioner_fn``; min-cut is the fallback."""

    def __init__(self, options: PlanOptions, *, on_plan: PlanCallback | None = None) -> None:
        self.options = options
        self.on_plan = on_plan

    def __call__(
        self, gm: GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[GraphModule, GraphModule]:
        return partition(
            gm,
            joint_inputs,
            options=self.options,
            on_plan=self.on_plan,
            fallback=_compat.min_cut_rematerialization_partition,
            **kwargs,
        )

    def uuid(self) -> bytes:
        """Inductor's cache key: the planner's sources and the options (marks included)."""
        return _compat.get_hash_for_files(_PLANNER_SOURCES, _stable_repr(self.options))

    # Inductor pickles its config into cache keys and deep-copies it for repro scripts:
    # the partitioner stands in as its uuid, so the model and callbacks stay out of both.
    def __reduce__(self) -> tuple[type[PartitionerKey], tuple[bytes]]:
        return PartitionerKey, (self.uuid(),)

    def __deepcopy__(self, memo: dict[int, object]) -> MirrorPartitioner:
        return self


class PlannedGraphPass(_compat.CustomGraphPass):
    """Inductor's last post-grad pass, on the graphs of a plan: outputs of a planned
    forward that the forward also reads through views keep their traced strides (see
    ``_mark_view_read_outputs``); in a planned backward, products that Inductor fused
    into a late ``addmm`` run where the plan placed them (``late_gemm``).

    Graphs without the marks (min-cut's, other compiles) are left alone; ``then`` is a
    pass that was configured before, run first."""

    def __init__(self, then: object = None) -> None:
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        for earlier in self.then if isinstance(self.then, (list, tuple)) else [self.then]:
            if earlier is not None:
                earlier(graph)
        output = graph.find_nodes(op="output")[0]
        indices = output.meta.get(VIEW_READ_OUTPUTS)
        if indices:
            _compat.keep_output_strides(graph, indices)
        if output.meta.get(PLANNED_BACKWARD):
            split_late_addmms(graph)

    def uuid(self) -> bytes | None:
        """Inductor's cache key; None (no caching) behind a pass without one."""
        earlier = [] if self.then is None else self.then
        earlier = earlier if isinstance(earlier, (list, tuple)) else [earlier]
        keys = [p.uuid() if hasattr(p, "uuid") else None for p in earlier]
        if any(k is None for k in keys):
            return None
        return _compat.get_hash_for_files((*_PLANNER_SOURCES, _compat.__file__), repr(keys))

    def __reduce__(self) -> tuple[type[PartitionerKey], tuple[bytes | None]]:
        return PartitionerKey, (self.uuid(),)

    def __deepcopy__(self, memo: dict[int, object]) -> PlannedGraphPass:
        return self


def _stable_repr(value: object) -> str:
    """``repr`` with sets sorted: set order follows string hashes, which differ per process."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = (
            f"{f.name}={_stable_repr(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return f"{type(value).__name__}({', '.join(fields)})"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, dict):
        items = sorted(f"{_stable_repr(k)}: {_stable_repr(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_stable_repr(v) for v in value) + "]"
    return repr(value)


@dataclasses.dataclass(frozen=True, slots=True)
class PartitionerKey:
    """What a pickled ``MirrorPartitioner`` (or ``PlannedGraphPass``) becomes: its
    cache identity, nothing to run."""

    uuid: bytes | None
