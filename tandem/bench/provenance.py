"""Where a report's figures came from: the checkout's commit, for the header of every benchmark report."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
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




def report_meta(script: str, argv: Sequence[str] | None, wall_s: float, **extra) -> dict:
    """A benchmark report's header: the command that made it, the machine, the date, the wall time, the commit."""
    args = list(argv) if argv is not None else sys.argv[1:]
    return {"command": " ".join(["python", script, *args]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "date": time.strftime("%Y-%m-%d"), "wall_s": wall_s, "commit": git_commit() or "unknown", **extra}


def cost_sources(gpus: Sequence[str], cost_model: str = "auto", framework: str = "vllm") -> str:
    """Where a report's step costs come from, per GPU: "h100: measured (vllm, h100_sxm); h20: derived (...)"."""
    from tandem.perf.costs import choose_cost_model

    return "; ".join(f"{g}: {choose_cost_model(cost_model, g, framework).label}" for g in gpus)


__all__ = ["cost_sources", "git_commit", "report_meta"]
