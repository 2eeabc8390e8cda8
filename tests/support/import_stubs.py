"""Test support: placeholder modules for imports a test environment cannot satisfy.

`install(prefix, real_attrs)` makes every module under `prefix` importable; any
attribute not in `real_attrs` is a `Placeholder` class that can be imported, used in
annotations, subclassed or looked into (`X.Y.Z`), but raises NotImplementedError when
called. SGLang imports sgl-kernel and torchvision at module level in code paths a CPU
test never runs; the placeholders let those imports succeed while any real use fails
loudly. Used only by tests/support/sglang_path/; never imported by specplug.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(
            f"{cls.__qualname__} is a test-support placeholder (tests/support/import_stubs.py): "
            "the real package is not installed in this environment")


def placeholder(qualname: str) -> type:
    """A class standing for the missing object `qualname`."""
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefix: str):
        self.prefix = prefix

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.prefix + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install(package: types.ModuleType) -> None:
    """Make `package` answer unknown attributes with placeholders and make its
    submodules (any depth) importable as stub modules."""
    package.__class__ = _StubModule
    package.__path__ = []
    if not any(isinstance(f, _StubFinder) and f.prefix == package.__name__ for f in sys.meta_path):
        sys.meta_path.append(_StubFinder(package.__name__))
