#!/usr/bin/env bash
# Installs the core test environment into the virtual environment $1: core.txt (which the
# vLLM and SGLang environments install too) plus the linter the core suite runs
# (tests/common/test_lint.py, settings in pyproject.toml's [tool.ruff]). Kept out of
# core.txt so a new ruff rebuilds only this environment.
set -euo pipefail
venv=$1
here=$(cd "$(dirname "$0")" && pwd)
"$venv/bin/pip" install -q -r "$here/core.txt" ruff==0.17.6
