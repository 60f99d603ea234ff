"""The report of a training run: what `mirrorgrad train lm` prints at the end."""

from __future__ import annotations

import dataclasses

from mirrorgrad._units import format_bytes as size


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
        if self.peak_measured_bytes is not None:
            lines.append(
                f"               measured, whole run: {size(self.peak_measured_bytes)} per GPU "
                "(the largest of all GPUs)"
            )
        if self.step:
            lines.append(f"  step         {self.step}")
        if self.plan:
            lines.append(f"  plan         {self.plan}")
        if self.checkpoint:
            lines.append(f"  checkpoint   {self.checkpoint}")
        return "\n".join(lines)
