"""Test support (not product code): runs a tests/support module under Triton's interpreter
(TRITON_INTERPRET=1 must be set before triton is imported, hence a process of its own) on
torch.save'd cases, as `python -m MODULE CASES OUT`, and returns what it saved in OUT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, cases: list[dict], tmp_path: Path, timeout: float = 300) -> list:
    """`module`'s outputs for `cases` (one process for all of them); fails with its stderr."""
    torch.save(cases, tmp_path / "cases.pt")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-m", module, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp_path / "out.pt")
