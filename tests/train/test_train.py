"""The training loop in-process: resume equality, Ctrl-C, TensorBoard events, errors."""

import dataclasses
import random
import signal

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mirrorgrad.callbacks import Callback
from mirrorgrad.options import MirrorOptions
from mirrorgrad.train import checkpoint, progress, step
from mirrorgrad.train.config import PRESETS, TrainConfig
from mirrorgrad.train.distributed import World
from mirrorgrad.train.loop import train
from mirrorgrad.train.model import LanguageModel
from mirrorgrad.train.setup import set_up


class Recorder(Callback):
    def __init__(self, interrupt_at: int | None = None) -> None:
        self.train: dict[int, float] = {}
        self.valid: dict[int, float] = {}
        self.interrupt_at = interrupt_at
        self.closed = False

    def on_train_step(self, step, metrics):
        self.train[step] = metrics["loss"]
        if step == self.interrupt_at:
            # Ctrl-C at a known step: the handler has run when raise_signal returns.
            signal.raise_signal(signal.SIGINT)

    def on_validation(self, step, metrics):
        self.valid[step] = metrics["loss"]

    def close(self):
        self.closed = True


def make_config(corpus, logdir, **overrides) -> TrainConfig:
    # 6 windows per epoch on the fixture corpus.
    values = dict(
        data=corpus, batch_size=8, bptt=20, epochs=2, log_freq=1, logdir=logdir, seed=3,
        mirror=MirrorOptions.from_cli("balance"),
    )  # fmt: skip
    values.update(overrides)
    return TrainConfig.from_preset("tiny", **values)


@pytest.mark.slow
def test_resume_after_ctrl_c_equals_uninterrupted_run(corpus, tmp_path):
    steps = 10  # crosses the epoch boundary: validation, lr schedule, state reset
    full = Recorder()
    summary = train(make_config(corpus, tmp_path / "full", max_steps=steps), [full])
    assert summary.steps == steps and not summary.interrupted
    assert len(full.valid) == 2 and full.closed  # end of epoch 1, and the end of the run

    first = Recorder(interrupt_at=4)
    stopped = train(make_config(corpus, tmp_path / "part", max_steps=steps), [first])
    assert stopped.interrupted and stopped.steps == 4
    state = checkpoint.load(tmp_path / "part" / "checkpoints")
    assert state["position"]["step"] == 4

    second = Recorder()
    resumed = train(
        make_config(
            corpus, tmp_path / "part", max_steps=steps, resume=tmp_path / "part" / "checkpoints"
        ),
        [second],
    )
    assert resumed.steps == steps
    assert list(first.train) == list(range(1, 5))
    assert first.train | second.train == full.train  # exactly equal, step by step
    assert second.valid == full.valid
    assert resumed.test_perplexity == summary.test_perplexity
    assert resumed.train_perplexity == summary.train_perplexity  # steps before the resume count
    state = checkpoint.load(tmp_path / "part" / "checkpoints" / "last.pt")
    assert state["position"] == {"step": steps, "epoch": 1, "window": 4}

    events = EventAccumulator(str(tmp_path / "full"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/perplexity", "train/lr", "train/samples_per_s"}
    expected |= {"train/step_time_ms", "validation/loss", "validation/perplexity"}
    assert expected <= tags
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert logged.keys() == full.train.keys()
    np.testing.assert_allclose(list(logged.values()), list(full.train.values()), rtol=1e-6)


def test_resume_with_other_vocabulary_or_world_size_fails(corpus, tmp_path):
    train(make_config(corpus, tmp_path, max_steps=2, mirror=MirrorOptions.from_cli("off")))
    config = make_config(
        corpus, tmp_path, max_steps=4, vocab_size=10, resume=tmp_path / "checkpoints"
    )
    with pytest.raises(ValueError, match="vocabulary mismatch on resume"):
        train(config)
    path = tmp_path / "checkpoints" / "last.pt"
    state = checkpoint.load(path)
    checkpoint.save({**state, "world_size": 2}, path)
    with pytest.raises(ValueError, match="same --nproc_per_node"):
        train(dataclasses.replace(config, vocab_size=None))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_names_the_fix(corpus, tmp_path):
    with pytest.raises(RuntimeError, match="--device cpu"):
        train(make_config(corpus, tmp_path, device="cuda"))


def test_setup_restores_the_progress_a_checkpoint_saved(corpus, tmp_path, monkeypatch):
    from mirrorgrad.train import probes

    monkeypatch.setattr(probes, "explain_plan", lambda *args: None)  # not needed here: fast
    config = make_config(corpus, None, mirror=MirrorOptions.from_cli("off"))
    cpu = torch.device("cpu")
    setup, moved = set_up(config, World(), cpu, [])
    assert moved.position == progress.Position() and moved.saved_step is None
    # Somewhere in the second epoch, with a carried state, loss sums and a lowered lr.
    moved.position = progress.Position(step=8, epoch=1, window=2)
    moved.state = tuple(torch.randn_like(t) for t in moved.state)
    for loss in (3.0, 2.5, 2.0):
        moved.losses.add(torch.tensor(loss))
    moved.losses.end_epoch()
    moved.losses.add(torch.tensor(1.5))
    setup.scheduler.step(4.0)
    setup.scheduler.step(5.0)  # no improvement: lr / 4
    saved = progress.checkpoint_state(
        moved, model=setup.model, optimizer=setup.optimizer, scheduler=setup.scheduler,
        vocab=setup.data.vocab, config=config, world=setup.world,
    )  # fmt: skip
    checkpoint.save(saved, tmp_path / "last.pt")
    draws = torch.rand(3)

    resumed, restored = set_up(dataclasses.replace(config, resume=tmp_path), World(), cpu, [])
    assert restored.position == moved.position and restored.saved_step == 8
    assert all(torch.equal(a, b) for a, b in zip(restored.state, moved.state))
    assert restored.losses.to_state() == moved.losses.to_state()
    assert restored.losses.train_loss(World()) == 1.5
    assert resumed.optimizer.param_groups[0]["lr"] == setup.optimizer.param_groups[0]["lr"] == 5.0
    assert resumed.scheduler.state_dict() == setup.scheduler.state_dict()
    for a, b in zip(resumed.model.parameters(), setup.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(torch.rand(3), draws)  # the RNG goes on from the save


def test_rng_state_round_trip():
    state = checkpoint.rng_state()
    draws = torch.rand(3), random.random(), np.random.rand()
    checkpoint.set_rng_state(state)
    again = torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(again[0], draws[0]) and again[1:] == draws[1:]


def test_tied_weights_share_the_embedding():
    model = LanguageModel(50, PRESETS["tiny"], tie_weights=True)
    assert model.decoder.weight is model.encoder.weight
    narrow = dataclasses.replace(PRESETS["tiny"], hidden=64)
    with pytest.raises(ValueError, match="--tie-weights"):
        LanguageModel(50, narrow, tie_weights=True)


def test_step_peak_probe_measures_both_modes_and_leaves_no_gradients(monkeypatch):
    # The probe runs on one GPU; here torch.cuda's memory counters are stand-ins.
    import mirrorgrad
    from mirrorgrad.train import probes

    torch.manual_seed(0)
    model = LanguageModel(50, PRESETS["tiny"])
    mirror, device = MirrorOptions.from_cli("off"), torch.device("cpu")

    def example_inputs():
        tokens = torch.randint(0, 50, (5, 3))
        return tokens, tokens.roll(-1, 0), model.initial_state(3, device)

    compiled, real_compile = [], mirrorgrad.compile

    def compile_eagerly(model, *, mode, backend, **options):
        assert "options" not in options  # measured without CUDA Graphs (replays allocate 0)
        compiled.append(mode)
        return real_compile(model, mode=mode, backend="eager", **options)

    peaks = iter([111, 222])  # read once per mode, after a compiling call and a measured one
    monkeypatch.setattr(mirrorgrad, "compile", compile_eagerly)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(peaks))
    # --mirror off: "without" is the step as planned (off), "with" balance.
    planned = step.compile_for_training(model, mirror, device, cuda_graphs=False)
    assert probes.measure_step_peaks(model, planned, mirror, device, example_inputs) == (111, 222)
    assert compiled == ["off", "balance"]
    assert all(p.grad is None for p in model.parameters())


def test_explain_plan_releases_the_rnn_loops_its_forward_recorded(monkeypatch):
    """explain runs one forward: the RNN loop graphs it records are no step's and go; on
    a GPU it chooses implementations as the captured step does."""
    import mirrorgrad
    from mirrorgrad.ops.rnn import cuda_graphs, dispatch
    from mirrorgrad.train import probes

    released, captured = [], []

    def explain(*args, **kwargs):
        for keys in cuda_graphs._RECORDING:  # what cuda_graphs.acquire does for a loop it runs
            keys.add(("a loop",))
        captured.append(dispatch._captured_depth > 0)
        return "the plan"

    monkeypatch.setattr(mirrorgrad, "explain", explain)
    monkeypatch.setattr(cuda_graphs, "release", lambda keys: released.append(set(keys)))
    monkeypatch.setattr(probes.step, "backend_for", lambda device: "eager")
    model = LanguageModel(50, PRESETS["tiny"])
    for device in ("cpu", "cuda"):  # explain is a stand-in: no GPU is touched
        plan = probes.explain_plan(model, lambda: (), MirrorOptions.from_cli("off"),
                                   torch.device(device))  # fmt: skip
        assert plan == "the plan"
    assert released == [{("a loop",)}] * 2
    # On a GPU the step runs captured: auto chooses as captured while the plan is traced.
    assert captured == [False, True]


def test_runs_in_one_process_do_not_pile_compiles_on_the_model(corpus, tmp_path):
    """Each run compiles its step in a frame of its own: runs in one process (a notebook,
    a sweep) never reach Dynamo's recompile limit, which would run the step eagerly."""
    from mirrorgrad import _compat

    with _compat.recompile_limit_raises(2):
        for run in range(3):
            summary = train(make_config(corpus, tmp_path / str(run), epochs=1, max_steps=2))
            assert summary.steps == 2


def test_summary_reports_the_steps_peak_apart_from_the_whole_run():
    """The final evaluation can raise a run's peak above its steps': both are printed."""
    from mirrorgrad.train.summary import Summary

    fields = {f: None for f in Summary.__dataclass_fields__}
    fields.update(model="medium", mirror="balance", device="cuda", world_size=1,
                  parameters=10**6, steps=10, epochs_done=0.5, seconds=1.0,
                  samples_per_s=1.0, tokens_per_s=35.0, interrupted=False,
                  precision="fp32", peak_loop_bytes=190 * 2**20,
                  peak_measured_bytes=246 * 2**20)  # fmt: skip
    text = str(Summary(**fields))
    assert "training steps: 190 MiB" in text
    assert "whole run (final evaluation included): 246 MiB" in text


def test_final_evaluation_runs_without_the_steps_gradients(corpus, tmp_path, monkeypatch):
    """After the last step the gradients (and on a GPU the step's graph) are dropped:
    the final evaluation needs neither, and their memory would stand beside it."""
    from mirrorgrad.train import evaluation

    seen = []
    final_losses = evaluation.final_losses

    def recording(setup, *args):
        seen.append([p.grad for p in setup.model.parameters()])
        return final_losses(setup, *args)

    monkeypatch.setattr(evaluation, "final_losses", recording)
    summary = train(make_config(corpus, tmp_path, epochs=1, max_steps=2))
    assert summary.steps == 2 and len(seen) == 1
    assert all(g is None for g in seen[0])


def test_a_released_graphed_step_holds_no_graph_and_no_static_tensors():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    graphed = step.GraphedStep(lambda *a: None, optimizer, clip=1.0)
    graphed.graph, graphed._inputs = object(), [torch.zeros(1)]
    graphed.release()
    assert graphed.graph is None and graphed._inputs is None
