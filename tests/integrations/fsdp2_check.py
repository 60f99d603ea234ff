"""``mirrorgrad.compile`` on an FSDP2 (``fully_shard``) transformer: same gradients, peak per rank.

    PYTHONPATH=src torchrun --nproc_per_node 2 tests/integrations/fsdp2_check.py OUT_DIR
    PYTHONPATH=src torchrun --standalone --nproc_per_node 2 \\
        tests/integrations/fsdp2_check.py OUT_DIR --cpu      # gloo, tiny sizes (the CI test)

Two copies of one transformer (embedding, ``nn.TransformerEncoderLayer`` blocks,
head), each block and the root sharded with ``fully_shard`` over all ranks: one with
every block compiled with one ``mirrorgrad.backend`` before sharding (as torchtitan
compiles per block: FSDP2's all-gathers stay outside the compiled graphs; one backend
for all blocks, so that Dynamo compiles the block once instead of once per block, up to
its recompile limit of 8), one eager. Each rank
trains on its own batch; the full (gathered) gradients of the two must agree, and
each rank's step peak is reported for both. Rank 0 writes OUT_DIR/fsdp2.json and
prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import mirrorgrad
from mirrorgrad.mirror.partition import MirrorgradFallbackWarning

# d_model, heads, feed-forward, blocks, batch per rank, sequence, vocabulary
SIZES = {"cuda": (512, 8, 2048, 4, 8, 1024, 8192), "cpu": (32, 4, 64, 2, 2, 10, 64)}


class Transformer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int, blocks: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
            for _ in range(blocks)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard(model: Transformer, mesh, backend: Callable | None) -> None:
    """``fully_shard`` every block, then the root; blocks compiled first if asked."""
    for i, block in enumerate(model.blocks):
        if backend is not None:
            block = torch.compile(block, backend=backend)
            model.blocks[i] = block
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train_step(model: nn.Module, tokens: torch.Tensor, device: str) -> int | None:
    """One step; its peak above the memory in use before it (CUDA only)."""
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def full_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() for p in model.parameters()]


def run(args: argparse.Namespace) -> dict | None:
    device = "cpu" if args.cpu else "cuda"
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    mesh = init_device_mesh(device, (world,))
    d, heads, ff, blocks, batch, seq, vocab = SIZES[device]
    torch.manual_seed(0)
    plain = Transformer(d, heads, ff, blocks, vocab).to(device)
    planned = copy.deepcopy(plain)
    options = {"mode": args.mode, "backend": "eager" if args.cpu else "inductor"}
    if args.mode == "budget":
        options["budget"] = args.budget
    backend = mirrorgrad.backend(**options)
    shard(planned, mesh, backend)
    shard(plain, mesh, None)
    torch.manual_seed(1 + rank)  # each rank its own batch
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(planned, tokens, device)  # compiles
        train_step(plain, tokens, device)
        grads, reference = full_grads(planned), full_grads(plain)
        peaks = {"mirrorgrad": train_step(planned, tokens, device)}
        peaks["plain"] = train_step(plain, tokens, device)
    fallback = MirrorgradFallbackWarning
    fallbacks = sorted({str(w.message)[:200] for w in caught if issubclass(w.category, fallback)})
    # Largest difference over the largest gradient entry, over all parameters.
    scale = max(r.abs().max().item() for r in reference) or 1.0
    error = max((g - r).abs().max().item() for g, r in zip(grads, reference)) / scale
    row = {
        "rank": rank,
        "plans": len(backend.plans),
        "recomputed": sum(len(plan.mirrored) for plan in backend.plans),
        "fallbacks": fallbacks,
        "grad_error": error,
        "peak_mirrorgrad": peaks["mirrorgrad"],
        "peak_plain": peaks["plain"],
    }
    rows = [None] * world
    dist.all_gather_object(rows, row)
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "world": world,
        "sizes": dict(zip(("d", "heads", "ff", "blocks", "batch", "seq", "vocab"), SIZES[device])),
        "options": options,
        "rows": rows,
    }


def print_table(result: dict) -> None:
    print(f"\nFSDP2 on {result['world']} x {result['device']}, torch {result['torch']}, "
          f"blocks compiled with mirrorgrad.backend({result['options']})")  # fmt: skip
    print(f"{'rank':>4} {'plans':>5} {'recomp':>6} {'grad err':>9} {'peak MiB plain':>15} "
          f"{'mirrorgrad':>11} {'ratio':>6}")  # fmt: skip
    for r in result["rows"]:
        plain, ours = r["peak_plain"], r["peak_mirrorgrad"]
        mib = [f"{p / 2**20:.0f}" if p is not None else "-" for p in (plain, ours)]
        ratio = f"{ours / plain:.2f}" if plain and ours else "-"
        print(f"{r['rank']:>4} {r['plans']:>5} {r['recomputed']:>6} {r['grad_error']:>9.1e} "
              f"{mib[0]:>15} {mib[1]:>11} {ratio:>6}")  # fmt: skip
        for f in r["fallbacks"]:
            print(f"  rank {r['rank']} fallback: {f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, tiny sizes")
    parser.add_argument("--mode", default="balance", choices=("balance", "budget"))
    parser.add_argument("--budget", type=float, default=0.5)
    args = parser.parse_args()
    result = run(args)
    if result is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fsdp2.json").write_text(json.dumps(result, indent=2))
        print_table(result)


if __name__ == "__main__":
    main()
    # Every check is done and written. Skip the interpreter's teardown: CI saw a rank abort
    # there once ("terminate called without an active exception", a C++ thread of the CPU
    # process group destroyed at exit), after its gradients had matched.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
