"""`torchrun --nproc_per_node 2 -m mirrorgrad train lm` on CPU (gloo): same losses as 1 process."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mirrorgrad.callbacks import Callback
from mirrorgrad.train import distributed
from mirrorgrad.train.config import TrainConfig
from mirrorgrad.train.loop import train

# Two processes each: under pytest-xdist, one such test at a time (a 2-core machine).
pytestmark = pytest.mark.xdist_group("two-processes")

# Dropout off: masks cannot match between a 1- and a 2-process run.
_OPTIONS = dict(batch_size=8, bptt=20, epochs=2, log_freq=1, dropout=0.0, device="cpu", seed=5)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_step(self, step, metrics):
        self.losses[step] = metrics["loss"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(corpus, logdir, *extra: str, mode: str) -> subprocess.CompletedProcess:
    options = [f"--{k.replace('_', '-')}={v}" for k, v in _OPTIONS.items()]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={_free_port()}", "-m", "mirrorgrad", "train", "lm",
        f"--data={corpus}", f"--logdir={logdir}", *options, *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", distributed.DATA_PARALLEL_ENV: mode}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _logged_losses(logdir) -> dict[int, float]:
    events = EventAccumulator(str(logdir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}


# The default, and the variant that sends only the embedding rows each window reads
# (its row ids come from the loop's window position: an epoch boundary and a resume).
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "allreduce-rows"])
def test_two_processes_match_one_and_resume(corpus, tmp_path, mode):
    single = Losses()
    train(
        TrainConfig.from_preset("tiny", data=corpus, logdir=None, max_steps=9, **_OPTIONS), [single]
    )

    logdir = tmp_path / "ddp"
    first = _torchrun(corpus, logdir, "--max-steps=5", mode=mode)
    assert "cpu x 2" in first.stdout
    assert first.stdout.count("perplexity") == 1  # rank 0 alone reports
    _torchrun(corpus, logdir, "--max-steps=9", "--resume", mode=mode)
    logged = _logged_losses(logdir)
    assert sorted(logged) == list(range(1, 10))
    # Gradients are averaged over the two halves of the batch, as one process sums them.
    np.testing.assert_allclose(
        [logged[s] for s in range(1, 10)], [single.losses[s] for s in range(1, 10)], rtol=1e-4
    )
