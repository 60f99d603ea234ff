"""Which code produced a result file: the git commit, recorded with every benchmark."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout this package runs from; the commit
    MIRRORGRAD_COMMIT names (or None) and dirty None where that is set or there is
    no git (a lent GPU machine's copy of the tree may carry a stale .git)."""
    if os.environ.get("MIRRORGRAD_COMMIT"):
        return os.environ["MIRRORGRAD_COMMIT"], None
    here = str(Path(__file__).parent)
    try:
        git = ["git", "-C", here]
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
        status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True)  # fmt: skip
    except OSError:  # no git installed
        return None, None
    if commit.returncode != 0:
        # A copy of the tree without .git (a lent GPU machine): the caller may say it.
        return None, None
    return commit.stdout.strip(), bool(status.stdout.strip())
