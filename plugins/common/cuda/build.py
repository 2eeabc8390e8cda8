"""Builds and loads the torch extension of the fused verify kernels (once per process).

The extension is compiled on first use with ``torch.utils.cpp_extension.load`` (ninja)
into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) and reused by later processes; ``python -m
specplug.common.cuda`` builds it ahead of time (on a machine without a GPU, name the
target with ``TORCH_CUDA_ARCH_LIST``, e.g. "9.0"). A failed build is reported, never
raised: callers fall back to the torch path.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("verify_binding.cpp", "verify_kernels.cu")
HEADERS = ("verify.h",)
# Bump when the binding's signature changes, so a stale cached build is not loaded.
EXTENSION_NAME = "specplug_verify_v1"
NVCC_FLAGS = ("-O3", "-lineinfo")  # no --use_fast_math: the kernels need IEEE division
CXX_FLAGS = ("-O3",)


class Build(NamedTuple):
    """module: the loaded extension, or None; error: why not (None when loaded)."""

    module: Any
    error: str | None


@functools.lru_cache(maxsize=None)
def load_extension(verbose: bool = False) -> Build:
    """Compiles (or finds in the cache) and imports the extension; never raises."""
    try:
        from torch.utils import cpp_extension

        reason = build_blocker()
        if reason is not None:
            return Build(None, reason)
        module = cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(SOURCE_DIR / s) for s in SOURCES],
            extra_include_paths=[str(SOURCE_DIR)],
            extra_cflags=list(CXX_FLAGS),
            extra_cuda_cflags=list(NVCC_FLAGS),
            verbose=verbose,
        )
    except Exception as exc:  # a failed build must never break the caller
        message = " ".join(str(exc).split())[:300] or type(exc).__name__
        logger.debug("specplug CUDA verify extension failed to build", exc_info=True)
        return Build(None, f"{type(exc).__name__}: {message}")
    return Build(module, None)


def build_blocker() -> str | None:
    """Why the extension cannot be built in this environment (torch without CUDA, no device
    and no TORCH_CUDA_ARCH_LIST, no CUDA toolkit), or None. Builds nothing."""
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return f"torch {torch.__version__} was built without CUDA"
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return "torch sees no CUDA device (set TORCH_CUDA_ARCH_LIST to build without one)"
    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME to a folder with bin/nvcc)"
    return None


def cached_build() -> Path | None:
    """The compiled extension in torch's extension cache for this Python and CUDA (where
    load_extension would find it), or None; builds and imports nothing."""
    import sys

    import torch
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:  # torch's own layout: <root>/py311_cu128/<name>/
        if torch.version.cuda is None:
            return None
        tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = Path(cpp_extension.get_default_build_root()) / f"{tag}_cu{torch.version.cuda.replace('.', '')}"
    built = Path(root) / EXTENSION_NAME / f"{EXTENSION_NAME}.so"
    return built if built.is_file() else None
