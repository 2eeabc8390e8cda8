"""Tree attention for vLLM-CPU: the CPU_ATTN backend (registered in place of vLLM's by
register()) runs vLLM's kernel for every row; in a stage-"tree" step, whose attention
metadata carries `specplug_tree` (tree_verify.TreeVerifier puts it there), it then
recomputes the tree rows with their ancestor masks (specplug.common.paged_tree_attention).
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from specplug.common.paged_tree_attention import PaddedTrees, attend_tree_rows, pad_trees
from specplug.vllm_eagle3 import paged_kv


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, plus an ancestor-masked recomputation of tree rows."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        trees = [t for t in getattr(attn_metadata, "specplug_tree", None) or () if t.rows.numel()]
        if trees:
            batch = getattr(attn_metadata, "specplug_padded_trees", None)
            if batch is None:  # first layer of the step: pad once, reuse in every layer
                batch = pad_trees(trees, attn_metadata, kv_cache.shape[2], kv_cache.shape[1],
                                  query.shape[1] // kv_cache.shape[1], query.dtype)
                attn_metadata.specplug_padded_trees = batch
            self._tree_rows(batch, query, kv_cache, output)
        return output

    def _tree_rows(self, batch: PaddedTrees, query, kv_cache, output) -> None:
        """The step's padded tree rows attended over their cache blocks, read whole."""
        keys, values = paged_kv.blocks(kv_cache, batch.blocks.flatten())  # [T*nb, kvh, D, bs], [T*nb, kvh, bs, D]
        attend_tree_rows(batch, query, keys, values, self.scale, output)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with TreeCPUAttentionImpl (same name, metadata and cache layout)."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
