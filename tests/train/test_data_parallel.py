"""Each data-parallel mode on 2 gloo processes: one step's gradients and weights equal
those of one process on the whole batch."""

import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mirrorgrad.options import MirrorOptions
from mirrorgrad.train import distributed, step
from mirrorgrad.train.config import PRESETS
from mirrorgrad.train.distributed import World
from mirrorgrad.train.model import LanguageModel

_VOCAB, _T, _B = 50, 6, 4
# Dropout off: the masks of two half batches cannot equal those of the whole batch.
_PRESET = dataclasses.replace(PRESETS["tiny"], dropout=0.0, layers=2, embedding=16, hidden=16)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, _VOCAB, (_T + 1, _B), generator=g)
    return tokens[:-1], tokens[1:]


def _one_step(world: World, columns: slice) -> dict[str, list[torch.Tensor]]:
    torch.manual_seed(1 + world.rank)  # different initial weights: rank 0's must win
    model = LanguageModel(_VOCAB, _PRESET)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step_model, reduce = step.compile_for_world(
        model, MirrorOptions.from_cli("balance"), torch.device("cpu"), world
    )
    x, y = (t[:, columns] for t in _batch())
    state = model.initial_state(x.shape[1], "cpu")
    # A clip above the gradient norm: the averaged gradient itself is compared.
    step.sgd_step(step_model, model, optimizer, x, y, state, clip=1e3, reduce_gradients=reduce)
    return {
        "grads": [p.grad.clone() for p in model.parameters()],
        "weights": [p.detach().clone() for p in model.parameters()],
    }


def _worker(rank: int, port: int, mode: str, results) -> None:
    os.environ[distributed.DATA_PARALLEL_ENV] = mode
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        world = World(rank=rank, world_size=2)
        half = _B // 2
        results[rank] = _one_step(world, slice(rank * half, (rank + 1) * half))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", distributed.DATA_PARALLEL_MODES)
def test_two_processes_step_as_one_on_the_whole_batch(mode):
    single = _one_step(World(), slice(None))
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_free_port(), mode, results), nprocs=2)
        ranks = [results[0], results[1]]
    for key in ("grads", "weights"):
        for rank in ranks:
            for got, want in zip(rank[key], single[key], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_unknown_mode_names_the_choices(monkeypatch):
    monkeypatch.setenv(distributed.DATA_PARALLEL_ENV, "fsdp")
    with pytest.raises(ValueError, match="allreduce, ddp"):
        distributed.data_parallel_mode()
