"""Can a command write where it was told to? Checked before any work, by train and bench."""

from __future__ import annotations

import os
from pathlib import Path


class FolderNotWritable(Exception):
    """A folder the run writes to cannot be created or written; the message names it."""


def probe_writable(folder: Path, option: str) -> None:
    """Creates ``folder`` if needed and writes (then removes) a probe file in it."""
    probe = folder / f".mirrorgrad-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"probe")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        is_file = folder.exists() and not folder.is_dir()
        reason = "a file has that name" if is_file else e.strerror or type(e).__name__
        raise FolderNotWritable(
            f"{option} {folder}: cannot create or write there ({reason}); "
            f"pass a writable folder with {option}"
        ) from None
