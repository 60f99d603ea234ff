"""Every private PyTorch name mirrorgrad touches, in one place.

Supported: torch 2.11 .. 2.14. Each name here has a test in tests/test_compat.py
that fails loudly when a torch release moves or changes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]

# --- AOTAutograd, partitioners, torch.compile backends, the Inductor partitioner hook
# (used by graph/, mirror/, compiler.py) ----------------------------------------------
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._dynamo.backends.debugging import boxed_nop  # noqa: E402
from torch._functorch.aot_autograd import aot_function, aot_module_simplified  # noqa: E402
from torch._functorch.compile_utils import raise_getitems  # noqa: E402
from torch._functorch.partitioners import (  # noqa: E402
    _extract_fwd_bwd_modules as extract_fwd_bwd_modules,
)
from torch._functorch.partitioners import (  # noqa: E402
    default_partition,
    min_cut_rematerialization_partition,
    reordering_to_mimic_autograd_engine,
)
from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: E402
from torch._inductor.custom_graph_pass import (  # noqa: E402
    CustomGraphPass,
    CustomPartitionerFn,
    get_hash_for_files,
)

# The Inductor config entry that takes a CustomPartitionerFn in place of min-cut.
INDUCTOR_PARTITIONER_CONFIG = "custom_partitioner_fn"
# The Inductor config entry for a CustomGraphPass run last on every post-grad graph.
INDUCTOR_POST_GRAD_PASS_CONFIG = "post_grad_custom_post_pass"


def keep_output_strides(graph: torch.fx.Graph, indices: list[int]) -> list[int]:
    """Make Inductor give the outputs at ``indices`` their traced strides, as it does the
    user's outputs (``user_visible_output_idxs``; other outputs it lays out freely:
    channels-last where a convolution is near, padded). For a post-grad pass: the list
    is set before those run and read when lowering starts. Returns the indices pinned
    (tensor outputs only)."""
    output = graph.find_nodes(op="output")[0]
    values = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in output.args[0]]
    if "original_output_strides" not in output.meta:  # recorded later, the same way
        output.meta["original_output_strides"] = [
            v.stride() if isinstance(v, torch.Tensor) else None for v in values
        ]
    recorded = output.meta["original_output_strides"]
    pinned = [i for i in indices if i < len(recorded) and recorded[i] is not None]
    visible = output.meta.get("user_visible_output_idxs", [])
    output.meta["user_visible_output_idxs"] = sorted({*visible, *pinned})
    return pinned
# torch.compile(mode="max-autotune", ...) -> the Inductor settings that mode stands for.
inductor_mode_options = torch._inductor.list_mode_options


def inductor_setting_names() -> set[str]:
    """The names ``torch.compile(options={...})`` accepts as Inductor settings."""
    return set(inductor_config.get_config_copy())

# --- Joint-graph node roles and sizes (used by graph/joint.py) ---------------------------
from torch._functorch._aot_autograd.utils import _is_primal as is_primal  # noqa: E402
from torch._functorch._aot_autograd.utils import _is_tangent as is_tangent  # noqa: E402
from torch._functorch.partitioners import (  # noqa: E402
    _must_be_in_backward as must_be_in_backward,
)
from torch._ops import OpOverload, OpOverloadPacket  # noqa: E402

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch 2.11: the same guard-free size hint as size_hint (hint_int
    # is its deprecated alias there and warns on every call)
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The schema of an ATen overload (argument and return alias annotations)."""
    return op._schema


def inductor_decompositions() -> dict:
    """The decompositions Inductor traces joint graphs with (planner tests use them)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


# --- torch.compile's own recompute budget (used by bench/methods.py) ---------------------
from torch._functorch import config as functorch_config  # noqa: E402


def activation_memory_budget(fraction: float):
    """Context manager: torch.compile's min-cut partitioner saves at most ``fraction``
    of its default saved bytes (``torch._functorch.config.activation_memory_budget``)."""
    return functorch_config.patch(activation_memory_budget=fraction)


# --- torch's own RNN functions (used by ops/rnn/dispatch.py for impl="cudnn") -------------------
def vf_rnn(mode: str):
    """``torch._VF.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``: what torch.nn's RNN
    modules call (cuDNN on CUDA); ``mode`` is mirrorgrad's lower-case mode name."""
    return getattr(torch._VF, mode)


# --- AOTAutograd's backward compile (used by compiler.py) -------------------------------
def eager_backward_compile():
    """Context manager: AOTAutograd compiles the backward with the forward instead of at
    the first backward call (``force_non_lazy_backward_lowering``), and raises its errors."""
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def inductor_seeded_random_ops() -> tuple[OpOverload, ...]:
    """Inductor's seeded draws (``prims.inductor_random``/``inductor_randint``, what its
    joint-graph passes make of ``rand``/``randint``). Their eager kernels ignore the seed:
    only Inductor's generated code draws the same values from the same seed."""
    import torch._inductor.inductor_prims  # registers the prims

    return (torch.ops.prims.inductor_random.default, torch.ops.prims.inductor_randint.default)


def inductor_lookup_seed_op() -> OpOverload:
    """``prims.inductor_lookup_seed(seeds, k)``: the k-th of a graph's seeds, which
    Inductor's joint-graph passes give each draw (``inductor_random(shape, seed)``)."""
    import torch._inductor.inductor_prims  # registers the prims

    return torch.ops.prims.inductor_lookup_seed.default


# --- storage references (used by ops/rnn/cuda_graphs.py) -------------------------------------
def storage_use_count(t: torch.Tensor) -> int:
    """How many references (tensors, views, storage objects) hold ``t``'s storage; the
    same private counter cudagraph_trees reads to know whether an output is still alive."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# --- AOTAutograd's cache (used by compiler.py) ----------------------------------------
def without_autograd_cache():
    """Context manager: AOTAutograd's cache off, so every compile runs the partitioner (a
    hit would skip it, and its plan); Inductor's FX graph cache of the code stays on."""
    return functorch_config.patch(enable_autograd_cache=False)


# --- Inductor's CUDA Graph trees (used by ops/rnn/cuda_graphs.py) ----------------------------
def cudagraph_trees_warming_up(device: torch.device) -> bool:
    """Whether Inductor's CUDA Graph trees are warming up a graph on ``device`` (in this
    thread): that eager run allocates from the trees' private memory pool, where a kernel
    must neither capture a graph of its own nor cache buffers. False where Inductor's
    trees were never imported or made no manager for the device."""
    import sys

    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or not torch._C._is_key_in_tls("tree_manager_containers"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    container = trees.get_obj(trees.local, "tree_manager_containers").get(index)
    manager = container.tree_manager if container is not None else None
    return manager is not None and manager.in_warmup


# --- What the frame being traced compiles for (used by ops/rnn/dispatch.py) ----------------
def tracing_for_cuda_graphs() -> bool:
    """Whether the frame Dynamo traces now is compiled to replay as CUDA Graphs:
    ``torch.compile(mode="reduce-overhead")`` or Inductor's ``triton.cudagraphs`` option
    (``mirrorgrad.compile``'s and ``backend="mirrorgrad"``'s ``options=`` too). Read from
    the backend of the translator Dynamo runs; False outside a trace."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no translator on this thread: not tracing
        return False
    backend = getattr(getattr(tx, "output", None), "compiler_fn", None)
    for _ in range(8):  # Dynamo's wrappers around the backend, outermost first
        if backend is None:
            return False
        options = getattr(backend, "inductor_options", None)  # mirrorgrad's MirrorBackend
        if options is None and hasattr(backend, "get_compiler_config"):  # torch's Inductor
            options = backend.get_compiler_config()
        if options is None:  # a named backend: torch.compile hands it options= as kwargs
            options = (getattr(backend, "kwargs", None) or {}).get("options")
        if options and options.get("triton.cudagraphs", False):
            return True
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(
            backend, "compiler_fn", None
        )
    return False



def recompile_limit_raises(limit: int):
    """Context manager: Dynamo compiles a code object at most ``limit`` times, and one
    more is an error instead of a silent fall back to eager (tests of compile reuse)."""
    return torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True)

# --- Dynamo's tracing context (used by compiler.py's first-call guard) -------------------
def tracing_context():
    """The ``torch._guards.TracingContext`` of the compile in progress (None outside one)."""
    return torch._guards.TracingContext.try_get()


def tracing(context):
    """Context manager: ``context`` is the current tracing context again (a compile
    after the original one returned sees the same fake mode, shapes and metadata)."""
    return torch._guards.tracing(context)


def mutated_input_indices(context, num_inputs: int) -> list[int] | None:
    """Positions of the compiled graph's inputs that its forward mutates (BatchNorm's
    running statistics), from AOTAutograd's metadata; None where that metadata is
    missing or does not line up with the ``num_inputs`` inputs."""
    metadata = getattr(context, "fw_metadata", None)
    if metadata is None or len(metadata.input_info) != num_inputs:
        return None
    return [
        i
        for i, info in enumerate(metadata.input_info)
        if info.mutates_data or info.mutates_metadata
    ]


# --- The CUDA allocator's history (used by bench/peak_compare.py) ------------------------
def record_memory_history(enabled: bool, max_entries: int = 1_000_000) -> None:
    """Start (or stop) recording every CUDA allocation and free with its Python stack."""
    torch.cuda.memory._record_memory_history(
        "all" if enabled else None, context="all", stacks="python", max_entries=max_entries
    )


def memory_snapshot() -> dict:
    """The allocator's segments, blocks and recorded trace (``_record_memory_history``)."""
    return torch.cuda.memory._snapshot()


__all__ = [
    "INDUCTOR_PARTITIONER_CONFIG",
    "INDUCTOR_POST_GRAD_PASS_CONFIG",
    "TORCH_VERSION",
    "CustomGraphPass",
    "CustomPartitionerFn",
    "OpOverload",
    "OpOverloadPacket",
    "activation_memory_budget",
    "aot_autograd",
    "aot_function",
    "aot_module_simplified",
    "boxed_nop",
    "compile_fx",
    "compile_fx_inner",
    "cudagraph_trees_warming_up",
    "default_partition",
    "eager_backward_compile",
    "extract_fwd_bwd_modules",
    "functorch_config",
    "get_hash_for_files",
    "gpu_shape_padding",
    "inductor_config",
    "inductor_decompositions",
    "inductor_lookup_seed_op",
    "inductor_mode_options",
    "inductor_seeded_random_ops",
    "inductor_setting_names",
    "is_primal",
    "is_tangent",
    "keep_output_strides",
    "memory_snapshot",
    "min_cut_rematerialization_partition",
    "must_be_in_backward",
    "mutated_input_indices",
    "op_schema",
    "optimization_hint",
    "raise_getitems",
    "record_memory_history",
    "reordering_to_mimic_autograd_engine",
    "storage_use_count",
    "stride_padding",
    "tracing",
    "tracing_context",
    "vf_rnn",
    "without_autograd_cache",
]


# --- Dynamo and RNN modules (used by nn/rnn.py) -------------------------------------------
def let_dynamo_trace_modules(classes: tuple[type, ...]) -> None:
    """Let Dynamo trace instances of ``classes`` (subclasses of torch.nn.LSTM/GRU/RNN).

    Dynamo's ``VariableBuilder.wrap_module`` refuses every torch.nn.RNN/GRU/LSTM instance
    unless ``torch._dynamo.config.allow_rnn`` is set, which would also make it trace
    torch.nn's own RNNs. This lifts the refusal for ``classes`` only, while one is wrapped.
    """
    from torch._dynamo import config as dynamo_config
    from torch._dynamo.variables.builder import VariableBuilder

    original = VariableBuilder.wrap_module
    if hasattr(original, "_mirrorgrad_classes"):  # patched already: widen the set
        original._mirrorgrad_classes += tuple(classes)
        return

    def wrap_module(self, value):
        if isinstance(value, wrap_module._mirrorgrad_classes):
            with dynamo_config.patch(allow_rnn=True):
                return original(self, value)
        return original(self, value)

    wrap_module._mirrorgrad_classes = tuple(classes)
    VariableBuilder.wrap_module = wrap_module


# --- Forward AD and torch.func transforms (used by ops/rnn/dispatch.py) -------------------
def needs_plain_autograd(tensors) -> bool:
    """True while a torch.func transform (grad, vmap, jvp, ...) is active, or forward AD
    has a dual tensor among ``tensors``: then only plain PyTorch ops are differentiable."""
    import torch.autograd.forward_ad as fwad

    if torch._C._functorch.maybe_current_level() is not None:
        return True
    if fwad._current_level < 0:  # no dual_level() context open
        return False
    return any(t is not None and fwad.unpack_dual(t).tangent is not None for t in tensors)


def is_batched(t: torch.Tensor | None) -> bool:
    """True for a tensor batched by vmap: functorch's (``torch.func.vmap``) or the legacy
    one that ``torch.autograd.grad(..., is_grads_batched=True)`` runs the backward under
    (its ``Batched`` dispatch key has no Python binding: read from the key set's name)."""
    return t is not None and "Batched" in repr(torch._C._dispatch_keys(t))


# --- Dynamo's DDP optimizer (used by train/step.py's ddp-graphs-whole benchmark mode) ----
def ddp_graph_split(enabled: bool):
    """A context in which Dynamo does (``True``, its default) or does not split a
    DDP-wrapped model's graph at the gradient buckets (``torch._dynamo.config.optimize_ddp``)."""
    from torch._dynamo import config as dynamo_config

    return dynamo_config.patch(optimize_ddp=enabled)


# --- sizes Dynamo traces (used by ops/rnn/dispatch.py) -------------------------------------
def static_sizes(sizes) -> bool:
    """True when every size is a plain int: also while Dynamo traces, where a symbolic size
    passes ``isinstance(size, int)`` but no bound is known for it (Dynamo folds
    ``statically_known_true`` to a constant, without a guard)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return all(statically_known_true(size <= 2**62) for size in sizes)


# --- dispatch modes (used by ops/rnn/op.py) ---------------------------------------------
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def dispatches_plainly(tensors) -> bool:
    """True when a custom op called on ``tensors`` would meet no one but its own kernel:
    no TorchDispatchMode (fake tensors, FlopCounterMode, tracing) and no TorchFunctionMode
    (a default device included) is active, and every tensor is a plain ``Tensor`` or
    ``Parameter`` (no subclass with ``__torch_dispatch__``/``__torch_function__``)."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    if is_in_torch_dispatch_mode() or torch._C._is_torch_function_mode_enabled():
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


# --- fake tensors (used by ops/rnn/cuda_graphs.py) -------------------------------------------
def fake_tensors():
    """Context manager: factory calls inside make fake tensors (shape, dtype, device; no
    memory); real tensors may be passed in (``empty_like`` of one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


# --- cuBLAS workspaces (used by bench/runner.py) ----------------------------------------
def clear_cublas_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps per (thread's handle, stream) for the whole
    process (32 MiB each on an H100); a no-op without CUDA. Only when no CUDA Graph that
    ran a cuBLAS call will replay again (its captured kernels point into them)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()


def stride_padding() -> tuple[bool, int, int]:
    """Inductor's comprehensive padding as configured now: (on, alignment in bytes, the
    shortest stride padded, in elements). ``graph.fusion.padded_strides`` follows it."""
    return (
        bool(inductor_config.comprehensive_padding),
        int(inductor_config.padding_alignment_bytes),
        int(inductor_config.padding_stride_threshold),
    )


@contextlib.contextmanager
def gpu_shape_padding() -> Iterator[None]:
    """Inductor's ``pad_mm`` joint-graph pass as it runs on a GPU, for a capture on the
    CPU (where ``check_device`` turns it off): matmuls whose K or N is not a multiple
    of the alignment are padded (``force_shape_pad`` skips its benchmark; an M-only pad,
    which the H100's benchmark declined for GPT-2's LM-head weight gradient, is not)."""
    from torch._inductor.fx_passes import pad_mm

    plain = pad_mm.should_pad

    def k_or_n(match, mat1, mat2, op, input=None):
        aligned = mat1.shape[1] % 4 == 0 and mat2.shape[1] % 4 == 0
        return not aligned and plain(match, mat1, mat2, op, input)

    saved = (pad_mm.check_device, pad_mm.has_triton, pad_mm.should_pad)
    pad_mm.check_device = lambda a, b: True
    pad_mm.has_triton = lambda: True
    pad_mm.should_pad = k_or_n
    try:
        with inductor_config.patch({"force_shape_pad": True}):
            yield
    finally:
        pad_mm.check_device, pad_mm.has_triton, pad_mm.should_pad = saved


# --- the whole-step CUDA Graph of `mirrorgrad train lm` (train/step.py) -------------
def sgd_update_(params: list[torch.Tensor], grads: list[torch.Tensor], lr: torch.Tensor) -> None:
    """``p -= lr * g`` for every pair, in one fused kernel that reads ``lr`` (a 0-d
    tensor) on the device: a CUDA Graph replays it at whatever lr the tensor holds.
    torch.optim.SGD(fused=True) runs the same op but takes lr from its param group."""
    torch._fused_sgd_(
        params, grads, [], weight_decay=0.0, momentum=0.0, lr=lr, dampening=0.0,
        nesterov=False, maximize=False, is_first_step=False,
    )  # fmt: skip


# --- The torch-level graph Dynamo hands a backend (mirror/fused_loss.py) ---------------

# The node meta key holding the fake tensor Dynamo traced for a node's value.
DYNAMO_EXAMPLE_VALUE = "example_value"
# What a linear layer is recorded as: nn.Linear and F.linear both call torch._C._nn.linear.
DYNAMO_LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)
