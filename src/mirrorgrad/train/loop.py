"""The training loop of `mirrorgrad train lm`: steps, evaluation, checkpoints, resume.

Everything that can fail on bad input (folders, the checkpoint to resume, the data)
is checked before the first step. Resuming restores the model, optimizer, scheduler,
data position, carried LSTM state, running loss sums and every RNG, so the resumed
loss curve and summary equal the uninterrupted ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

import mirrorgrad
from mirrorgrad.callbacks import Callback, TensorBoardLogger, perplexity
from mirrorgrad.options import MirrorOptions
from mirrorgrad.train import checkpoint, data, distributed, preflight, step
from mirrorgrad.train.checkpoint import CheckpointError
from mirrorgrad.train.config import TrainConfig
from mirrorgrad.train.corpus import default_corpus
from mirrorgrad.train.distributed import World
from mirrorgrad.train.metrics import RunningLosses
from mirrorgrad.train.model import LanguageModel, State
from mirrorgrad.train.stop import StopRequest
from mirrorgrad.train.summary import Summary

# Settings that fix the model's shape or the data order: a resume must use the same.
_RESUME_SETTINGS = ("model", "tie_weights", "batch_size", "bptt", "char", "dropout")
_CHECKPOINT_KEYS = frozenset(
    {"model", "optimizer", "scheduler", "position", "state", "rng", "losses", "vocab"}
    | {"world_size", "config"}
)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class Diverged(RuntimeError):
    """A step gave a non-finite loss or gradient norm; no checkpoint was written after it."""


class StepNotCaptured(RuntimeError):
    """The whole-step CUDA Graph could not be captured (before any weight changed)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class _Position:
    """Where training stands: ``window`` is the next BPTT window of ``epoch``."""

    step: int = 0
    epoch: int = 0
    window: int = 0


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


def train(config: TrainConfig, callbacks: Sequence[Callback] = ()) -> Summary:
    """Trains the LSTM language model that ``config`` describes; see `mirrorgrad train lm`.

    SIGINT/SIGTERM during the steps stop after the current one, save and return a
    summary with ``interrupted=True`` and ``signal`` naming it; before or after the
    steps they raise `mirrorgrad.train.stop.Interrupted` (a KeyboardInterrupt).
    """
    stop = StopRequest()
    with stop.installed():
        world, device = distributed.init(config.device)
        try:
            run = _Run(config, world, device, list(callbacks))
            try:
                stop.check()  # a signal in setup whose exception was swallowed
                return run.run(stop)
            finally:
                for cb in run.callbacks:
                    cb.close()
        finally:
            distributed.shutdown(world)


def _data_path(config: TrainConfig, world: World) -> Path:
    if config.data is not None:
        return config.data
    if world.is_main:  # one download; the other ranks read the cached copy
        default_corpus()
    distributed.barrier(world)
    return default_corpus()


class _Run:
    def __init__(
        self, config: TrainConfig, world: World, device: torch.device, callbacks: list[Callback]
    ) -> None:
        started = time.perf_counter()
        self.config, self.world, self.device = config, world, device
        self.callbacks = callbacks
        resume = self._prepare()
        self._load_data(resume)
        self._build_model()
        # Dropout masks differ between ranks, as they would between batch columns.
        torch.manual_seed(config.seed + world.rank)

        self.position = _Position()
        self.state = self._initial_state()
        self.losses = RunningLosses.zeros(device)
        self.valid: tuple[int, float | None] | None = None  # step, loss of the last validation
        # The first step with a non-finite loss or gradient norm (0: none), on the device.
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)
        self.saved_step: int | None = None
        self.eval_seconds = 0.0  # kept out of the throughput
        if resume is not None:
            self._restore(resume)
        if world.is_main and config.logdir is not None:
            self.callbacks.append(
                TensorBoardLogger(
                    config.logdir,
                    log_freq=config.log_freq,
                    device=device,
                    plan=self.plan,
                    settings={"precision": config.precision, "step": self._step_description()},
                    # Drop what an earlier run logged after this checkpoint.
                    purge_step=self.position.step + 1 if resume is not None else None,
                )
            )
        self.setup_seconds = time.perf_counter() - started  # data, plan, compile

    # -- before the first step ---------------------------------------------------------

    def _prepare(self) -> dict[str, Any] | None:
        """Folders written to, stale temporaries removed, the checkpoint to resume
        verified against this run's settings; returns that checkpoint's state."""
        cfg = self.config
        if cfg.logdir is not None:
            preflight.probe_writable(cfg.logdir, "--logdir")
        ckpt_dir = cfg.checkpoint_dir
        if ckpt_dir is not None:
            preflight.probe_writable(ckpt_dir, "--ckpt-dir")
            preflight.probe_replaceable(ckpt_dir / checkpoint.LAST, "--ckpt-dir")
            if self.world.is_main:
                checkpoint.remove_stale_temporaries(ckpt_dir)
        if cfg.resume is None:
            return None
        self.resume_path = checkpoint.resolve(cfg.resume)
        state = checkpoint.load(self.resume_path)
        self._check_resumable(state)
        return state

    def _check_resumable(self, state: dict[str, Any]) -> None:
        path = self.resume_path
        missing = _CHECKPOINT_KEYS - state.keys()
        if not missing and not isinstance(state["config"], dict):
            missing = {"config"}
        if missing:
            names = ", ".join(sorted(missing))
            raise CheckpointError(f"{path}: not a checkpoint of `mirrorgrad train lm` (no {names})")
        ours = self._resume_settings()
        for key in _RESUME_SETTINGS:
            saved = state["config"].get(key)
            if saved != ours[key]:
                flag = f"--{key.replace('_', '-')}"
                raise ValueError(
                    f"{flag} is {ours[key]!r} but {path} was trained with {saved!r}; "
                    f"resume with the same {flag}, or start a new run in another --ckpt-dir"
                )
        if state["world_size"] != self.world.world_size:
            raise ValueError(
                f"{path} was written by {state['world_size']} processes, this run has "
                f"{self.world.world_size}; resume with the same --nproc_per_node"
            )

    def _resume_settings(self) -> dict[str, Any]:
        """Effective values, not flags: --dropout 0.1 equals the tiny model's default."""
        cfg = self.config
        values = {key: getattr(cfg, key) for key in _RESUME_SETTINGS}
        values["dropout"] = cfg.preset.dropout
        return values

    def _load_data(self, resume: dict[str, Any] | None) -> None:
        cfg, world = self.config, self.world
        corpus = data.load_corpus(
            data.find_splits(_data_path(cfg, world)), char=cfg.char, vocab_size=cfg.vocab_size
        )
        self.vocab = corpus.vocab
        if resume is not None and resume["vocab"] != self.vocab.tokens:
            raise ValueError(
                f"vocabulary mismatch on resume: {self.resume_path} has {len(resume['vocab'])} "
                f"tokens, the data gives {len(self.vocab)} (or the same number in another "
                "order); resume with the same --data, --char and --vocab-size"
            )
        if cfg.batch_size % world.world_size:
            raise ValueError(
                f"--batch-size {cfg.batch_size} must be divisible by the number of "
                f"processes ({world.world_size}): it is the global batch"
            )
        eval_batch = math.ceil(cfg.eval_batch_size / world.world_size) * world.world_size
        train_batches = data.batchify(corpus.train, cfg.batch_size)
        self.train_data = self._shard(train_batches)
        self.embedding_rows = self._embedding_rows(train_batches)
        self.valid_data, self.test_data = (
            None if ids is None else self._shard(data.batchify(ids, eval_batch))
            for ids in (corpus.valid, corpus.test)
        )
        self.windows_per_epoch = data.num_windows(self.train_data, cfg.bptt, drop_last=True)
        if self.windows_per_epoch == 0:
            raise ValueError(
                f"the training text is too short for --bptt {cfg.bptt} at --batch-size "
                f"{cfg.batch_size}; lower them or add text"
            )

    def _embedding_rows(self, train_batches: Tensor) -> Tensor | None:
        """Per window, the embedding rows all ranks' inputs touch (``allreduce-rows``)."""
        mode = distributed.data_parallel_mode() if self.world.distributed else None
        if mode != "allreduce-rows" or self.config.tie_weights:  # tied: the decoder's too
            return None
        rows = distributed.window_rows(train_batches, self.config.bptt)
        return rows.pin_memory() if self.device.type == "cuda" else rows

    def _build_model(self) -> None:
        cfg, device = self.config, self.device
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = LanguageModel(
            len(self.vocab), cfg.preset, tie_weights=cfg.tie_weights, precision=cfg.precision
        )
        self.model.to(device)
        lr = cfg.preset.lr if cfg.lr is None else cfg.lr  # a resume restores its own
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        # The word_language_model schedule: lr / 4 whenever valid loss does not improve.
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self.optimizer, mode="min", factor=0.25, patience=0
        )
        self.plan = self._explain() if self.world.is_main else None
        # On one GPU the whole step is one CUDA Graph around the planned step compiled
        # without Inductor's own graphs (a graph cannot hold graphs). Under DDP the
        # forward and backward are graphs and the rest runs eagerly.
        self.graphed: step.GraphedStep | None = None
        plain = None
        if device.type == "cuda":
            plain = step.compile_for_training(self.model, cfg.mirror, device, cuda_graphs=False)
        # On every GPU, before any wrapper: the plain model's step is each rank's.
        self.step_peaks = self._measure_step_peaks(plain) if plain is not None else None
        if plain is not None and cfg.step_graph and self._graphable_world():
            self.step_model = plain
            self.reduce_gradients = None
            self.graphed = step.GraphedStep(plain, self.optimizer, clip=cfg.clip)
        else:
            self.step_model = self._wrap(self.model)

    def _graphable_world(self) -> bool:
        """One GPU. NOTE: under torchrun the step with its all-reduce captured trained at
        the uncaptured path's speed on two H100s, then hung in the collectives after the
        last step (docs/training.md), so data parallelism keeps the forward and backward
        graphs with the all-reduce, clip and SGD eager."""
        return not self.world.distributed

    def _shard(self, batches: Tensor) -> Tensor:
        return data.shard_columns(batches, self.world.rank, self.world.world_size).to(self.device)

    def _initial_state(self) -> State:
        return self.model.initial_state(self.train_data.shape[1], self.device)

    def _example_inputs(self) -> tuple[Tensor, Tensor, State]:
        x, y = data.window(self.train_data, 0, self.config.bptt)
        return x, y, self._initial_state()

    def _explain(self) -> Any:
        """The mirror plan of one training step: estimated stash and peak, with and without."""
        mirror = self.config.mirror
        # With --mirror off, "with mirroring" shows what balance mode would give.
        if mirror.mode == "off":
            mirror = dataclasses.replace(mirror, mode="balance")
        try:
            return mirrorgrad.explain(
                self.model,
                *self._example_inputs(),
                backend=step.backend_for(self.device),
                **mirror.as_kwargs(),
            )
        except Exception as e:  # an estimate for the log must never stop training
            warnings.warn(f"mirrorgrad.explain failed, no plan in the logs: {e}", stacklevel=2)
            return None

    def _measure_step_peaks(self, measured: Callable[..., Any]) -> tuple[int, int] | None:
        """Measured peak bytes of one forward+backward without and with mirroring.

        Of this rank's GPU; ``measured`` is the step as planned, compiled without CUDA
        Graphs (their replays allocate nothing, so the peak would read ~0). Runs before
        training, leaves no gradients, and the RNG is seeded afresh after it, so
        training is the same with or without it.
        """
        mirror = self.config.mirror
        other = "balance" if mirror.mode == "off" else "off"
        other_model = step.compile_for_training(
            self.model, MirrorOptions(mode=other), self.device, cuda_graphs=False
        )
        pair = (measured, other_model) if mirror.mode == "off" else (other_model, measured)
        try:
            return tuple(self._step_peak(m) for m in pair)
        except Exception as e:  # a measurement for the summary must never stop training
            warnings.warn(f"could not measure the step peaks: {e}", stacklevel=2)
            return None
        finally:
            self.model.zero_grad(set_to_none=True)

    def _step_peak(self, step_model: nn.Module) -> int:
        inputs = self._example_inputs()
        for _ in range(2):  # the first call compiles (and may autotune)
            self.model.zero_grad(set_to_none=True)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            loss, _ = step_model(*inputs)
            loss.backward()
            torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def _wrap(self, model: nn.Module) -> Callable[..., Any]:
        step_model, self.reduce_gradients = step.compile_for_world(
            model, self.config.mirror, self.device, self.world
        )
        return step_model

    # -- checkpoints -------------------------------------------------------------------

    def _checkpoint_state(self) -> dict[str, Any]:
        """Collective under DDP: every rank contributes its state, loss sums and RNG."""
        h, c = (distributed.gather_columns(self.world, t, dim=1) for t in self.state)
        per_rank = distributed.gather_objects(
            self.world, {"rng": checkpoint.rng_state(), "losses": self.losses.to_state()}
        )
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "position": dataclasses.asdict(self.position),
            "state": [h.cpu(), c.cpu()],
            "rng": [r["rng"] for r in per_rank],
            "losses": [r["losses"] for r in per_rank],
            "vocab": self.vocab.tokens,
            "world_size": self.world.world_size,
            "config": {**self._resume_settings(), "mirror": self.config.mirror.to_cli()},
        }

    def _save(self) -> str | None:
        """Saves unless a step since the last check went non-finite (then Diverged)."""
        ckpt_dir = self.config.checkpoint_dir
        if ckpt_dir is None:
            return None
        self._check_finite()
        state = self._checkpoint_state()
        path = ckpt_dir / checkpoint.LAST
        if self.world.is_main:
            checkpoint.save(state, path)
        distributed.barrier(self.world)
        self.saved_step = self.position.step
        return str(path)

    def _restore(self, state: dict[str, Any]) -> None:
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"{self.resume_path}: its weights do not fit this model ({_first_line(e)})"
            ) from None
        try:
            self._restore_progress(state)
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
            # Only a file written by something else (its checksum holds) gets here.
            raise CheckpointError(
                f"{self.resume_path}: its training state does not fit this run ({_first_line(e)})"
            ) from None
        self._override_lr()

    def _restore_progress(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.position = _Position(**state["position"])
        h, c = (
            data.shard_columns(t, self.world.rank, self.world.world_size).to(self.device)
            for t in state["state"]
        )
        self.state = (h.contiguous(), c.contiguous())
        self.losses = RunningLosses.from_state(state["losses"][self.world.rank], self.device)
        checkpoint.set_rng_state(state["rng"][self.world.rank])
        self.saved_step = self.position.step

    def _override_lr(self) -> None:
        """An explicit --lr replaces the one the checkpoint's schedule had reached."""
        lr, groups = self.config.lr, self.optimizer.param_groups
        saved = groups[0]["lr"]
        if lr is None or lr == saved:
            return
        for group in groups:
            group["lr"] = lr
        if self.world.is_main:
            print(
                f"--lr {lr:g} replaces the lr of {self.resume_path} "
                f"({saved:g}); the schedule goes on from {lr:g}",
                file=sys.stderr,
            )

    # -- the steps ---------------------------------------------------------------------

    def run(self, stop: StopRequest) -> Summary:
        cfg, pos = self.config, self.position
        total_steps = cfg.epochs * self.windows_per_epoch
        if cfg.max_steps is not None:
            total_steps = min(total_steps, cfg.max_steps)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        progress = tqdm(
            total=total_steps, initial=pos.step, disable=not self.world.is_main,
            unit="step", dynamic_ncols=True, desc=f"{cfg.model} lm",
            mininterval=0.1 if sys.stderr.isatty() else 30.0,  # keep captured logs short
        )  # fmt: skip
        clock = _Clock.start()
        self.model.train()
        with progress, stop.deferring():
            signum = self._train_steps(total_steps, stop, clock, progress)
            self._synchronize()
            seconds = time.perf_counter() - clock.started
            steps_per_s = clock.steps_per_s(pos.step, self.eval_seconds)
            first_step_s = None if clock.timed_from is None else clock.timed_from[1] - clock.started
            train_loss = self.losses.train_loss(self.world)
            path = self._save()
        # A signal that came while the last checkpoint was written also skips evaluation.
        signum = signum or stop.signum
        valid_loss = test_loss = None
        if signum is None:
            valid_loss, test_loss = self._final_evaluation()
            stop.check()  # a signal in the evaluation whose exception was swallowed
        return self._summary(
            seconds=seconds,
            steps_per_s=steps_per_s,
            first_step_seconds=first_step_s,
            losses=(train_loss, valid_loss, test_loss),
            signum=signum,
            checkpoint=path,
        )

    def _train_steps(
        self, total_steps: int, stop: StopRequest, clock: _Clock, progress: tqdm
    ) -> int | None:
        """Steps until ``total_steps`` or a stop request; the signal that stopped them."""
        cfg, pos = self.config, self.position
        while pos.step < total_steps:
            x, y = data.window(self.train_data, pos.window, cfg.bptt)
            self.losses.add(self._step(x, y))
            pos.step += 1
            pos.window += 1
            if clock.timed_from is None:
                self._synchronize()
                clock.timed_from = (pos.step, time.perf_counter(), self.eval_seconds)
            progress.update()
            last = pos.step == total_steps
            if pos.step % cfg.log_freq == 0 or last:
                self._log(clock, progress)
                # All ranks must agree to stop at the same step (collectives follow).
                signum = distributed.largest(self.world, stop.signum or 0, self.device) or None
            else:
                signum = None if self.world.distributed else stop.signum
            if pos.window == self.windows_per_epoch:
                eval_started = self.eval_seconds
                self._end_epoch()
                clock.window_started += self.eval_seconds - eval_started
            if signum is not None:
                return signum
            if pos.step % cfg.ckpt_every == 0 and not last:
                self._save()
        return None

    def _step(self, x: Tensor, y: Tensor) -> Tensor:
        reduce = self.reduce_gradients
        if self.embedding_rows is not None:
            rows = self.embedding_rows[self.position.window].to(self.device, non_blocking=True)
            reduce = functools.partial(reduce, rows=(self.model.encoder.weight, rows))
        if self.graphed is not None:
            loss, grad_norm, self.state = self._graphed_step(x, y)
        else:
            loss, grad_norm, self.state = step.sgd_step(
                self.step_model, self.model, self.optimizer, x, y, self.state,
                clip=self.config.clip, reduce_gradients=reduce,
            )  # fmt: skip
        # Recorded on the device (no sync per step); checked at log steps and saves.
        bad = ~torch.isfinite(loss + grad_norm) & (self.first_bad_step == 0)
        self.first_bad_step.masked_fill_(bad, self.position.step + 1)
        return loss

    def _graphed_step(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, State]:
        try:
            return self.graphed(x, y, self.state)
        except Exception as e:
            if self.graphed.graph is not None:  # a replay failed: not a capture problem
                raise
            # A failed capture leaves CUDA's RNG mid-capture: this process cannot go on.
            raise StepNotCaptured(
                f"the training step could not be captured as one CUDA Graph "
                f"({type(e).__name__}: {_first_line(e)}); run with --no-step-graph"
            ) from e

    def _check_finite(self) -> None:
        bad_step = int(distributed.maximum(self.world, self.first_bad_step))
        if not bad_step:
            return
        kept = (
            "no checkpoint was saved"
            if self.saved_step is None
            else f"the checkpoint of step {self.saved_step} is kept"
        )
        lr = self.optimizer.param_groups[0]["lr"]
        raise Diverged(
            f"training diverged: the loss or gradient norm is not finite at step {bad_step}; "
            f"{kept}. Lower --lr (now {lr:g}) or --clip (now {self.config.clip:g})"
        )

    def _log(self, clock: _Clock, progress: tqdm) -> None:
        """Mean loss of the steps since the last log, to the callbacks and progress bar."""
        window = self.losses.window
        mean_loss = window.mean(self.world)
        now = time.perf_counter()
        step_s = (now - clock.window_started) / window.steps
        metrics = {
            "loss": mean_loss,
            "perplexity": perplexity(mean_loss),
            "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_s": self.config.batch_size / step_s,  # global batch
            "step_time_ms": step_s * 1e3,
        }
        for cb in self.callbacks:
            cb.on_train_step(self.position.step, metrics)
        progress.set_postfix(loss=f"{mean_loss:.3f}", samples_s=f"{metrics['samples_per_s']:.0f}")
        window.total.zero_()
        window.steps, clock.window_started = 0, now
        self._check_finite()

    def _end_epoch(self) -> None:
        pos = self.position
        pos.epoch += 1
        pos.window = 0
        self.state = self._initial_state()
        self.losses.end_epoch()
        if self.valid_data is None:
            return
        self._check_finite()  # a NaN validation would also lower the lr for nothing
        valid_loss = self.evaluate(self.valid_data)
        self.scheduler.step(valid_loss)
        self.valid = (pos.step, valid_loss)
        for cb in self.callbacks:
            cb.on_validation(pos.step, {"loss": valid_loss})

    # -- evaluation and report ---------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, batches: Tensor) -> float:
        """Mean cross-entropy per token over a split (all ranks together)."""
        started = time.perf_counter()
        self.model.eval()
        state = self.model.initial_state(batches.shape[1], self.device)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for x, y in data.windows(batches, self.config.bptt):
            loss, state = self.model(x, y, state)
            total += loss.double() * y.numel()
        self.model.train()
        tokens = (batches.shape[0] - 1) * batches.shape[1]
        loss = float(distributed.mean(self.world, total)) / tokens
        self.eval_seconds += time.perf_counter() - started
        return loss

    def _final_evaluation(self) -> tuple[float | None, float | None]:
        """Validation (unless the last epoch's end just ran it) and test losses."""
        step = self.position.step
        valid_loss = self.valid[1] if self.valid is not None and self.valid[0] == step else None
        if valid_loss is None and self.valid_data is not None:
            valid_loss = self.evaluate(self.valid_data)
            for cb in self.callbacks:
                cb.on_validation(step, {"loss": valid_loss})
        test_loss = None if self.test_data is None else self.evaluate(self.test_data)
        return valid_loss, test_loss

    def _summary(
        self,
        *,
        seconds: float,
        steps_per_s: float,
        first_step_seconds: float | None,
        losses: tuple[float | None, float | None, float | None],
        signum: int | None,
        checkpoint: str | None,
    ) -> Summary:
        cfg, pos = self.config, self.position
        train_ppl, valid_ppl, test_ppl = (None if x is None else perplexity(x) for x in losses)
        samples_per_s = steps_per_s * cfg.batch_size  # the global batch
        return Summary(
            model=cfg.model,
            mirror=cfg.mirror.to_cli(),
            device=str(self.device.type),
            world_size=self.world.world_size,
            parameters=sum(p.numel() for p in self.model.parameters()),
            steps=pos.step,
            epochs_done=pos.epoch + pos.window / self.windows_per_epoch,
            train_perplexity=train_ppl,
            valid_perplexity=valid_ppl,
            test_perplexity=test_ppl,
            seconds=seconds,
            samples_per_s=samples_per_s,
            tokens_per_s=samples_per_s * cfg.bptt,
            peak_measured_bytes=self._peak_per_gpu(),
            peak_step_without=None if self.step_peaks is None else self.step_peaks[0],
            peak_step_with=None if self.step_peaks is None else self.step_peaks[1],
            peak_estimated_without=getattr(self.plan, "peak_before", None),
            peak_estimated_with=getattr(self.plan, "peak_after", None),
            first_step_seconds=first_step_seconds,
            interrupted=signum is not None,
            signal=None if signum is None else signal.Signals(signum).name,
            checkpoint=checkpoint,
            plan=None if self.plan is None else self.plan.summary_line(),
            precision=cfg.precision,
            step=self._step_description(),
            setup_seconds=self.setup_seconds,
        )

    def _step_description(self) -> str:
        if self.graphed is not None:
            return "one CUDA Graph (forward, backward, gradient clip, SGD)"
        if self.device.type == "cuda":
            return "compiled; forward and backward as CUDA Graphs, clip and SGD eager"
        return "compiled (AOTAutograd graphs run eagerly on the CPU)"

    def _peak_per_gpu(self) -> int | None:
        """The largest ``max_memory_allocated`` of all ranks (collective)."""
        if self.device.type != "cuda":
            return None
        peak = torch.tensor(torch.cuda.max_memory_allocated(self.device), device=self.device)
        return int(distributed.maximum(self.world, peak))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
