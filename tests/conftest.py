"""Shared pytest fixtures: tiny models built once per machine and cached."""

import pytest

from tests.support.tiny_llama import tiny_llama_dir


@pytest.fixture(scope="session")
def tiny_llama_path():
    """A tiny random Llama (vocab 512, hidden 128, 4 layers, GQA 4/2, head_dim 32) with its tokenizer."""
    return tiny_llama_dir()
