"""The training loop of `mirrorgrad train lm`: steps, evaluation, checkpoints, resume.

Resuming restores the model, optimizer, scheduler, data position, carried LSTM state
and every RNG, so the resumed loss curve equals the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

import mirrorgrad
from mirrorgrad.callbacks import Callback, TensorBoardLogger
from mirrorgrad.train import checkpoint, data, distributed
from mirrorgrad.train.config import TrainConfig
from mirrorgrad.train.corpus import default_corpus
from mirrorgrad.train.distributed import World
from mirrorgrad.train.model import LanguageModel, State


@dataclasses.dataclass(kw_only=True, slots=True)
class Summary:
    """What a run achieved; ``str()`` is the report printed at the end."""

    model: str
    mirror: str
    device: str
    world_size: int
    parameters: int
    steps: int
    epochs_done: float
    train_perplexity: float
    valid_perplexity: float | None
    test_perplexity: float | None
    seconds: float
    samples_per_s: float
    tokens_per_s: float
    peak_measured_bytes: int | None
    peak_step_without: int | None
    peak_step_with: int | None
    peak_estimated_without: int | None
    peak_estimated_with: int | None
    interrupted: bool = False
    checkpoint: str | None = None

    def __str__(self) -> str:
        def ppl(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2f}"

        def mib(x: int | None) -> str:
            return "n/a" if x is None else f"{x / 2**20:.1f} MiB"

        lines = [
            f"{'interrupted' if self.interrupted else 'done'}: {self.model} LSTM LM, "
            f"{self.parameters / 1e6:.2f}M parameters, mirror={self.mirror}, "
            f"{self.device} x {self.world_size}",
            f"  steps        {self.steps} ({self.epochs_done:.2f} epochs) in {self.seconds:.1f} s",
            f"  perplexity   train {ppl(self.train_perplexity)}  "
            f"valid {ppl(self.valid_perplexity)}  test {ppl(self.test_perplexity)}",
            f"  throughput   {self.samples_per_s:.1f} samples/s ({self.tokens_per_s:.0f} tokens/s, "
            "steps after the first)",
            f"  peak memory  without mirroring {mib(self.peak_estimated_without)} (plan "
            f"estimate), with {mib(self.peak_estimated_with)} (plan estimate)",
        ]
        if self.peak_step_without is not None:
            lines.append(
                f"               measured, one step: without {mib(self.peak_step_without)}, "
                f"with {mib(self.peak_step_with)}"
            )
        if self.peak_measured_bytes is not None:
            lines.append(
                f"               measured, whole run: {mib(self.peak_measured_bytes)} per GPU"
            )
        if self.checkpoint:
            lines.append(f"  checkpoint   {self.checkpoint}")
        return "\n".join(lines)


@dataclasses.dataclass(kw_only=True, slots=True)
class _Position:
    """Where training stands: ``window`` is the next BPTT window of ``epoch``."""

    step: int = 0
    epoch: int = 0
    window: int = 0


class _StopRequest:
    """SIGINT/SIGTERM set a flag; the loop stops after the current step and saves.

    A second Ctrl-C aborts at once. Signals can only be caught in the main thread;
    elsewhere the handlers are left alone.
    """

    def __init__(self) -> None:
        self.requested = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[_StopRequest]:
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum, frame):
            if self.requested and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.requested = True
            print(
                "\nstopping after this step and saving a checkpoint (Ctrl-C again aborts)",
                file=sys.stderr,
            )

        for s in previous:
            signal.signal(s, handler)
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def train(config: TrainConfig, callbacks: Sequence[Callback] = ()) -> Summary:
    """Trains the LSTM language model that ``config`` describes; see `mirrorgrad train lm`."""
    world, device = distributed.init(config.device)
    try:
        return _Run(config, world, device, list(callbacks)).run()
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
        self.config, self.world, self.device = config, world, device
        self.callbacks = callbacks
        resume = checkpoint.load(config.resume) if config.resume is not None else None
        corpus = data.load_corpus(
            data.find_splits(_data_path(config, world)),
            char=config.char,
            vocab_size=config.vocab_size,
        )
        self.vocab = corpus.vocab
        if resume is not None:
            self._check_resumable(resume)
        if config.batch_size % world.world_size:
            raise ValueError(
                f"--batch-size {config.batch_size} must be divisible by the number of "
                f"processes ({world.world_size}): it is the global batch"
            )
        eval_batch = math.ceil(config.eval_batch_size / world.world_size) * world.world_size
        self.train_data = self._shard(data.batchify(corpus.train, config.batch_size))
        self.valid_data, self.test_data = (
            None if ids is None else self._shard(data.batchify(ids, eval_batch))
            for ids in (corpus.valid, corpus.test)
        )
        self.windows_per_epoch = data.num_windows(self.train_data, config.bptt, drop_last=True)
        if self.windows_per_epoch == 0:
            raise ValueError(
                f"the training text is too short for --bptt {config.bptt} at --batch-size "
                f"{config.batch_size}; lower them or add text"
            )

        torch.manual_seed(config.seed)  # the same initial weights on every rank
        self.model = LanguageModel(
            len(self.vocab), config.preset, tie_weights=config.tie_weights
        ).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=config.lr)
        # The word_language_model schedule: lr / 4 whenever valid loss does not improve.
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self.optimizer, mode="min", factor=0.25, patience=0
        )
        self.plan = self._explain() if world.is_main else None
        self.step_model = self._wrap(self.model)
        one_gpu = device.type == "cuda" and not world.distributed
        self.step_peaks = self._measure_step_peaks() if one_gpu else None
        # Dropout masks differ between ranks, as they would between batch columns.
        torch.manual_seed(config.seed + world.rank)

        self.position = _Position()
        self.state = self._initial_state()
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
                    # Drop what an earlier run logged after this checkpoint.
                    purge_step=self.position.step + 1 if resume is not None else None,
                )
            )

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
        options = {"mode": "balance"} if mirror.mode == "off" else {"mode": mirror.mode}
        if mirror.budget is not None:
            options["budget"] = mirror.budget
        try:
            return mirrorgrad.explain(self.model, *self._example_inputs(), **options)
        except Exception as e:  # an estimate for the log must never stop training
            warnings.warn(f"mirrorgrad.explain failed, no plan in the logs: {e}", stacklevel=2)
            return None

    def _measure_step_peaks(self) -> tuple[int, int] | None:
        """Measured peak bytes of one forward+backward without and with mirroring.

        For one GPU. Runs before training, leaves no gradients, and the RNG is seeded
        afresh after it, so training is the same with or without it.
        """
        mirror = self.config.mirror
        other = "balance" if mirror.mode == "off" else "off"
        other_model = mirrorgrad.compile(self.model, mode=other, backend="inductor")
        pair = (
            (self.step_model, other_model)
            if mirror.mode == "off"
            else (other_model, self.step_model)
        )
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

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.world.distributed:
            # Gradients as views of the all-reduce buckets: no second copy of them, so
            # the per-GPU peak stays that of one process with the same per-GPU batch.
            model = nn.parallel.DistributedDataParallel(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
            )
        mirror = self.config.mirror
        backend = "inductor" if self.device.type == "cuda" else "eager"
        options = {} if mirror.budget is None else {"budget": mirror.budget}
        return mirrorgrad.compile(model, mode=mirror.mode, backend=backend, **options)

    def _check_resumable(self, state: dict[str, Any]) -> None:
        if state["vocab"] != self.vocab.tokens:
            raise ValueError(
                f"vocabulary mismatch on resume: the checkpoint has {len(state['vocab'])} "
                f"tokens, the data gives {len(self.vocab)} (or the same number in another "
                "order); resume with the same --data, --char and --vocab-size"
            )
        if state["world_size"] != self.world.world_size:
            raise ValueError(
                f"the checkpoint was written by {state['world_size']} processes, this run has "
                f"{self.world.world_size}; resume with the same --nproc_per_node"
            )
        for key in ("model", "tie_weights", "batch_size", "bptt", "char", "dropout"):
            if state["config"][key] != getattr(self.config, key):
                raise ValueError(
                    f"--{key.replace('_', '-')} is {getattr(self.config, key)!r} but the "
                    f"checkpoint was trained with {state['config'][key]!r}; resume with the same"
                )

    def _checkpoint_state(self) -> dict[str, Any]:
        """Collective under DDP: every rank contributes its state and RNG."""
        h, c = (distributed.gather_columns(self.world, t, dim=1) for t in self.state)
        rngs = distributed.gather_objects(self.world, checkpoint.rng_state())
        cfg = self.config
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "position": dataclasses.asdict(self.position),
            "state": [h.cpu(), c.cpu()],
            "rng": rngs,
            "vocab": self.vocab.tokens,
            "world_size": self.world.world_size,
            "config": {
                "model": cfg.model,
                "tie_weights": cfg.tie_weights,
                "batch_size": cfg.batch_size,
                "bptt": cfg.bptt,
                "char": cfg.char,
                "dropout": cfg.dropout,
                "mirror": str(cfg.mirror),
            },
        }

    def _save(self) -> str | None:
        ckpt_dir = self.config.checkpoint_dir
        if ckpt_dir is None:
            return None
        state = self._checkpoint_state()
        path = ckpt_dir / checkpoint.LAST
        if self.world.is_main:
            checkpoint.save(state, path)
        distributed.barrier(self.world)
        return str(path)

    def _restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.position = _Position(**state["position"])
        h, c = (
            data.shard_columns(t, self.world.rank, self.world.world_size).to(self.device)
            for t in state["state"]
        )
        self.state = (h.contiguous(), c.contiguous())
        checkpoint.set_rng_state(state["rng"][self.world.rank])

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

    def run(self) -> Summary:
        cfg, pos = self.config, self.position
        total_steps = cfg.epochs * self.windows_per_epoch
        if cfg.max_steps is not None:
            total_steps = min(total_steps, cfg.max_steps)
        samples_per_step = cfg.batch_size  # global: every rank holds batch_size / world
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        progress = tqdm(
            total=total_steps, initial=pos.step, disable=not self.world.is_main,
            unit="step", dynamic_ncols=True, desc=f"{cfg.model} lm",
            mininterval=0.1 if sys.stderr.isatty() else 30.0,  # keep captured logs short
        )  # fmt: skip
        valid_loss: float | None = None
        valid_step = -1
        epoch_loss, epoch_steps = torch.zeros((), device=self.device), 0
        window_loss, window_steps = torch.zeros((), device=self.device), 0
        finished_epoch: tuple[Tensor, int] | None = None
        started = time.perf_counter()
        # Throughput counts from the end of the first step: that one compiles.
        timed_from: tuple[int, float, float] | None = None  # step, time, eval seconds
        window_started = started
        interrupted = False
        stop = _StopRequest()
        self.model.train()
        with stop.installed():
            while pos.step < total_steps:
                x, y = data.window(self.train_data, pos.window, cfg.bptt)
                loss = self._step(x, y)
                pos.step += 1
                pos.window += 1
                if timed_from is None:
                    self._synchronize()
                    timed_from = (pos.step, time.perf_counter(), self.eval_seconds)
                epoch_loss += loss
                window_loss += loss
                epoch_steps += 1
                window_steps += 1
                progress.update()

                last = pos.step == total_steps
                if pos.step % cfg.log_freq == 0 or last:
                    mean_loss = float(distributed.mean(self.world, window_loss)) / window_steps
                    now = time.perf_counter()
                    step_s = (now - window_started) / window_steps
                    metrics = {
                        "loss": mean_loss,
                        "perplexity": math.exp(min(mean_loss, 700.0)),
                        "lr": self.optimizer.param_groups[0]["lr"],
                        "samples_per_s": samples_per_step / step_s,
                        "step_time_ms": step_s * 1e3,
                    }
                    for cb in self.callbacks:
                        cb.on_train_step(pos.step, metrics)
                    progress.set_postfix(
                        loss=f"{mean_loss:.3f}", samples_s=f"{metrics['samples_per_s']:.0f}"
                    )
                    window_loss.zero_()
                    window_steps, window_started = 0, now
                    # All ranks must agree to stop at the same step (collectives follow).
                    interrupted = distributed.any_true(self.world, stop.requested, self.device)
                elif not self.world.distributed:
                    interrupted = stop.requested

                if pos.window == self.windows_per_epoch:
                    eval_started = self.eval_seconds
                    valid_loss, valid_step = self._end_epoch(), pos.step
                    window_started += self.eval_seconds - eval_started
                    finished_epoch = (epoch_loss, epoch_steps)
                    epoch_loss, epoch_steps = torch.zeros((), device=self.device), 0
                if interrupted:
                    break
                if pos.step % cfg.ckpt_every == 0 and not last:
                    self._save()
        self._synchronize()
        progress.close()
        now = time.perf_counter()
        seconds = now - started
        timed_steps, timed_seconds = 0, 0.0
        if timed_from is not None:
            timed_steps = pos.step - timed_from[0]
            timed_seconds = now - timed_from[1] - (self.eval_seconds - timed_from[2])
        if epoch_steps == 0 and finished_epoch is not None:
            epoch_loss, epoch_steps = finished_epoch  # report the last complete epoch
        train_loss = (
            float(distributed.mean(self.world, epoch_loss)) / epoch_steps if epoch_steps else None
        )
        path = self._save()
        if interrupted:
            valid_loss = test_loss = None
        else:
            if valid_step != pos.step and self.valid_data is not None:
                valid_loss = self.evaluate(self.valid_data)
                for cb in self.callbacks:
                    cb.on_validation(pos.step, {"loss": valid_loss})
            test_loss = None if self.test_data is None else self.evaluate(self.test_data)
        for cb in self.callbacks:
            cb.close()
        per_s = timed_steps / timed_seconds if timed_steps else 0.0

        def ppl(loss: float | None) -> float | None:
            return None if loss is None else math.exp(min(loss, 700.0))

        return Summary(
            model=cfg.model,
            mirror=str(cfg.mirror),
            device=str(self.device.type),
            world_size=self.world.world_size,
            parameters=sum(p.numel() for p in self.model.parameters()),
            steps=pos.step,
            epochs_done=pos.epoch + pos.window / self.windows_per_epoch,
            train_perplexity=ppl(train_loss),
            valid_perplexity=ppl(valid_loss),
            test_perplexity=ppl(test_loss),
            seconds=seconds,
            samples_per_s=per_s * samples_per_step,
            tokens_per_s=per_s * samples_per_step * cfg.bptt,
            peak_measured_bytes=(
                torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
            ),
            peak_step_without=None if self.step_peaks is None else self.step_peaks[0],
            peak_step_with=None if self.step_peaks is None else self.step_peaks[1],
            peak_estimated_without=getattr(self.plan, "peak_before", None),
            peak_estimated_with=getattr(self.plan, "peak_after", None),
            interrupted=interrupted,
            checkpoint=path,
        )

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _step(self, x: Tensor, y: Tensor) -> Tensor:
        # Carry the state across windows, but not its gradient (truncated BPTT).
        state = (self.state[0].detach(), self.state[1].detach())
        loss, (h, c) = self.step_model(x, y, state)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip)
        self.optimizer.step()
        self.state = (h.detach(), c.detach())
        return loss.detach()

    def _end_epoch(self) -> float | None:
        pos = self.position
        pos.epoch += 1
        pos.window = 0
        self.state = self._initial_state()
        if self.valid_data is None:
            return None
        valid_loss = self.evaluate(self.valid_data)
        self.scheduler.step(valid_loss)
        for cb in self.callbacks:
            cb.on_validation(pos.step, {"loss": valid_loss})
        return valid_loss
