"""Every private PyTorch name mirrorgrad touches, in one place.

Supported: torch 2.11 .. 2.14. Each name here has a test in tests/test_compat.py
that fails loudly when a torch release moves or changes it.
"""

from __future__ import annotations

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
from torch._inductor.compile_fx import compile_fx  # noqa: E402
from torch._inductor.custom_graph_pass import (  # noqa: E402
    CustomPartitionerFn,
    get_hash_for_files,
)

# The Inductor config entry that takes a CustomPartitionerFn in place of min-cut.
INDUCTOR_PARTITIONER_CONFIG = "custom_partitioner_fn"
# torch.compile(mode="max-autotune", ...) -> the Inductor settings that mode stands for.
inductor_mode_options = torch._inductor.list_mode_options

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


# --- AOTAutograd's cache (used by compiler.py) ----------------------------------------
def without_autograd_cache():
    """Context manager: AOTAutograd's cache off, so every compile runs the partitioner (a
    hit would skip it, and its plan); Inductor's FX graph cache of the code stays on."""
    return functorch_config.patch(enable_autograd_cache=False)


# --- Inductor's CUDA Graph trees (used by ops/rnn/graphs.py) ----------------------------
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


__all__ = [
    "INDUCTOR_PARTITIONER_CONFIG",
    "TORCH_VERSION",
    "CustomPartitionerFn",
    "OpOverload",
    "OpOverloadPacket",
    "activation_memory_budget",
    "aot_autograd",
    "aot_function",
    "aot_module_simplified",
    "boxed_nop",
    "compile_fx",
    "cudagraph_trees_warming_up",
    "default_partition",
    "extract_fwd_bwd_modules",
    "functorch_config",
    "get_hash_for_files",
    "inductor_config",
    "inductor_decompositions",
    "inductor_mode_options",
    "is_primal",
    "is_tangent",
    "min_cut_rematerialization_partition",
    "must_be_in_backward",
    "op_schema",
    "optimization_hint",
    "raise_getitems",
    "reordering_to_mimic_autograd_engine",
    "vf_rnn",
    "without_autograd_cache",
]
