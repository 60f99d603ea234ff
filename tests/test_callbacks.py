import dataclasses
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mirrorgrad.callbacks import Callback, TensorBoardLogger, perplexity


def test_perplexity_is_exp_of_the_loss_and_never_overflows():
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(42.0)) == pytest.approx(42.0, rel=1e-15)
    assert math.isfinite(perplexity(1e6))  # a diverged loss still prints
    assert math.isnan(perplexity(float("nan")))


def _scalars(logdir) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@dataclasses.dataclass
class FakePlan:
    stash_bytes_before: int = 4 * 2**20
    stash_bytes_after: int = 2**20
    peak_before: int = 8 * 2**20
    peak_after: int = 5 * 2**20

    def __str__(self) -> str:
        return "stash 4 MiB -> 1 MiB"


def test_base_callback_is_a_no_op():
    cb = Callback()
    cb.on_train_step(1, {"loss": 1.0})
    cb.on_validation(1, {"loss": 1.0})
    cb.close()


def test_tensorboard_logger_tags_and_log_freq(tmp_path):
    logger = TensorBoardLogger(tmp_path, log_freq=2, plan=FakePlan())
    for step in range(1, 6):
        logger.on_train_step(step, {"loss": 2.0 + step, "lr": 0.5, "samples_per_s": 100.0})
    logger.on_validation(5, {"loss": 1.5})
    logger.close()
    scalars = _scalars(tmp_path)
    assert scalars["train/loss"] == {2: 4.0, 4: 6.0}  # every log_freq-th step only
    assert scalars["train/perplexity"][4] == pytest.approx(math.exp(6.0), rel=1e-6)
    assert scalars["train/lr"] == {2: 0.5, 4: 0.5}
    assert scalars["validation/loss"] == {5: 1.5}
    assert scalars["validation/perplexity"][5] == pytest.approx(math.exp(1.5), rel=1e-6)
    assert scalars["plan/stash_before_mib"] == {0: 4.0}
    assert scalars["plan/stash_after_mib"] == {0: 1.0}
    assert scalars["plan/estimated_peak_before_mib"] == {0: 8.0}
    assert scalars["plan/estimated_peak_after_mib"] == {0: 5.0}
    assert not any(tag.startswith("memory/") for tag in scalars)  # CPU: no device memory


def test_log_freq_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="log_freq"):
        TensorBoardLogger(tmp_path, log_freq=0)


def test_lightning_callback_logs_a_fit(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    adapter = TensorBoardLogger(tmp_path / "tb", log_freq=1).as_lightning_callback()
    assert isinstance(adapter, pl.Callback)
    trainer = pl.Trainer(
        max_steps=4, callbacks=[adapter], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=2))
    scalars = _scalars(tmp_path / "tb")
    assert sorted(scalars["train/loss"]) == [1, 2, 3, 4]
    assert {"train/lr", "train/step_time_ms", "train/perplexity"} <= scalars.keys()
