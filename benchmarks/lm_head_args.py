"""The flags the LM-head benchmarks share (the head's shape) and their checks on a GPU."""

from __future__ import annotations

import argparse

import torch


def head_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first paragraph with --rows, --hidden and --vocab,
    the medium word LM's head by default (rows = batch x BPTT: 700 at 20, 4,480 at 128)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[700, 4480])
    parser.add_argument("--hidden", type=int, default=650)
    parser.add_argument("--vocab", type=int, default=10000)
    return parser


def parse_on_gpu(parser: argparse.ArgumentParser, *counts: str) -> argparse.Namespace:
    """The arguments, after checking a CUDA GPU is there and that the head's sizes and
    the other ``counts`` (flag names) are >= 1; fp32 matmuls then run as TF32, as the
    LM trains."""
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    names = ("rows", "hidden", "vocab", *counts)
    if min(*args.rows, *(getattr(args, n) for n in names[1:])) < 1:
        flags = [f"--{n}" for n in names]
        parser.error(f"{', '.join(flags[:-1])} and {flags[-1]} must be >= 1")
    torch.backends.cuda.matmul.allow_tf32 = True
    return args
