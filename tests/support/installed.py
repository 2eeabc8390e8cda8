"""Test support (not product code): checks that a process runs specplug as users install it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def folder_outside_checkout(tmp_path_factory) -> Path:
    """A fresh folder that is not inside this checkout (where a user would run a server)."""
    folder = tmp_path_factory.mktemp("user")
    assert CHECKOUT not in folder.parents
    return folder


def imported_paths(code: str, cwd: Path, env: dict) -> list[Path]:
    """The paths `code` prints (one a line), run by this Python in `cwd` with `env`."""
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return [Path(line) for line in out.split()]


def assert_installed(path: Path) -> None:
    """`path` lies in site-packages, not in this checkout."""
    assert "site-packages" in path.parts and CHECKOUT not in path.parents, f"not from the installed wheel: {path}"
