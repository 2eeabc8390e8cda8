"""Test support (not product code): run a short `specplug soak` and check every result."""

from __future__ import annotations

import json
import subprocess
import sys


def assert_short_soak_passes(tmp_path, engine: str, config: str, skip: str, limit_s: int, clients: int = 16) -> None:
    """`clients` clients for half a minute against one configuration; every check must pass. Long
    prompts of 600 words still cross chunked prefill (256-token chunks) and shorten the
    drain after the load (1,500-word prompts kept it going ~95 s in SGLang)."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "specplug.cli", "soak", "--engine", engine, "--configs", config,
           "--minutes", "0.5", "--clients", str(clients), "--skip", skip, "--long-prompt-words", "600",
           "--log-dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s)
    assert out.is_file(), done.stderr[-4000:]
    (result,) = json.loads(out.read_text())["results"]
    assert all(result["checks"].values()), (result, done.stdout, done.stderr[-4000:])
    assert done.returncode == 0, done.stderr[-4000:]
    assert result["completed"] > 0 and result["aborted"] > 0 and result["greedy_checked"] >= 8
