"""The wheel holds the whole package: every module under plugins/, every data file the
code opens (the CUDA sources, the committed test-bed heads) and the entry points the
engines look for; and the suites run the installed wheel, not this checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import specplug
from specplug import testbed_heads
from specplug.common.cuda import build as cuda_build

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WHEEL_SOURCES = ("plugins", "heads", "pyproject.toml", "setup.py", "README.md")  # as scripts/envs.sh


def _copy_sources(dest: Path) -> Path:
    """The files the wheel is built from, without caches (an in-tree build/ would leak)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in WHEEL_SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    if not (ROOT / "setup.py").is_file():
        pytest.skip("needs the source checkout (setup.py)")
    work = tmp_path_factory.mktemp("wheel")
    src = _copy_sources(work / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(work / "dist"), str(src)], check=True, timeout=300)
    (path,) = (work / "dist").glob("specplug-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def _tracked(folder: str) -> list[Path]:
    """Files of `folder` in the checkout, relative to it, without caches."""
    base = ROOT / folder
    return sorted(p.relative_to(base) for p in base.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def test_every_module_and_data_file_under_plugins_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    missing = [str(p) for p in _tracked("plugins") if f"specplug/{p.as_posix()}" not in names]
    assert not missing, f"not in the wheel: {missing} (setup.py's package walk or package-data)"


def test_the_cuda_sources_the_kernel_build_opens_are_in_the_wheel(wheel):
    names = set(wheel.namelist())
    for source in cuda_build.SOURCES + cuda_build.HEADERS:
        assert f"specplug/common/cuda/{source}" in names


def test_the_committed_heads_are_package_data(wheel):
    names = set(wheel.namelist())
    heads = [p for p in _tracked("heads") if p.name != "__init__.py"]
    assert any(p.name == "model.safetensors" for p in heads)
    missing = [str(p) for p in heads if f"specplug/testbed_heads/{p.as_posix()}" not in names]
    assert not missing, f"heads not in the wheel: {missing}"


def test_the_wheel_holds_only_the_package(wheel):
    stray = [n for n in wheel.namelist() if not n.startswith(("specplug/", "specplug-"))]
    assert not stray, f"files outside the package: {stray[:10]}"


def test_the_entry_points_engines_look_for_are_declared(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    for line in ("[vllm.general_plugins]", "specplug_eagle3 = specplug.vllm_eagle3:register",
                 "[sglang.srt.plugins]", "specplug_medusa = specplug.sglang_medusa:register",
                 "[console_scripts]", "specplug = specplug.cli:main"):
        assert line in text


@pytest.mark.skipif(os.environ.get("SPECPLUG_INSTALL", "wheel") != "wheel",
                    reason="the suite runs an editable install (SPECPLUG_INSTALL=editable)")
def test_the_suite_imports_the_installed_wheel_not_the_checkout():
    package = Path(specplug.__file__).resolve().parent
    assert ROOT not in package.parents, f"specplug imported from the checkout: {package}"
    assert "site-packages" in package.parts
    assert (testbed_heads.ROOT / "smollm2-eagle3" / "model.safetensors").is_file()
