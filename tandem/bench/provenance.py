"""Where a report's figures came from: the checkout's commit, for the header of every benchmark report."""
from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(cwd: str | Path | None = None) -> str | None:
    """The checkout's short commit, with "+dirty" when tracked files differ from it; None outside git."""
    where = Path(cwd) if cwd is not None else Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=where, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=where, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


__all__ = ["git_commit"]
