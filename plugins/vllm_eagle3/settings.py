"""A head's `specplug` section in vLLM: vLLM's method -> the head's kind (HEAD_METHOD), the
schema's settings (specplug.common.head_section, the same for SGLang) refused where vLLM
cannot run them, and the head checked against its target and the engine's parallel layout.
Without a section vLLM's built-in path runs untouched.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping

from specplug.common.heads.eagle3 import check_capture_order
from specplug.common.head_section import ENV_TREE, HeadSettings, checked_section, parse, refuse_unsupported
from specplug.common.parallel import shard_error

# vLLM's speculative method -> the method a specplug head's section names
HEAD_METHOD = {"eagle3": "eagle3", "eagle": "eagle1", "medusa": "medusa"}
VLLM_METHOD = {head: vllm for vllm, head in HEAD_METHOD.items()}  # and back


def specplug_section(hf_config: Any, vllm_method: str = "eagle3") -> dict | None:
    """The head config's specplug section if it marks a specplug head for `vllm_method`
    ("eagle3": an EAGLE-3 head, "eagle": an EAGLE-1 head, "medusa": Medusa heads), else None."""
    section = getattr(hf_config, "specplug", None)
    if section is None and isinstance(hf_config, Mapping):
        section = hf_config.get("specplug")
    if not section or vllm_method not in HEAD_METHOD:
        return None
    checked_section(section)
    expected = HEAD_METHOD[vllm_method]
    given = section.get("method", expected)
    if given != expected:
        fix = VLLM_METHOD.get(given)
        raise ValueError(
            f"the head's specplug section says method {given!r}, but vLLM was asked for method {vllm_method!r}: "
            + (f"pass \"method\": \"{fix}\" in --speculative-config" if fix else
               f"set \"method\": \"{expected}\" in the section of an {expected.upper()} head")
        )
    return dict(section)


def speculative_section(speculative_config) -> dict | None:
    """The specplug section of a SpeculativeConfig's draft model for its method, else None."""
    draft = getattr(speculative_config, "draft_model_config", None)
    return None if draft is None else specplug_section(draft.hf_config, speculative_config.method)


def adapter_settings(section: Mapping[str, Any], environ: Mapping[str, str] = os.environ, *,
                     method: str | None = None, num_heads: int | None = None) -> HeadSettings:
    """The section's settings (specplug.common.head_section.parse, environment applied),
    refused where vLLM cannot run them (check_vllm)."""
    settings = parse(section, environ, method=method, num_heads=num_heads).settings
    check_vllm(settings)
    return settings


def check_vllm(settings: HeadSettings) -> None:
    """ValueError for what vLLM runs in stage "chain" only: sampled drafts, the gate and
    adaptive depth."""
    if settings.stage != "chain":
        refuse_unsupported(settings, f"stage {settings.stage!r} in vLLM", ("draft_temperature", "gate", "adaptive"),
                           "use stage \"chain\"")


def check_num_speculative_tokens(settings: HeadSettings, num_speculative_tokens: int, nodes: int | None = None) -> None:
    """Stage "tree" hands vLLM every node of the tree as a draft token, so vLLM must
    reserve exactly the tree's `nodes` draft slots per request (default tree.budget; Medusa
    heads: their static tree's non-root nodes); raise ValueError otherwise."""
    nodes = settings.tree.budget if nodes is None else nodes
    if settings.stage == "tree" and num_speculative_tokens != nodes:
        raise ValueError(
            f"specplug stage \"tree\" verifies its {nodes} tree nodes per step as vLLM draft tokens, but "
            f"num_speculative_tokens is {num_speculative_tokens}: set \"num_speculative_tokens\": {nodes} in "
            f"vLLM's speculative_config (or change the head's tree, e.g. "
            f"{ENV_TREE}='{{\"budget\": {num_speculative_tokens}}}')"
        )


def check_head_matches_target(head_dir: str, target_config: Any, vllm_method: str = "eagle3", *,
                              weights: bool = True) -> None:
    """Raise ValueError naming the first field where the head cannot draft for the target:
    specplug.common.formats' validation (hidden size, vocab, aux layer ids, shapes), the
    head's kind against vLLM's method, plus the engines' constraints: aux layer ids
    ascending (heads.eagle3.check_capture_order); no fc bias in an EAGLE-1 head (vLLM
    0.32's EAGLE-1 model has none to load it into).
    weights=False reads the head's safetensors headers only (formats.load_head)."""
    from specplug.common import formats

    head = formats.load_head(head_dir, target_config, weights=weights)
    if head.method != HEAD_METHOD[vllm_method]:  # formats' methods are HEAD_METHOD's values
        raise ValueError(f"{head_dir} holds {head.method} heads ({head.format} format), but vLLM was asked for method "
                         f"{vllm_method!r}: pass \"method\": \"{VLLM_METHOD[head.method]}\" in --speculative-config")
    if head.method == "eagle1" and "fc.bias" in head.state_dict:
        raise ValueError(f"{head_dir}: the EAGLE-1 head has an fc bias (fc.bias), which vLLM 0.32's EAGLE-1 model "
                         "cannot load: serve it in SGLang with --speculative-algorithm SPECPLUG_EAGLE3, or use "
                         "a head trained without fc bias")
    check_capture_order((head.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), "vLLM",
                        f"config.json of {head_dir}")


def check_head_shards(speculative_config: Any) -> None:
    """ValueError naming the head's dimensions that vLLM cannot shard over the engine's
    tensor_parallel_size (specplug.common.parallel.shard_error), or the engine's
    pipeline_parallel_size when above 1, for specplug heads only:
    vLLM builds the head with the target's TP size and would fail at load with an
    AssertionError from its vocab-parallel or QKV layers."""
    parallel = getattr(speculative_config, "target_parallel_config", None)
    if parallel is None or speculative_section(speculative_config) is None:
        return
    draft = speculative_config.draft_model_config
    stages = getattr(parallel, "pipeline_parallel_size", 1)
    if stages > 1:
        raise ValueError(
            f"the specplug head {draft.model} runs at pipeline_parallel_size 1 only, got {stages}: specplug's "
            f"proposer reads the target's hidden states of several layers and its logits, which pipeline stages "
            f"hold apart. Fix: set pipeline_parallel_size 1 and shard with tensor_parallel_size instead "
            f"(docs/tensor_parallel.md)")
    tp_size = parallel.tensor_parallel_size
    message = shard_error(draft.hf_config, tp_size, f"the specplug head {draft.model}", "tensor_parallel_size")
    if message is not None:
        raise ValueError(message)


def checking_head_shards(post_init):
    """SpeculativeConfig.__post_init__ followed by check_head_shards (patch
    "SpeculativeConfig.__post_init__ shards" in patches.py): the refusal comes while the
    engine's configuration is built, before any worker starts or the head is loaded."""

    @functools.wraps(post_init)
    def __post_init__(self, *args, **kwargs):
        post_init(self, *args, **kwargs)
        check_head_shards(self)

    return __post_init__
