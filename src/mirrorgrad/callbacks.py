"""Training-loop callbacks: a no-op base class, a TensorBoard logger, and `perplexity`.

Usable from any training loop::

    logger = mirrorgrad.callbacks.TensorBoardLogger("runs/exp", log_freq=50, plan=plan)
    for step in range(1, steps + 1):
        ...
        logger.on_train_step(step, {"loss": loss.item(), "lr": lr, "samples_per_s": s})
    logger.on_validation(step, {"loss": val_loss})  # perplexity = exp(loss) is added
    logger.close()

With PyTorch Lightning installed, ``logger.as_lightning_callback()`` returns a
``lightning.pytorch.Callback`` that feeds the same logger.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["Callback", "TensorBoardLogger", "perplexity"]


def perplexity(loss: float) -> float:
    """exp(mean cross-entropy per token), capped where a float would overflow."""
    return math.exp(min(float(loss), 700.0))  # exp(710) overflows a float


class Callback:
    """A sink for training metrics; every hook does nothing unless overridden."""

    def on_train_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """Called after optimizer step ``step`` (1-based) with scalar metrics."""

    def on_validation(self, step: int, metrics: Mapping[str, float]) -> None:
        """Called after an evaluation on the validation split."""

    def close(self) -> None:
        """Flushes and releases resources; called once at the end of training."""


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _device_memory_mib(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    mib = 2**20
    return {
        "memory/allocated_mib": torch.cuda.memory_allocated(device) / mib,
        "memory/peak_mib": torch.cuda.max_memory_allocated(device) / mib,
        "memory/reserved_mib": torch.cuda.memory_reserved(device) / mib,
    }


class TensorBoardLogger(Callback):
    """Writes scalars to TensorBoard every ``log_freq`` steps, on rank 0 only.

    Training metrics go under ``train/`` (a key that already has a ``/`` is kept as
    is), validation metrics under ``validation/``. When ``loss`` is given and
    ``perplexity`` is not, ``perplexity = exp(loss)`` is added. On a CUDA device the
    memory of ``device`` (allocated, peak, reserved) is logged under ``memory/``.
    A mirror ``plan`` (from ``mirrorgrad.explain``) is logged once under ``plan/``:
    stash and estimated peak, with and without mirroring; ``settings`` (name -> value,
    e.g. the precision) once as a table under ``settings``.
    """

    def __init__(
        self,
        logdir: str | Path,
        log_freq: int = 50,
        *,
        device: torch.device | str | None = None,
        plan: Any = None,
        purge_step: int | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        if log_freq < 1:
            raise ValueError(f"log_freq must be >= 1, got {log_freq}")
        self.log_freq = log_freq
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._writer = None
        if not _is_rank_zero():
            return
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(logdir), purge_step=purge_step)
        if plan is not None:
            self._log_plan(plan, purge_step or 0)
        if settings:
            table = "\n".join(f"| {k} | {v} |" for k, v in settings.items())
            self._writer.add_text("settings", f"| setting | value |\n|---|---|\n{table}", 0)

    def _log_plan(self, plan: Any, step: int) -> None:
        mib = 2**20
        for name in ("stash_bytes_before", "stash_bytes_after", "peak_before", "peak_after"):
            value = getattr(plan, name, None)
            if value is not None:
                tag = name.replace("_bytes", "").replace("peak", "estimated_peak")
                self._writer.add_scalar(f"plan/{tag}_mib", value / mib, step)
        self._writer.add_text("plan", f"```\n{plan}\n```", step)

    def on_train_step(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None or step % self.log_freq:
            return
        scalars = {k if "/" in k else f"train/{k}": v for k, v in metrics.items()}
        if "train/loss" in scalars and "train/perplexity" not in scalars:
            scalars["train/perplexity"] = perplexity(scalars["train/loss"])
        scalars.update(_device_memory_mib(self.device))
        self._write(step, scalars)

    def on_validation(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        scalars = {f"validation/{k}": v for k, v in metrics.items()}
        if "validation/loss" in scalars and "validation/perplexity" not in scalars:
            scalars["validation/perplexity"] = perplexity(scalars["validation/loss"])
        self._write(step, scalars)
        self._writer.flush()

    def _write(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def as_lightning_callback(self) -> Any:
        """A ``lightning.pytorch.Callback`` that feeds this logger (needs ``lightning``)."""
        return _lightning_adapter()(self)


def _lightning_adapter() -> type:
    try:
        import lightning.pytorch as pl
    except ImportError as e:
        raise ImportError(
            "as_lightning_callback() needs PyTorch Lightning: pip install lightning"
        ) from e

    class LightningAdapter(pl.Callback):
        """Forwards the loss Lightning logs (``callback_metrics``) to a mirrorgrad callback."""

        def __init__(self, callback: Callback) -> None:
            self.callback = callback
            self._last = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            metrics = {
                k: float(v)
                for k, v in trainer.callback_metrics.items()
                if v.numel() == 1 and not k.startswith(("val_", "val/"))
            }
            if isinstance(outputs, Mapping) and "loss" in outputs:
                metrics["loss"] = float(outputs["loss"])
            elif isinstance(outputs, torch.Tensor):
                metrics["loss"] = float(outputs)
            metrics["step_time_ms"] = (now - self._last) * 1e3
            if trainer.optimizers:
                metrics["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
            self._last = now
            self.callback.on_train_step(trainer.global_step, metrics)

        def on_validation_end(self, trainer, pl_module) -> None:
            metrics = {
                k.removeprefix("val_").removeprefix("val/"): float(v)
                for k, v in trainer.callback_metrics.items()
                if k.startswith(("val_", "val/")) and v.numel() == 1
            }
            self.callback.on_validation(trainer.global_step, metrics)

        def on_fit_end(self, trainer, pl_module) -> None:
            self.callback.close()

    return LightningAdapter
