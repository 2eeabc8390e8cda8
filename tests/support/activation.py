"""Test support (not product code): an engine version specplug does not support, or a
specplug module that fails to import, made up in a test's own subprocess(es), and the
runner of those subprocesses (`run_case`).

`install_fakes()` reads environment variables and, before the engine loads its plugins,
makes
- SPECPLUG_TEST_BLOCK_IMPORT=MODULE: `import MODULE` raise ImportError (a sys.meta_path
  finder), as a broken install would;
- SPECPLUG_TEST_SGLANG_VERSION=X: importlib.metadata.version("sglang") answer X.
tests/support/activation_path/sitecustomize.py calls it at start-up, so every process
started with that folder on PYTHONPATH (SGLang's spawned scheduler too) gets the same
fakes. vLLM's version (SPECPLUG_TEST_VLLM_VERSION) is faked by the vLLM case script
itself (`fake_vllm_version`: vllm.__version__, which the adapter reads), as vLLM runs
there in one process.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

BLOCK_IMPORT = "SPECPLUG_TEST_BLOCK_IMPORT"
SGLANG_VERSION = "SPECPLUG_TEST_SGLANG_VERSION"
VLLM_VERSION = "SPECPLUG_TEST_VLLM_VERSION"
ROOT = Path(__file__).resolve().parents[2]
SITE_PATH = Path(__file__).parent / "activation_path"
DRAFTER_PLUGIN = Path(__file__).parent / "drafter_plugin"  # a third-party token drafter ("lookup")
RESULT = "ACTIVATION-CASE-RESULT "
ASKED_DONE = "ACTIVATION-CASE-ASKED-DONE"  # a case script's mark after its refused engine


class BlockImport(importlib.abc.MetaPathFinder):
    """A finder that makes one module's import fail."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise ImportError(f"No module named {fullname!r} (blocked by the test: a broken install)",
                              name=fullname)
        return None


class Records(logging.Handler):
    """Collects (level, message) of the records of the logger it is added to."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))


def install_fakes(environ=os.environ) -> None:
    blocked = environ.get(BLOCK_IMPORT)
    if blocked:
        sys.modules.pop(blocked, None)
        sys.meta_path.insert(0, BlockImport(blocked))
    fake = environ.get(SGLANG_VERSION)
    if fake:
        real = importlib.metadata.version

        def version(name):
            return fake if name == "sglang" else real(name)

        importlib.metadata.version = version


def fake_vllm_version(environ=os.environ) -> None:
    """vllm.__version__ = SPECPLUG_TEST_VLLM_VERSION where set (before vLLM loads plugins)."""
    if environ.get(VLLM_VERSION):
        import vllm

        vllm.__version__ = environ[VLLM_VERSION]


def report(result: dict) -> None:
    """The case script's last word: its result as one JSON line on stdout."""
    print(RESULT + json.dumps(result), flush=True)


def run_case(module: str, fakes: dict[str, str], timeout_s: float) -> tuple[dict, str]:
    """Run `python -m module` with the fakes ({BLOCK_IMPORT: ..., ...}) in its environment;
    returns its reported result and its whole output (stdout + stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in (BLOCK_IMPORT, SGLANG_VERSION, VLLM_VERSION)}
    env.update(fakes)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_PATH), str(ROOT), str(DRAFTER_PLUGIN)] + rest)
    proc = subprocess.run([sys.executable, "-m", module], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)
    output = proc.stdout + proc.stderr
    import pytest  # here: the fakes above also run in engine processes, which need no pytest

    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"{module} with {fakes} ended with exit code {proc.returncode} and no result:\n{output[-6000:]}")
    return json.loads(lines[-1][len(RESULT):]), output
