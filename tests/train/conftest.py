import random
import signal
from pathlib import Path

import pytest
import torch

_WORDS = [f"word{i}" for i in range(30)]


def _sentence(rng: random.Random) -> str:
    # Runs of consecutive words: learnable, so the loss falls within a few steps.
    start = rng.randrange(len(_WORDS))
    return " ".join(_WORDS[(start + k) % len(_WORDS)] for k in range(rng.randint(3, 12)))


def write_corpus(folder: Path, *, lines: tuple[int, int, int] = (120, 20, 20), seed: int = 0):
    """A small PTB-layout corpus of random sentences (deterministic)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in zip(("train", "valid", "test"), lines):
        text = "\n".join(_sentence(rng) for _ in range(count))
        (folder / f"ptb.{split}.txt").write_text(text + "\n", encoding="utf-8")
    return folder


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def make_corpus():
    """``write_corpus`` for fixtures of a wider scope than ``corpus``."""
    return write_corpus


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Each test compiles as a fresh ``mirrorgrad train`` process does. Every train() run
    leaves its compiled entries on LanguageModel.forward's code object (a new backend each
    run, so none is reused); once earlier tests on the same xdist worker have left
    recompile_limit (8) of them, Dynamo runs the step eagerly and the resume tests, which
    compare losses bit for bit with a compiled run, see other roundings."""
    torch.compiler.reset()
    yield


@pytest.fixture(autouse=True)
def ctrl_c_as_in_a_terminal():
    """SIGINT handled as in a terminal. A process started with SIGINT ignored (`bash
    .ci/run &`, some CI runners) keeps it ignored, and so does `train`, as Unix programs
    do: a test's Ctrl-C would then never arrive."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
