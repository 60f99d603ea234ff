"""Checkpoint files: versioned and checksummed, written atomically, loaded with ``weights_only``.

A file is one header line, then the bytes ``torch.save`` wrote::

    mirrorgrad-checkpoint {"format": 2, "bytes": N, "sha256": "..."}\\n<N payload bytes>

Loading checks the header, the length and the SHA-256 before unpickling anything, so
a damaged, truncated or foreign file is refused with one line naming what is wrong
instead of resuming on garbage. Everything stored is a tensor or a plain Python
value, so the payload loads with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = 2
LAST = "last.pt"
MAGIC = b"mirrorgrad-checkpoint "
_ZIP_MAGIC = b"PK\x03\x04"  # what a plain torch.save file starts with
_MAX_HEADER = 4096
# The temporary name of a save in progress: .last.pt.<pid>.tmp
_TEMPORARY = re.compile(r"^\..+\.pt\.(\d+)\.tmp$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted; the message names the file."""


def resolve(path: Path) -> Path:
    """A checkpoint file, or a folder holding ``last.pt``."""
    return path / LAST if path.is_dir() else path


def save(state: dict[str, Any], path: Path) -> None:
    """Writes a temporary file beside ``path``, syncs it to disk and renames it, so a
    crash or kill -9 at any moment leaves the previous checkpoint or the new one."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    header = {
        "format": FORMAT,
        "bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(MAGIC + json.dumps(header).encode() + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_folder(path.parent)
    except OSError as e:  # the command prints "<path>: <strerror>"
        # os.replace is atomic: what was at `path` before the save is there still.
        kept = "the previous one is kept" if os.path.isfile(path) else "no checkpoint was saved"
        reason = f"cannot save the checkpoint ({e.strerror or e}); {kept}"
        raise OSError(e.errno, reason, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)


def _sync_folder(folder: Path) -> None:
    # Makes the rename itself durable. Some file systems cannot open a folder for
    # syncing (EINVAL/EACCES); the data is synced already, the rename then rests
    # with the file system's own ordering.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load(path: Path) -> dict[str, Any]:
    """The state saved at ``path`` (a file, or a folder holding ``last.pt``), verified.

    Raises CheckpointError, naming the file, for anything that is not an intact
    checkpoint of this format.
    """
    path = resolve(path)
    if not path.exists():
        raise CheckpointError(f"--resume {path}: no checkpoint there")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    payload = _verified_payload(path, raw)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # the checksum matched, so this is a foreign or newer payload
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: its contents cannot be loaded ({reason})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a checkpoint")
    return state


def _verified_payload(path: Path, raw: bytes) -> memoryview:
    if not raw:
        raise CheckpointError(f"{path}: the file is empty (0 bytes), not a checkpoint")
    if raw.startswith(_ZIP_MAGIC):
        raise CheckpointError(
            f"{path}: a plain torch.save file (or a checkpoint of mirrorgrad before format "
            f"{FORMAT}) without a checksum; it cannot be verified, start a new run"
        )
    if not raw.startswith(MAGIC):
        raise CheckpointError(f"{path}: not a mirrorgrad checkpoint (unknown header)")
    end = raw.find(b"\n", 0, _MAX_HEADER)
    header = _parse_header(raw[len(MAGIC) : end]) if end > 0 else None
    if header is None:
        raise CheckpointError(f"{path}: damaged checkpoint (unreadable header)")
    if header["format"] != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {header['format']}, this mirrorgrad reads format {FORMAT}"
        )
    payload = memoryview(raw)[end + 1 :]
    if len(payload) < header["bytes"]:
        raise CheckpointError(
            f"{path}: truncated checkpoint ({len(payload)} of {header['bytes']} bytes)"
        )
    if len(payload) > header["bytes"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise CheckpointError(
            f"{path}: damaged checkpoint (its SHA-256 does not match the one saved with it)"
        )
    return payload


def _parse_header(text: bytes) -> dict[str, Any] | None:
    try:
        header = json.loads(text)
    except ValueError:
        return None
    types = {"format": int, "bytes": int, "sha256": str}
    if not isinstance(header, dict) or any(
        not isinstance(header.get(k), t) for k, t in types.items()
    ):
        return None
    return header


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Deletes the temporary files of saves that were killed (their process is gone)."""
    removed = []
    if not folder.is_dir():
        return removed
    for path in folder.iterdir():
        match = _TEMPORARY.match(path.name)
        if match is None or not path.is_file():
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and _alive(pid):
            continue  # another run is saving into this folder right now
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def rng_state() -> dict[str, Any]:
    """torch (CPU and every CUDA device), Python and NumPy generator states."""
    version, internal, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["gauss"]))
