"""Checks before the first step: the folders a run writes to exist and take a file,
and the checkpoint file there can be replaced.

A checkpoint folder that cannot be written, or a ``last.pt`` that a rename cannot
replace, would otherwise be found at the first save, after the work it was meant to keep.
"""

from __future__ import annotations

import os
import stat
import struct
import sys
from pathlib import Path

from mirrorgrad._folders import FolderNotWritable, probe_writable  # noqa: F401 (loop, command)

# Linux's FS_IOC_GETFLAGS (_IOR('f', 1, long)) and the flags lsattr shows as i and a.
_FS_IOC_GETFLAGS = (2 << 30) | (struct.calcsize("l") << 16) | (ord("f") << 8) | 1
_IMMUTABLE_OR_APPEND_ONLY = 0x10 | 0x20


def probe_replaceable(path: Path, option: str) -> None:
    """``path``, which saves replace by a rename, is missing or a file a rename can
    replace: not a folder, not immutable or append-only (``chattr +i``/``+a``, which
    stop root too), and not someone else's in a sticky folder (``/tmp``). Changes nothing."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    except OSError as e:
        message = f"{option} {path.parent}: cannot inspect {path} ({e.strerror})"
        raise FolderNotWritable(message) from None
    if stat.S_ISDIR(info.st_mode):
        reason, fix = "it is a folder", "move it away"
    elif stat.S_ISREG(info.st_mode) and _immutable_or_append_only(path):
        reason, fix = "it is immutable or append-only", "lift that with chattr -i -a"
    elif _someone_elses_in_a_sticky_folder(path, info):
        reason, fix = "another user owns it in a sticky folder", "let its owner remove it"
    else:
        return
    raise FolderNotWritable(
        f"{option} {path.parent}: the checkpoint {path} cannot be replaced ({reason}); "
        f"{fix}, or pass another {option}"
    )


def _immutable_or_append_only(path: Path) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False  # unreadable: the rename may still work; the save will tell
    try:
        flags = struct.unpack_from("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8)))[0]
    except OSError:
        return False  # a file system without these flags
    finally:
        os.close(fd)
    return bool(flags & _IMMUTABLE_OR_APPEND_ONLY)


def _someone_elses_in_a_sticky_folder(path: Path, info: os.stat_result) -> bool:
    uid = os.geteuid() if hasattr(os, "geteuid") else 0
    try:
        folder = path.parent.stat()
    except OSError:
        return False
    sticky = bool(folder.st_mode & stat.S_ISVTX)
    return sticky and uid != 0 and uid not in (info.st_uid, folder.st_uid)
