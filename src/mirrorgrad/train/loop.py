"""The training loop of `mirrorgrad train lm`: setup, the steps, the final evaluation, the summary.

`train` passes a run through each part once: `setup.set_up` (folders, data, model, plan,
compile, resume), the `StepLoop` here (epochs, steps, logging, checkpoints, the lr
schedule, stop requests, the divergence check), `evaluation.final_losses` and
`summary.summarize`.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from mirrorgrad import _cuda_graphs
from mirrorgrad.callbacks import Callback, perplexity
from mirrorgrad.train import checkpoint, data, distributed, evaluation, step
from mirrorgrad.train.config import TrainConfig
from mirrorgrad.train.model import State
from mirrorgrad.train.progress import Position, Progress, checkpoint_state, first_line
from mirrorgrad.train.setup import Setup, set_up
from mirrorgrad.train.stop import StopRequest
from mirrorgrad.train.summary import Summary, peak_per_gpu, summarize


class Diverged(RuntimeError):
    """A step gave a non-finite loss or gradient norm; no checkpoint was written after it."""


class StepNotCaptured(RuntimeError):
    """The whole-step CUDA Graph could not be captured (before any weight changed)."""


def train(config: TrainConfig, callbacks: Sequence[Callback] = ()) -> Summary:
    """Trains the LSTM language model that ``config`` describes; see `mirrorgrad train lm`.

    SIGINT/SIGTERM during the steps stop after the current one, save and return a
    summary with ``interrupted=True`` and ``signal`` naming it; before or after the
    steps they raise `mirrorgrad.train.stop.Interrupted` (a KeyboardInterrupt).

    On a GPU, cuBLAS workspaces are 4 MiB unless ``CUBLAS_WORKSPACE_CONFIG`` is set
    (`_cuda_graphs.small_cublas_workspaces`), and fp32 matmuls run as TF32
    (``torch.set_float32_matmul_precision("high")``), as cuDNN's RNNs already do by
    default (``torch.backends.cudnn.allow_tf32``).
    """
    if config.device != "cpu" and torch.cuda.is_available():
        _cuda_graphs.small_cublas_workspaces()
        torch.set_float32_matmul_precision("high")
    stop = StopRequest()
    with stop.installed():
        world, device = distributed.init(config.device)
        try:
            setup, start = set_up(config, world, device, callbacks)
            try:
                stop.check()  # a signal in setup whose exception was swallowed
                trained = StepLoop(setup, start).run(stop)
                valid_loss = test_loss = None
                if trained.signum is None:
                    valid_loss, test_loss = evaluation.final_losses(
                        setup, trained.position.step, trained.last_validation
                    )
                    stop.check()  # a signal in the evaluation whose exception was swallowed
                return summarize(setup, trained, valid_loss=valid_loss, test_loss=test_loss)
            finally:
                for cb in setup.callbacks:
                    cb.close()
        finally:
            distributed.shutdown(world)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Trained:
    """What the steps did: where they ended, how fast, and why."""

    position: Position
    seconds: float  # the whole loop, evaluations at epoch ends included
    steps_per_s: float  # after the first step, evaluation excluded
    first_step_seconds: float | None  # compiles included
    train_loss: float | None  # see RunningLosses.train_loss
    last_validation: tuple[int, float] | None  # step, loss
    signum: int | None  # the signal that stopped the steps
    checkpoint: str | None  # the last one saved
    peak_loop_bytes: int | None = None  # the steps' peak per GPU (largest rank), CUDA only


@dataclasses.dataclass(kw_only=True, slots=True)
class _Clock:
    """Wall-clock time of the run and of the current log window.

    NOTE: not _timing.py: that times repeated calls of one function (CUDA events,
    quantiles); training throughput is wall time over the whole loop, Python and data
    included, evaluation excluded. (bench imports train, so train does not import bench.)
    Throughput counts from the end of the first step (that one compiles), evaluation
    time excluded.
    """

    started: float
    window_started: float
    timed_from: tuple[int, float, float] | None = None  # step, time, eval seconds then

    @classmethod
    def start(cls) -> _Clock:
        now = time.perf_counter()
        return cls(started=now, window_started=now)

    def steps_per_s(self, step: int, eval_seconds: float) -> float:
        if self.timed_from is None or step == self.timed_from[0]:
            return 0.0
        first_step, first_time, first_eval = self.timed_from
        seconds = time.perf_counter() - first_time - (eval_seconds - first_eval)
        return (step - first_step) / seconds


class StepLoop:
    """The steps from ``start`` to the last one or a stop request: the epochs (validation,
    lr schedule, a fresh LSTM state), logging, checkpoints and the divergence check."""

    def __init__(self, setup: Setup, start: Progress) -> None:
        self.setup = setup
        self.progress = start  # the loop's own from here: advanced step by step
        self.last_validation: tuple[int, float] | None = None  # step, loss
        # The first step with a non-finite loss or gradient norm (0: none), on the device.
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=setup.device)
        self.eval_seconds = 0.0  # kept out of the throughput

    def run(self, stop: StopRequest) -> Trained:
        setup, pos = self.setup, self.progress.position
        cfg = setup.config
        total_steps = cfg.epochs * setup.data.windows_per_epoch
        if cfg.max_steps is not None:
            total_steps = min(total_steps, cfg.max_steps)
        if setup.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.device)
        bar = tqdm(
            total=total_steps, initial=pos.step, disable=not setup.world.is_main,
            unit="step", dynamic_ncols=True, desc=f"{cfg.model} lm",
            mininterval=0.1 if sys.stderr.isatty() else 30.0,  # keep captured logs short
        )  # fmt: skip
        clock = _Clock.start()
        setup.model.train()
        with bar, stop.deferring():
            signum = self._train_steps(total_steps, stop, clock, bar)
            self._synchronize()
            peak_loop = peak_per_gpu(setup.world, setup.device)  # before the final evaluation
            seconds = time.perf_counter() - clock.started
            steps_per_s = clock.steps_per_s(pos.step, self.eval_seconds)
            first_step_s = None if clock.timed_from is None else clock.timed_from[1] - clock.started
            train_loss = self.progress.losses.train_loss(setup.world)
            path = self._save()
            self._release_step()
        return Trained(
            position=pos,
            seconds=seconds,
            steps_per_s=steps_per_s,
            first_step_seconds=first_step_s,
            train_loss=train_loss,
            last_validation=self.last_validation,
            # A signal that came while the last checkpoint was written also skips evaluation.
            signum=signum or stop.signum,
            checkpoint=path,
            peak_loop_bytes=peak_loop,
        )

    def _train_steps(
        self, total_steps: int, stop: StopRequest, clock: _Clock, bar: tqdm
    ) -> int | None:
        """Steps until ``total_steps`` or a stop request; the signal that stopped them."""
        setup, pos = self.setup, self.progress.position
        cfg, world = setup.config, setup.world
        while pos.step < total_steps:
            x, y = data.window(setup.data.train, pos.window, cfg.bptt, setup.device)
            self.progress.losses.add(self._step(x, y))
            pos.step += 1
            pos.window += 1
            if clock.timed_from is None:
                self._synchronize()
                clock.timed_from = (pos.step, time.perf_counter(), self.eval_seconds)
            bar.update()
            last = pos.step == total_steps
            if pos.step % cfg.log_freq == 0 or last:
                self._log(clock, bar)
                # All ranks must agree to stop at the same step (collectives follow).
                signum = distributed.largest(world, stop.signum or 0, setup.device) or None
            else:
                signum = None if world.distributed else stop.signum
            if pos.window == setup.data.windows_per_epoch:
                eval_started = self.eval_seconds
                self._end_epoch()
                clock.window_started += self.eval_seconds - eval_started
            if signum is not None:
                return signum
            if pos.step % cfg.ckpt_every == 0 and not last:
                self._save()
        return None

    def _step(self, x: Tensor, y: Tensor) -> Tensor:
        """One step on the window ``x``, ``y``; carries the LSTM state on, returns the loss."""
        setup, at = self.setup, self.progress
        reduce = setup.step.reduce_gradients
        if setup.data.embedding_rows is not None:
            rows = setup.data.embedding_rows[at.position.window].to(setup.device, non_blocking=True)
            reduce = functools.partial(reduce, rows=(setup.model.encoder.weight, rows))
        if setup.step.graphed is not None:
            loss, grad_norm, at.state = self._graphed_step(x, y)
        else:
            loss, grad_norm, at.state = step.sgd_step(
                setup.step.model, setup.model, setup.optimizer, x, y, at.state,
                clip=setup.config.clip, reduce_gradients=reduce,
            )  # fmt: skip
        # Recorded on the device (no sync per step); checked at log steps and saves.
        bad = ~torch.isfinite(loss + grad_norm) & (self.first_bad_step == 0)
        self.first_bad_step.masked_fill_(bad, at.position.step + 1)
        return loss

    def _graphed_step(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, State]:
        graphed = self.setup.step.graphed
        try:
            return graphed(x, y, self.progress.state)
        except Exception as e:
            if graphed.graph is not None:  # a replay failed: not a capture problem
                raise
            # A failed capture leaves CUDA's RNG mid-capture: this process cannot go on.
            raise StepNotCaptured(
                f"the training step could not be captured as one CUDA Graph "
                f"({type(e).__name__}: {first_line(e)}); run with --no-step-graph"
            ) from e

    def _check_finite(self) -> None:
        bad_step = int(distributed.maximum(self.setup.world, self.first_bad_step))
        if not bad_step:
            return
        saved_step = self.progress.saved_step
        kept = (
            "no checkpoint was saved"
            if saved_step is None
            else f"the checkpoint of step {saved_step} is kept"
        )
        lr = self.setup.optimizer.param_groups[0]["lr"]
        raise Diverged(
            f"training diverged: the loss or gradient norm is not finite at step {bad_step}; "
            f"{kept}. Lower --lr (now {lr:g}) or --clip (now {self.setup.config.clip:g})"
        )

    def _log(self, clock: _Clock, bar: tqdm) -> None:
        """Mean loss of the steps since the last log, to the callbacks and progress bar."""
        setup = self.setup
        window = self.progress.losses.window
        mean_loss = window.mean(setup.world)
        now = time.perf_counter()
        step_s = (now - clock.window_started) / window.steps
        metrics = {
            "loss": mean_loss,
            "perplexity": perplexity(mean_loss),
            "lr": setup.optimizer.param_groups[0]["lr"],
            "samples_per_s": setup.config.batch_size / step_s,  # global batch
            "step_time_ms": step_s * 1e3,
        }
        for cb in setup.callbacks:
            cb.on_train_step(self.progress.position.step, metrics)
        bar.set_postfix(loss=f"{mean_loss:.3f}", samples_s=f"{metrics['samples_per_s']:.0f}")
        window.total.zero_()
        window.steps, clock.window_started = 0, now
        self._check_finite()

    def _release_step(self) -> None:
        """After the last step (saved): the step's CUDA Graph and the gradients go, so
        that the final evaluation, which needs neither, does not stand beside them (the
        medium LM's bf16 run at batch 20 peaked 20 MiB above its steps in it, H200)."""
        if self.setup.step.graphed is not None:
            self.setup.step.graphed.release()
        self.setup.optimizer.zero_grad(set_to_none=True)

    def _end_epoch(self) -> None:
        setup, pos = self.setup, self.progress.position
        pos.epoch += 1
        pos.window = 0
        self.progress.state = setup.initial_state()
        self.progress.losses.end_epoch()
        if setup.data.valid is None:
            return
        self._check_finite()  # a NaN validation would also lower the lr for nothing
        started = time.perf_counter()
        valid_loss = evaluation.evaluate(
            setup.model, setup.data.valid, bptt=setup.config.bptt, world=setup.world,
            device=setup.device,
        )  # fmt: skip
        self.eval_seconds += time.perf_counter() - started
        setup.scheduler.step(valid_loss)
        self.last_validation = (pos.step, valid_loss)
        for cb in setup.callbacks:
            cb.on_validation(pos.step, {"loss": valid_loss})

    def _save(self) -> str | None:
        """Saves unless a step since the last check went non-finite (then Diverged)."""
        setup = self.setup
        ckpt_dir = setup.config.checkpoint_dir
        if ckpt_dir is None:
            return None
        self._check_finite()
        state = checkpoint_state(
            self.progress, model=setup.model, optimizer=setup.optimizer,
            scheduler=setup.scheduler, vocab=setup.data.vocab, config=setup.config,
            world=setup.world,
        )  # fmt: skip
        path = ckpt_dir / checkpoint.LAST
        if setup.world.is_main:
            checkpoint.save(state, path)
        distributed.barrier(setup.world)
        self.progress.saved_step = self.progress.position.step
        return str(path)

    def _synchronize(self) -> None:
        if self.setup.device.type == "cuda":
            torch.cuda.synchronize(self.setup.device)
