"""Each private torch name in mirrorgrad._compat must resolve, with the signature we use."""

import inspect

import pytest
import torch

from mirrorgrad import _compat


def test_torch_version_supported():
    assert _compat.TORCH_VERSION >= (2, 11)


def test_extract_fwd_bwd_modules_signature():
    params = inspect.signature(_compat.extract_fwd_bwd_modules).parameters
    for name in ("joint_module", "saved_values", "saved_sym_nodes", "num_fwd_outputs"):
        assert name in params, f"torch changed _extract_fwd_bwd_modules: no {name!r}"
    assert params["num_fwd_outputs"].kind is inspect.Parameter.KEYWORD_ONLY


def test_partitioners_take_num_fwd_outputs():
    for fn in (_compat.default_partition, _compat.min_cut_rematerialization_partition):
        assert "num_fwd_outputs" in inspect.signature(fn).parameters, fn.__name__


def test_aot_function_takes_partition_fn():
    assert "partition_fn" in inspect.signature(_compat.aot_function).parameters


def test_inductor_has_custom_partitioner_config():
    from torch._inductor import config

    assert hasattr(config, _compat.INDUCTOR_PARTITIONER_CONFIG)
    assert _compat.inductor_config is config


def test_custom_partitioner_fn_interface():
    abstract = _compat.CustomPartitionerFn.__abstractmethods__
    assert abstract == {"__call__", "uuid"}, f"torch changed CustomPartitionerFn: {abstract}"
    assert isinstance(_compat.get_hash_for_files((_compat.__file__,), "x"), bytes)


def test_aot_autograd_backend_takes_partition_fn_and_boxed_nop():
    backend = _compat.aot_autograd(
        fw_compiler=_compat.boxed_nop, partition_fn=_compat.default_partition
    )
    assert backend.kwargs["partition_fn"] is _compat.default_partition
    assert list(inspect.signature(_compat.boxed_nop).parameters) == ["fx_g", "example_inputs"]


def test_graph_reorder_helpers_take_a_graph_module():
    for fn in (_compat.reordering_to_mimic_autograd_engine, _compat.raise_getitems):
        assert list(inspect.signature(fn).parameters) == ["gm"], fn.__name__


def test_compile_fx_takes_model_and_example_inputs():
    params = list(inspect.signature(_compat.compile_fx).parameters)
    assert params[:2] == ["model_", "example_inputs_"]
    assert "config_patches" in params  # patches the lazily compiled backward too


def test_joint_graph_role_helpers():
    import torch.fx

    g = torch.fx.Graph()
    primal, tangent = g.placeholder("primals_1"), g.placeholder("tangents_1")
    assert _compat.is_primal(primal) and not _compat.is_primal(tangent)
    assert _compat.is_tangent(tangent) and not _compat.is_tangent(primal)
    assert _compat.must_be_in_backward(primal) is False


def test_optimization_hint_on_plain_int():
    assert _compat.optimization_hint(7, fallback=4096) == 7


def test_op_schema_shows_view_aliasing():
    import torch

    (ret,) = _compat.op_schema(torch.ops.aten.t.default).returns
    assert ret.alias_info is not None and not ret.alias_info.is_write
    assert isinstance(torch.ops.aten.t.default, _compat.OpOverload)
    assert isinstance(torch.ops.aten.t, _compat.OpOverloadPacket)


def test_activation_memory_budget_patches_the_functorch_config():
    assert _compat.functorch_config.activation_memory_budget == 1.0
    with _compat.activation_memory_budget(0.25):
        assert _compat.functorch_config.activation_memory_budget == 0.25
    assert _compat.functorch_config.activation_memory_budget == 1.0


def test_vf_rnn_functions_match_torch_nn():
    import torch

    x, h = torch.randn(3, 2, 4), torch.zeros(1, 2, 5)
    for mode, module in (("gru", torch.nn.GRU), ("rnn_tanh", torch.nn.RNN)):
        ref = module(4, 5)
        weights = list(ref._flat_weights)
        out = _compat.vf_rnn(mode)(x, h, weights, True, 1, 0.0, False, False, False)
        torch.testing.assert_close(out[0], ref(x, h)[0])
    lstm = torch.nn.LSTM(4, 5)
    lstm_vf = _compat.vf_rnn("lstm")
    out = lstm_vf(x, (h, h), list(lstm._flat_weights), True, 1, 0.0, False, False, False)
    torch.testing.assert_close(out[0], lstm(x, (h, h))[0])


def test_without_autograd_cache_turns_the_cache_off():
    from torch._functorch import config

    with _compat.without_autograd_cache():
        assert config.enable_autograd_cache is False


def test_extract_fwd_bwd_modules_takes_static_lifetime_input_nodes():
    params = inspect.signature(_compat.extract_fwd_bwd_modules).parameters
    assert params["static_lifetime_input_nodes"].kind is inspect.Parameter.KEYWORD_ONLY


def test_inductor_mode_options_maps_a_mode_to_settings():
    assert _compat.inductor_mode_options("max-autotune")["max_autotune"] is True


def test_inductor_decompositions_decompose_batch_norm():
    import torch

    table = _compat.inductor_decompositions()
    assert torch.ops.aten._native_batch_norm_legit_functional.default in table


def test_cudagraph_trees_warming_up_reads_the_tree_manager_state():
    """The trees' per-thread containers, their manager and its warm-up state, as Inductor
    keeps them (a manager is made by hand: the real one needs a GPU)."""
    import torch
    from torch._inductor import cudagraph_trees as trees

    device = torch.device("cuda", 0)
    containers = trees.get_obj(trees.local, "tree_manager_containers")
    assert torch._C._is_key_in_tls("tree_manager_containers")
    assert 0 not in containers
    assert not _compat.cudagraph_trees_warming_up(device)
    container = trees.TreeManagerContainer(0)
    manager = object.__new__(trees.CUDAGraphTreeManager)
    manager.path_state = trees.ExecutionState.WARMUP
    container.tree_manager = manager
    containers[0] = container
    try:
        assert _compat.cudagraph_trees_warming_up(device)
        manager.path_state = trees.ExecutionState.EXECUTION
        assert not _compat.cudagraph_trees_warming_up(device)
    finally:
        del containers[0]


def test_inductor_setting_names_hold_the_torch_compile_options():
    names = _compat.inductor_setting_names()
    assert {"max_autotune", "triton.cudagraphs", "custom_partitioner_fn"} <= names


def test_eager_backward_compile_patches_the_functorch_config():
    assert _compat.functorch_config.force_non_lazy_backward_lowering is False
    with _compat.eager_backward_compile():
        assert _compat.functorch_config.force_non_lazy_backward_lowering is True
    assert _compat.functorch_config.force_non_lazy_backward_lowering is False


def test_memory_history_functions_take_what_peak_compare_passes():
    import torch

    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    for name in ("enabled", "context", "stacks", "max_entries"):
        assert name in params, f"torch changed _record_memory_history: no {name!r}"
    assert callable(torch.cuda.memory._snapshot)
    assert callable(_compat.record_memory_history) and callable(_compat.memory_snapshot)


def test_let_dynamo_trace_modules_lifts_the_rnn_refusal_for_those_classes_only():
    import pytest
    import torch
    from torch._dynamo.variables.builder import VariableBuilder

    import mirrorgrad.nn  # registers mirrorgrad's RNN classes

    assert hasattr(VariableBuilder.wrap_module, "_mirrorgrad_classes")

    def step(rnn, x):
        return rnn(x)[0]

    x = torch.randn(3, 2, 4)
    torch._dynamo.reset()
    ours = mirrorgrad.nn.GRU(4, 5)
    torch.compile(step, fullgraph=True, backend="eager")(ours, x)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"RNN, GRU, (or LSTM|LSTMs)"):
        torch.compile(step, fullgraph=True, backend="eager")(torch.nn.GRU(4, 5), x)


def test_needs_plain_autograd_sees_functorch_transforms_and_dual_tensors():
    import torch
    import torch.autograd.forward_ad as fwad

    x = torch.randn(3)
    assert not _compat.needs_plain_autograd([x])
    seen = []
    torch.func.vmap(lambda t: seen.append(_compat.needs_plain_autograd([t])) or t)(x[None])
    torch.func.jvp(lambda t: seen.append(_compat.needs_plain_autograd([t])) or t, (x,), (x,))
    assert seen == [True, True]
    with fwad.dual_level():
        assert not _compat.needs_plain_autograd([x])
        assert _compat.needs_plain_autograd([x, fwad.make_dual(x, torch.ones(3))])


def test_storage_use_count_sees_views_and_their_release():
    import torch

    t = torch.zeros(4)
    alone = _compat.storage_use_count(t)
    view = t[1:]
    assert _compat.storage_use_count(t) == alone + 1
    del view
    assert _compat.storage_use_count(t) == alone


def test_keep_output_strides_marks_outputs_as_inductor_reads_them():
    import torch
    import torch.fx
    from torch._inductor.graph import get_user_visible_output_strides

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    z = graph.call_function(torch.ops.aten.neg.default, (x,))
    output = graph.output((y, z))
    y.meta["val"], z.meta["val"] = torch.empty(2, 4), torch.empty(4, 2).t()
    assert _compat.keep_output_strides(graph, [1]) == [1]  # strides recorded from meta
    assert get_user_visible_output_strides(graph) == {z: (1, 2)}
    output.meta["original_output_strides"] = [(4, 1), (1, 2)]  # as Inductor records them
    output.meta["user_visible_output_idxs"] = [0]
    assert _compat.keep_output_strides(graph, [1]) == [1]
    assert get_user_visible_output_strides(graph) == {y: (4, 1), z: (1, 2)}


def test_post_grad_pass_config_takes_a_custom_graph_pass():
    assert hasattr(_compat.inductor_config, _compat.INDUCTOR_POST_GRAD_PASS_CONFIG)
    abstract = _compat.CustomGraphPass.__abstractmethods__
    assert abstract == {"__call__", "uuid"}, f"torch changed CustomGraphPass: {abstract}"


def test_tracing_context_gives_the_mutated_inputs():
    import torch

    seen = {}

    def backend(gm, example_inputs):
        compiled = _compat.aot_autograd(fw_compiler=_compat.boxed_nop)(gm, example_inputs)
        context = _compat.tracing_context()
        with _compat.tracing(context):
            assert _compat.tracing_context() is context
        seen["mutated"] = _compat.mutated_input_indices(context, len(example_inputs))
        seen["mismatch"] = _compat.mutated_input_indices(context, len(example_inputs) + 1)
        seen["shapes"] = [tuple(t.shape) for t in example_inputs]
        return compiled

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
    torch.compile(model, backend=backend)(torch.randn(4, 3)).sum().backward()
    torch._dynamo.reset()
    assert _compat.tracing_context() is None
    assert seen["mismatch"] is None
    # BatchNorm's running mean, running variance and batch count, nothing else.
    assert sorted(seen["shapes"][i] for i in seen["mutated"]) == [(), (5,), (5,)]


def test_ddp_graph_split_setting():
    from torch._dynamo import config

    assert config.optimize_ddp is True  # torch's default: split at the buckets
    with _compat.ddp_graph_split(False):
        assert config.optimize_ddp is False
    assert config.optimize_ddp is True


def test_dispatches_plainly_sees_modes_and_subclasses():
    from torch.utils.flop_counter import FlopCounterMode

    t = torch.ones(2)
    assert _compat.dispatches_plainly([t, None, torch.nn.Parameter(torch.ones(1))])
    with FlopCounterMode(display=False):
        assert not _compat.dispatches_plainly([t])
    with torch.device("cpu"):  # a TorchFunctionMode
        assert not _compat.dispatches_plainly([t])

    class Sub(torch.Tensor):
        pass

    assert not _compat.dispatches_plainly([t.as_subclass(Sub)])


def test_clear_cublas_workspaces_is_the_private_call_on_cuda_and_a_no_op_without():
    _compat.clear_cublas_workspaces()  # no CUDA here: nothing to free, no error
    if torch.cuda.is_available():
        assert hasattr(torch._C, "_cuda_clearCublasWorkspaces")


def test_compile_fx_takes_an_inner_compile_told_which_graph_is_the_backward():
    params = inspect.signature(_compat.compile_fx).parameters
    assert "inner_compile" in params
    inner = inspect.signature(_compat.compile_fx_inner).parameters
    assert list(inner)[:2] == ["gm", "example_inputs"]
    seen = []

    def inner_compile(gm, example_inputs, **kwargs):
        seen.append(bool(kwargs.get("is_backward")))
        return _compat.compile_fx_inner(gm, example_inputs, **kwargs)

    def backend(gm, example_inputs):
        # A hit in AOTAutograd's cache would skip the compilers.
        with _compat.eager_backward_compile(), _compat.without_autograd_cache():
            return _compat.compile_fx(gm, example_inputs, inner_compile=inner_compile)

    torch._dynamo.reset()
    x = torch.randn(4, requires_grad=True)
    torch.compile(lambda t: t.sin(), backend=backend)(x).sum().backward()
    torch._dynamo.reset()
    assert sorted(seen) == [False, True]


def test_inductor_seeded_random_ops_ignore_the_seed_when_run_eagerly():
    # Why compiler.EagerBackward compiles them alone: eagerly, one seed draws anew.
    ops = _compat.inductor_seeded_random_ops()
    assert all(isinstance(op, _compat.OpOverload) for op in ops)
    random = ops[0]
    seed = torch.tensor(1234)
    assert not torch.equal(random([64], seed, "rand"), random([64], seed, "rand"))


def test_inductor_lookup_seed_op_reads_the_kth_seed():
    lookup = _compat.inductor_lookup_seed_op()
    assert isinstance(lookup, _compat.OpOverload)
    assert lookup(torch.tensor([5, 7, 9]), 1).item() == 7


def test_static_sizes_tells_symbolic_sizes_apart_while_dynamo_traces():
    seen = {}

    def f(x):
        seen["static"] = _compat.static_sizes(x.shape)
        return x * 2

    assert _compat.static_sizes([3, 4])
    for dynamic in (False, True):
        torch._dynamo.reset()
        torch.compile(f, dynamic=dynamic, backend="eager", fullgraph=True)(torch.ones(5, 4))
        assert seen["static"] is not dynamic


def test_stride_padding_reads_inductors_settings():
    # graph.fusion.padded_strides models Inductor's comprehensive padding with these:
    # a rename or a new default must show up here, not as a wrong peak estimate.
    assert _compat.stride_padding() == (True, 128, 1024)
    settings = {"comprehensive_padding": False, "padding_alignment_bytes": 64}
    with _compat.inductor_config.patch({**settings, "padding_stride_threshold": 512}):
        assert _compat.stride_padding() == (False, 64, 512)


def test_gpu_shape_padding_patches_names_pad_mm_has():
    from torch._inductor.fx_passes import pad_mm

    for name in ("check_device", "has_triton", "should_pad"):
        assert callable(getattr(pad_mm, name)), name
    assert hasattr(_compat.inductor_config, "force_shape_pad")
    before = pad_mm.should_pad
    with _compat.gpu_shape_padding():
        assert pad_mm.check_device(None, None) and _compat.inductor_config.force_shape_pad
    assert pad_mm.should_pad is before


def test_is_batched_sees_both_vmaps_and_not_a_plain_tensor():
    from torch import _vmap_internals

    seen = []

    def record(t):
        seen.append(_compat.is_batched(t))
        return t * 2

    _vmap_internals._vmap(record, 0, 0)(torch.randn(3, 2))  # what is_grads_batched runs
    torch.func.vmap(record)(torch.randn(3, 2))
    assert seen == [True, True]
    assert not _compat.is_batched(torch.randn(3)) and not _compat.is_batched(None)



def test_sgd_update_is_plain_sgd_with_a_tensor_lr():
    torch.manual_seed(0)
    params = [torch.randn(5), torch.randn(3, 2)]
    grads = [torch.randn(5), torch.randn(3, 2)]
    expected = [p - 0.25 * g for p, g in zip(params, grads)]
    lr = torch.tensor(0.5)
    lr.fill_(0.25)  # read at the call, not when the tensor was made
    _compat.sgd_update_(params, grads, lr)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e)


def test_tracing_for_cuda_graphs_reads_the_traced_frames_backend():
    """reduce-overhead and the triton.cudagraphs option (torch's and mirrorgrad's) say
    True while Dynamo traces; default modes and untraced calls say False."""
    import mirrorgrad

    seen = []

    @torch.compiler.assume_constant_result
    def probe() -> bool:
        seen.append(_compat.tracing_for_cuda_graphs())
        return seen[-1]

    def fn(x):
        return x + 1 if probe() else x - 1

    x = torch.ones(3)
    cases = [
        (dict(backend="eager"), False),
        (dict(backend="inductor", mode="reduce-overhead"), True),
        (dict(backend="inductor"), False),
        (dict(backend="mirrorgrad", options={"triton.cudagraphs": True}), True),
    ]
    for kwargs, expected in cases:
        torch._dynamo.reset()
        seen.clear()
        torch.compile(fn, **kwargs)(x)
        assert seen == [expected], kwargs
    assert mirrorgrad.compile(fn, options={"triton.cudagraphs": True})(x)[0] == 2
    assert seen[-1] is True
    assert _compat.tracing_for_cuda_graphs() is False


def test_recompile_limit_raises_instead_of_running_eagerly():
    def f(x):
        return x * 2

    with _compat.recompile_limit_raises(1):
        torch._dynamo.reset()
        compiled = torch.compile(f, backend="eager", dynamic=False)
        compiled(torch.ones(2))
        with pytest.raises(Exception, match="recompile_limit"):
            compiled(torch.ones(3))  # a new shape: a second compile of f's code
    torch._dynamo.reset()


def test_dynamo_records_linears_and_their_example_values_as_fused_loss_reads_them():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layer = torch.nn.Linear(3, 5)
    torch._dynamo.reset()
    torch.compile(lambda x: layer(x) + torch.nn.functional.linear(x, layer.weight), backend=record)(
        torch.randn(2, 3)
    )
    (gm,) = graphs
    linears = [n for n in gm.graph.nodes if n.target in _compat.DYNAMO_LINEAR_TARGETS]
    assert len(linears) == 2
    for node in linears:
        assert node.meta[_compat.DYNAMO_EXAMPLE_VALUE].shape == (2, 5)
