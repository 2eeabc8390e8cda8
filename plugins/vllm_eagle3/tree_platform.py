"""Whether this vLLM can run stage "tree", checked at start-up before anything of vLLM's
CPU attention backend is imported (that module may not import on a GPU build).

Stage "tree" masks vLLM-CPU's attention backend (tree_attention.py) over its paged KV
layout (paged_kv.py). For GPUs only its attention kernel (specplug.common.cuda.tree_attention_triton) exists and
is proven, under Triton's interpreter on CPU (tests/vllm/test_tree_attention_triton.py); tree
positions and KV compaction on GPU buffers and the hook into vLLM's GPU attention backends are
not, so on any other platform stage "tree" is refused here with one message saying what is
proven, what is not and the fix, never an ImportError from deeper down.
"""

from __future__ import annotations

GPU_REFUSAL = ("specplug stage \"tree\" runs on vLLM-CPU only: for GPUs only its tree attention kernel "
               "(specplug.common.cuda.tree_attention_triton) is proven, under Triton's interpreter on CPU; tree "
               "positions and KV compaction on GPU buffers and the hook into vLLM's GPU attention backends are "
               "not, so a GPU is refused: use stage \"chain\" (\"stage\": \"chain\" in the head's specplug "
               "section, or SPECPLUG_STAGE=chain)")


def check_platform(vllm_config, stage: str = "tree") -> None:
    """For stage "tree": RuntimeError unless this is vLLM-CPU with a KV layout specplug
    reads (paged_kv). Other stages run anywhere."""
    if stage != "tree":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise RuntimeError(GPU_REFUSAL)
    from vllm.v1.attention.backends import cpu_attn

    from specplug.vllm_eagle3 import paged_kv

    model = vllm_config.model_config
    isa = cpu_attn._get_attn_isa(model.dtype, vllm_config.cache_config.block_size, model.get_head_size(),
                                 vllm_config.cache_config.cache_dtype)
    paged_kv.check_layout(isa, model.dtype)
