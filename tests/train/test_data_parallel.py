"""Each data-parallel mode on 2 processes: three steps give the gradients and weights of
one process on the whole batch (gloo on CPU; nccl on 2 GPUs, CUDA Graphs replaying)."""

import dataclasses
import functools
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

# Two processes each: under pytest-xdist, one such test at a time (a 2-core machine).
pytestmark = pytest.mark.xdist_group("two-processes")

_VOCAB, _T, _B, _STEPS = 50, 6, 4, 3
# Dropout off: the masks of two half batches cannot equal those of the whole batch.
_PRESET = dataclasses.replace(PRESETS["tiny"], dropout=0.0, layers=2, embedding=16, hidden=16)


def _tokens(device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, _VOCAB, (_STEPS * _T + 1, _B), generator=g).to(device)


def _train(
    world: World, columns: slice, device: torch.device, graphed: bool = False
) -> dict[str, list[torch.Tensor]]:
    torch.manual_seed(1 + world.rank)  # different initial weights: rank 0's must win
    model = LanguageModel(_VOCAB, _PRESET).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step_model, average = step.compile_for_world(
        model, MirrorOptions.from_cli("balance"), device, world
    )
    state = model.initial_state(_B // (2 if world.distributed else 1), device)
    tokens = _tokens(device)
    rows = distributed.window_rows(tokens.cpu(), _T).to(device)  # as the loop gives them
    sparse = world.distributed and distributed.data_parallel_mode() == "allreduce-rows"
    if graphed:  # as the loop runs it: the all-reduce captured in the whole-step graph
        distributed.broadcast_parameters(world, model)
        plain = step.compile_for_training(
            model, MirrorOptions.from_cli("balance"), device, cuda_graphs=False
        )
        run_step = step.GraphedStep(plain, optimizer, clip=1e3, reduce_gradients=average)
    for w in range(_STEPS):  # on a GPU: CUDA Graphs record, then replay
        x, y = tokens[w * _T : (w + 1) * _T], tokens[w * _T + 1 : (w + 1) * _T + 1]
        reduce = average
        if sparse:
            reduce = functools.partial(average, rows=(model.encoder.weight, rows[w]))
        if graphed:
            _, _, state = run_step(x[:, columns], y[:, columns], state)
            continue
        # A clip above the gradient norm: the averaged gradient itself is compared.
        _, _, state = step.sgd_step(
            step_model, model, optimizer, x[:, columns], y[:, columns], state,
            clip=1e3, reduce_gradients=reduce,
        )  # fmt: skip
    return {
        "grads": [p.grad.cpu() for p in model.parameters()],
        "weights": [p.detach().cpu() for p in model.parameters()],
    }


def _worker(rank: int, port: int, mode: str, device_type: str, results, graphed=False) -> None:
    os.environ[distributed.DATA_PARALLEL_ENV] = mode
    torch.set_num_threads(1)
    device = torch.device(device_type, rank if device_type == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=2)
    try:
        half = _B // 2
        columns = slice(rank * half, (rank + 1) * half)
        results[rank] = _train(World(rank=rank, world_size=2), columns, device, graphed)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_two_processes_match_one(
    mode: str, device_type: str, rtol: float, atol: float, graphed: bool = False
):
    single = _train(World(), slice(None), torch.device(device_type))
    with mp.Manager() as manager:
        results = manager.dict()
        args = (_free_port(), mode, device_type, results, graphed)
        mp.spawn(_worker, args=args, nprocs=2)
        ranks = [results[0], results[1]]
    for key in ("grads", "weights"):
        for rank in ranks:
            for got, want in zip(rank[key], single[key], strict=True):
                torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("mode", distributed.DATA_PARALLEL_MODES)
def test_two_processes_step_as_one_on_the_whole_batch(mode):
    _check_two_processes_match_one(mode, "cpu", rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("mode", ["allreduce", "allreduce-rows", "ddp-graphs"])
def test_two_gpus_step_as_one_on_the_whole_batch(mode):
    _check_two_processes_match_one(mode, "cuda", rtol=1e-3, atol=1e-5)


def test_unknown_mode_names_the_choices(monkeypatch):
    monkeypatch.setenv(distributed.DATA_PARALLEL_ENV, "fsdp")
    with pytest.raises(ValueError, match="choose one of allreduce, allreduce-rows"):
        distributed.data_parallel_mode()


def test_window_rows_are_the_tokens_each_window_reads():
    tokens = torch.tensor([[3, 1], [1, 4], [5, 9], [2, 6], [5, 3]])  # 2 windows of 2 rows
    rows = distributed.window_rows(tokens, 2)
    assert rows.tolist() == [[1, 3, 4, 1], [2, 5, 6, 9]]  # padded with the first id


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_whole_step_graph_with_the_all_reduce_captured():
    _check_two_processes_match_one("allreduce", "cuda", rtol=1e-3, atol=1e-5, graphed=True)
