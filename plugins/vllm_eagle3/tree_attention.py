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
from typing import NamedTuple

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


class PaddedTrees(NamedTuple):
    """Every tree of a step, padded to T trees x S keys x R recomputed rows; built once
    per step (and attention metadata group), shared by all layers."""

    slots: torch.Tensor  # Long [T * S] cache slot of each key (padding: the tree's slot 0)
    mask: torch.Tensor  # Bool [T, 1, R, S] row r may attend to key s
    rows: torch.Tensor  # Long [T, R] token row of each recomputed query (padding: the root's)
    valid: torch.Tensor  # Bool [T, R] real (not padding) recomputed rows


def pad_trees(trees: list[TreeRows], attn_metadata, block_size: int) -> PaddedTrees:
    """Pad the step's trees (those with rows to recompute) into one PaddedTrees."""
    seq_lens = [int(attn_metadata.seq_lens[t.batch_row]) for t in trees]
    width, height = max(seq_lens), max(len(t.rows) for t in trees)
    positions = torch.arange(width)
    slots, mask = [], torch.zeros(len(trees), 1, height, width, dtype=torch.bool)
    rows = torch.zeros(len(trees), height, dtype=torch.long)
    valid = torch.zeros(len(trees), height, dtype=torch.bool)
    for i, (tree, seq_len) in enumerate(zip(trees, seq_lens)):
        pos = positions.clamp(max=seq_len - 1)
        slots.append(attn_metadata.block_table[tree.batch_row, pos // block_size].long() * block_size
                     + pos % block_size)
        n, context = len(tree.rows), seq_len - tree.mask.shape[0]  # context: positions before the root
        mask[i, 0, :n, :context] = True
        mask[i, 0, :n, context:seq_len] = tree.mask[tree.rows]
        mask[i, 0, n:, 0] = True  # padding rows attend to one key (no NaN), never written
        rows[i] = tree.root_row
        rows[i, :n] = tree.root_row + tree.rows
        valid[i, :n] = True
    return PaddedTrees(torch.cat(slots), mask, rows, valid)


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
                batch = pad_trees(trees, attn_metadata, kv_cache.shape[2])
                attn_metadata.specplug_padded_trees = batch
            self._tree_rows(batch, query, kv_cache, output)
        return output

    def _tree_rows(self, batch: PaddedTrees, query, kv_cache, output) -> None:
        """Overwrite the recomputed rows of output ([T, heads * D] or [T, heads, D]) with
        attention of query ([T, heads, D]) over context + ancestors (SDPA, GQA)."""
        trees, height = batch.rows.shape
        keys, values = paged_kv.gather(kv_cache, batch.slots)  # [T * S, kv_heads, D]
        keys = keys.view(trees, -1, *keys.shape[1:]).transpose(1, 2).to(query.dtype)  # [T, kv_heads, S, D]
        values = values.view(trees, -1, *values.shape[1:]).transpose(1, 2).to(query.dtype)
        q = query[batch.rows.flatten()].view(trees, height, *query.shape[1:]).transpose(1, 2)  # [T, heads, R, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, scale=self.scale,
                                             enable_gqa=True)  # [T, heads, R, D]
        out = out.transpose(1, 2)[batch.valid]  # [rows, heads, D]
        output.view(output.shape[0], -1)[batch.rows[batch.valid]] = out.reshape(out.shape[0], -1).to(output.dtype)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with TreeCPUAttentionImpl (same name, metadata and cache layout)."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
