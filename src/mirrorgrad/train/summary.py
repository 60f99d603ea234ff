"""The report of a training run: what `mirrorgrad train lm` prints at the end."""

from __future__ import annotations

import dataclasses
import signal
from typing import TYPE_CHECKING

import torch

from mirrorgrad._units import format_bytes as size
from mirrorgrad.callbacks import perplexity
from mirrorgrad.train import distributed

if TYPE_CHECKING:
    from mirrorgrad.train.loop import Trained
    from mirrorgrad.train.setup import Setup


@dataclasses.dataclass(kw_only=True, slots=True)
class Summary:
    """What a run achieved; ``str()`` is the report printed at the end.

    ``train_perplexity`` is that of the current epoch's steps (of the last complete
    epoch when the run ended on its boundary), steps before a resume included.
    """

    model: str
    mirror: str
    device: str
    world_size: int
    parameters: int
    steps: int
    epochs_done: float
    train_perplexity: float | None
    valid_perplexity: float | None
    test_perplexity: float | None
    seconds: float
    samples_per_s: float
    tokens_per_s: float
    peak_measured_bytes: int | None
    peak_loop_bytes: int | None  # the steps' (and mid-run validations'), before the final ones
    peak_step_without: int | None
    peak_step_with: int | None
    peak_estimated_without: int | None
    peak_estimated_with: int | None
    first_step_seconds: float | None = None  # compiles included
    interrupted: bool = False
    signal: str | None = None  # what interrupted it: "SIGINT" or "SIGTERM"
    checkpoint: str | None = None
    plan: str | None = None  # Plan.summary_line(): the op choices, and a budget not met
    precision: str = "fp32"
    step: str | None = None  # how each training step ran
    setup_seconds: float | None = None  # before the first step: data, plan, compiles

    def __str__(self) -> str:
        def ppl(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2f}" if x < 1e6 else f"{x:.3g}"

        first_step = ""
        if self.first_step_seconds is not None:
            first_step = f" (the first {self.first_step_seconds:.1f} s)"
        if self.setup_seconds is not None:
            first_step += f", after {self.setup_seconds:.1f} s of setup (data, plan, compile)"
        status = "done"
        if self.interrupted:
            status = f"interrupted by {self.signal}" if self.signal else "interrupted"
        lines = [
            f"{status}: {self.model} LSTM LM, "
            f"{self.parameters / 1e6:.2f}M parameters, mirror={self.mirror}, "
            f"{self.precision}, {self.device} x {self.world_size}",
            f"  steps        {self.steps} ({self.epochs_done:.2f} epochs) in {self.seconds:.1f} s"
            + first_step,
            f"  perplexity   train {ppl(self.train_perplexity)}  "
            f"valid {ppl(self.valid_perplexity)}  test {ppl(self.test_perplexity)}",
            f"  throughput   {self.samples_per_s:.1f} samples/s ({self.tokens_per_s:.0f} tokens/s, "
            "steps after the first)",
            f"  peak memory  without mirroring {size(self.peak_estimated_without)} (plan "
            f"estimate), with {size(self.peak_estimated_with)} (plan estimate)",
        ]
        if self.peak_step_without is not None:
            lines.append(
                f"               measured, one step: without {size(self.peak_step_without)}, "
                f"with {size(self.peak_step_with)}"
            )
        if self.peak_loop_bytes is not None:
            lines.append(
                f"               measured, training steps: {size(self.peak_loop_bytes)} per GPU "
                "(the largest of all GPUs)"
            )
        if self.peak_measured_bytes is not None:
            lines.append(
                f"               measured, whole run (final evaluation included): "
                f"{size(self.peak_measured_bytes)} per GPU"
            )
        if self.step:
            lines.append(f"  step         {self.step}")
        if self.plan:
            lines.append(f"  plan         {self.plan}")
        if self.checkpoint:
            lines.append(f"  checkpoint   {self.checkpoint}")
        return "\n".join(lines)


def summarize(
    setup: Setup, trained: Trained, *, valid_loss: float | None, test_loss: float | None
) -> Summary:
    """The summary of a run from its setup, its steps and its final losses. Collective
    under DDP (the measured peak is the largest of all ranks)."""
    cfg, pos = setup.config, trained.position
    losses = (trained.train_loss, valid_loss, test_loss)
    train_ppl, valid_ppl, test_ppl = (None if x is None else perplexity(x) for x in losses)
    samples_per_s = trained.steps_per_s * cfg.batch_size  # the global batch
    step_peaks, plan = setup.step_peaks, setup.plan
    return Summary(
        model=cfg.model,
        mirror=cfg.mirror.to_cli(),
        device=str(setup.device.type),
        world_size=setup.world.world_size,
        parameters=setup.model.parameter_count(),
        steps=pos.step,
        epochs_done=pos.epoch + pos.window / setup.data.windows_per_epoch,
        train_perplexity=train_ppl,
        valid_perplexity=valid_ppl,
        test_perplexity=test_ppl,
        seconds=trained.seconds,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * cfg.bptt,
        peak_measured_bytes=peak_per_gpu(setup.world, setup.device),
        peak_loop_bytes=trained.peak_loop_bytes,
        peak_step_without=None if step_peaks is None else step_peaks[0],
        peak_step_with=None if step_peaks is None else step_peaks[1],
        peak_estimated_without=getattr(plan, "peak_before", None),
        peak_estimated_with=getattr(plan, "peak_after", None),
        first_step_seconds=trained.first_step_seconds,
        interrupted=trained.signum is not None,
        signal=None if trained.signum is None else signal.Signals(trained.signum).name,
        checkpoint=trained.checkpoint,
        plan=None if plan is None else plan.summary_line(),
        precision=cfg.precision,
        step=setup.step.description,
        setup_seconds=setup.seconds,
    )


def peak_per_gpu(world: distributed.World, device: torch.device) -> int | None:
    """The largest ``max_memory_allocated`` of all ranks (collective)."""
    if device.type != "cuda":
        return None
    peak = torch.tensor(torch.cuda.max_memory_allocated(device), device=device)
    return int(distributed.maximum(world, peak))
