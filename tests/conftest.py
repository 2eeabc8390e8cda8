"""Shared pytest fixtures: tiny models built once per machine and cached."""

import sys
from pathlib import Path

import pytest
import torch

from tests.support.tiny_llama import tiny_llama_dir

# A third-party token drafter plugin ("lookup", entry-point group "specplug"), visible to
# every process the suites start (spawned engine processes inherit sys.path).
DRAFTER_PLUGIN = Path(__file__).parent / "support" / "drafter_plugin"
sys.path.insert(0, str(DRAFTER_PLUGIN))


@pytest.fixture(scope="session")
def tiny_llama_path():
    """A tiny random Llama (vocab 512, hidden 128, 4 layers, GQA 4/2, head_dim 32) with its tokenizer."""
    return tiny_llama_dir()


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    tiny models and big element-wise batches run faster without OpenMP hand-offs, and a
    shared 2-core machine would otherwise oversubscribe (spin-waits made such tests 30x
    slower under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
