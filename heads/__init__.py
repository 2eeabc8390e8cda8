"""The committed test-bed heads, installed as the data-only package `specplug.testbed_heads`.

Each folder holds one head trained for SmolLM2-135M-Instruct (the test bed's target):
smollm2-eagle3 (an EAGLE-3 head in vLLM's format) and smollm2-medusa (compact Medusa
heads, materialised by `specplug.common.testbed.head_dir`). `specplug testbed`, the demo
and `specplug bench` find them here, in a source checkout and in an installed wheel alike.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
