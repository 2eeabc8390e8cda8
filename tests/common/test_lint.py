"""The checkout's Python passes ruff with pyproject.toml's [tool.ruff] settings (lines up to
120 characters, pyflakes, pycodestyle errors and warnings), so the lint cannot drift.

Ruff reads the checkout, not the installed wheel: the tests always run from it, also when
the suite tests the wheel. Alone: `bash scripts/test.sh core -- tests/common/test_lint.py`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINTED = ["plugins", "tests", "bench", "scripts"]


def test_ruff_finds_nothing():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip(f"ruff is not installed in {sys.prefix}: the core environment installs it "
                    "(requirements/core.sh), or `pip install ruff`")
    assert (ROOT / "pyproject.toml").is_file(), f"{ROOT} is not the repository root"
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                             *LINTED], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (f"ruff check {' '.join(LINTED)} (from {ROOT}) found problems:\n"
                                    f"{result.stdout}{result.stderr}")
