"""Test support (not product code): applies tests.support.activation's fakes at start-up
in every process with this folder on PYTHONPATH (the activation tests put it there)."""

import os

if os.environ.get("SPECPLUG_TEST_BLOCK_IMPORT") or os.environ.get("SPECPLUG_TEST_SGLANG_VERSION"):
    from tests.support.activation import install_fakes

    install_fakes()
