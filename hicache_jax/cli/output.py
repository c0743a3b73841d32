"""What the commands write besides their tables: the ``--json`` file (checked writable before
minutes of work, then written) and the ``--plot`` check that matplotlib is installed."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["check_writable", "require_matplotlib", "write_json"]


def check_writable(path: str) -> None:
    """Fail before minutes of work when ``--json`` cannot be written (OSError naming it)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise OSError(f"--json {path}: {exc}") from None
    if not os.access(folder, os.W_OK) or os.path.isdir(path):
        raise OSError(f"--json {path}: cannot write there")


def write_json(path: str, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON at ``path`` (values JSON lacks as their ``str``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"wrote {path}")


def require_matplotlib() -> None:
    """ImportError saying what to install when matplotlib is missing: a command with ``--plot``
    checks it before its work, and reports it as a usage error."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            '--plot needs matplotlib: pip install -e ".[plot]" (or pip install matplotlib)'
        ) from None
