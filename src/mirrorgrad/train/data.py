"""Text corpora for language modelling: splits, vocabulary, batches and BPTT windows.

Word level: whitespace-separated tokens, an ``<eos>`` at the end of every line and
``<unk>`` for words outside the vocabulary (capped to the most frequent words of the
training split). Character level (``char=True``): every character is a token and a
line ends with ``<eos>``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

UNK = "<unk>"
EOS = "<eos>"
SPLITS = ("train", "valid", "test")
# File names per split, in the order they are looked for inside a data folder.
_LAYOUTS = (
    "{split}.txt",  # our default corpus
    "ptb.{split}.txt",  # Penn Treebank (Mikolov)
    "wiki.{split}.tokens",  # WikiText-2/103
)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SplitPaths:
    train: Path
    valid: Path | None
    test: Path | None


def find_splits(path: str | Path) -> SplitPaths:
    """A text file (train only) or a folder with train/valid/test files in a known layout."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--data {path}: no such file or folder")
    if not path.is_dir():  # a file, or a device or pipe that reads as one
        return SplitPaths(train=path, valid=None, test=None)
    for layout in _LAYOUTS:
        found = {s: path / layout.format(split=s) for s in SPLITS}
        if found["train"].is_file():
            return SplitPaths(**{s: p if p.is_file() else None for s, p in found.items()})
    names = ", ".join(layout.format(split="train") for layout in _LAYOUTS)
    raise FileNotFoundError(
        f"--data {path}: the folder has no training file (looked for {names}); "
        "pass a text file or a folder in the PTB or WikiText layout"
    )


def read_text(path: Path) -> str:
    """The file's text; a clear error for empty or non-UTF-8 files."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"--data: cannot read {path} ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text: byte {e.start} is {raw[e.start : e.start + 1]!r}; "
            "convert it, e.g. `iconv -f latin1 -t utf-8`"
        ) from None
    if not text.strip():
        raise ValueError(f"{path} is empty; the data needs some text")
    return text


def tokenize(text: str, *, char: bool = False) -> list[str]:
    tokens: list[str] = []
    for line in text.splitlines():
        words = list(line.strip()) if char else line.split()
        if words:
            tokens.extend(words)
            tokens.append(EOS)
    return tokens


@dataclasses.dataclass(kw_only=True, slots=True)
class Vocabulary:
    """Token <-> id. ``<unk>`` is id 0 and ``<eos>`` id 1."""

    tokens: list[str]
    index: dict[str, int] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tokens[:2] != [UNK, EOS]:
            raise ValueError(f"a vocabulary starts with {UNK!r}, {EOS!r}")
        self.index = {t: i for i, t in enumerate(self.tokens)}

    @classmethod
    def build(cls, tokens: list[str], *, max_size: int | None = None) -> Vocabulary:
        """The most frequent tokens (ties broken by first appearance), at most max_size."""
        counts = collections.Counter(t for t in tokens if t not in (UNK, EOS))
        limit = None if max_size is None else max(0, max_size - 2)
        return cls(tokens=[UNK, EOS, *(t for t, _ in counts.most_common(limit))])

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, tokens: list[str]) -> Tensor:
        unk = self.index[UNK]
        return torch.tensor([self.index.get(t, unk) for t in tokens], dtype=torch.long)


@dataclasses.dataclass(kw_only=True, slots=True)
class Corpus:
    vocab: Vocabulary
    train: Tensor
    valid: Tensor | None
    test: Tensor | None


def load_corpus(paths: SplitPaths, *, char: bool = False, vocab_size: int | None = None) -> Corpus:
    """Reads and encodes every split with a vocabulary built on the training split."""
    train_tokens = tokenize(read_text(paths.train), char=char)
    vocab = Vocabulary.build(train_tokens, max_size=vocab_size)
    encoded = {
        split: None if path is None else vocab.encode(tokenize(read_text(path), char=char))
        for split, path in (("valid", paths.valid), ("test", paths.test))
    }
    return Corpus(vocab=vocab, train=vocab.encode(train_tokens), **encoded)


def batchify(ids: Tensor, batch_size: int) -> Tensor:
    """[N] -> [N // B, B]: B independent streams read down the columns (tail dropped)."""
    rows = ids.numel() // batch_size
    if rows < 2:
        raise ValueError(
            f"{ids.numel()} tokens are too few for --batch-size {batch_size}: each of the "
            "batch columns needs at least 2 tokens; use a smaller batch or more text"
        )
    return ids[: rows * batch_size].view(batch_size, rows).t().contiguous()


def shard_columns(batches: Tensor, rank: int, world_size: int) -> Tensor:
    """This rank's contiguous slice of the batch columns (data parallelism)."""
    columns = batches.shape[1]
    if columns % world_size:
        raise ValueError(
            f"--batch-size {columns} must be divisible by the number of processes ({world_size})"
        )
    per_rank = columns // world_size
    return batches[:, rank * per_rank : (rank + 1) * per_rank]


def num_windows(batches: Tensor, bptt: int, *, drop_last: bool = False) -> int:
    """Windows of ``bptt`` steps; with drop_last, no short final window (so a compiled
    training step always sees the same shape)."""
    targets = batches.shape[0] - 1
    return targets // bptt if drop_last else (targets + bptt - 1) // bptt


def window(
    batches: Tensor, index: int, bptt: int, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Inputs [T, B] and next-token targets [T, B] of BPTT window ``index``, on ``device``
    where given (copied without waiting for the host when ``batches`` is pinned)."""
    start = index * bptt
    length = min(bptt, batches.shape[0] - 1 - start)
    x, y = batches[start : start + length], batches[start + 1 : start + 1 + length]
    if device is None:
        return x, y
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def windows(
    batches: Tensor, bptt: int, *, start: int = 0, drop_last: bool = False
) -> Iterator[tuple[Tensor, Tensor]]:
    for index in range(start, num_windows(batches, bptt, drop_last=drop_last)):
        yield window(batches, index, bptt)
