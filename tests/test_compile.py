"""mirrorgrad.compile / backend / explain: eager's gradients in every mode, on the zoo."""

from __future__ import annotations

import copy
import json
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import pytest
import torch
from tests.zoo import ZOO, build, loss_of

import mirrorgrad
from mirrorgrad import _compat
from mirrorgrad.mirror import planner as planner_module
from mirrorgrad.mirror.partition import MirrorgradFallbackWarning

MODES = [
    pytest.param({"mode": "off"}, id="off"),
    pytest.param({"mode": "balance"}, id="balance"),
    pytest.param({"mode": "budget", "budget": 0.1}, id="budget0.1"),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Every test compiles zoo models whose forward code objects are shared between
    # tests; a reset keeps Dynamo's recompile limit from silently running eager.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@contextmanager
def no_fallback() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    fallbacks = [w for w in caught if issubclass(w.category, MirrorgradFallbackWarning)]
    assert not fallbacks, str(fallbacks[0].message)


def step(model, inputs, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    out = model(*inputs)
    loss_of(out).backward()
    return out.detach()


def assert_same_training_state(model, reference, *, rtol: float, atol: float) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{name}: gradient where eager has none"
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, rtol=rtol, atol=atol, msg=name)


def compiled_twin(name: str, dtype=None, **options):
    reference, inputs = build(name, dtype)
    model = copy.deepcopy(reference)
    return reference, model, mirrorgrad.compile(model, backend="eager", **options), inputs


@pytest.mark.slow
@pytest.mark.parametrize("options", MODES)
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_gradients_equal_eager(name, options):
    reference, model, compiled, inputs = compiled_twin(name, **options)
    with no_fallback():
        out = step(compiled, inputs)
    expected = step(reference, inputs)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert_same_training_state(model, reference, rtol=1e-9, atol=1e-12)
    (plan,) = compiled._mirrorgrad_plans
    if options["mode"] == "off":
        assert not plan.mirrored
    if options["mode"] == "budget":
        assert plan.mirrored, "a budget of 0.1 should mirror something"


def test_gradient_accumulation_over_two_backward_calls():
    reference, model, compiled, inputs = compiled_twin("lstm_lm", mode="balance")
    other = (torch.randint(0, 11, inputs[0].shape),)
    with no_fallback():
        step(compiled, inputs, seed=1)
        step(compiled, other, seed=2)
    step(reference, inputs, seed=1)
    step(reference, other, seed=2)
    assert_same_training_state(model, reference, rtol=1e-9, atol=1e-12)


def test_frozen_parameters_get_no_gradient():
    reference, inputs = build("mlp")
    for module in (reference.fc1, reference.norm2):
        module.requires_grad_(False)
    model = copy.deepcopy(reference)
    compiled = mirrorgrad.compile(model, mode="budget", budget=0.5, backend="eager")
    with no_fallback():
        step(compiled, inputs)
    step(reference, inputs)
    assert model.fc1.weight.grad is None and model.norm2.bias.grad is None
    assert model.fc2.weight.grad is not None
    assert_same_training_state(model, reference, rtol=1e-9, atol=1e-12)


def test_batchnorm_running_stats_follow_eager():
    reference, model, compiled, inputs = compiled_twin("convnet", mode="balance")
    with no_fallback():
        step(compiled, inputs)
        step(compiled, inputs)
    step(reference, inputs)
    step(reference, inputs)
    assert int(model.block1.bn1.num_batches_tracked) == 2
    assert not torch.equal(
        model.block1.bn1.running_mean, torch.zeros_like(model.block1.bn1.running_mean)
    )
    assert_same_training_state(model, reference, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_env_var_turns_mirroring_off(monkeypatch):
    monkeypatch.setenv("MIRRORGRAD_MIRROR", "0")
    reference, model, compiled, inputs = compiled_twin(
        "seq2seq_attention", mode="budget", budget=0.5
    )
    with no_fallback():
        step(compiled, inputs)
    step(reference, inputs)
    (plan,) = compiled._mirrorgrad_plans
    assert not plan.mirrored
    assert_same_training_state(model, reference, rtol=1e-9, atol=1e-12)


def test_backend_for_torch_compile():
    reference, inputs = build("encoder_block")
    model = copy.deepcopy(reference)
    plans = []
    compiled = torch.compile(
        model, backend=mirrorgrad.backend(mode="balance", backend="eager", on_plan=plans.append)
    )
    with no_fallback():
        step(compiled, inputs)
    step(reference, inputs)
    assert len(plans) == 1
    assert_same_training_state(model, reference, rtol=1e-9, atol=1e-12)


def test_torch_compile_options_need_inductor_codegen():
    model = torch.compile(
        torch.nn.Linear(3, 3),
        backend=mirrorgrad.backend(backend="eager"),
        options={"max_autotune": True},
    )
    with pytest.raises(Exception, match="Inductor settings"):
        model(torch.randn(2, 3))


def test_compile_a_function():
    weight = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)

    def f(x):
        return torch.tanh(x @ weight).exp().sum(-1)

    x = torch.randn(4, 7, dtype=torch.float64)
    compiled = mirrorgrad.compile(f, mode="budget", budget=0.5, backend="eager")
    with no_fallback():
        (grad,) = torch.autograd.grad(loss_of(compiled(x)), weight)
    (expected,) = torch.autograd.grad(loss_of(f(x)), weight)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    assert len(compiled._mirrorgrad_plans) == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "fast"}, "mode"),
        ({"backend": "tvm"}, "choose one of inductor, eager"),
        ({"mode": "budget"}, "needs budget="),
        ({"mode": "budget", "budget": -1}, "finite and > 0"),
        ({"mode": "budget", "budget": "abc"}, "activation_memory_budget"),
        ({"mode": "budget", "budget": 1.5}, r"a fraction in \(0, 1\]"),
        ({"mode": "balance", "budget": 0.5}, "only used by mode='budget'"),
        ({"max_overhead": -0.1}, "max_overhead"),
        ({"backend": "eager", "options": {"max_autotune": True}}, "backend='inductor'"),
    ],
)
def test_bad_options_raise_value_error(options, message):
    with pytest.raises(ValueError, match=message):
        mirrorgrad.compile(torch.nn.Linear(2, 2), **options)


def test_planner_failure_warns_once_and_falls_back(monkeypatch):
    def broken_plan(joint, options, **kwargs):
        raise RuntimeError("injected planner failure")

    monkeypatch.setattr(planner_module, "plan", broken_plan)
    reference, model, compiled, inputs = compiled_twin("mlp", mode="balance")
    with pytest.warns(MirrorgradFallbackWarning) as record:
        step(compiled, inputs)
    step(reference, inputs)
    fallbacks = [w for w in record if issubclass(w.category, MirrorgradFallbackWarning)]
    assert len(fallbacks) == 1
    message = str(fallbacks[0].message)
    assert "injected planner failure" in message and "default_partition" in message
    dump = message.rsplit(": ", 1)[-1]
    with open(dump) as f:
        assert "injected planner failure" in f.read()
    assert compiled._mirrorgrad_plans == []
    assert_same_training_state(model, reference, rtol=1e-9, atol=1e-12)


def test_explain_prints_a_table_and_leaves_the_model_alone():
    model, inputs = build("convnet")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    plan = mirrorgrad.explain(model, *inputs, mode="budget", budget=0.5)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"explain() changed {key}"
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    table = str(plan)
    assert table.splitlines()[2].split() == ["value", "op", "shape", "bytes"]
    as_dict = json.loads(json.dumps(plan.to_dict()))
    assert as_dict["mirrored"] and as_dict["stashed"]
    rows = table.splitlines()[3:]
    for kind, values in (("stash", as_dict["stashed"]), ("mirror", as_dict["mirrored"])):
        for value in values:
            assert any(r.split()[:1] == [kind] and value["name"] in r for r in rows), value
    assert as_dict["peak_after"] < as_dict["peak_before"]


def test_explain_without_grad_raises():
    model = torch.nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="require grad"):
        mirrorgrad.explain(model, torch.randn(2, 3))


@pytest.mark.slow
@pytest.mark.parametrize("options", [MODES[0], MODES[2]])
def test_inductor_backend_matches_eager_and_leaves_config_alone(options):
    # The Transformer block once saved a base next to its view, and Inductor reused
    # the donated base's memory in backward: wrong gradients (see one_per_storage).
    reference, inputs = build("encoder_block", torch.float32)
    model = copy.deepcopy(reference)
    compiled = mirrorgrad.compile(model, **options)
    with no_fallback():
        out = step(compiled, inputs)
    expected = step(reference, inputs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert_same_training_state(model, reference, rtol=1e-5, atol=1e-5)
    (plan,) = compiled._mirrorgrad_plans
    assert bool(plan.mirrored) == (options["mode"] != "off")
    assert getattr(_compat.inductor_config, _compat.INDUCTOR_PARTITIONER_CONFIG) is None


def test_mark_forbids_mirroring_a_module():
    reference, model, compiled, inputs = compiled_twin("mlp", mode="budget", budget=0.3)
    mirrorgrad.mark(model.norm1, mirror=False)
    with no_fallback():
        step(compiled, inputs)
    step(reference, inputs)
    (plan,) = compiled._mirrorgrad_plans
    assert plan.mirrored, "the rest of the MLP is still mirrored"
    from_norm1 = [n for n in plan.mirrored if "norm1" in str(n.meta.get("nn_module_stack"))]
    assert from_norm1 == []
    assert_same_training_state(model, reference, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_dynamic_shapes_pass_through_and_model_stays_copyable():
    reference, model, compiled, inputs = compiled_twin(
        "lstm_lm", mode="budget", budget=0.5, dynamic=True
    )
    wider = (torch.randint(0, 11, (7, 5)),)  # another batch size, same length
    with no_fallback():
        step(compiled, inputs, seed=1)
        step(compiled, wider, seed=2)
    step(reference, inputs, seed=1)
    step(reference, wider, seed=2)
    assert len(compiled._mirrorgrad_plans) == 1, "one graph for both shapes"
    assert_same_training_state(model, reference, rtol=1e-9, atol=1e-12)
    assert not hasattr(model, "_mirrorgrad_plans")
    copy.deepcopy(model)


def test_public_name_stays_callable_once_its_module_is_imported():
    import mirrorgrad.compiler as module

    assert mirrorgrad.compile is module.compile
    compiled = mirrorgrad.compile(torch.nn.Linear(2, 2), backend="eager")
    assert compiled._mirrorgrad_plans == []


class _FusedLSTMLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        import mirrorgrad.nn

        self.embed = torch.nn.Embedding(11, 8)
        self.rnn = mirrorgrad.nn.LSTM(8, 10, num_layers=2)
        self.decoder = torch.nn.Linear(10, 11)

    def forward(self, tokens):
        y, _ = self.rnn(torch.tanh(self.embed(tokens)))
        return self.decoder(torch.relu(y))


def test_mirrorgrad_nn_lstm_goes_through_the_planner_as_one_op():
    reference = _FusedLSTMLM().double()
    model = copy.deepcopy(reference)
    # Bytes no plan meets: the lowest peak, so something is mirrored around the op.
    compiled = mirrorgrad.compile(model, mode="budget", budget=2, backend="eager")
    tokens = torch.randint(0, 11, (5, 3))
    with no_fallback(), warnings.catch_warnings():
        warnings.simplefilter("ignore", mirrorgrad.MirrorgradBudgetWarning)
        step(compiled, (tokens,))
    step(reference, (tokens,))
    assert_same_training_state(model, reference, rtol=1e-9, atol=1e-12)
    (plan,) = compiled._mirrorgrad_plans
    assert plan.mirrored and not [n for n in plan.mirrored if "mirrorgrad" in str(n.target)]


def test_explain_leaves_dynamo_room_for_the_users_compile():
    # Each explain compiles with a new backend; on the model's own forward that used up
    # Dynamo's recompile limit (8 per code object): the ninth explain failed, and so would
    # the user's compile afterwards (seen in the train loop's log line).
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.linear(x).relu().sum()

    for _ in range(10):
        mirrorgrad.explain(Block(), torch.randn(4, 8))
    step = mirrorgrad.compile(Block(), backend="eager", fullgraph=True)
    step(torch.randn(4, 8)).backward()
    assert len(step._mirrorgrad_plans) == 1


def test_plan_inductor_rejects_falls_back_at_compile_time(monkeypatch):
    # Inductor raising on the plan's backward must be caught while compiling (the backward
    # compiles with the forward), then min-cut takes over: one warning, eager's gradients.
    from mirrorgrad import compiler

    real_compile_fx_inner = _compat.compile_fx_inner

    def reject_the_plans_backward(gm, inputs, **kwargs):
        if kwargs.get("is_backward") and _compiling_a_plan():
            raise RuntimeError("injected: query: last dimension must be contiguous")
        return real_compile_fx_inner(gm, inputs, **kwargs)

    monkeypatch.setattr(compiler._compat, "compile_fx_inner", reject_the_plans_backward)
    reference, inputs = build("mlp")
    model = copy.deepcopy(reference)
    compiled = mirrorgrad.compile(model, mode="balance")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(compiled, inputs)
        step(compiled, inputs, seed=2)
    step(reference, inputs)
    step(reference, inputs, seed=2)
    fallbacks = [w for w in caught if issubclass(w.category, MirrorgradFallbackWarning)]
    assert len(fallbacks) == 1
    message = str(fallbacks[0].message)
    assert "Inductor rejected the plan" in message and "last dimension must be" in message
    assert compiled._mirrorgrad_plans == []
    assert_same_training_state(model, reference, rtol=1e-5, atol=1e-6)


def _compiling_a_plan() -> bool:
    from mirrorgrad.mirror.partition import MirrorPartitioner

    return isinstance(_compat.inductor_config.custom_partitioner_fn, MirrorPartitioner)


def _dropout_batchnorm_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.GELU(),
        torch.nn.Dropout(0.5), torch.nn.Linear(16, 4),
    )  # fmt: skip


def test_plan_failing_at_run_time_falls_back_once(monkeypatch):
    # A planned forward that raises inside its compiled code (an encoder's attention layout)
    # must not end the run: the call is run again by min-cut's code, with the RNG state
    # and the BatchNorm statistics it changed before raising undone, so the step equals
    # torch.compile's own (same dropout masks, statistics updated once).
    from mirrorgrad import compiler
    from mirrorgrad.mirror.partition import MirrorPartitioner

    real_compile_fx = _compat.compile_fx
    planned_calls = []

    def fail_after_running(compiled):
        def run(*args):
            planned_calls.append(1)
            compiled(*args)  # draws dropout, updates BatchNorm statistics
            raise RuntimeError("injected: query: last dimension must be contiguous")

        return run

    def compile_fx(gm, inputs, **kwargs):
        compiled = real_compile_fx(gm, inputs, **kwargs)
        planned = isinstance(_compat.inductor_config.custom_partitioner_fn, MirrorPartitioner)
        return fail_after_running(compiled) if planned else compiled

    monkeypatch.setattr(compiler._compat, "compile_fx", compile_fx)
    reference = _dropout_batchnorm_net()
    model = copy.deepcopy(reference)
    compiled = mirrorgrad.compile(model, mode="balance")
    expected = torch.compile(reference)
    x = torch.randn(32, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (1, 2):
            step(compiled, (x,), seed=seed)
            step(expected, (x,), seed=seed)
    fallbacks = [w for w in caught if issubclass(w.category, MirrorgradFallbackWarning)]
    assert len(fallbacks) == 1
    message = str(fallbacks[0].message)
    assert "failed on its first call" in message and "last dimension must be" in message
    assert len(planned_calls) == 1  # the second step ran min-cut's code directly
    assert compiled._mirrorgrad_plans == []
    assert_same_training_state(model, reference, rtol=1e-6, atol=1e-7)


def test_plan_running_fine_keeps_its_code(monkeypatch):
    # The guard's bookkeeping stops after a first call that succeeds.
    from mirrorgrad import compiler

    undo_logs = []
    real_before = compiler._UndoLog.before

    def counting_before(*args, **kwargs):
        undo_logs.append(1)
        return real_before(*args, **kwargs)

    monkeypatch.setattr(compiler._UndoLog, "before", counting_before)
    model = _dropout_batchnorm_net()
    compiled = mirrorgrad.compile(model, mode="balance")
    with no_fallback():
        for seed in (1, 2, 3):
            step(compiled, (torch.randn(32, 8),), seed=seed)
    assert len(undo_logs) == 1
    assert len(compiled._mirrorgrad_plans) == 1


def _fail_the_plans_backward(
    monkeypatch,
    *,
    on_call: int,
    error: type[Exception] = RuntimeError,
    sparing: Callable[[], Iterable[torch.Tensor]] | None = None,
) -> list[weakref.ref | None]:
    """Make every planned backward raise ``error`` on its ``on_call``-th call, after
    running its compiled code to the end (which frees its inputs and may overwrite
    donated ones); with ``sparing``, after overwriting every input tensor but those on
    the storage of one of ``sparing()`` (the graph's inputs: parameters, data, which the
    backward never writes). Returns a list with an entry per call of the planned
    backward: for the failing one, a weak reference to a gradient it computed before
    raising."""
    from mirrorgrad import compiler

    real_compile_fx_inner = _compat.compile_fx_inner
    calls: list[weakref.ref | None] = []

    def fail_after_running(compiled):
        def run(args):
            inputs = list(args) if sparing is not None else []
            out = compiled(args)
            if len(calls) + 1 != on_call:
                calls.append(None)
                return out
            calls.append(weakref.ref(next(g for g in out if isinstance(g, torch.Tensor))))
            spared = {t.untyped_storage().data_ptr() for t in (sparing or tuple)()}
            for x in inputs:
                if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in spared:
                    x.fill_(float("nan") if x.is_floating_point() else 7)
            raise error("injected: backward kernel cannot take this shape")

        run._boxed_call = True
        return run

    def compile_fx_inner(gm, inputs, **kwargs):
        compiled = real_compile_fx_inner(gm, inputs, **kwargs)
        planned_backward = kwargs.get("is_backward") and _compiling_a_plan()
        return fail_after_running(compiled) if planned_backward else compiled

    monkeypatch.setattr(compiler._compat, "compile_fx_inner", compile_fx_inner)
    return calls


def _accumulation_step(model, xs) -> None:
    """One optimizer step's gradients over micro-batches ``xs`` (each a planned forward
    before any backward runs)."""
    model.zero_grad(set_to_none=True)
    loss = sum(model(x).square().sum() for x in xs)
    loss.backward()


def _train(model, xs, steps: int) -> list[list[torch.Tensor]]:
    """Each step's gradients and the BatchNorm statistics after it; the RNG is seeded
    once, so a guard that drew random numbers of its own would shift later masks."""
    torch.manual_seed(1)
    states = []
    for _ in range(steps):
        _accumulation_step(model, xs)
        grads = [p.grad.clone() for p in model.parameters()]
        states.append(grads + [b.clone() for b in model.buffers()])
    return states


def test_plan_backward_failing_on_its_first_call_runs_eagerly_then_min_cut(monkeypatch):
    # The forward ran with the plan's saved values, so the failed backward is run again by
    # the plan's own backward graph without Inductor (from copies of its inputs: the
    # compiled code freed them), with the recomputed dropout mask drawn from the forward's
    # seed as Inductor drew it; both micro-batches' backwards of that step go there. From
    # the next step the graph is min-cut's. Each step equals torch.compile's.
    from mirrorgrad import compiler

    guards = []
    real_guard_init = compiler.BackwardGuard.__init__

    def record(self, *args, **kwargs):
        real_guard_init(self, *args, **kwargs)
        guards.append(self)

    monkeypatch.setattr(compiler.BackwardGuard, "__init__", record)
    reference = _dropout_batchnorm_net()
    model = copy.deepcopy(reference)
    microbatches = [torch.randn(32, 8), torch.randn(32, 8)]
    planned_backward_calls = _fail_the_plans_backward(
        monkeypatch, on_call=1, sparing=lambda: [*model.parameters(), *microbatches]
    )
    # Budget 0.3 recomputes the first Linear and the dropout mask in the backward.
    compiled = mirrorgrad.compile(model, mode="budget", budget=0.3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = _train(compiled, microbatches, steps=3)
    expected = _train(torch.compile(reference), microbatches, steps=3)
    for step_number, (got, want) in enumerate(zip(steps, expected)):
        # Gradients reach ~40; the first bias's is zero but for rounding (BatchNorm).
        for i, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step_number}, {i}")
    fallbacks = [w for w in caught if issubclass(w.category, MirrorgradFallbackWarning)]
    assert len(fallbacks) == 1
    message = str(fallbacks[0].message)
    assert "compiled backward failed on its first call" in message
    assert "cannot take this shape" in message and "without Inductor" in message
    assert len(planned_backward_calls) == 1  # the second micro-batch's ran eagerly
    # The failed call's buffers are not kept (by the exception's frames, say).
    assert planned_backward_calls[0]() is None
    assert compiled._mirrorgrad_plans == []
    (guard,) = guards
    recomputed = {n.target for n in guard.graph.graph.nodes}
    assert torch.ops.prims.inductor_random.default in recomputed


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
# Room for the safety copies on the device: all, none, or a part (the rest in host memory).
COPY_ROOMS = {"device": 1 << 62, "host": 0, "split": 3000}


@pytest.mark.parametrize("where", list(COPY_ROOMS))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_plan_backward_failing_after_overwriting_its_inputs_runs_from_the_copies(
    monkeypatch, device, where
):
    # Wherever the first call's copies are (on the device, in host memory, split), the
    # eager backward gets what the compiled one was given, though that overwrote all of
    # it but the parameters: the gradients and statistics are torch.compile's.
    from mirrorgrad import compiler, safety_copies

    placed = []
    real_of = safety_copies.SafetyCopies.of.__func__

    def recording(cls, args, **kwargs):
        copies = real_of(cls, args, **kwargs)
        placed.append(copies.placed())
        return copies

    monkeypatch.setattr(safety_copies.SafetyCopies, "of", classmethod(recording))
    monkeypatch.setattr(compiler, "device_room", lambda plan: lambda d: COPY_ROOMS[where])
    reference = _dropout_batchnorm_net().to(device)
    model = copy.deepcopy(reference)
    microbatches = [torch.randn(32, 8, device=device), torch.randn(32, 8, device=device)]
    _fail_the_plans_backward(
        monkeypatch, on_call=1, sparing=lambda: [*model.parameters(), *microbatches]
    )
    compiled = mirrorgrad.compile(model, mode="budget", budget=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MirrorgradFallbackWarning)
        steps = _train(compiled, microbatches, steps=2)
    expected = _train(torch.compile(reference), microbatches, steps=2)
    for step_number, (got, want) in enumerate(zip(steps, expected)):
        for i, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"step {step_number}, {i}")
    (first,) = placed  # one first call
    assert (first["device"] > 0, first["host"] > 0) == {
        "device": (True, False), "host": (False, True), "split": (True, True)
    }[where]  # fmt: skip


def test_plan_backward_failing_after_a_first_call_that_succeeded_is_raised(monkeypatch):
    # Code that has run once is no plan the code generator could not handle (an
    # out-of-memory, a device fault): the error reaches the caller, nothing is re-run.
    _fail_the_plans_backward(monkeypatch, on_call=2)
    model = _dropout_batchnorm_net()
    compiled = mirrorgrad.compile(model, mode="budget", budget=0.3)
    x = torch.randn(32, 8)
    with no_fallback():
        _accumulation_step(compiled, [x])
        with pytest.raises(RuntimeError, match="cannot take this shape"):
            _accumulation_step(compiled, [x])
    assert len(compiled._mirrorgrad_plans) == 1


def test_plan_backward_running_out_of_memory_is_raised(monkeypatch):
    # Not a plan the code generator cannot handle; the eager graph would hold more.
    _fail_the_plans_backward(monkeypatch, on_call=1, error=torch.OutOfMemoryError)
    compiled = mirrorgrad.compile(_dropout_batchnorm_net(), mode="budget", budget=0.3)
    with no_fallback(), pytest.raises(torch.OutOfMemoryError, match="cannot take this shape"):
        _accumulation_step(compiled, [torch.randn(32, 8)])


def test_a_post_grad_pass_of_the_user_still_runs():
    # The planner installs its own post-grad pass (saved values read through views keep
    # their strides); one the user configured runs before it, on every graph.
    from mirrorgrad import _compat

    graphs = []

    class Recorder(_compat.CustomGraphPass):
        def __call__(self, graph):
            graphs.append(len(graph.nodes))

        def uuid(self):
            return b"recorder"

    _, inputs = build("mlp")
    model = build("mlp")[0]
    compiled = mirrorgrad.compile(model, options={"post_grad_custom_post_pass": Recorder()})
    # A cache hit (an earlier test compiled the same graphs) would skip every pass.
    no_caches = torch._inductor.config.patch(fx_graph_cache=False)
    with no_fallback(), no_caches, _compat.without_autograd_cache():
        step(compiled, inputs)
    assert len(graphs) == 2  # forward and backward
    assert len(compiled._mirrorgrad_plans) == 1
