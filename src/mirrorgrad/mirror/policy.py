"""The mirror function: which forward ops may be recomputed in the backward pass.

Cheap, deterministic, side-effect-free ops may be mirrored; compute-heavy ops and
random ops may not (a recomputed dropout would draw a new mask and give wrong
gradients). Users override the decision per op, per module (``mark``), or globally
(``MIRRORGRAD_MIRROR=0``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.fx import Node

from mirrorgrad import _compat
from mirrorgrad.graph.joint import is_getitem, is_view, op_name, schema_arg

aten = torch.ops.aten

# The attribute mark() sets on a module; policy_for() collects it.
MARK_ATTR = "_mirrorgrad_mirror"
ENV_VAR = "MIRRORGRAD_MIRROR"


def mark(module: nn.Module, mirror: bool = True) -> nn.Module:
    """Force (``mirror=True``) or forbid (``False``) mirroring of ``module``'s ops.

    The innermost marked module wins. Random ops are never mirrored, marked or not.
    Returns ``module`` so the call can wrap a constructor.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"mark() expects an nn.Module, got {type(module).__name__}")
    if not isinstance(mirror, bool):
        raise TypeError(f"mark(mirror=...) expects True or False, got {mirror!r}")
    setattr(module, MARK_ATTR, mirror)
    return module


def _packets(*names: str) -> frozenset[str]:
    return frozenset(names)


@dataclass(kw_only=True, slots=True, frozen=True)
class OpClasses:
    """Op classes by ATen overload-packet name (``aten.mm.default`` -> ``mm``)."""

    heavy: frozenset[str] = _packets(
        "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "dot", "vdot", "mv", "addmv",
        "convolution", "_convolution", "cudnn_convolution", "miopen_convolution",
        "mkldnn_convolution", "convolution_overrideable", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward",
        "embedding", "_embedding_bag", "embedding_bag", "_cudnn_rnn", "_thnn_fused_lstm_cell",
        "lstm", "gru", "rnn_tanh", "rnn_relu", "_fft_r2c", "_fft_c2r", "_fft_c2c",
        "linalg_eigh", "_linalg_svd", "linalg_qr", "_linalg_solve_ex", "cholesky",
        "topk", "sort", "nonzero",
    )  # fmt: skip
    # Heavy ops budget mode may still recompute when cheaper ones cannot meet its
    # budget: deterministic, cost known from their FLOPs. Attention kernels only
    # without dropout (``is_random``): with it they draw their mask inside.
    recomputable_heavy: frozenset[str] = _packets(
        "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
        "embedding", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )  # fmt: skip
    # Attention kernels: tagged as drawing random numbers (their dropout), which they do
    # only with ``dropout_p`` > 0.
    attention: frozenset[str] = _packets(
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward",
    )  # fmt: skip
    random: frozenset[str] = _packets(
        "native_dropout", "dropout", "feature_dropout", "alpha_dropout", "bernoulli",
        "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
        "randperm", "normal", "uniform", "multinomial", "exponential", "geometric",
        "cauchy", "log_normal", "rrelu_with_noise", "run_and_save_rng_state", "seed",
        "inductor_seeds",
    )  # fmt: skip
    # Random ops whose numbers are fixed by a seed (or RNG state) they take as an input:
    # recomputed, they draw the same numbers. Inductor rewrites the joint graph's
    # dropout `rand` into `inductor_random(shape, seed)` before any partitioner runs, so
    # a dropout mask can be recomputed from its seed instead of stashed (min-cut does).
    seeded_random: frozenset[str] = _packets(
        "inductor_random", "inductor_randint", "philox_rand", "run_with_rng_state"
    )
    normalization: frozenset[str] = _packets(
        "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
        "native_group_norm", "_fused_rms_norm", "rms_norm", "batch_norm",
    )  # fmt: skip
    softmax: frozenset[str] = _packets(
        "_softmax", "_safe_softmax", "_log_softmax", "softmax", "log_softmax"
    )
    reduction: frozenset[str] = _packets(
        "sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "prod",
        "any", "all", "logsumexp", "norm", "linalg_vector_norm", "argmax", "argmin",
    )  # fmt: skip
    shape: frozenset[str] = _packets(
        "cat", "stack", "clone", "_to_copy", "copy", "constant_pad_nd", "index_select",
        "gather", "index", "where", "repeat", "flip", "roll", "tril", "triu", "full_like",
        "zeros_like", "ones_like", "empty_like", "full", "zeros", "ones", "scalar_tensor",
        "arange", "fill", "masked_fill", "_unsafe_view", "view_copy", "expand_copy",
        "permute_copy", "slice_scatter", "select_scatter", "as_strided_scatter",
        "lift_fresh_copy", "split_with_sizes_copy",
    )  # fmt: skip
    # Ops that run elementwise but carry no ``pointwise`` tag in every torch release.
    pointwise_extra: frozenset[str] = _packets(
        "gelu", "silu", "relu", "hardtanh", "leaky_relu", "elu", "softplus", "threshold",
        "hardsigmoid", "hardswish", "mish", "sigmoid", "tanh", "clamp", "clamp_min",
        "clamp_max", "glu", "_prelu_kernel", "prelu",
    )  # fmt: skip


DEFAULT_CLASSES = OpClasses()


def _packet(node: Node) -> str:
    return op_name(node).split("::")[-1]


def _namespace(node: Node) -> str:
    name = op_name(node)
    return name.split("::")[0] if "::" in name else ""


_SEEDED_NAMESPACES = ("prims", "rngprims", "")  # Inductor's prims, functionalized RNG, HOPs


def is_seeded_random(node: Node) -> bool:
    """A random op whose draw a seed input fixes (``OpClasses.seeded_random``):
    recomputed from the same seed, it draws the same numbers."""
    return (
        node.op == "call_function"
        and _packet(node) in DEFAULT_CLASSES.seeded_random
        and _namespace(node) in _SEEDED_NAMESPACES
    )


def is_random(node: Node) -> bool:
    """A random op: recomputing it draws fresh random numbers (an op whose draw a seed
    input fixes, ``is_seeded_random``, is not)."""
    if is_seeded_random(node):
        return False
    if _packet(node) in DEFAULT_CLASSES.attention and _namespace(node) == "aten":
        return schema_arg(node, "dropout_p") != 0  # no dropout: nothing drawn
    target = node.target
    if isinstance(target, _compat.OpOverload) and torch.Tag.nondeterministic_seeded in (
        target.tags
    ):
        return True
    return _packet(node) in DEFAULT_CLASSES.random and _namespace(node) in ("aten", "prims", "")


def _is_pointwise(node: Node) -> bool:
    target = node.target
    tagged = isinstance(target, _compat.OpOverload) and torch.Tag.pointwise in target.tags
    return tagged or _packet(node) in DEFAULT_CLASSES.pointwise_extra


_PATH_PREFIX = re.compile(r"^L\['[^']*'\]")
_PATH_ITEM = re.compile(r"(?:\._modules)?\[['\"]?([^'\"\]]+)['\"]?\]")


def module_path(dynamo_path: str) -> str:
    """A Dynamo module path (``L['self'].layers[0]``) as a qualified name (``layers.0``)."""
    path = _PATH_PREFIX.sub("", dynamo_path)
    path = _PATH_ITEM.sub(r".\1", path)
    return path.lstrip(".")


def _env_enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


@dataclass(kw_only=True, slots=True)
class MirrorPolicy:
    """Decides, per forward node, whether it may be recomputed in the backward pass.

    Precedence: ``enabled`` (``MIRRORGRAD_MIRROR=0`` turns mirroring off) > random ops
    (never) > module overrides (innermost marked module) > op overrides > op classes.
    """

    enabled: bool = field(default_factory=_env_enabled)
    op_overrides: dict[str, bool] = field(default_factory=dict)
    module_overrides: dict[str, bool] = field(default_factory=dict)
    classes: OpClasses = field(default_factory=OpClasses)
    # Views allocate nothing and cost nothing to recompute.
    mirror_views: bool = True
    # Elementwise ops are memory-bound: recomputing reads what stashing would have read.
    mirror_pointwise: bool = True
    # Layer/batch/group norm are a few passes over the data, cheap next to the GEMMs.
    mirror_normalization: bool = True
    # Softmax is a row reduction plus pointwise work.
    mirror_softmax: bool = True
    # Reductions read their input once; their output is small.
    mirror_reductions: bool = True
    # Concatenation, copies, padding and indexing move bytes without arithmetic.
    mirror_shape_ops: bool = True
    # An op we do not know may be expensive or impure: leave it stashed.
    mirror_unknown: bool = False

    def __post_init__(self) -> None:
        self.op_overrides = {_normalise_op(k): bool(v) for k, v in self.op_overrides.items()}
        for name, value in self.op_overrides.items():
            if value and name.split("::")[-1] in self.classes.random:
                raise ValueError(
                    f"op override {name}=True: random ops are never mirrored (a recomputed "
                    "random op draws new numbers); remove the override"
                )

    def may_mirror(self, node: Node) -> bool:
        if not self.enabled or node.op != "call_function":
            return False
        if is_getitem(node):
            return self.may_mirror(node.args[0])
        if is_random(node):
            return False
        by_module = self._module_override(node)
        if by_module is not None:
            return by_module
        name = op_name(node)
        if name in self.op_overrides:
            return self.op_overrides[name]
        return self._by_class(node)

    def may_mirror_heavy(self, node: Node) -> bool:
        """A heavy op budget mode may recompute as a last resort: never when
        mirroring is off or a ``mark(module, mirror=False)`` covers it."""
        if node.op != "call_function" or is_random(node) or self.forbids(node):
            return False
        return _namespace(node) == "aten" and _packet(node) in self.classes.recomputable_heavy

    def forbids(self, node: Node) -> bool:
        """The user forbade recomputing ``node``: mirroring is off, or a ``mark(module,
        mirror=False)`` covers it, or an op override says False. (Our RNN op's memory
        mode is then stash: mirror/op_memory.py.)"""
        if not self.enabled:
            return True
        return self._module_override(node) is False or self.op_overrides.get(op_name(node)) is False

    def _module_override(self, node: Node) -> bool | None:
        if not self.module_overrides:
            return None
        stack = node.meta.get("nn_module_stack") or {}
        for dynamo_path, *_ in reversed(list(stack.values())):
            decision = self.module_overrides.get(module_path(dynamo_path))
            if decision is not None:
                return decision
        return None

    def _by_class(self, node: Node) -> bool:
        packet, c = _packet(node), self.classes
        if packet in c.seeded_random and _namespace(node) in _SEEDED_NAMESPACES:
            return self.mirror_pointwise  # an elementwise generator, replayed from its seed
        if _namespace(node) not in ("aten", "prims") or packet in c.heavy:
            return False
        if is_view(node):
            return self.mirror_views
        if packet in c.normalization:
            return self.mirror_normalization
        if packet in c.softmax:
            return self.mirror_softmax
        if packet in c.reduction:
            return self.mirror_reductions
        if packet in c.shape:
            return self.mirror_shape_ops
        if _is_pointwise(node):
            return self.mirror_pointwise
        return self.mirror_unknown


def _normalise_op(name: str) -> str:
    """``gelu``, ``aten.gelu``, ``aten::gelu`` -> ``aten::gelu``."""
    name = name.replace(".", "::", 1) if "::" not in name else name
    return name if "::" in name else f"aten::{name}"


def policy_for(root: nn.Module | None, **op_overrides: bool) -> MirrorPolicy:
    """The default policy plus the ``mark()``s of ``root``'s submodules and op overrides.

    ``op_overrides`` map op names to decisions: ``policy_for(model, gelu=False)``.
    """
    module_overrides: dict[str, bool] = {}
    if root is not None:
        for qualname, module in root.named_modules():
            decision = getattr(module, MARK_ATTR, None)
            if decision is not None:
                module_overrides[qualname] = decision
    return MirrorPolicy(op_overrides=op_overrides, module_overrides=module_overrides)
