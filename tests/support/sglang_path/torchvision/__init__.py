"""Test support: import-only stand-in for torchvision (PyPI's links CUDA and breaks beside
CPU torch). SGLang imports it at module level in multimodal code a text-only CPU test
never runs; every attribute is a placeholder that raises when called."""

from tests.support import import_stubs

__version__ = "0.0.0+specplug.test.stub"
import_stubs.install(__import__(__name__))
