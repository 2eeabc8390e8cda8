"""The `specplug` console script is installed and lists every command."""

import subprocess
import sys

from specplug.cli import COMMANDS


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "specplug.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for name in COMMANDS:
        assert name in out
