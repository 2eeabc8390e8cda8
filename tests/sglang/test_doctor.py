"""`specplug doctor` in the SGLang environment: SGLang is supported, every patch in the
registry matches (the opt-in oneDNN pair does not apply unasked) and every patch site is
found (with the CPU stand-ins conftest.py puts on PYTHONPATH, as SGLang's CPU engine
needs them here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from specplug import testbed_heads
from specplug.sglang_medusa import PATCH_SITES, PATCHES, SUPPORTED_SGLANG
from specplug.sglang_medusa.patches import CPU_LINEAR


def doctor(*args: str) -> subprocess.CompletedProcess:
    """`specplug doctor ARGS` as a user runs it (a fresh process: SGLang imported there only)."""
    env = {k: v for k, v in os.environ.items() if k != "SPECPLUG_SGLANG_CPU_LINEAR"}  # the opt-in pair: unasked
    return subprocess.run([sys.executable, "-m", "specplug.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_sglang_is_supported_and_every_patch_site_found():
    proc = doctor("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # no engine log line in stdout
    sglang = next(e for e in report["engines"] if e["name"] == "SGLang")
    assert sglang["supported"] and sglang["version"].split("+")[0] == SUPPORTED_SGLANG
    assert sglang["plugin"].startswith("entry point specplug_medusa registered")
    found = report["patches"]["SGLang"]
    assert found["missing"] == {} and found["sites"] == {site: True for site in PATCH_SITES}
    rows = {row["name"]: row for row in found["patches"]}  # the registry, each patch checked
    assert list(rows) == [patch.name for patch in PATCHES]
    assert [name for name, row in rows.items() if row["matched"] is not True] == list(CPU_LINEAR)  # opt-in
    assert all("SPECPLUG_SGLANG_CPU_LINEAR=onednn is not set" in rows[name]["reason"] for name in CPU_LINEAR)
    assert found["status"] == f"{len(rows) - 2} of {len(rows)} patches match, 2 do not apply here"


def test_medusa_head_report_names_the_algorithm():
    proc = doctor("--head", str(testbed_heads.ROOT / "smollm2-medusa"), "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["head"]["engines"]["SGLang"]
    assert plan["method"] == "MEDUSA" and plan["refused"] is None
    assert "--speculative-algorithm MEDUSA" in plan["command"]
