"""Where a benchmark result comes from: the commit of the code that produced it."""
from __future__ import annotations

import os
import subprocess


def git_commit() -> str:
    """TOKENMILL_GIT_COMMIT when set (device runs of a copied tree), else this checkout's short hash with
    "-dirty" for uncommitted changes to tracked files, else "unknown"."""
    if os.environ.get("TOKENMILL_GIT_COMMIT"):
        return os.environ["TOKENMILL_GIT_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
