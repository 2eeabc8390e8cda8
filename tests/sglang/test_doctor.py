"""`specplug doctor` in the SGLang environment: SGLang is supported and every patch site
is found (with the CPU stand-ins conftest.py puts on PYTHONPATH, as SGLang's CPU engine
needs them here)."""

from __future__ import annotations

import json
import subprocess
import sys

from specplug import testbed_heads
from specplug.sglang_medusa import PATCH_SITES, SUPPORTED_SGLANG


def doctor(*args: str) -> subprocess.CompletedProcess:
    """`specplug doctor ARGS` as a user runs it (a fresh process: SGLang imported there only)."""
    return subprocess.run([sys.executable, "-m", "specplug.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=300)


def test_sglang_is_supported_and_every_patch_site_found():
    proc = doctor("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # no engine log line in stdout
    sglang = next(e for e in report["engines"] if e["name"] == "SGLang")
    assert sglang["supported"] and sglang["version"].split("+")[0] == SUPPORTED_SGLANG
    assert sglang["plugin"].startswith("entry point specplug_medusa registered")
    found = report["patches"]["SGLang"]
    assert found["missing"] == {} and found["sites"] == {site: True for site in PATCH_SITES}


def test_medusa_head_report_names_the_algorithm():
    proc = doctor("--head", str(testbed_heads.ROOT / "smollm2-medusa"), "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["head"]["engines"]["SGLang"]
    assert plan["method"] == "MEDUSA" and plan["refused"] is None
    assert "--speculative-algorithm MEDUSA" in plan["command"]
