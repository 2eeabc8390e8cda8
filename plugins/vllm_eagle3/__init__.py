"""vLLM adapter: EAGLE-3 with dynamic draft trees (entry point `vllm.general_plugins`).

`register()` runs in every vLLM process. It replaces the V1 model runner's
`EagleProposer` with `SpecplugEagleProposer` and its `MedusaProposer` with
`SpecplugMedusaProposer` (medusa_proposer.py), which behave exactly like vLLM's for heads
without a `specplug` section in config.json and draft specplug trees for heads with
one. Model Runner V2 (the GPU default) is refused for specplug heads with a clear error.
On vLLM-CPU it also overrides the CPU_ATTN attention backend with a subclass that adds
ancestor masks for stage-"tree" steps (tree_attention.py; other steps run vLLM's kernel).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
_registered = False


def check_vllm_version(version: str) -> None:
    """Raise RuntimeError unless `version` is one specplug's vLLM adapter was tested with."""
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"specplug's vLLM adapter supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, found {version}: "
            "install a supported version (pip install 'specplug[vllm]'), or skip the plugin with "
            "VLLM_PLUGINS set to the other plugins you use"
        )


def register() -> None:
    """Entry point run by vLLM in every process; imports vLLM lazily."""
    global _registered
    if _registered:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    _log_like_vllm()
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
    _registered = True
    logger.info(
        "specplug %s registered: vllm.v1.worker.gpu_model_runner.EagleProposer and MedusaProposer "
        "replaced by SpecplugEagleProposer and SpecplugMedusaProposer (specplug trees for heads whose "
        "config.json has a 'specplug' section; vLLM's own EAGLE and Medusa paths otherwise)%s", _version(),
        "; attention backend CPU_ATTN overridden by TreeCPUAttentionBackend (vLLM's kernel, plus "
        "ancestor masks in stage-tree steps only)" if tree_attention else "",
    )


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
