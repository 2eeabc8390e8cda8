"""CI's compile step for the CUDA kernels (no GPU needed): nvcc compiles the .cu for
Hopper and Ampere without register spills, and the torch binding compiles against the
installed (CPU) torch headers. Skipped with a reason when the compilers are missing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from specplug.common.cuda import build

SRC = build.SOURCE_DIR
ARCHS = ("-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_80,code=sm_80")


def _nvcc() -> str | None:
    from torch.utils import cpp_extension

    found = shutil.which("nvcc")
    if found:
        return found
    home = cpp_extension.CUDA_HOME
    candidate = Path(home, "bin", "nvcc") if home else None
    return str(candidate) if candidate and candidate.is_file() else None


NVCC = _nvcc()
GXX = shutil.which("g++")
PYTHON_H = Path(sysconfig.get_paths()["include"], "Python.h")


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH or in $CUDA_HOME/bin")
def test_kernels_compile_for_hopper_and_ampere(tmp_path):
    # --threads 2: the two architectures compile side by side (163 s -> 76 s on 2 cores)
    cmd = [NVCC, "-c", "-o", str(tmp_path / "verify.o"), "-O3", "-std=c++17", *ARCHS, "--threads", "2", "-Xptxas", "-v",
           "-I", str(SRC), str(SRC / "verify_kernels.cu")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"nvcc failed:\n{done.stderr[-4000:]}"
    assert "warning" not in done.stderr.lower(), done.stderr[-4000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr)]
    assert spills and not any(spills), "a kernel spills registers to local memory:\n" + done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(GXX is None, reason="no g++ on PATH")
@pytest.mark.skipif(not PYTHON_H.is_file(), reason=f"no Python headers at {PYTHON_H}")
def test_binding_compiles_against_torch_headers():
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), str(PYTHON_H.parent), str(SRC)]]
    cmd = [GXX, "-fsyntax-only", "-std=c++20", "-Wall", "-Werror=sign-compare", "-Werror=unused-variable",
           f"-DTORCH_EXTENSION_NAME={build.EXTENSION_NAME}", *includes, str(SRC / "verify_binding.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"g++ failed:\n{done.stderr[-4000:]}"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on PATH")
def test_header_is_plain_c(tmp_path):
    source = tmp_path / "use.c"
    source.write_text('#include "verify.h"\nint main(void) { SpecplugVerifyArgs a = {0}; return a.batch; }\n')
    done = subprocess.run(["gcc", "-fsyntax-only", "-std=c99", "-Wall", "-I", str(SRC), str(source)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
