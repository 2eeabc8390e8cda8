"""Test support: stand-in `sgl_kernel` for SGLang's CPU engine on a CPU without sgl-kernel.

Exposes the torch stand-ins of tests/support/sgl_kernel_cpu.py under the names SGLang
imports; every other name (and every submodule) is an import-only placeholder that
raises when called. Put on the path only by tests/sglang/conftest.py.
"""

import types

from tests.support import import_stubs
from tests.support.sgl_kernel_cpu import *  # noqa: F401,F403
from tests.support.sgl_kernel_cpu import reconstruct_indices_from_tree_mask

import_stubs.install(__import__(__name__))
# `from sgl_kernel.speculative import reconstruct_indices_from_tree_mask`
speculative = types.ModuleType(__name__ + ".speculative")
speculative.reconstruct_indices_from_tree_mask = reconstruct_indices_from_tree_mask
__import__("sys").modules[speculative.__name__] = speculative
